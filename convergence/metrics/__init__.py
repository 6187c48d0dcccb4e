"""Reading metrics: TensorBoard event files at full precision and the live JSONL stream."""

from __future__ import annotations

from convergence.metrics.curve import Curve, RunMetrics

__all__ = ["Curve", "RunMetrics"]
