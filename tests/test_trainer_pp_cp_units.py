"""Context parallel and pipeline parallel units, checked with real gloo ranks (started warm by
the local launcher: tests/trainer_jobs.py).

Each worker script under tests/fixtures/ppcp/ runs every check of its kind in ONE launch
(process start-up dominates on 2 cores) and rank 0 writes the worst deviations from the
single-process reference as JSON; the tests below only read that JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_jobs import run_job

from convergence.trainer.config import ModelConfig
from convergence.trainer.context_parallel import causal_mask_with_offset
from convergence.trainer.model import ModelArgs, build_model
from convergence.trainer.pipeline import (
    SCHEDULES,
    is_last_stage_rank,
    resolve_stages_per_rank,
    split_model_for_pp,
    stage_ids_this_rank,
)

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("trainer_pp_cp_units")

FIXTURES = Path(__file__).parent / "fixtures" / "ppcp"
REPO = Path(__file__).resolve().parents[1]


def run_torchrun(
    script: str, nproc: int, out: Path, *args: str, timeout: float = 240
) -> dict[str, Any]:
    """Launch `script` on `nproc` gloo ranks (started warm: tests/trainer_jobs.py); return the
    JSON rank 0 wrote to `out`."""
    run_job(nproc, [str(FIXTURES / script), str(out), *args], out.parent / "logs", timeout=timeout)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


# ---------------------------------------------------------------- context parallel


def test_causal_mask_offset_is_global_causal() -> None:
    """Chunk r's mask rows equal rows [r*L, (r+1)*L) of the full causal mask."""
    seq, cp = 12, 3
    full = torch.ones(seq, seq).tril().bool()
    local = seq // cp
    for rank in range(cp):
        mask = causal_mask_with_offset(local, seq, rank * local, torch.device("cpu"))
        assert torch.equal(mask, full[rank * local : (rank + 1) * local])


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def cp_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    out = tmp_path_factory.mktemp(f"cp{request.param}") / "result.json"
    return run_torchrun("cp_worker.py", request.param, out)


@pytest.mark.parametrize("kind", ["sdpa_mha", "sdpa_gqa"])
def test_cp_sdpa_matches_full_causal_sdpa(cp_results: dict[str, Any], kind: str) -> None:
    errs = cp_results[kind]
    for key in ("out", "dq", "dk", "dv"):
        assert errs[key] <= 1e-6, (kind, key, errs)
    # Negative control: without the query offset the result is far off, so the check has teeth.
    assert errs["unshifted_out"] > 1e-2, errs


@pytest.mark.parametrize("kind", ["tiny_model", "trainer_model"])
def test_cp_model_matches_single_process(cp_results: dict[str, Any], kind: str) -> None:
    errs = cp_results[kind]
    assert errs["loss_abs"] <= 1e-6 * max(1.0, errs["loss"]), errs
    assert errs["grad_rel"] <= 1e-5, errs


# ---------------------------------------------------------------- pipeline parallel

TINY = ModelArgs.from_config(
    ModelConfig(vocab_size=32, dim=32, n_layers=8, n_heads=4, n_kv_heads=2), seq_len=16
)


@pytest.mark.parametrize(
    ("schedule", "rank", "expected"),
    [
        ("1F1B", 1, [1]),
        ("Interleaved1F1B", 0, [0, 2]),
        ("Interleaved1F1B", 1, [1, 3]),
        ("ZBVZeroBubble", 0, [0, 3]),
        ("ZBVZeroBubble", 1, [1, 2]),
        ("DualPipeV", 1, [1, 2]),
    ],
)
def test_stage_placement_loop_and_v(schedule: str, rank: int, expected: list[int]) -> None:
    spr = resolve_stages_per_rank(schedule, 0)
    assert stage_ids_this_rank(rank, 2, spr, schedule) == expected


