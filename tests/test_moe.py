"""Mixture of experts and expert parallelism on the built-in trainer (docs/moe.md).

Units: the grouped GEMM against the per-expert loop, the collection-time refusals of layouts
EP cannot run. Real pairs (torchrun, gloo, 2 ranks, the shipped moe_debug config): FSDP2 vs
FSDP2+EP2 passes with the default verdict and routes every step's tokens exactly as the
control does; two planted EP bugs fail, each on the metric that witnesses it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from docs_blocks import write_project
from torch import nn

from convergence.configs import shipped_config
from convergence.preflight import load_checked
from convergence.run.outcome import PairOutcome
from convergence.run.runner import Runner, RunSettings
from convergence.spec.errors import SpecError
from convergence.spec.layout import ParallelLayout
from convergence.trainer.config import load_train_config
from convergence.trainer.config_checks import check_config
from convergence.trainer.model import ModelArgs, build_model
from convergence.trainer.moe import (
    MoE,
    Router,
    StepRouting,
    grouped_mm,
    grouped_mm_runs,
    sequence_balance_loss,
    update_expert_bias,
)
from experiments import write_experiment

pytestmark = pytest.mark.xdist_group("moe")

ROOT = Path(__file__).resolve().parents[1]
HOOKS = Path(__file__).parent / "fixtures" / "hooks"
MOE = shipped_config("moe_debug")
assert MOE is not None
STEPS = 8


# ----------------------------------------------------------------------------------------------
# Units


def _loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([p @ w[e] for e, p in enumerate(torch.split(x, counts.tolist()))])


def test_grouped_gemm_is_the_per_expert_loop() -> None:
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2, 0, 7])  # empty experts included
    x = torch.randn(int(counts.sum()), 16)
    w = torch.randn(6, 24, 16).transpose(-2, -1)  # (E, K, M) as GroupedExperts passes it
    assert grouped_mm_runs(x, w)
    assert torch.equal(grouped_mm(x, w, counts), _loop(x, w, counts))
    # Sizes whose strides are not 16-byte multiples: torch._grouped_mm refuses them, the
    # loop runs instead (same math).
    odd_x, odd_w = torch.randn(int(counts.sum()), 6), torch.randn(6, 6, 5)
    assert not grouped_mm_runs(odd_x, odd_w)
    assert torch.equal(grouped_mm(odd_x, odd_w, counts), _loop(odd_x, odd_w, counts))


def _router(**changes: object) -> Router:
    args = ModelArgs.from_config(load_train_config(MOE).model, seq_len=64).moe
    assert args is not None
    router = Router(16, dataclasses.replace(args, **changes))  # type: ignore[arg-type]
    torch.manual_seed(0)
    router.reset_parameters()
    return router


def test_sigmoid_scores_with_route_norm_weigh_each_token_to_one() -> None:
    router = _router(score_func="sigmoid", route_norm=True)
    scores, selected, weights = router(torch.randn(32, 16))
    assert ((scores > 0) & (scores < 1)).all() and selected.shape == (32, 2)
    assert torch.allclose(weights.sum(dim=-1), torch.ones(32))
    # The weights are the chosen experts' scores, renormalised: the bias only chooses.
    chosen = scores.gather(-1, selected)
    assert torch.allclose(weights, chosen / chosen.sum(dim=-1, keepdim=True))


def test_the_expert_bias_moves_the_load_towards_balance() -> None:
    router = _router()
    model = nn.ModuleDict({"layers": nn.ModuleDict({"1": nn.Module()})})
    moe = MoE(16, router.args, None)
    moe.router = router
    model["layers"]["1"].moe = moe  # type: ignore[index]
    tokens = torch.tensor([[24, 0, 12, 12, 12, 12, 12, 12]])  # mean 12
    routing = StepRouting(layers=(1,), tokens=tokens, balance=torch.ones(1))
    update_expert_bias([model], routing, rate=0.01)
    bias = router.expert_bias
    assert bias[0] < 0 < bias[1]  # overloaded down, idle up
    assert torch.equal(bias[2:], torch.zeros(6))  # at the mean: unchanged
    # With the bias, the choice moves away from the overloaded expert; weights do not change.
    x = torch.randn(64, 16)
    before = router(x)
    router.expert_bias.copy_(torch.tensor([-1.0, 1.0, 0, 0, 0, 0, 0, 0]))
    after = router(x)
    assert (after[1] == 1).any(dim=-1).all() and not (after[1] == 0).any()
    assert torch.equal(after[0], before[0])


def test_the_balance_loss_is_one_at_perfect_balance() -> None:
    # 2 sequences of 4 tokens, 4 experts, top 1, uniform scores, each expert once per sequence.
    scores = torch.full((8, 4), 0.25)
    selected = torch.tensor([[0], [1], [2], [3], [3], [2], [1], [0]])
    assert torch.allclose(sequence_balance_loss(scores, selected, 2, 1), torch.ones(2))
    # Every token on expert 0, which also takes most of the score: E times the balance.
    skewed_scores = torch.tensor([[0.97, 0.01, 0.01, 0.01]]).repeat(8, 1)
    skewed = torch.zeros(8, 1, dtype=torch.long)
    assert torch.allclose(
        sequence_balance_loss(skewed_scores, skewed, 2, 1), torch.full((2,), 4 * 0.97)
    )


def test_a_dense_config_builds_no_expert() -> None:
    debug = shipped_config("debug")
    assert debug is not None
    args = ModelArgs.from_config(load_train_config(debug).model, seq_len=64)
    assert args.moe is None
    names = [n for n, _ in build_model(args).named_parameters()]
    assert not any("moe" in n for n in names) and "layers.0.feed_forward.w1.weight" in names
    moe_args = ModelArgs.from_config(load_train_config(MOE).model, seq_len=64)
    moe_names = [n for n, _ in build_model(moe_args).named_parameters()]
    assert "layers.0.feed_forward.w1.weight" in moe_names  # n_dense_layers = 1
    assert {"layers.1.moe.experts.w1", "layers.1.moe.router.gate.weight"} <= set(moe_names)


def test_ep_borrows_ranks_and_adds_none() -> None:
    layout = ParallelLayout(dp_shard=4, ep=2)
    assert layout.world_size == 4 and layout.short_name() == "fsdp4-ep2"
    assert layout.degrees()["ep"] == 2
    # ep = 1 is left out of the job key: keys of layouts without EP are what they were.
    assert "ep" not in ParallelLayout(dp_shard=4).to_dict() and layout.to_dict()["ep"] == 2


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["--parallelism.dp_shard=3", "--parallelism.ep=2"], "parallelism.ep", "dp_shard*cp=3"),
        (
            ["--parallelism.dp_shard=4", "--parallelism.ep=4", "--model.n_experts=6"],
            "parallelism.ep",
            "n_experts=6",
        ),
        (["--model.top_k=9"], "model.top_k", "between 1 and n_experts=8"),
        (
            ["--model.n_experts=0", "--parallelism.dp_shard=2", "--parallelism.ep=2"],
            "parallelism.ep",
            "dense model",
        ),
        (["--model.score_func=relu"], "model.score_func", "relu"),
        (
            ["--parallelism.tp=2", "--parallelism.sequence_parallel=true"],
            "parallelism.sequence_parallel",
            "not built",
        ),
        (["--parallelism.cp=2"], "model.aux_loss_coeff", "whole sequences"),
    ],
)
def test_impossible_moe_layouts_are_refused_with_key_and_fix(
    overrides: list[str], key: str, words: str
) -> None:
    cfg = load_train_config(MOE, overrides)
    with pytest.raises(SpecError) as err:
        check_config(cfg)
    assert err.value.key == key and words in str(err.value), str(err.value)
    assert err.value.fix and err.value.file == str(MOE)


def test_an_experiment_with_an_impossible_ep_fails_at_collection(tmp_path: Path) -> None:
    def write(test_par: dict[str, int], config: str = "moe_debug") -> Path:
        return write_experiment(
            tmp_path,
            file=f"e{len(list(tmp_path.iterdir()))}.toml",
            defaults={"train_config": config, "steps": 2},
            control={"name": "c", "parallelism": {"dp_shard": 4}},
            tests=[{"name": "t", "parallelism": test_par}],
        )

    with pytest.raises(SpecError) as not_dividing:
        load_checked(write({"dp_shard": 4, "ep": 3}), rootdir=ROOT)
    assert "ep" in str(not_dividing.value) and "dp_shard" in str(not_dividing.value)
    with pytest.raises(SpecError) as dense:
        load_checked(write({"dp_shard": 4, "ep": 2}, config="debug"), rootdir=ROOT)
    assert "dense model" in str(dense.value) and "n_experts" in str(dense.value)


def test_the_shipped_moe_experiment_loads() -> None:
    exp = load_checked(ROOT / "experiments" / "moe.toml", rootdir=ROOT)
    pairs = {p.name: p for p in exp.pairs}
    assert set(pairs) == {"fsdp2-ep2", "fsdp2-tp2-ep2", "fsdp2-pp2-ep2"}
    ep2 = pairs["fsdp2-ep2"]
    assert ep2.test.world_size == ep2.control.world_size == 2  # EP adds no ranks
    assert all(p.test.layout.ep == 2 and p.regime == "paired" for p in exp.pairs)


def test_the_docs_first_moe_pair_loads_outside_this_repository(tmp_path: Path) -> None:
    # docs/moe.md's first block is a whole experiment file a new user copies into their own
    # repository: it must name its train config (a shipped one) and load there as it is.
    (path,) = write_project(ROOT / "docs" / "moe.md", tmp_path)
    (pair,) = load_checked(path, rootdir=tmp_path).pairs
    assert pair.test.layout.ep == 2 and pair.control.layout.ep == 1
    assert pair.test.world_size == pair.control.world_size == 2 and pair.regime == "paired"


# ----------------------------------------------------------------------------------------------
# Real pairs


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p
    )
    sys.path.insert(0, str(HOOKS))
    work = tmp_path_factory.mktemp("work")
    return Runner(RunSettings(work_dir=work, idle_limit_s=180, wall_limit_s=600))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    ep2 = {"dp_shard": 2, "ep": 2}
    path = write_experiment(
        tmp_path_factory.mktemp("exp"),
        file="moe.toml",
        defaults={"train_config": "moe_debug", "steps": STEPS, "seed": 5, "probe": "off"},
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[
            # Opted in: the routing compared exactly (not by default: docs/moe.md).
            {"name": "fsdp2-ep2", "parallelism": ep2, "compare": {"routing_fingerprint": "exact"}},
            {
                "name": "ep2-experts-2x",
                "parallelism": ep2,
                "hook": "planted_moe_bugs:experts_divided_by_efsdp",
            },
            # Checkpointed under EP after step 3, resumed on plain FSDP2 (DCP reshards the
            # experts; the expert bias travels with the model).
            {
                "name": "ep2-resumed-on-fsdp2",
                "parallelism": ep2,
                "resume": {"at_step": 3, "parallelism": {"dp_shard": 2}},
            },
            {
                "name": "ep2-no-regroup",
                "parallelism": ep2,
                "hook": "planted_moe_bugs:dispatch_without_regroup",
            },
        ],
    )
    return {p.name: p for p in load_checked(path, rootdir=ROOT).pairs}


def _metric(outcome: PairOutcome, side: str, name: str) -> list[float]:
    """A metric of a side's metrics.jsonl, step by step (the MoE entries are not curves the
    verdict reads, so they are read from the file)."""
    run = outcome.control if side == "control" else outcome.test
    assert run is not None and run.run_dir is not None
    (path,) = run.run_dir.rglob("metrics.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [float(line[name]) for line in lines]


@pytest.mark.rounding  # a routing flip, or the step a bug shows, is a draw
def test_fsdp_vs_fsdp_ep2_passes_and_routes_alike(runner: Runner, pairs: dict) -> None:
    outcome = runner.run_pair(pairs["fsdp2-ep2"])
    assert outcome.status == "passed", (outcome.error, [v.message for v in outcome.verdicts])
    routing = outcome.verdict("routing_fingerprint")
    assert routing is not None and routing.passed and routing.gate and routing.steps_compared
    # Deterministic fp32: every step's tokens per expert per layer are the control's.
    control = _metric(outcome, "control", "routing_fingerprint")
    assert len(control) == STEPS
    assert _metric(outcome, "test", "routing_fingerprint") == control
    for name in ("moe_tokens/1.0", "moe_tokens/3.7", "moe_aux_loss"):
        assert _metric(outcome, "test", name) == pytest.approx(_metric(outcome, "control", name))


@pytest.mark.rounding  # a routing flip, or the step a bug shows, is a draw
def test_an_ep_checkpoint_resumes_on_another_layout(runner: Runner, pairs: dict) -> None:
    outcome = runner.run_pair(pairs["ep2-resumed-on-fsdp2"])
    assert outcome.status == "passed", (outcome.error, [v.message for v in outcome.verdicts])
    # The resumed steps route as the uninterrupted control does.
    control = _metric(outcome, "control", "routing_fingerprint")
    assert _metric(outcome, "test", "routing_fingerprint")[-3:] == control[-3:]


def test_expert_gradients_ep_times_too_large_fail_on_the_part_norms(
    runner: Runner, pairs: dict
) -> None:
    outcome = runner.run_pair(pairs["ep2-experts-2x"])
    assert outcome.status == "failed"
    parts = outcome.verdict("grad_norm_parts")
    assert parts is not None and not parts.passed and parts.first_divergent_step == 1
    # The experts alone: their part of the step-1 grad norm is exactly ep = 2 times the
    # control's, the router's is not touched.
    for part in ("moe.experts.w1", "moe.experts.w2"):
        ratio = _metric(outcome, "test", f"grad_norm/{part}")[0]
        ratio /= _metric(outcome, "control", f"grad_norm/{part}")[0]
        assert ratio == pytest.approx(2.0, rel=1e-6)
    gate = _metric(outcome, "test", "grad_norm/moe.router.gate")[0]
    assert gate == pytest.approx(_metric(outcome, "control", "grad_norm/moe.router.gate")[0])


@pytest.mark.rounding  # a routing flip, or the step a bug shows, is a draw
def test_a_dispatch_without_its_permutation_fails_within_5_steps(
    runner: Runner, pairs: dict
) -> None:
    outcome = runner.run_pair(pairs["ep2-no-regroup"])
    assert outcome.status == "failed"
    # At init the experts are alike and small: tokens through the wrong ones move the loss by
    # little at first, but within a few steps.
    loss = outcome.verdict("loss")
    assert loss is not None and not loss.passed and loss.gate
    assert loss.first_divergent_step is not None and loss.first_divergent_step <= 5


@pytest.mark.slow
@pytest.mark.rounding
@pytest.mark.parametrize(
    "test_par",
    [{"dp_shard": 2, "tp": 2, "ep": 2}, {"dp_shard": 2, "pp": 2, "ep": 2}],
    ids=["fsdp2-tp2-ep2", "fsdp2-pp2-ep2"],
)
def test_ep_composed_with_tp_or_pp_passes_and_routes_alike(
    runner: Runner, tmp_path: Path, test_par: dict[str, int]
) -> None:
    """4 ranks each (slow on 2 cores); the CI-tier pair of the same property is FSDP2+EP2."""
    path = write_experiment(
        tmp_path,
        file="composed.toml",
        defaults={"train_config": "moe_debug", "steps": 6, "seed": 5, "probe": "off"},
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[{"name": "composed", "parallelism": test_par}],
    )
    (pair,) = load_checked(path, rootdir=ROOT).pairs
    outcome = runner.run_pair(pair)
    assert outcome.status == "passed", (outcome.error, [v.message for v in outcome.verdicts])
    control = _metric(outcome, "control", "routing_fingerprint")
    assert _metric(outcome, "test", "routing_fingerprint") == control


# ----------------------------------------------------------------------------------------------
# EP in the reports


def _ep_outcome() -> PairOutcome:
    """The report examples' passing pair, its test with EP: FSDP2 vs FSDP2+EP2."""
    from report_examples import passing_pair

    base = passing_pair()
    test = dataclasses.replace(
        base.pair.test, name="fsdp2-ep2", layout=ParallelLayout(dp_shard=2, ep=2)
    )
    pair = dataclasses.replace(base.pair, pair_id="moe.toml::fsdp2-ep2", test=test)
    assert base.test is not None
    return dataclasses.replace(base, pair=pair, test=dataclasses.replace(base.test, job=test))


