"""Which floors this process's verdicts use: the calibration for its stack, else the shipped
CPU defaults -- and the sentence that says so.

A session selects once (the Runner, when it is built: :func:`select_calibration` then
:func:`use`); the paired and twin tolerances then ask :func:`calibrated` for each metric's
parameters instead of reading their defaults table directly. A process that selected nothing
(a unit test, ``convergence compare``) gets the shipped defaults.

A file is only used when its stack equals this machine's (stack.py). A file for another stack
is never used, but never ignored silently either: the note names it and what differs, and every
paired/twin verdict carries the note (its tolerance text, details["floors"]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from convergence.calibration.file import (
    Calibration,
    default_path,
    explicit_path,
    load_calibration,
)
from convergence.calibration.stack import current_stack, stack_differences, stack_hash
from convergence.spec.errors import SpecError

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Selection:
    calibration: Calibration | None
    """The calibration in force (None: the shipped defaults)."""
    path: Path | None = None
    """Its file (or the file that was found and not used)."""
    stack_hash: str = ""
    """This machine's stack hash."""
    note: str = ""
    """Why the defaults: no file for this stack, a file for another stack, an unreadable one."""

    @property
    def source(self) -> str:
        return "calibration" if self.calibration is not None else "defaults"

    def label(self) -> str:
        """A few words for a verdict's tolerance text."""
        if self.calibration is not None:
            return f"floors calibrated on this stack ({self.stack_hash})"
        return "floors: shipped CPU defaults"

    def describe(self) -> str:
        """One sentence for reports and the terminal."""
        if self.calibration is not None:
            when = self.calibration.obtained.get("date", "?")
            return f"floors from calibration {self.path} (stack {self.stack_hash}, measured {when})"
        return f"floors: shipped CPU defaults ({self.note})" if self.note else self.label()

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "file": None if self.path is None else str(self.path),
            "stack_hash": self.stack_hash,
            "note": self.describe(),
        }


DEFAULTS = Selection(calibration=None, note="no calibration selected")


def select_calibration(work_dir: Path, *, explicit: Path | None = None) -> Selection:
    """The calibration for this machine's stack: ``explicit`` (or $CONVERGENCE_CALIBRATION),
    else ``<work_dir>/calibration/<stack_hash>.json``; the defaults with a note otherwise."""
    stack = current_stack()
    digest = stack_hash(stack)
    path = explicit or explicit_path() or default_path(work_dir, digest)
    if not path.is_file():
        return Selection(
            calibration=None,
            path=None,
            stack_hash=digest,
            note=f"no calibration for stack {digest}: run `convergence calibrate` to measure one",
        )
    try:
        calibration = load_calibration(path)
    except SpecError as exc:
        return Selection(
            calibration=None,
            path=path,
            stack_hash=digest,
            note=f"calibration {path} not used: {exc}",
        )
    if calibration.stack_hash != digest or calibration.stack != stack:
        differs = "; ".join(stack_differences(calibration.stack, stack)) or "stack hash"
        return Selection(
            calibration=None,
            path=path,
            stack_hash=digest,
            note=f"calibration {path} is for another stack ({differs}), ignored; "
            "run `convergence calibrate` here",
        )
    return Selection(calibration=calibration, path=path, stack_hash=digest)


_current: list[Selection] = [DEFAULTS]


def use(selection: Selection) -> Selection:
    """Make ``selection`` the one this process's verdicts use (returns it)."""
    _current[0] = selection
    return selection


def current() -> Selection:
    return _current[0]


@contextmanager
def in_force(selection: Selection) -> Iterator[Selection]:
    """``selection`` in force for the verdicts made inside the block, the previous one after
    (convergence/run/judge.py: a verdict uses the calibration it is handed, whatever the
    process selected before)."""
    before = _current[0]
    _current[0] = selection
    try:
        yield selection
    finally:
        _current[0] = before


def calibrated(method: str, metric: str, default: T) -> T:
    """``default`` (a frozen dataclass of tolerance parameters) with the calibrated values of
    comparison ``method`` for ``metric`` in place, when a calibration is in force and has
    them."""
    calibration = current().calibration
    if calibration is None:
        return default
    values = calibration.values(method, metric)
    names = {f.name for f in dataclasses.fields(default)}  # type: ignore[arg-type]
    values = {k: v for k, v in values.items() if k in names}
    return dataclasses.replace(default, **values) if values else default  # type: ignore[type-var]
