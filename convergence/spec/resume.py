"""A test side that stops, checkpoints and resumes: ``resume = { at_step = K, ... }``.

The side trains K steps under its own layout, saves a full training checkpoint (model,
optimizer, LR schedule, data position, RNG, step), stops; a second job under the resume layout
loads it and trains to the end. Both jobs' metrics form one curve, compared with the
uninterrupted control like any test (convergence.run.resume runs it; the built-in trainer's
convergence/trainer/resume.py writes and reads the checkpoint).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from convergence.spec.errors import SpecError
from convergence.spec.layout import ParallelLayout, Techniques
from convergence.spec.toml_io import check_keys, expect, expect_table, require_key

#: Keys of the ``resume`` table.
RESUME_KEYS = ("at_step", "parallelism", "techniques", "local_batch_size")
LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(ParallelLayout))

TECHNIQUE_KEYS = tuple(f.name for f in dataclasses.fields(Techniques))


@dataclass(frozen=True, kw_only=True)
class Resume:
    """Where a test side stops and how it goes on."""

    at_step: int
    """The optimizer step after which the side checkpoints and stops (1 <= K < steps)."""
    layout: ParallelLayout
    """The layout of the job that resumes (default: the side's own)."""
    techniques: Techniques
    """The techniques after the resume (default: the side's own; a table merges into them)."""
    local_batch_size: int | None = None
    """Samples per DP rank after the resume (None: the side's own). The tokens per step
    must stay the same: another DP degree needs another local batch."""

    def __post_init__(self) -> None:
        if not isinstance(self.at_step, int) or isinstance(self.at_step, bool) or self.at_step < 1:
            raise SpecError(
                f"at_step must be a positive integer, got {self.at_step!r}",
                key="resume.at_step",
                fix="set at_step to a step inside the run, e.g. at_step = 10 for a 20-step run",
            )
        if self.local_batch_size is not None and self.local_batch_size < 1:
            raise SpecError(
                "local_batch_size must be >= 1",
                key="resume.local_batch_size",
                fix="set it to 1 or more, or drop it",
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "at_step": self.at_step,
            "layout": self.layout.to_dict(),
            "techniques": self.techniques.to_dict(),
            "local_batch_size": self.local_batch_size,
        }


def parse_resume(
    value: Any, *, layout: ParallelLayout, techniques: Techniques, file: str, key: str
) -> Resume:
    """The ``resume`` table of a test side (``key`` is its path, e.g. ``test[0].resume``):
    ``parallelism`` replaces the side's layout (a whole layout, as in ``parallelism``),
    ``techniques`` merge into the side's."""
    table = expect_table(value, file=file, key=key)
    check_keys(table, RESUME_KEYS, file=file, path=key)
    at_step = require_key(
        table,
        "at_step",
        file=file,
        key=key,
        what="resume",
        fix="set at_step = K: the step after which the side checkpoints",
    )
    par = table.get("parallelism")
    tech = expect_table(table.get("techniques", {}), file=file, key=f"{key}.techniques")
    check_keys(tech, TECHNIQUE_KEYS, file=file, path=f"{key}.techniques")
    try:
        if par is not None:
            par = expect_table(par, file=file, key=f"{key}.parallelism")
            check_keys(par, LAYOUT_KEYS, file=file, path=f"{key}.parallelism")
        batch = table.get("local_batch_size")
        return Resume(
            at_step=expect(at_step, int, file=file, key=f"{key}.at_step", what="an integer"),
            layout=ParallelLayout(**par) if par is not None else layout,
            techniques=Techniques(**{**techniques.to_dict(), **tech}),
            local_batch_size=None
            if batch is None
            else expect(batch, int, file=file, key=f"{key}.local_batch_size", what="an integer"),
        )
    except SpecError as exc:
        if exc.file:
            raise
        sub = _sub_table(exc.key or "")
        raise SpecError(
            exc.detail,
            file=file,
            key=".".join(p for p in (key, sub, (exc.key or "").removeprefix("resume.")) if p),
            fix=exc.fix,
        ) from None


def _sub_table(name: str) -> str:
    if name in LAYOUT_KEYS:
        return "parallelism"
    return "techniques" if name in TECHNIQUE_KEYS else ""
