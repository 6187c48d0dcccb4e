"""Example PairOutcomes for the report tests: what the runner returns, built by hand from
synthetic curves; the verdicts come from the real comparison methods (convergence.stats).

- ``passing_pair``: FSDP2 vs FSDP2+TP, paired, agreeing at the fp32 noise floor (control cached).
- ``failing_pair``: FSDP2 vs FSDP2+PP, paired, the loss leaves the tolerance at step 17 and the
  grad norm doubles (a wrongly scaled gradient).
- ``errored_pair``: the CP test job crashed on rank 1; no verdicts.
- ``seed_pair``: bf16 test against 3 fp32 control replicates (seed regime), inside the band.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from convergence.launch.types import FailureInfo, JobResult
from convergence.metrics.curve import Curve, RunMetrics
from convergence.run.outcome import PairOutcome, SideOutcome
from convergence.spec.job import JobSpec
from convergence.spec.layout import ParallelLayout, Techniques
from convergence.spec.pair import ComparisonRule, PairSpec
from convergence.stats.registry import compare_all
from convergence.stats.types import MetricVerdict

STEPS = 40
DIVERGES_AT = 17
SOURCE = "experiments/converging.toml"
CONFIG = Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml"


def _job(
    name: str, seed: int = 42, techniques: Techniques | None = None, **degrees: int
) -> JobSpec:
    return JobSpec(
        name=name,
        train_config=CONFIG,
        layout=ParallelLayout(**degrees),
        techniques=techniques or Techniques(),
        steps=STEPS,
        seed=seed,
        source=SOURCE,
    )


def _rules(regime: str) -> tuple[ComparisonRule, ...]:
    method = regime
    return (
        ComparisonRule(metric="loss", method=method),
        ComparisonRule(metric="grad_norm", method=method),
        ComparisonRule(metric="tokens_per_s", method="regression", gate=False, max_regression=0.2),
    )


def _pair(name: str, control: JobSpec, test: JobSpec, regime: str = "paired") -> PairSpec:
    return PairSpec(
        pair_id=f"converging.toml::{name}",
        control=control,
        test=test,
        rules=_rules(regime),
        regime=regime,
        source=SOURCE,
    )


def run_metrics(
    seed: int,
    *,
    tps: float = 1000.0,
    mem: float = 512.0,
    loss_shift: np.ndarray | None = None,
    gnorm_scale: np.ndarray | None = None,
    noise: float = 1.0,
) -> RunMetrics:
    """A plausible run: decaying loss with seed noise, grad norm, lr, throughput, memory."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, STEPS + 1, dtype=np.int64)
    loss = 3.0 * np.exp(-steps / 12.0) + 2.0 + noise * 0.02 * rng.standard_normal(STEPS)
    gnorm = 1.5 * np.exp(-steps / 20.0) + 0.3 + noise * 0.01 * rng.standard_normal(STEPS)
    if loss_shift is not None:
        loss = loss + loss_shift
    if gnorm_scale is not None:
        gnorm = gnorm * gnorm_scale
    return {
        "loss": Curve("loss", steps, loss),
        "grad_norm": Curve("grad_norm", steps, gnorm),
        "lr": Curve("lr", steps, np.minimum(steps / 5.0, 1.0) * 3e-4),
        "tokens_per_s": Curve("tokens_per_s", steps, tps + rng.normal(0, 5, STEPS)),
        "peak_mem_mib": Curve("peak_mem_mib", steps, np.full(STEPS, mem)),
    }


def _side(
    job: JobSpec,
    metrics: RunMetrics,
    *,
    cached: bool = False,
    wall_s: float = 12.5,
    status: str = "ok",
    failure: FailureInfo | None = None,
    replicates: tuple[RunMetrics, ...] = (),
) -> SideOutcome:
    run_dir = Path(f"/tmp/conv/runs/{job.name}")
    result = (
        None
        if cached
        else JobResult(
            name=job.name,
            status=status,
            returncode=0 if status == "ok" else 1,
            wall_s=wall_s,
            log_dir=run_dir / "logs",
            metrics_path=run_dir / "dump" / "metrics.jsonl",
            failure=failure,
            last_step=STEPS if status == "ok" else 3,
        )
    )
    return SideOutcome(
        job=job,
        metrics=metrics,
        result=result,
        cached=cached,
        run_dir=run_dir,
        wall_s=wall_s,
        replicates=replicates,
        meta={"world_size": job.world_size, "seed_checkpoint": "abc123"},
    )


def judge(
    pair: PairSpec, controls: list[RunMetrics], test: RunMetrics
) -> tuple[MetricVerdict, ...]:
    """The verdicts the runner would give: the real comparison methods of convergence.stats."""
    return tuple(compare_all(pair.rules, controls, test))


