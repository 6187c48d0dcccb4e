"""The shipped regimes as strategies, without running anything: the default choice, control
jobs, what travels with the control, probe eligibility, and the twin's dependence on the
backend's ``noise_twin``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from convergence.metrics.curve import Curve
from convergence.preflight import REGIMES
from convergence.regimes import REGISTRY, get_regime
from convergence.regimes.registry import SHIPPED
from convergence.regimes.twin import forward_twin_degrees
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.layout import ParallelLayout, Techniques
from convergence.spec.pair import PairSpec

CONTROL = JobSpec(name="fsdp2", train_config=Path("debug.toml"), layout=ParallelLayout(dp_shard=2))


class NoTwins:
    def noise_twin(self, job: JobSpec) -> JobSpec | None:
        return None


class Twins:
    def noise_twin(self, job: JobSpec) -> JobSpec | None:
        return dataclasses.replace(job, name=f"{job.name}-twin")


def pair(regime: str, *, replicates: int = 3, test: JobSpec = CONTROL) -> PairSpec:
    return PairSpec(
        pair_id="e.toml::t",
        control=CONTROL,
        test=test,
        rules=get_regime(regime).default_rules(),
        regime=regime,
        replicates=replicates,
        source="e.toml",
    )


def test_the_shipped_regimes_in_the_order_the_default_is_asked() -> None:
    names = ("margin", "paired", "twin", "seed")
    assert REGISTRY.names()[:4] == names == tuple(r.name for r in SHIPPED)
    bf16 = dataclasses.replace(CONTROL, techniques=Techniques(param_dtype="bfloat16"))
    assert REGISTRY.default_for(CONTROL, CONTROL) == "paired"
    # A technique that changes the math on purpose is judged for "as good", first of all.
    float8 = dataclasses.replace(bf16, techniques=Techniques(float8="tensorwise"))
    assert REGISTRY.default_for(bf16, float8, twins=True) == "margin"
    assert REGISTRY.default_for(bf16, dataclasses.replace(float8, seed=7)) == "margin"
    # Twin where both sides' backends derive twins (Capabilities.twins_by_default), else seed.
    assert REGISTRY.default_for(CONTROL, bf16, twins=True) == "twin"
    assert REGISTRY.default_for(CONTROL, bf16, twins=False) == "seed"
    assert REGISTRY.default_for(CONTROL, dataclasses.replace(CONTROL, seed=7), twins=True) == "seed"
    # As the parser sees it (convergence.preflight.REGIMES): the backends are asked.
    assert REGIMES.default_for(CONTROL, bf16) == "twin"
    assert REGIMES.default_for(CONTROL, dataclasses.replace(bf16, backend="command")) == "seed"


def test_an_unknown_regime_names_the_known_ones() -> None:
    with pytest.raises(SpecError, match="unknown regime 'bitwise'") as err:
        get_regime("bitwise")
    assert "paired, twin, seed" in str(err.value)


def test_each_regime_judges_its_gating_metrics_by_its_method() -> None:
    for regime in SHIPPED:
        methods = {r.metric: r.method for r in regime.default_rules()}
        assert methods["loss"] == methods["grad_norm"] == regime.method == regime.name
        assert methods["tokens_per_s"] == "regression"


def test_control_jobs_and_what_travels_with_the_control() -> None:
    curve = {"loss": Curve("loss", np.array([1, 2]), np.array([1.0, 0.9]))}
    assert get_regime("paired").control_jobs(pair("paired"), NoTwins()) == (CONTROL,)
    seeds = get_regime("seed").control_jobs(pair("seed", replicates=3), NoTwins())
    assert [(j.name, j.seed) for j in seeds] == [
        ("fsdp2", 42),
        ("fsdp2-seed1", 43),
        ("fsdp2-seed2", 44),
    ]
    assert len(get_regime("seed").control_curves([curve, curve]).replicates) == 2
    twin = get_regime("twin").control_jobs(pair("twin"), Twins())
    assert [j.name for j in twin] == ["fsdp2", "fsdp2-twin"]
    kept = get_regime("twin").control_curves([curve, curve])
    assert kept.twins == (curve,) and kept.replicates == ()


def test_a_backend_without_twins_leaves_the_twin_regime_with_a_fix() -> None:
    with pytest.raises(SpecError) as err:
        get_regime("twin").check(pair("twin"), key="test[0]", backend=NoTwins())
    assert err.value.key == "test[0].regime" and 'regime = "seed"' in str(err.value)
    get_regime("twin").check(
        dataclasses.replace(pair("twin"), golden="g.json"), key="test[0]", backend=NoTwins()
    )  # a golden is the control


def test_the_seed_regime_needs_two_replicates_and_probes_nothing() -> None:
    with pytest.raises(SpecError, match="at least 2 control replicates"):
        get_regime("seed").check(pair("seed", replicates=1), key="test", backend=NoTwins())
    # margin: a deliberate change differs at step 1 by design, nothing for the probe to find.
    assert [r.probe_on_failure for r in SHIPPED] == [False, True, True, False]


class ForwardTwins(Twins):
    def forward_twin(self, job: JobSpec, *, tp: int = 2) -> JobSpec | None:
        return dataclasses.replace(job, name=f"{job.name}-fwd-twin-tp{tp}")


def test_twin_regime_adds_the_forward_twin_and_the_twin_with_the_tests_numerics() -> None:
    # A backend with forward_twin: the control, its noise twin, its forward-noise twin (as
    # TP2), and for a TP4 test one more that rounds as TP4 (their noises add up).
    same = get_regime("twin").control_jobs(pair("twin"), ForwardTwins())
    assert [j.name for j in same] == ["fsdp2", "fsdp2-twin", "fsdp2-fwd-twin-tp2"]
    tp4 = dataclasses.replace(
        CONTROL, name="t", layout=dataclasses.replace(CONTROL.layout, dp_shard=2, tp=4)
    )
    jobs = get_regime("twin").control_jobs(pair("twin", test=tp4), ForwardTwins())
    assert [j.name for j in jobs][2:] == ["fsdp2-fwd-twin-tp2", "fsdp2-fwd-twin-tp4"]
    assert [forward_twin_degrees(tp) for tp in (1, 2, 4, 6, 8)] == [
        [2],
        [2],
        [2, 4],
        [2, 4, 6],
        [2, 4, 8],
    ]
    # A test that reduces in bf16 against an fp32 control: the control run with the test's
    # numerics gets a noise twin too (noise from the noisier side); its layout is the control's.
    noisier = dataclasses.replace(
        CONTROL, name="t", techniques=Techniques(reduce_dtype="bfloat16"), hook="x:y"
    )
    jobs = get_regime("twin").control_jobs(pair("twin", test=noisier), Twins())
    assert [j.name for j in jobs] == [
        "fsdp2",
        "fsdp2-twin",
        "fsdp2-as-test-reduce_dtype=bfloat16-twin",
    ]
    assert jobs[2].techniques.reduce_dtype == "bfloat16" and jobs[2].layout == CONTROL.layout
    assert jobs[2].hook is None  # control-side: no test code in it
    kept = get_regime("twin").control_curves(["c", "t1", "t2"])  # type: ignore[list-item]
    assert kept.twins == ("t1", "t2")


def test_a_resuming_test_resumes_the_twins_and_only_in_the_twin_regime() -> None:
    from convergence.regimes import resumed_controls
    from convergence.spec.resume import Resume

    resuming = dataclasses.replace(
        CONTROL,
        name="t",
        resume=Resume(at_step=4, layout=ParallelLayout(dp_shard=2, tp=2), techniques=Techniques()),
    )
    twin = get_regime("twin")
    assert [j.name for j in resumed_controls(twin, pair("twin", test=resuming), Twins())] == [
        "fsdp2-twin"
    ]
    assert resumed_controls(twin, pair("twin"), Twins()) == ()  # no resume, nothing again
    for name in ("paired", "seed"):
        assert resumed_controls(get_regime(name), pair(name, test=resuming), Twins()) == ()
