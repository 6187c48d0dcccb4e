"""Backend metric names -> ours (:data:`convergence.spec.pair.METRICS`).

A *source map* maps a backend's key (a TensorBoard tag or a JSONL key) to one of our metric
names. Several sources may feed one metric (``validation_metrics/loss`` and
``validation/loss``); the first source in map order that holds data wins, so a user's explicit
entries (which come first) beat the defaults.
"""

from __future__ import annotations

from collections.abc import Mapping

from convergence.metrics.curve import Curve, RunMetrics
from convergence.spec.pair import METRICS

#: TensorBoard tags the built-in trainer writes (torchtitan's names) and the aliases we accept.
TENSORBOARD_TAGS: dict[str, str] = {
    "loss_metrics/global_avg_loss": "loss",
    "grad_norm": "grad_norm",
    "grad_norm_parts": "grad_norm_parts",
    "update_norm": "update_norm",
    "update_norm_parts": "update_norm_parts",
    "lr": "lr",
    # torchtitan 0.3.0 logs each optimizer's learning rate as lr/<optimizer class> (one param
    # group; lr/<class>/<i> with several, which has no single "lr" to compare).
    "lr/AdamW": "lr",
    "lr/Adam": "lr",
    "lr/SGD": "lr",
    "validation_metrics/loss": "val_loss",
    "validation/loss": "val_loss",
    "throughput(tps)": "tokens_per_s",
    "memory/max_reserved(MiB)": "peak_mem_mib",
    # torchtitan logs memory in GiB; converted on read (see SOURCE_SCALE).
    "memory/max_reserved(GiB)": "peak_mem_mib",
}

#: JSONL keys are already our names.
JSONL_KEYS: dict[str, str] = {name: name for name in METRICS}

#: Factors applied to a source's values on read (unit conversions).
SOURCE_SCALE: dict[str, float] = {"memory/max_reserved(GiB)": 1024.0}

#: Metrics for which a negative value is "no measurement", never a value: torchtitan 0.3
#: logs ``reserved_bytes.all.peak`` as -1 byte where the device reports no memory statistics
#: (CPU: -9.3e-10 GiB, which read as -9.5e-07 MiB and was compared). Such points are dropped,
#: so a run without a measurement has no curve and the metric is "not compared".
NEGATIVE_IS_UNMEASURED: frozenset[str] = frozenset({"peak_mem_mib"})


def resolve_map(
    defaults: Mapping[str, str], override: Mapping[str, str] | None, *, what: str = "key_map"
) -> dict[str, str]:
    """The effective source map: ``override`` (their name -> ours) first, then the defaults.

    A metric named by the override no longer takes its default sources: a user who says
    ``keys.loss = "train_loss"`` means *that* key is the loss, even if the file also has a
    ``loss`` key with another meaning.
    """
    override = dict(override or {})
    for source, metric in override.items():
        if metric not in METRICS:
            raise ValueError(
                f"{what}: {source!r} maps to unknown metric {metric!r}; "
                f"map it to one of {', '.join(METRICS)}"
            )
    overridden = set(override.values())
    merged = dict(override)
    for source, metric in defaults.items():
        if metric not in overridden and source not in merged:
            merged[source] = metric
    return merged


def scale_for(source: str) -> float:
    """Unit factor for one source (1.0 for all but GiB memory tags)."""
    return SOURCE_SCALE.get(source, 1.0)


def sources_for(source_map: Mapping[str, str], metric: str) -> list[str]:
    """Sources feeding ``metric``, in priority order."""
    return [source for source, name in source_map.items() if name == metric]


def assemble(
    source_map: Mapping[str, str], pairs: Mapping[str, list[tuple[int, float]]]
) -> RunMetrics:
    """Curves from raw (step, value) lists per source: per metric, the first source with data.

    Unit factors (:data:`SOURCE_SCALE`) are applied here, once.
    """
    metrics: RunMetrics = {}
    for metric in dict.fromkeys(source_map.values()):
        for source in sources_for(source_map, metric):
            found = pairs.get(source)
            if found and metric in NEGATIVE_IS_UNMEASURED:
                found = [(s, v) for s, v in found if not v < 0]
            if found:
                factor = scale_for(source)
                scaled = found if factor == 1.0 else [(s, v * factor) for s, v in found]
                metrics[metric] = Curve.from_pairs(metric, scaled)
                break
    return metrics
