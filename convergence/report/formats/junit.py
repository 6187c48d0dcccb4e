"""JUnit properties of one pair (the pytest plugin passes them to ``record_property``)."""

from __future__ import annotations

from convergence.report.data.records import first_divergent_step, techniques_changed
from convergence.report.data.resume import resume_record, resumed_label
from convergence.report.fmt import describe_test, fmt_num
from convergence.run.outcome import PairOutcome

PREFIX = "convergence."


def _test_layout(o: PairOutcome) -> str:
    """The test's layout; a resume pair's as ``fsdp2→fsdp2-tp2@10`` (it resumed on the
    second), not its pre-resume layout alone."""
    resume = resume_record(o, None)
    return resumed_label(resume) if resume is not None else o.pair.test.layout.short_name()


def junit_properties(o: PairOutcome) -> list[tuple[str, str]]:
    """``(name, value)`` strings: layouts, status, per-metric verdicts, divergence, cache, wall."""
    pair = o.pair
    props: list[tuple[str, str]] = [
        ("status", o.status),
        ("regime", pair.regime),
        ("control_layout", pair.control.layout.short_name()),
        ("test_layout", describe_test(_test_layout(o), techniques_changed(o))),
        ("world_size", f"{pair.control.world_size}->{pair.test.world_size}"),
    ]
    if pair.control.layout.ep > 1 or pair.test.layout.ep > 1:  # MoE pairs: EP, borrowed ranks
        props.append(("expert_parallel", f"{pair.control.layout.ep}->{pair.test.layout.ep}"))
    if pair.placement:  # where both sides ran (convergence.launch.placement)
        props.append(("device", pair.placement))
    if o.attribution:  # which axis a failing N-D pair's failure belongs to
        props.append(("attribution", str(o.attribution["summary"])))
    for v in o.verdicts:
        name = v.metric
        word = (
            "not compared"
            if v.not_compared
            else ("pass" if v.passed else "inconclusive" if v.inconclusive else "fail")
        )
        props.append(
            (
                f"{name}.verdict",
                f"{word} ({v.method}{'' if v.gate or v.not_compared else ', not gating'})",
            )
        )
        if v.not_compared:
            props.append((f"{name}.not_compared", v.message))
        if "excludable" in v.details:  # the margin comparison's power statement
            props.append((f"{name}.excludable", fmt_num(v.details["excludable"])))
            if v.details.get("replicates_needed") is not None:
                props.append((f"{name}.replicates_needed", str(v.details["replicates_needed"])))
        if v.inconclusive:
            props.append((f"{name}.inconclusive", v.message))
        props.append(
            (
                f"{name}.max_deviation",
                fmt_num(v.max_deviation)
                + ("" if v.max_deviation_step is None else f" at step {v.max_deviation_step}"),
            )
        )
        if v.tolerance_at_max is not None:
            props.append((f"{name}.tolerance", fmt_num(v.tolerance_at_max)))
        if v.first_divergent_step is not None:
            props.append((f"{name}.first_divergent_step", str(v.first_divergent_step)))
    floors = next((v.details["floors"] for v in o.verdicts if "floors" in v.details), None)
    if isinstance(floors, dict):  # whose noise floors the paired/twin verdicts used
        props.append(("floors", str(floors.get("note", ""))[:300]))
    step = first_divergent_step(o)
    if step is not None:
        props.append(("first_divergent_step", str(step)))
    if o.stopped_early_at is not None:
        props.append(("stopped_early_at", str(o.stopped_early_at)))
    props.append(("control_cached", str(bool(o.control and o.control.cached)).lower()))
    props.append(("wall_s", f"{o.wall_s:.2f}"))
    if o.test is not None:
        props.append(("test_wall_s", f"{o.test.wall_s:.2f}"))
    if o.error:
        props.append(("error", o.error.strip().splitlines()[0][:300]))
    return [(PREFIX + k, v) for k, v in props]