def passing_pair() -> PairOutcome:
    control, test = _job("fsdp2", dp_shard=2), _job("fsdp2-tp2", dp_shard=2, tp=2)
    rng = np.random.default_rng(7)
    noise = 1e-7 * rng.standard_normal(STEPS)
    ctrl_m = run_metrics(1)
    test_m = run_metrics(1, tps=930.0, mem=300.0, loss_shift=noise)
    pair = _pair("fsdp2-tp2", control, test)
    verdicts = judge(pair, [ctrl_m], test_m)
    assert all(v.passed for v in verdicts), verdicts
    return PairOutcome(
        pair=pair,
        status="passed",
        control=_side(control, ctrl_m, cached=True, wall_s=11.0),
        test=_side(test, test_m, wall_s=14.2),
        verdicts=verdicts,
        wall_s=14.9,
    )


def failing_pair() -> PairOutcome:
    control, test = _job("fsdp2", dp_shard=2), _job("fsdp2-pp2", dp_shard=2, pp=2)
    steps = np.arange(1, STEPS + 1)
    shift = np.where(steps >= DIVERGES_AT, 2e-3 * (steps - DIVERGES_AT + 1), 0.0)
    scale = np.where(steps >= DIVERGES_AT, 2.0, 1.0)
    ctrl_m = run_metrics(1)
    test_m = run_metrics(1, tps=1100.0, mem=700.0, loss_shift=shift, gnorm_scale=scale)
    pair = _pair("fsdp2-pp2", control, test)
    verdicts = judge(pair, [ctrl_m], test_m)
    assert [v.first_divergent_step for v in verdicts if not v.passed] == [DIVERGES_AT] * 2
    return PairOutcome(
        pair=pair,
        status="failed",
        control=_side(control, ctrl_m, wall_s=10.5),
        test=_side(test, test_m, wall_s=16.0),
        verdicts=verdicts,
        localisation={
            "module": "layers.1.attention.wo",
            "parameter": "weight",
            "max_abs_diff": 3.2e-4,
        },
        wall_s=27.1,
    )


def errored_pair() -> PairOutcome:
    control, test = _job("fsdp2", dp_shard=2), _job("fsdp2-cp2", dp_shard=2, cp=2)
    error = (
        "test job 'fsdp2-cp2' (fsdp2-cp2) rank 1 exited with code 1\n"
        'RuntimeError: shapes do not match <q> & "k"\n  logs: /tmp/conv/runs/logs'
    )
    return PairOutcome(
        pair=_pair("fsdp2-cp2", control, test),
        status="error",
        control=_side(control, run_metrics(1), cached=True),
        test=None,
        error=error,
        wall_s=3.5,
    )


def seed_pair() -> PairOutcome:
    bf16 = Techniques(param_dtype="bfloat16", deterministic=False)
    control = _job("fsdp2", dp_shard=2)
    test = _job("fsdp2-bf16", dp_shard=2, techniques=bf16)
    reps = tuple(run_metrics(10 + i) for i in range(3))
    test_m = run_metrics(20, tps=1500.0, mem=400.0, noise=0.4)

    pair = _pair("fsdp2-bf16", control, test, regime="seed")
    verdicts = judge(pair, list(reps), test_m)
    assert all(v.passed for v in verdicts), verdicts
    return PairOutcome(
        pair=pair,
        status="passed",
        control=_side(control, reps[0], cached=True, replicates=reps),
        test=_side(test, test_m, wall_s=9.0),
        verdicts=verdicts,
        stopped_early_at=None,
        wall_s=9.8,
    )


def twin_pair() -> PairOutcome:
    """bf16 on both sides: the twin's small drift from the control sizes the envelope."""
    bf16 = Techniques(param_dtype="bfloat16")
    control = _job("fsdp2", dp_shard=2, techniques=bf16)
    test = _job("fsdp2-tp2", dp_shard=2, tp=2, techniques=bf16)
    steps = np.arange(1, STEPS + 1)
    drift = 2e-5 * np.sqrt(steps) * np.cos(steps)
    ctrl_m = run_metrics(1)
    twin_m = run_metrics(1, loss_shift=drift)
    test_m = run_metrics(1, tps=900.0, mem=300.0, loss_shift=-1.5 * drift)
    pair = _pair("fsdp2-tp2-bf16", control, test, regime="twin")
    verdicts = judge(pair, [ctrl_m, twin_m], test_m)
    assert all(v.passed for v in verdicts), verdicts
    return PairOutcome(
        pair=pair,
        status="passed",
        control=dataclasses.replace(_side(control, ctrl_m, cached=True), twins=(twin_m,)),
        test=_side(test, test_m, wall_s=9.0),
        verdicts=verdicts,
        wall_s=9.8,
    )


def all_examples() -> list[PairOutcome]:
    return [passing_pair(), failing_pair(), errored_pair(), seed_pair()]