def test_pp_rules_schedule_sets_match_torch_classes() -> None:
    """pp_rules is plain Python (it runs at collection): its sets must say what torch's
    schedule classes do."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        get_schedule_class,
    )

    from convergence.spec.layout import PP_SCHEDULES as SPEC_SCHEDULES
    from convergence.spec.pp_schedules import MULTI_STAGE_SCHEDULES as SPEC_MULTI
    from convergence.trainer import pp_rules

    for name in pp_rules.SCHEDULES:
        cls = get_schedule_class(name)
        assert issubclass(cls, PipelineScheduleMulti) == (name in pp_rules.MULTI_STAGE_SCHEDULES)
        assert issubclass(cls, PipelineScheduleSingle) == (name in pp_rules.SINGLE_STAGE_SCHEDULES)
    # One table for the experiment spec and the trainer (spec/pp_schedules.py).
    assert SPEC_SCHEDULES is pp_rules.SCHEDULES
    assert SPEC_MULTI is pp_rules.MULTI_STAGE_SCHEDULES


def test_loss_lives_on_rank0_for_v_schedules_else_last_rank() -> None:
    assert [is_last_stage_rank(r, 2, "1F1B") for r in range(2)] == [False, True]
    assert [is_last_stage_rank(r, 2, "Interleaved1F1B") for r in range(2)] == [False, True]
    assert [is_last_stage_rank(r, 2, "ZBVZeroBubble") for r in range(2)] == [True, False]


def test_split_keeps_contiguous_blocks_and_owned_modules() -> None:
    chunks = split_model_for_pp(
        build_model, TINY, pp_rank=1, pp_size=2, stages_per_rank=2, schedule_name="Interleaved1F1B"
    )
    assert [i for i, _ in chunks] == [1, 3]
    (_, first), (_, last) = chunks
    assert list(first.layers) == ["2", "3"] and list(last.layers) == ["6", "7"]
    assert first.tok_embeddings is None and first.norm is None and first.output is None
    assert last.tok_embeddings is None and last.norm is not None and last.output is not None
    assert all(p.is_meta for _, c in chunks for p in c.parameters())
    (_, stage0), _ = split_model_for_pp(build_model, TINY, 0, 2, 2, "Interleaved1F1B")
    assert stage0.tok_embeddings is not None and stage0.output is None


@pytest.mark.parametrize(
    ("schedule", "pp", "spr", "match"),
    [
        ("1F1B", 2, 2, "one stage per rank"),
        ("Interleaved1F1B", 2, 1, ">= 2 stages per rank"),
        ("ZBVZeroBubble", 2, 4, "exactly 2"),
        ("Interleaved1F1B", 3, 2, "n_layers=8 is not divisible by the 6"),
        ("Zero", 2, 1, "unknown parallelism.pp_schedule"),
    ],
)
def test_split_rejects_bad_layouts_naming_the_key(
    schedule: str, pp: int, spr: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        split_model_for_pp(build_model, TINY, 0, pp, spr, schedule)


PP_DEFAULT = "GPipe,1F1B,Interleaved1F1B,ZBVZeroBubble"
PP_MORE = "LoopedBFS,InterleavedZeroBubble,DualPipeV"


def test_every_schedule_is_checked_somewhere() -> None:
    """The first four run by default, the rest under -m slow (pp2-more)."""
    assert set(PP_DEFAULT.split(",")) | set(PP_MORE.split(",")) == set(SCHEDULES)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((2, 1, 1, PP_DEFAULT), id="pp2"),
        pytest.param((2, 1, 1, PP_MORE), id="pp2-more", marks=pytest.mark.slow),
        pytest.param((2, 2, 1, PP_DEFAULT), id="pp2-fsdp2"),
        pytest.param((2, 1, 2, "GPipe,1F1B,Interleaved1F1B"), id="pp2-cp2"),
    ],
)
def pp_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    pp, dp, cp, schedules = request.param
    out = tmp_path_factory.mktemp(f"pp{pp}dp{dp}cp{cp}") / "result.json"
    result = run_torchrun("pp_worker.py", pp * dp * cp, out, str(pp), str(dp), str(cp), schedules)
    names = schedules.split(",")
    result["_schedules"] = names + (["1F1B+accum"] if "1F1B" in names else [])
    return result


def test_pp_matches_single_process_loss_and_every_grad(pp_results: dict[str, Any]) -> None:
    """Each schedule (and 1F1B over 2 accumulation microsteps): one step's loss and all
    parameter gradients equal the un-pipelined model on the same batch, with 4 microbatches."""
    for schedule in pp_results["_schedules"]:
        res = pp_results[schedule]
        assert res["num_params_checked"] == res["num_params_model"], (schedule, res)
        assert res["loss_rel"] <= 1e-5, (schedule, res)
        assert res["grad_rel"] <= 1e-5, (schedule, res)
        # The validation (forward-only) path returns the same loss and leaves grads alone
        # (the worker checks the grads above after running it).
        assert res["eval_rel"] <= 1e-6, (schedule, res)


def test_zero_bubble_with_nested_fsdp_is_refused(pp_results: dict[str, Any]) -> None:
    """torch 2.13 loses nested-FSDP grads under split backward: build_schedule says so."""
    res = pp_results.get("ZBVZeroBubble+nested_fsdp")
    if res is None:
        pytest.skip("only the FSDP layout builds nested FSDP units")
    assert res["rejected"] and "fully_shard to the whole chunk" in res["rejected"], res
