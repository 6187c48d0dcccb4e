"""Any trainer as a backend: a command template plus where its metrics land.

    [control]
    backend = "command"
    backend_options = { command = "my_trainer.py --tp {tp} --steps {steps} --out {dump_dir}",
                        metrics = "jsonl", metrics_file = "log.jsonl",
                        keys = { loss = "train_loss", grad_norm = "gnorm" } }

``sources = ["train.py", "my_trainer/**/*.py"]``: glob patterns (relative to the experiment
file's folder, or absolute) of the files that define the trainer; their content goes into the
run-cache key, so editing the trainer never reuses a stale control. Without them the key holds
the command text (and ``version``) only, and the report's environment says so.

``command`` is a string, split into argv words like a shell would *before* placeholders are
filled in, or a TOML list of strings, taken word for word (``["python", "my train.py", "--out",
"{dump_dir}"]``); it never goes through a shell: a value from TOML cannot inject a command.
With ``launch = "torchrun"`` (the default) the words follow torchrun's own options (a script path or ``-m module``); with
``launch = "direct"`` the words are the whole command (a trainer that starts its own ranks).
"""

from __future__ import annotations

import ast
import json
import shlex
from pathlib import Path
from typing import Any

from convergence.backends.base import Capabilities, CodeIdentity
from convergence.metrics.curve import RunMetrics
from convergence.metrics.jsonl import read_jsonl
from convergence.metrics.tags import TENSORBOARD_TAGS, resolve_map
from convergence.metrics.tensorboard import read_tensorboard
from convergence.spec import run_dir
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.run_dir import DumpDir
from convergence.spec.toml_io import shell_words

OPTION_KEYS = (
    "command",
    "launch",
    "metrics",
    "metrics_file",
    "version",
    "tokens_per_step",
    "sources",
)
#: Options that take one of a few words; the first is the default.
CHOICES: dict[str, tuple[str, ...]] = {
    "launch": ("torchrun", "direct"),
    "metrics": ("jsonl", "tensorboard"),
}
PLACEHOLDERS = (
    "nproc",
    "world_size",
    "dp_replicate",
    "dp_shard",
    "dp",
    "tp",
    "pp",
    "cp",
    "pp_schedule",
    "pp_microbatches",
    "steps",
    "seed",
    "dump_dir",
    "local_batch_size",
    "grad_accum_steps",
    "float8",
    "float8_all_gather",
    "mxfp8",
    "train_config",
)


def _options(job: JobSpec) -> dict[str, str]:
    return dict(job.backend_options)


def _key_map(options: dict[str, str]) -> dict[str, str]:
    """``keys.loss = "train_loss"`` -> {"train_loss": "loss"} (their name -> ours)."""
    return {
        theirs: ours.split(".", 1)[1]
        for ours, theirs in ((k, v) for k, v in options.items() if k.startswith("keys."))
    }


def _sources(job: JobSpec) -> list[str]:
    """``backend_options.sources``: a list of globs (backend options are flat strings: a TOML
    array arrives as its Python text, ``['train.py']``; a single glob as itself)."""
    raw: Any = dict(job.backend_options).get("sources")
    if raw is None:
        return []
    if isinstance(raw, str):
        try:
            raw = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            raw = [raw]
    if isinstance(raw, str):
        raw = [raw]
    return [str(p) for p in raw]


def placeholders(job: JobSpec, dump_dir: Path) -> dict[str, str]:
    layout = job.layout
    return {
        "nproc": str(job.world_size),
        "world_size": str(job.world_size),
        "dp_replicate": str(layout.dp_replicate),
        "dp_shard": str(layout.dp_shard),
        "dp": str(layout.dp),
        "tp": str(layout.tp),
        "pp": str(layout.pp),
        "cp": str(layout.cp),
        "pp_schedule": layout.pp_schedule,
        "pp_microbatches": str(layout.microbatches),
        "steps": str(job.steps),
        "seed": str(job.seed),
        "dump_dir": str(dump_dir),
        "local_batch_size": str(job.local_batch_size or ""),
        "grad_accum_steps": str(job.techniques.grad_accum_steps),
        # The precision techniques, for a trainer that offers them (docs/precision.md).
        "float8": job.techniques.float8,
        "float8_all_gather": str(job.techniques.float8_all_gather).lower(),
        "mxfp8": str(job.techniques.mxfp8).lower(),
        "train_config": str(job.train_config),
    }


