"""PairOutcome <-> JSON: exact round trip (float64 curves, non-finite values), clear errors."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import pytest
from report_examples import all_examples, failing_pair, seed_pair

from convergence.metrics.curve import Curve
from convergence.report.data.serialize import (
    OUTCOME_FORMAT,
    OutcomeFormatError,
    outcome_from_json,
    outcome_to_json,
)
from convergence.run.outcome import PairOutcome


def _roundtrip(o: PairOutcome) -> PairOutcome:
    text = json.dumps(outcome_to_json(o), allow_nan=False)  # strict JSON: no NaN literals
    return outcome_from_json(json.loads(text))


@pytest.mark.parametrize("outcome", all_examples(), ids=lambda o: o.pair.name)
def test_roundtrip_keeps_everything(outcome: PairOutcome) -> None:
    back = _roundtrip(outcome)
    assert outcome_to_json(back) == outcome_to_json(outcome)
    assert back.pair == outcome.pair  # frozen dataclasses compare field by field
    assert back.verdicts == outcome.verdicts
    assert (back.status, back.error, back.stopped_early_at, back.localisation) == (
        outcome.status,
        outcome.error,
        outcome.stopped_early_at,
        outcome.localisation,
    )
    for side_name in ("control", "test"):
        side, side_back = getattr(outcome, side_name), getattr(back, side_name)
        if side is None:
            assert side_back is None
            continue
        assert side_back.result == side.result
        assert (side_back.cached, side_back.run_dir, side_back.meta) == (
            side.cached,
            side.run_dir,
            side.meta,
        )
        for name, curve in side.metrics.items():
            # Bit-exact float64: a paired verdict lives at 1e-7 and must be re-judgeable.
            assert side_back.metrics[name].values.tobytes() == curve.values.tobytes()
            assert np.array_equal(side_back.metrics[name].steps, curve.steps)


def test_seed_replicates_survive() -> None:
    o = seed_pair()
    back = _roundtrip(o)
    assert back.control is not None and o.control is not None
    assert len(back.control.replicates) == 3
    for a, b in zip(back.control.replicates, o.control.replicates, strict=True):
        assert a["loss"].values.tobytes() == b["loss"].values.tobytes()


def test_twin_curves_survive() -> None:
    import dataclasses

    o = seed_pair()
    assert o.control is not None
    twin_side = dataclasses.replace(o.control, replicates=(), twins=(o.control.replicates[1],))
    back = _roundtrip(dataclasses.replace(o, control=twin_side))
    assert back.control is not None and len(back.control.twins) == 1
    original = o.control.replicates[1]["loss"].values
    assert back.control.twins[0]["loss"].values.tobytes() == original.tobytes()


def test_non_finite_values_roundtrip_as_strict_json() -> None:
    o = failing_pair()
    assert o.test is not None
    loss = o.test.metrics["loss"]
    values = loss.values.copy()
    values[-3:] = [math.nan, math.inf, -math.inf]
    test = dataclasses.replace(
        o.test, metrics={**o.test.metrics, "loss": Curve("loss", loss.steps, values)}
    )
    verdict = dataclasses.replace(
        o.verdicts[0], max_deviation=math.nan, p_values={"tost": math.inf}
    )
    o = dataclasses.replace(o, test=test, verdicts=(verdict, *o.verdicts[1:]))
    data = outcome_to_json(o)
    text = json.dumps(data, allow_nan=False)
    assert '"NaN"' in text and '"Infinity"' in text and '"-Infinity"' in text
    back = outcome_from_json(json.loads(text))
    assert back.test is not None
    got = back.test.metrics["loss"].values
    assert math.isnan(got[-3]) and got[-2] == math.inf and got[-1] == -math.inf
    assert math.isnan(back.verdicts[0].max_deviation)
    assert back.verdicts[0].p_values == {"tost": math.inf}


def test_wrong_format_is_a_clear_error() -> None:
    data = outcome_to_json(failing_pair())
    with pytest.raises(OutcomeFormatError, match="format"):
        outcome_from_json({**data, "format": "convergence.outcome/0"})
    broken = {**data, "pair": {k: v for k, v in data["pair"].items() if k != "pair_id"}}
    with pytest.raises(OutcomeFormatError, match="pair_id"):
        outcome_from_json(broken)
    assert data["format"] == OUTCOME_FORMAT


def _non_default_specs() -> PairOutcome:
    """A pair whose every JobSpec and PairSpec field differs from its default: a field that the
    serializer drops then shows up (the old round-trip test used defaults and could not)."""
    from pathlib import Path

    from convergence.spec.job import JobSpec
    from convergence.spec.layout import ParallelLayout, Techniques
    from convergence.spec.pair import ComparisonRule, PairSpec
    from convergence.spec.resume import Resume
    from convergence.spec.trainer_request import TrainerRequest

    job = JobSpec(
        name="t",
        train_config=Path("/x/debug.toml"),
        layout=ParallelLayout(dp_shard=2, tp=2),
        techniques=Techniques(param_dtype="bfloat16"),
        steps=7,
        seed=3,
        backend="command",
        local_batch_size=2,
        hook="pkg.mod:fn",
        hook_mode="replace_tp",
        overrides=(("a.b", "1"),),
        backend_options=(("command", "python x.py"),),
        source="e.toml",
        resume=Resume(
            at_step=3,
            layout=ParallelLayout(dp_shard=4),
            techniques=Techniques(),
            local_batch_size=1,
        ),
        device="cpu",
        request=TrainerRequest(anchor_every=5),
    )
    pair = PairSpec(
        pair_id="e.toml::t",
        control=dataclasses.replace(job, name="c"),
        test=job,
        rules=(ComparisonRule(metric="loss", method="seed", margin=0.1),),
        regime="seed",
        replicates=4,
        early_stop=False,
        source="e.toml",
        tier="nightly",
        probe_on_failure=False,
        probe_always=True,
        golden="g.json",
        check_keys=(("anchor_every", 25),),
        extra=(("k", "v"),),
        placement="cpu: 4 rank(s) on CPU (gloo)",
    )
    for spec in (job, pair):
        for f in dataclasses.fields(spec):
            default = (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            )
            assert getattr(spec, f.name) != default, f"set {f.name} to a non-default value"
    return PairOutcome(pair=pair, status="error", control=None, test=None, error="x")


def _as_saved(job: Any) -> Any:
    """The job as a saved outcome holds it: its trainer request inside its overrides, as the
    request travelled before it had a type (and as the run-cache key still hashes it)."""
    from convergence.spec.trainer_request import TrainerRequest

    overrides = (*job.overrides, *job.request.as_overrides())
    return dataclasses.replace(job, overrides=overrides, request=TrainerRequest())


def test_every_spec_field_survives_the_round_trip() -> None:
    o = _non_default_specs()
    pair = dataclasses.replace(
        o.pair, control=_as_saved(o.pair.control), test=_as_saved(o.pair.test)
    )
    back = _roundtrip(o).pair
    assert back == pair and ("checkpoint.anchor_every", "5") in back.test.overrides
    assert back.test.identity() == o.pair.test.identity()  # the same key either way


def test_an_outcome_saved_without_newer_fields_reads_with_their_defaults() -> None:
    data = outcome_to_json(_non_default_specs())
    del data["pair"]["probe_always"], data["pair"]["test"]["hook_mode"]
    data["pair"]["from_a_newer_version"] = 1
    back = outcome_from_json(json.loads(json.dumps(data)))
    assert back.pair.probe_always is False and back.pair.test.hook_mode == "after"
