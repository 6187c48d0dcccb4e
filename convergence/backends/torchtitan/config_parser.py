"""torchtitan's own config parser (``ConfigManager``, tyro), run on CPU without a process
group to validate a job at collection; its messages cleaned and mapped back to the experiment
key that caused them."""

from __future__ import annotations

import contextlib
import functools
import io
import re
from typing import Any

from convergence.spec.job import JobSpec


@functools.cache
def _config_manager() -> Any:
    from torchtitan.config import ConfigManager  # seconds: torchtitan, tyro, the models

    return ConfigManager()


class ParseError(Exception):
    """torchtitan's config parser refused an argv; ``text`` is its message, cleaned."""

    def __init__(self, text: str) -> None:
        self.text = text
        super().__init__(text)


_NOISE = re.compile(r"^[\s│╭╰─┌└┐┘|+-]*$")


def _clean(text: str) -> str:
    """tyro's boxed help output -> the lines that say what is wrong."""
    keep = []
    for raw in text.splitlines():
        line = raw.strip().strip("│").strip()
        if (
            _NOISE.match(line)
            or line.startswith(("For full helptext", "in /"))
            or "has no effect without" in line
            or "does not exist!" in line
        ):
            continue
        keep.append(re.sub(r"\s+", " ", line))
    return "\n".join(keep) or "invalid arguments"


@functools.lru_cache(maxsize=256)
def parse(argv: tuple[str, ...]) -> Any:
    """torchtitan's config for ``argv`` (after ``-m torchtitan.train``); raises ParseError.

    Runs on CPU, without a process group. tyro reports an error by printing it and exiting:
    both are captured here."""
    manager = _config_manager()
    sink = io.StringIO()
    try:
        with contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
            return manager.parse_args(list(argv))
    except SystemExit:
        raise ParseError(_clean(sink.getvalue())) from None
    except ImportError:  # torchtitan made for another torch: preflight says so (registry)
        raise
    except Exception as exc:  # noqa: BLE001 - torchtitan's own checks (lookup, __post_init__)
        raise ParseError(f"{type(exc).__name__}: {exc}") from None


#: torchtitan settings derived from the spec -> the experiment key that set them.
SPEC_KEYS = {
    "mixed_precision_param": "techniques.param_dtype",
    "mixed_precision_reduce": "techniques.reduce_dtype",
    "pipeline_parallel_schedule": "parallelism.pp_schedule",
    "pipeline_parallel_microbatch_size": "parallelism.pp_microbatches",
    "local_batch_size": "local_batch_size",
    "context_parallel_degree": "parallelism.cp",
    "tensor_parallel_degree": "parallelism.tp",
    "pipeline_parallel_degree": "parallelism.pp",
}


def blame(job: JobSpec, message: str) -> str:
    """The experiment key a parser message is about: a user override when it names one."""
    text = message.replace("-", "_")
    keys = [(key, key.lstrip("-").replace("-", "_")) for key, _ in job.overrides]
    for key, dotted in keys:  # the full ``section.key`` first, then the bare key name
        if dotted in text:
            return f"overrides.{key}"
    for key, dotted in keys:
        if re.search(rf"\b{re.escape(dotted.rsplit('.', 1)[-1])}\b", text):
            return f"overrides.{key}"
    for theirs, ours in SPEC_KEYS.items():  # a value the spec put there
        if theirs in text:
            return ours
    if "Config function" in message or "config_registry" in message:
        return (
            "backend_options.config" if "Config function" in message else "backend_options.module"
        )
    return "overrides" if job.overrides else "backend_options"
