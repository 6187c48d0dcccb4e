"""One metrics reader for every place that takes "a run" from a user.

``convergence compare``, ``convergence export-golden``, a pair's ``golden = ...`` key and the
runner all call :func:`read_metrics`, which accepts:

- a run folder of ours (``metrics.jsonl`` in it or in its ``dump/``);
- a torchtitan dump or any TensorBoard folder (``events.out.tfevents.*`` found recursively;
  among ``rank_<N>`` siblings the one holding the real loss, see
  :mod:`convergence.metrics.tensorboard`);
- a JSONL metrics file, a single event file, or a golden JSON file.

A path that does not exist and a path that exists but holds no metrics are different mistakes
(a typo vs. the wrong folder or a job that logged nothing), so they raise different errors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from convergence.metrics.curve import RunMetrics
from convergence.metrics.golden import load_golden
from convergence.metrics.jsonl import read_jsonl
from convergence.metrics.tensorboard import read_tensorboard
from convergence.spec import run_dir
from convergence.spec.errors import SpecError

#: Where a run folder of ours keeps its JSONL stream, in the order we look.
RUN_JSONL = (run_dir.METRICS, f"{run_dir.DUMP}/{run_dir.METRICS}")
EVENT_PREFIX = "events.out.tfevents."
ACCEPTED = (
    "a run folder (holding metrics.jsonl or dump/metrics.jsonl), a torchtitan dump or "
    "TensorBoard folder (events.out.tfevents.* files), a metrics.jsonl file, or a golden "
    "JSON file"
)


class MetricsPathMissing(FileNotFoundError):
    """The path given for a run does not exist."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(f"{path} does not exist: check the path (expected {ACCEPTED})")


class NoMetricsFound(ValueError):
    """The path exists but nothing in it is a metrics source we read (or the source is empty)."""

    def __init__(self, path: Path, why: str) -> None:
        self.path, self.why = path, why
        super().__init__(f"{path} holds no metrics: {why}")


class NotAGolden(ValueError):
    """A JSON file that is not a golden file of a schema we read."""


def read_metrics(
    path: Path,
    *,
    key_map: Mapping[str, str] | None = None,
    tag_map: Mapping[str, str] | None = None,
) -> RunMetrics:
    """All metric curves of the run at ``path`` (see the module docstring for what it takes).

    ``key_map``/``tag_map`` map a JSONL file's keys / TensorBoard tags to our metric names for
    trainers that log under their own names.
    """
    path = Path(path)
    if not path.exists():
        raise MetricsPathMissing(path)
    metrics = (
        _read_file(path, key_map, tag_map)
        if path.is_file()
        else _read_folder(path, key_map, tag_map)
    )
    if not metrics:
        raise NoMetricsFound(
            path,
            "its files hold no metric we know (loss, grad_norm, lr, ...); "
            "map the trainer's names with a key/tag map",
        )
    return metrics


def read_run(path: Path, *, key: str | None = None) -> RunMetrics:
    """:func:`read_metrics` for user input: every mistake becomes a :class:`SpecError` naming
    the path (and ``key``, e.g. an experiment's ``golden``) and the fix."""

    try:
        return read_metrics(path)
    except MetricsPathMissing:
        raise SpecError(
            "does not exist", file=str(path), key=key, fix=f"check the path; pass {ACCEPTED}"
        ) from None
    except NotAGolden as exc:
        raise SpecError(
            f"not a golden file: {exc}",
            file=str(path),
            key=key,
            fix="create it with: convergence export-golden RUN_DIR OUT.json",
        ) from None
    except NoMetricsFound as exc:
        raise SpecError(
            f"no metrics found ({exc.why})", file=str(path), key=key, fix=f"pass {ACCEPTED}"
        ) from None
    except (FileNotFoundError, ValueError) as exc:  # e.g. a corrupt event file
        raise SpecError(
            f"cannot read its metrics: {exc}", file=str(path), key=key, fix=f"pass {ACCEPTED}"
        ) from None


def describe_source(path: Path) -> str:
    """What :func:`read_metrics` reads for ``path``, in words (for messages and metadata)."""
    path = Path(path)
    if path.is_file():
        return _file_kind(path)
    for name in RUN_JSONL:
        if (path / name).is_file():
            return f"run folder ({name})"
    return "TensorBoard folder"


def _read_file(
    path: Path, key_map: Mapping[str, str] | None, tag_map: Mapping[str, str] | None
) -> RunMetrics:
    kind = _file_kind(path)
    if kind == "golden":
        try:
            return load_golden(path)
        except ValueError as exc:
            raise NotAGolden(str(exc)) from None
    if kind == "tensorboard":
        return read_tensorboard(path, tag_map)

    return read_jsonl(path, key_map)


def _file_kind(path: Path) -> str:
    if path.name.startswith(EVENT_PREFIX):
        return "tensorboard"
    if path.suffix == ".json" or _looks_like_golden(path):
        return "golden"
    return "jsonl"


def _looks_like_golden(path: Path) -> bool:
    """A golden saved under another suffix: one JSON document with a ``curves`` key."""
    try:
        with path.open("rb") as f:
            if not f.read(64).lstrip().startswith(b"{"):
                return False
        # A JSONL file fails here at its second line ("extra data"): not a golden.
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and "curves" in document


def _read_folder(
    path: Path, key_map: Mapping[str, str] | None, tag_map: Mapping[str, str] | None
) -> RunMetrics:

    # Our runs write the JSONL stream and TensorBoard; the JSONL is what the backend reads
    # for the verdict (float64 exact), so compare reads the same.
    for name in RUN_JSONL:
        if (path / name).is_file():
            return read_jsonl(path / name, key_map)
    if not any(p.is_file() for p in path.rglob(EVENT_PREFIX + "*")):
        raise NoMetricsFound(
            path,
            f"no metrics.jsonl, dump/metrics.jsonl or {EVENT_PREFIX}* "
            f"files in it; pass {ACCEPTED} (torchtitan: enable "
            f"metrics.enable_tensorboard)",
        )

    return read_tensorboard(path, tag_map)


__all__ = [
    "ACCEPTED",
    "MetricsPathMissing",
    "NoMetricsFound",
    "NotAGolden",
    "describe_source",
    "read_metrics",
    "read_run",
]