class CommandBackend:
    name = "command"
    capabilities = Capabilities()

    def version(self) -> str:
        return "command-1"

    def code_identity(self, job: JobSpec) -> CodeIdentity:
        # Without ``sources`` the key knows the command text only.
        return CodeIdentity(
            keyed="sources" in dict(job.backend_options),
            note="keyed by their command text only (list the trainer's files in "
            "backend_options.sources to key their content)",
        )

    def source_files(self, job: JobSpec) -> list[Path]:
        """The files ``backend_options.sources`` names (sorted, existing files only)."""
        patterns = _sources(job)
        base = Path(job.source).resolve().parent if job.source else Path.cwd()
        found: set[Path] = set()
        for pattern in patterns:
            if Path(pattern).is_absolute():
                root, rel = Path(Path(pattern).anchor), pattern[len(Path(pattern).anchor) :]
            else:
                root, rel = base, pattern
            found.update(p.resolve() for p in root.glob(rel) if p.is_file())
        return sorted(found)

    def sources_digest(self, job: JobSpec) -> str:
        """sha256 over the trainer's source files (path + content); "" without ``sources``."""
        import hashlib

        files = self.source_files(job)
        if not files:
            return ""
        digest = hashlib.sha256()
        for path in files:
            digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()

    def preflight(self, job: JobSpec) -> None:
        options = _options(job)
        file = job.source
        for key in options:
            if key not in OPTION_KEYS and not key.startswith("keys."):
                raise SpecError(
                    "unknown backend option",
                    file=file,
                    key=f"backend_options.{key}",
                    fix=f"use one of {', '.join(OPTION_KEYS)} or keys.<metric>",
                )
        template = options.get("command")
        if not template:
            raise SpecError(
                "the command backend needs a command template",
                file=file,
                key="backend_options.command",
                fix='set backend_options = { command = "train.py --steps {steps} '
                '--out {dump_dir}" }',
            )
        words = shell_words(
            template,
            what="the command",
            file=file,
            key="backend_options.command",
            fix="balance the quotes",
        )
        for word in words:
            try:
                word.format(**placeholders(job, Path("DUMP")))
            except (KeyError, IndexError, ValueError) as exc:
                raise SpecError(
                    f"unknown placeholder {exc} in {word!r}",
                    file=file,
                    key="backend_options.command",
                    fix=f"use only {{{'}, {'.join(PLACEHOLDERS)}}}",
                ) from None
        for option, choices in CHOICES.items():  # the first choice is the default
            if options.get(option, choices[0]) not in choices:
                raise SpecError(
                    f"{option} must be {' or '.join(choices)}",
                    file=file,
                    key=f"backend_options.{option}",
                    fix=f'set {option} = "{choices[0]}"',
                )
        if "sources" in options:
            patterns = _sources(job)
            if not patterns or not self.source_files(job):
                raise SpecError(
                    f"backend_options.sources {patterns!r} matches no file",
                    file=file,
                    key="backend_options.sources",
                    fix="list globs of the trainer's files relative to the "
                    'experiment file, e.g. sources = ["train.py"]',
                )

    def launches_itself(self, job: JobSpec) -> bool:
        return _options(job).get("launch", "torchrun") == "direct"

    def tokens_per_step(self, job: JobSpec) -> int:
        # We cannot read another trainer's config: the user states it (or we skip the check
        # by reporting a value that depends only on the DP degree and batch they gave).
        stated = _options(job).get("tokens_per_step")
        if stated:
            return int(stated)
        return (job.local_batch_size or 1) * job.layout.dp * job.techniques.grad_accum_steps

    def config_text(self, job: JobSpec) -> str:
        """The train config's text and the trainer's sources (``backend_options.sources``):
        both go into the run-cache key."""
        path = Path(job.train_config)
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        digest = self.sources_digest(job)
        return text + (f"\n# trainer sources sha256 {digest}" if digest else "")

    def seed_identity(self, job: JobSpec) -> dict[str, Any] | None:
        return None

    def seed_entry(self, job: JobSpec, seed_dir: Path) -> list[str]:
        raise NotImplementedError("the command backend makes no seed checkpoint")

    def train_entry(self, job: JobSpec, dump_dir: Path, seed_dir: Path | None) -> list[str]:
        # Its Capabilities offer no part of a trainer request: collection refused any first.
        assert job.request.empty, f"the command backend got a trainer request: {job.request}"
        values = placeholders(job, dump_dir)
        return [word.format(**values) for word in shlex.split(_options(job)["command"])]

    def metrics_path(self, job: JobSpec, dump_dir: Path) -> Path | None:
        options = _options(job)
        if self.metrics_format(job) == "tensorboard":
            return dump_dir / options.get("metrics_file", "")  # tailed live (tb_tail.py)
        return dump_dir / options.get("metrics_file", run_dir.METRICS)

    def metrics_format(self, job: JobSpec) -> str:
        return "tensorboard" if _options(job).get("metrics") == "tensorboard" else "jsonl"

    def stop_file(self, job: JobSpec, dump_dir: Path) -> Path | None:
        return DumpDir(dump_dir).stop  # {dump_dir}/STOP: a trainer may honour it

    def record_keys(self, job: JobSpec) -> dict[str, str] | None:
        keys = _key_map(_options(job))
        if self.metrics_format(job) == "tensorboard":  # live records carry the writer's tags
            return resolve_map(TENSORBOARD_TAGS, keys or None, what="keys")
        return keys or None

    def read_metrics(self, job: JobSpec, dump_dir: Path) -> RunMetrics:
        options = _options(job)
        key_map = _key_map(options)
        if options.get("metrics", "jsonl") == "tensorboard":
            return read_tensorboard(
                dump_dir / options.get("metrics_file", ""), tag_map=key_map or None
            )

        return read_jsonl(
            dump_dir / options.get("metrics_file", run_dir.METRICS), key_map=key_map or None
        )

    def noise_twin(self, job: JobSpec) -> JobSpec | None:
        return None  # an arbitrary command has no settings to derive a twin from

    def forward_twin(self, job: JobSpec, *, tp: int = 2) -> JobSpec | None:
        return None

    def read_meta(self, job: JobSpec, dump_dir: Path) -> dict[str, Any]:
        path = DumpDir(dump_dir).run_meta
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}