def test_ep_is_a_dimension_of_every_report(tmp_path: Path) -> None:
    import jsonschema

    from convergence.report import REPORT_JSON_SCHEMA, write_reports
    from convergence.report.formats.junit import junit_properties
    from convergence.report.formats.terminal import render_matrix
    from convergence.report.sections.dimensions import dimension_of

    outcome = _ep_outcome()
    written = write_reports([outcome], tmp_path, environment={}, started_at=0.0, wall_s=1.0)
    doc = json.loads(written["json"].read_text())
    jsonschema.Draft202012Validator(REPORT_JSON_SCHEMA).validate(doc)
    (record,) = doc["pairs"]
    assert record["test"]["degrees"]["ep"] == 2 and record["control"]["degrees"]["ep"] == 1
    assert dimension_of(record) == "+ep2"
    assert "+ep2" in written["markdown"].read_text() and "+ep2" in written["html"].read_text()
    header = render_matrix([outcome]).splitlines()[0].split()
    assert header[header.index("pp") + 1] == "ep"  # the column, after pp
    assert ("convergence.expert_parallel", "1->2") in junit_properties(outcome)
    # A dense pair's matrix has no ep column.
    from report_examples import passing_pair

    assert "ep" not in render_matrix([passing_pair()]).splitlines()[0].split()
