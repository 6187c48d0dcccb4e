"""A metric curve: logged steps and their values, at full (float64) precision."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, eq=False)
class Curve:
    """One metric of one run. ``steps`` are strictly increasing optimizer steps (1-based)."""

    metric: str
    steps: npt.NDArray[np.int64]
    values: npt.NDArray[np.float64]

    @staticmethod
    def from_pairs(metric: str, pairs: list[tuple[int, float]]) -> Curve:
        """Build from (step, value) pairs; a step logged twice keeps its last value."""
        last: dict[int, float] = {}
        for step, value in pairs:
            last[int(step)] = float(value)
        steps = np.array(sorted(last), dtype=np.int64)
        values = np.array([last[s] for s in steps.tolist()], dtype=np.float64)
        return Curve(metric, steps, values)

    def __len__(self) -> int:
        return int(self.steps.size)

    def upto(self, step: int) -> Curve:
        keep = self.steps <= step
        return Curve(self.metric, self.steps[keep], self.values[keep])

    def after(self, step: int) -> Curve:
        """The steps past ``step`` (a resume's second job: step+1 on)."""
        keep = self.steps > step
        return Curve(self.metric, self.steps[keep], self.values[keep])

    def to_json(self) -> dict[str, list[float] | list[int] | str]:
        return {"metric": self.metric, "steps": self.steps.tolist(), "values": self.values.tolist()}

    @staticmethod
    def from_json(data: dict[str, object]) -> Curve:
        steps = np.asarray(data["steps"], dtype=np.int64)
        values = np.asarray(data["values"], dtype=np.float64)
        return Curve(str(data["metric"]), steps, values)


#: All curves of one run, by metric name (``loss``, ``grad_norm``, ...).
RunMetrics = dict[str, Curve]
