"""Reduced-communication blocks: the block kinds, their TP plans, the collective count, checks,
and the report's table and plot.

The block kinds' TP plans are checked for real (torchrun, 2 gloo ranks): each pattern computes
the same loss, logits and gradients as the plain tp=1 model from the same weights, and issues
exactly the collectives its design says (counted with CommDebugMode).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from trainer_jobs import metrics, run_job, run_trainer_job

from convergence.metrics.curve import Curve
from convergence.report.data import records
from convergence.report.sections import comm_blocks
from convergence.run.outcome import SideOutcome
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.trainer.config import ModelConfig, ParallelismConfig, TrainConfig
from convergence.trainer.config_checks import check_config
from convergence.trainer.model import ModelArgs, build_model, count_params

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("comm_reduction")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "fixtures" / "block_kinds_tp.py"

#: 12 layers, TP 2, no SP: (forward, backward) collectives of one forward+backward. Forward:
#: 1 embedding all-reduce + per layer (standard 2, single_sync 1, parallel 0) + 1 all-gather
#: where a run of parallel blocks ends (before a non-parallel block or the final norm) + 1
#: output all-gather. Backward mirrors it: per layer the same, 1 all-gather where a run of
#: parallel blocks begins, 1 all-reduce for the output's input; the embedding has none.
EXPECTED_12_LAYERS: dict[str, tuple[int, int]] = {
    "standard": (26, 25),  # 24 per layer stack
    "standard,single_sync": (20, 19),  # 18
    "standard,single_sync,parallel": (18, 17),  # 16 = 12 + 4 gathers
    "single_sync": (14, 13),  # 12
    "single_sync,parallel,parallel": (10, 9),  # 8 = 4 + 4 gathers
    "single_sync,parallel,parallel,parallel": (8, 7),  # 6 = 3 + 3 gathers
    "parallel": (3, 2),  # only the model's boundaries
    "parallel,standard,parallel,single_sync": (17, 16),  # every transition, parallel first
}


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("kinds") / "results.json"
    run_job(2, [str(SCRIPT), str(out), "12", *EXPECTED_12_LAYERS], out.parent / "logs", timeout=900)
    results: dict[str, Any] = json.loads(out.read_text())
    return results


@pytest.mark.parametrize("pattern", list(EXPECTED_12_LAYERS))
def test_tp2_computes_what_tp1_computes(tp_results: dict[str, Any], pattern: str) -> None:
    result = tp_results[pattern]
    assert abs(result["loss_tp2"] - result["loss_tp1"]) <= 1e-6 * abs(result["loss_tp1"]), result
    assert result["logits_max_abs_diff"] <= 1e-5, result
    assert result["grads_compared"] > 12 * 3
    assert result["grad_max_abs_diff"] <= 1e-6, (result["worst_grad"], result)


@pytest.mark.parametrize("pattern", list(EXPECTED_12_LAYERS))
def test_collectives_per_pattern(tp_results: dict[str, Any], pattern: str) -> None:
    counts = tp_results[pattern]["collectives"]
    assert (counts["forward"], counts["backward"]) == EXPECTED_12_LAYERS[pattern], counts
    assert counts["total"] == sum(counts["by_op"].values())


def test_kinds_keep_about_the_parameter_count() -> None:
    sizes = {
        pattern: count_params(
            build_model(
                ModelArgs.from_config(ModelConfig(n_layers=12, block_pattern=pattern), seq_len=64)
            )
        )
        for pattern in EXPECTED_12_LAYERS
    }
    base = sizes["standard"]
    assert all(abs(n - base) / base < 0.01 for n in sizes.values()), sizes
    # Not by accident: a parallel block without its wider MLP would be ~12% smaller.
    args = ModelArgs.from_config(ModelConfig(block_pattern="parallel"), seq_len=64)
    assert args.parallel_ffn_hidden_dim > args.ffn_hidden_dim


def _cfg(**kwargs: Any) -> TrainConfig:
    model = {k: v for k, v in kwargs.items() if k in ("block_pattern", "parallel_groups")}
    par = {k: v for k, v in kwargs.items() if k not in model}
    return TrainConfig(model=ModelConfig(**model), parallelism=ParallelismConfig(**par))


@pytest.mark.parametrize(
    ("kwargs", "key", "words"),
    [
        ({"block_pattern": "standard,paralel"}, "model.block_pattern", "paralel"),
        (
            {"block_pattern": "parallel", "tp": 2, "sequence_parallel": True},
            "parallelism.sequence_parallel",
            "sequence parallel",
        ),
        (
            {"block_pattern": "parallel", "parallel_groups": 1, "tp": 2},
            "model.parallel_groups",
            "tp=2 must divide",
        ),
        ({"block_pattern": "parallel", "parallel_groups": 3}, "model.parallel_groups", "divide"),
    ],
)
def test_bad_block_settings_name_the_key(kwargs: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(SpecError) as info:
        check_config(_cfg(**kwargs))
    assert info.value.key == key
    assert words in str(info.value)


def test_single_sync_supports_sequence_parallel_in_config() -> None:
    check_config(_cfg(block_pattern="single_sync,standard", tp=2, sequence_parallel=True))


# ----------------------------------------------------------------------------------------------
# The report


def _side(
    name: str,
    pattern: str,
    collectives: tuple[int, int] | None,
    val: float | None,
    params: int = 1000,
) -> dict[str, Any]:
    counts = (
        None
        if collectives is None
        else {
            "forward": collectives[0],
            "backward": collectives[1],
            "total": sum(collectives),
            "by_op": {"all_reduce": sum(collectives)},
        }
    )
    return {
        "name": name,
        "ran": True,
        "run_facts": {
            "block_pattern": pattern,
            "collectives": counts,
            "num_params": params,
            "final_val_loss": val,
        },
    }


def _record(
    test: dict[str, Any],
    *,
    status: str = "passed",
    tokens: float = 1200.0,
    source: str = "experiments/comm_reduction.toml",
) -> dict[str, Any]:
    control = _side("tp2-standard", "standard", (26, 25), 5.0)
    return {
        "source": source,
        "status": status,
        "control": control,
        "test": test,
        "resources": {
            "tokens_per_s": {"control": 1000.0, "test": tokens, "ratio": tokens / 1000.0}
        },
        "verdicts": [
            {
                "metric": "val_loss",
                "method": "regression",
                "passed": status == "passed",
                "tolerance_at_max": 0.1,
            }
        ],
    }


REPORT: dict[str, Any] = {
    "plots": {},
    "pairs": [
        _record(_side("tp2-single_sync", "single_sync", (14, 13), 5.05)),
        _record(_side("tp2-parallel", "parallel", (3, 2), 5.2), status="failed", tokens=3000.0),
        # Not in the study: same block pattern on both sides (e.g. a layout pair).
        {**_record(_side("fsdp2-tp2", "standard", (40, 40), 5.0)), "source": "other.toml"},
    ],
}


def test_table_rows() -> None:
    [table] = comm_blocks.tables(REPORT["pairs"])
    assert [r.config for r in table.rows] == ["tp2-standard", "tp2-single_sync", "tp2-parallel"]
    base, single, parallel = table.rows
    assert (base.role, base.collectives, base.val_loss_delta) == ("baseline", 51, None)
    assert single.collectives == 27 and single.val_loss_delta == pytest.approx(0.05)
    assert parallel.tokens_per_s_rel == pytest.approx(2.0)
    cells = comm_blocks.cells(parallel)
    assert cells[2:4] == ["5", "3 / 2"]
    assert cells[6] == "+0.2000 (+4.00%)"
    assert cells[-1] == "FAIL (limit +2.0%)"


def test_markdown_and_html_sections(tmp_path: Path) -> None:
    png = comm_blocks.write_plot(REPORT["pairs"], tmp_path)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = {**REPORT, "plots": {comm_blocks.PLOT_KEY: f"plots/{png.name}"}}
    md = "\n".join(comm_blocks.markdown_lines(report))
    assert f"## {comm_blocks.TITLE}" in md
    assert (
        "| tp2-single_sync | single_sync | 27 | 14 / 13 | 1,000 | 5.0500 | +0.0500 (+1.00%)" in md
    )
    assert "fsdp2-tp2" not in md
    assert f"](plots/{png.name})" in md
    html = comm_blocks.html_section(report, {f"plots/{png.name}": png})
    assert "<h2>Reduced-communication blocks</h2>" in html and "data:image/png;base64," in html
    # A report without the study shows nothing.
    other = {"plots": {}, "pairs": REPORT["pairs"][2:]}
    assert comm_blocks.markdown_lines(other) == [] and comm_blocks.html_section(other, {}) == ""
    assert comm_blocks.write_plot(other["pairs"], tmp_path / "none") is None


def test_side_facts_from_run_meta_and_val_curve() -> None:
    job = JobSpec(name="t", train_config=REPO / "train_configs" / "debug.toml")
    val = Curve(
        metric="val_loss", steps=np.array([10, 20], dtype=np.int64), values=np.array([5.5, 5.25])
    )
    side = SideOutcome(
        job=job,
        metrics={"val_loss": val},
        meta={
            "num_params": 123,
            "block_pattern": "single_sync",
            "collectives": {"forward": 6, "backward": 5, "total": 11, "by_op": {}},
        },
    )
    facts = records.side_facts(side)
    assert facts == {
        "num_params": 123,
        "block_pattern": "single_sync",
        "collectives": side.meta["collectives"],
        "final_val_loss": 5.25,
    }
    assert records.side_facts(None) == {}


# ----------------------------------------------------------------------------------------------
# The trainer: block kinds under FSDP + TP, TP + PP and sequence parallel match one process

TRAIN_COMMON = [
    "--training.steps=5",
    "--metrics.val_every=5",
    "--metrics.val_batches=1",
    "--metrics.enable_tensorboard=false",
]
MIXED = "--model.block_pattern=single_sync,parallel,parallel,standard"


def _train(nproc: int, dump: Path, overrides: list[str]) -> list[dict[str, Any]]:
    args = [
        "--config",
        str(REPO / "train_configs" / "debug.toml"),
        f"--metrics.dump_folder={dump}",
        *TRAIN_COMMON,
        *overrides,
    ]
    run_trainer_job(0 if nproc == 1 else nproc, args, dump / "logs", timeout=900)
    return metrics(dump)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pattern", "nproc", "layout"),
    [
        # PP 2 x 1F1B: the stage boundary (after layer 1) carries a hidden-dim-sharded state.
        (
            MIXED,
            4,
            [
                "--parallelism.tp=2",
                "--parallelism.pp=2",
                "--parallelism.pp_schedule=1F1B",
                "--training.local_batch_size=16",
            ],
        ),
        (
            MIXED,
            4,
            ["--parallelism.dp_shard=2", "--parallelism.tp=2", "--training.local_batch_size=8"],
        ),
        (
            "--model.block_pattern=single_sync,standard",
            4,
            [
                "--parallelism.dp_shard=2",
                "--parallelism.tp=2",
                "--parallelism.sequence_parallel=true",
                "--training.local_batch_size=8",
            ],
        ),
    ],
    ids=["tp2-pp2", "fsdp2-tp2", "fsdp2-tp2-sp"],
)
def test_trainer_layouts_match_one_process(
    pattern: str, nproc: int, layout: list[str], tmp_path: Path
) -> None:
    ref = _train(1, tmp_path / "ref", [pattern, "--training.local_batch_size=16"])
    test = _train(nproc, tmp_path / "test", [pattern, *layout])
    for r, t in zip(ref, test, strict=True):
        assert (
            abs(t["loss"] - r["loss"]) <= 1e-5
            and abs(t["grad_norm"] - r["grad_norm"]) <= 1e-4 * r["grad_norm"]
        ), (r, t)
    assert abs(test[-1]["val_loss"] - ref[-1]["val_loss"]) <= 1e-5
    meta = json.loads((tmp_path / "test" / "run_meta.json").read_text())
    assert meta["collectives"]["total"] > 0 and meta["block_pattern"] == pattern.split("=")[1]
