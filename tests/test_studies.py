"""The shipped studies of issue #6 items 2 and 3, and the report's trade-off ("Resources") table.

- experiments/dp_vs_tp.toml (+ cluster/): DP=2 with accumulation k vs TP=2 with accumulation
  2k, the same global batch (global = micro x accumulation x DP);
- experiments/zero_stages.toml (+ cluster/): DDP vs FSDP without / with reshard after forward
  vs FSDP with CPU offload.

Spec tests load the real files; the renderer is tested on hand-built report records; the CPU
sizes run end to end through the plugin (pytester, real torchrun on gloo) with fewer steps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from convergence.backends.builtin import BuiltinBackend
from convergence.metrics.curve import Curve
from convergence.preflight import load_checked, make_checked_pair
from convergence.report.data.records import step_time_s
from convergence.report.sections import resources
from convergence.run.outcome import SideOutcome
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.layout import ParallelLayout
from convergence.spec.toml_io import read_toml
from convergence.stats.regression import WARMUP_STEPS

REPO = Path(__file__).resolve().parents[1]
CPU_FILES = ("experiments/dp_vs_tp.toml", "experiments/zero_stages.toml")
CLUSTER_FILES = ("experiments/cluster/dp_vs_tp.toml", "experiments/cluster/zero_stages.toml")


def _load(rel: str) -> Any:
    return load_checked(REPO / rel, rootdir=REPO)


# -- the experiment files ----------------------------------------------------------------------
@pytest.mark.parametrize("rel", CPU_FILES + CLUSTER_FILES)
def test_study_files_load_and_validate(rel: str) -> None:
    experiment = _load(rel)  # every pair checked: degrees, preflight, tokens per step
    backend = BuiltinBackend()
    tier = "nightly" if "/cluster/" in rel else "ci"
    for pair in experiment.pairs:
        assert pair.tier == tier
        assert not pair.early_stop  # the study wants every step of both sides
        assert pair.control.layout.world_size == pair.test.layout.world_size
        assert backend.tokens_per_step(pair.control) == backend.tokens_per_step(pair.test)
        config = backend.effective_config(pair.test)
        if tier == "ci":
            assert pair.regime == "paired" and config.model.dim == 64  # the tiny debug model
        else:
            assert pair.regime == "seed" and config.model.n_layers == 12  # GPT-2 small
            assert not config.model.tie_embeddings and config.training.param_dtype == "float32"


@pytest.mark.parametrize("rel", ("experiments/dp_vs_tp.toml", "experiments/cluster/dp_vs_tp.toml"))
def test_dp_vs_tp_keeps_the_global_batch(rel: str) -> None:
    (pair,) = _load(rel).pairs
    control, test = pair.control, pair.test
    assert (control.layout.dp_replicate, control.layout.tp) == (2, 1)
    assert (test.layout.dp, test.layout.tp) == (1, 2)
    k = control.techniques.grad_accum_steps
    assert k >= 2 and test.techniques.grad_accum_steps == 2 * k
    assert control.local_batch_size == test.local_batch_size
    cfg = BuiltinBackend().effective_config(control)
    # global = micro x accumulation x DP, on both sides
    assert (
        BuiltinBackend().tokens_per_step(test)
        == control.local_batch_size * k * 2 * cfg.data.seq_len
    )
    if "cluster" not in rel:
        assert BuiltinBackend().effective_config(test).metrics.log_freq == 1  # every step


def test_dp_vs_tp_with_the_same_accumulation_is_rejected() -> None:
    """TP=2 on dp=1 with accumulation k reads half the tokens of DP=2: caught at collection,
    with the fix (double the local batch) named."""
    path = REPO / "experiments" / "dp_vs_tp.toml"
    data = read_toml(path)
    test = dict(data["test"][0], techniques={"grad_accum_steps": 2})
    with pytest.raises(SpecError) as info:
        make_checked_pair(
            name=test["name"],
            control=data["control"],
            test=test,
            defaults=data["defaults"],
            source=str(path),
            rootdir=REPO,
            key="test[0]",
        )
    err = info.value
    assert err.key == "test[0].local_batch_size" and err.file == str(path)
    assert "control 2048 vs test 1024" in err.detail
    assert "local_batch_size = 16" in (err.fix or "")


@pytest.mark.parametrize(
    "rel", ("experiments/zero_stages.toml", "experiments/cluster/zero_stages.toml")
)
def test_zero_stages_control_is_ddp_and_tests_are_the_fsdp_stages(rel: str) -> None:
    pairs = _load(rel).pairs
    control = pairs[0].control
    n = control.layout.dp_replicate
    assert n >= 2 and control.layout == ParallelLayout(dp_replicate=n)  # plain DDP
    stages = {
        p.test.name: (p.test.techniques.reshard_after_forward, p.test.techniques.cpu_offload)
        for p in pairs
    }
    assert sorted(stages.values()) == [(False, False), (True, False), (True, True)]
    for pair in pairs:
        assert pair.control == control
        assert pair.test.layout == ParallelLayout(dp_shard=n)


# -- step time in the report record -----------------------------------------------------------
def test_step_time_is_tokens_per_step_over_tokens_per_s_without_the_warmup_steps() -> None:
    job = JobSpec(
        name="j",
        train_config=REPO / "train_configs" / "debug.toml",
        layout=ParallelLayout(dp_shard=2),
    )
    values = [10.0] * WARMUP_STEPS + [1000.0, 500.0, 250.0]  # the slow warm-up is left out
    tps = Curve("tokens_per_s", np.arange(1, len(values) + 1), np.array(values))
    side = SideOutcome(job=job, metrics={"tokens_per_s": tps}, meta={"tokens_per_step": 1000})
    assert step_time_s(side) == pytest.approx(2.0)  # median of 1, 2, 4 s
    assert step_time_s(SideOutcome(job=job, metrics={"tokens_per_s": tps})) is None  # no meta
    assert step_time_s(None) is None


# -- the trade-off table, from hand-built report records --------------------------------------
def _side(name: str, short: str, ran: bool = True, **techniques: Any) -> dict[str, Any]:
    return {
        "name": name,
        "short_name": short,
        "ran": ran,
        "hook": None,
        "techniques": {"param_dtype": "float32", "grad_accum_steps": 1, **techniques},
    }


def _record(
    test: dict[str, Any],
    *,
    status: str = "passed",
    source: str = "exp/zero.toml",
    control: dict[str, Any] | None = None,
    step: tuple[Any, Any] = (0.5, 0.6),
    tps: tuple[Any, Any] = (2000.0, 1000.0),
    mem: tuple[Any, Any] = (400.0, 300.0),
    dloss: Any = 2.5e-7,
) -> dict[str, Any]:
    def res(pair: tuple[Any, Any]) -> dict[str, Any]:
        ctrl, tst = pair
        ratio = None if ctrl is None or tst is None else tst / ctrl
        return {"control": ctrl, "test": tst, "ratio": ratio}

    return {
        "id": f"{source}::{test['name']}",
        "source": source,
        "status": status,
        "control": control or _side("ddp2", "ddp2"),
        "test": test,
        "resources": {"step_time_s": res(step), "tokens_per_s": res(tps), "peak_mem_mib": res(mem)},
        "max_abs_delta": {"loss": dloss, "grad_norm": 0.0},
    }


def test_tradeoff_rows_are_relative_to_the_control() -> None:
    pairs = [
        _record(_side("fsdp2-no-reshard", "fsdp2", reshard_after_forward=False)),
        _record(
            _side("fsdp2-bad", "fsdp2"),
            status="failed",
            step=(0.5, 1.0),
            tps=(2000.0, 1000.0),
            mem=(400.0, 200.0),
            dloss=0.125,
        ),
    ]
    (table,) = resources.tables(pairs)
    assert (table.source, table.control) == ("exp/zero.toml", "ddp2")
    control, no_reshard, bad = table.rows
    assert (control.role, control.verdict, control.step_time_s, control.peak_mem_mib) == (
        "control",
        "reference",
        0.5,
        400.0,
    )
    assert control.step_time_rel is None and control.max_abs_dloss is None
    assert no_reshard.layout == "fsdp2 +no-reshard" and no_reshard.verdict == "PASS"
    assert no_reshard.step_time_rel == pytest.approx(0.2)
    assert no_reshard.tokens_per_s_rel == pytest.approx(-0.5)
    assert no_reshard.peak_mem_rel == pytest.approx(-0.25)
    assert bad.verdict == "FAIL" and bad.max_abs_dloss == 0.125
    assert resources.cells(bad)[4:] == ["1", "+100.0%", "1,000", "-50.0%", "200", "-50.0%", "0.125"]


def test_tradeoff_groups_by_file_and_control_and_skips_groups_that_never_ran() -> None:
    accum = _record(
        _side("tp2-accum4", "tp2", grad_accum_steps=4),
        source="a/dp_vs_tp.toml",
        control=_side("ddp2-accum2", "ddp2", grad_accum_steps=2),
    )
    never = _record(
        _side("x", "fsdp2", ran=False),
        source="b.toml",
        control=_side("c", "ddp2", ran=False),
        status="skipped",
    )
    other_control = _record(
        _side("t", "fsdp2"), source="a/dp_vs_tp.toml", control=_side("fsdp2", "fsdp2")
    )
    found = resources.tables([accum, never, other_control])
    assert [(t.source, t.control) for t in found] == [
        ("a/dp_vs_tp.toml", "ddp2-accum2"),
        ("a/dp_vs_tp.toml", "fsdp2"),
    ]
    assert [r.layout for r in found[0].rows] == ["ddp2 +accum:2", "tp2 +accum:4"]


def test_step_time_falls_back_to_the_inverse_throughput_ratio() -> None:
    """Reports without step times (a backend without run meta): tokens per step are equal on
    both sides of a pair, so the step time ratio is control tok/s / test tok/s."""
    record = _record(_side("t", "fsdp2"), step=(None, None), tps=(1000.0, 800.0))
    (table,) = resources.tables([record])
    assert table.rows[1].step_time_s is None
    assert table.rows[1].step_time_rel == pytest.approx(0.25)


def test_tradeoff_markdown_and_html() -> None:
    pairs = [_record(_side("fsdp2|cpu", "fsdp2", cpu_offload=True))]
    lines = resources.markdown_lines(pairs)
    text = "\n".join(lines)
    assert "## Resources" in text and "### zero.toml — control ddp2" in text
    header = next(line for line in lines if line.startswith("| job |"))
    assert header.count(" | ") == len(resources.HEADER) - 1 and "max \\|Δloss\\|" in header
    assert "| fsdp2\\|cpu | test | fsdp2 +offload | PASS | 0.6 | +20.0% |" in text
    assert "| ddp2 | control | ddp2 | reference | 0.5 | - |" in text
    html = resources.html_section(pairs)
    assert html.startswith("<h2>Resources</h2>") and html.count("<tr") == 3
    assert "fsdp2|cpu" in html and '<td class="num">+20.0%</td>' in html
    assert resources.markdown_lines([]) == [] and resources.html_section([]) == ""


def test_full_reports_carry_the_table() -> None:
    """Through build_report + render_markdown/render_html, on the report tests' examples."""
    from report_examples import failing_pair, passing_pair

    from convergence.report import build_report, render_markdown
    from convergence.report.formats.html import render_html

    report = build_report(
        [passing_pair(), failing_pair()],
        environment={},
        started_at=None,
        wall_s=None,
        include_curves=False,
    )
    for record in report["pairs"]:
        assert set(record["resources"]) >= {"tokens_per_s", "peak_mem_mib", "step_time_s"}
    md = render_markdown(report)
    assert "## Resources" in md and "### converging.toml — control fsdp2" in md
    assert md.index("## Resources") < md.index("## Failures")
    assert "<h2>Resources</h2>" in render_html(report, {})


# -- peak memory per rank is the largest over the ranks ---------------------------------------
BALLAST_HOOK = '''
import torch
import torch.distributed as dist

KEPT = []


def ballast_on_rank1(model, ctx):
    """Rank 1 holds 1 GiB more than rank 0 (touched, so it is resident)."""
    if dist.get_rank() == 1:
        KEPT.append(torch.ones(2**28))  # 2**28 float32 = 1 GiB
    return None
'''


def test_logged_peak_memory_is_the_max_over_ranks(tmp_path: Path) -> None:
    """The writer is rank 0; the memory-hungry rank is 1. Its peak must be the one logged."""
    (tmp_path / "ballast.py").write_text(textwrap.dedent(BALLAST_HOOK))
    dump = tmp_path / "dump"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "convergence.trainer",
        "--config",
        str(REPO / "train_configs" / "debug.toml"),
        f"--metrics.dump_folder={dump}",
        "--training.steps=2",
        "--metrics.val_every=0",
        "--metrics.enable_tensorboard=false",
        "--parallelism.dp_shard=2",
        "--parallelism.hook=ballast:ballast_on_rank1",
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = [
        json.loads(line)["peak_mem_mib"]
        for line in (dump / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(peaks) == 2 and min(peaks) > 1024, peaks  # rank 0 alone is ~400 MiB


# -- the CPU sizes end to end through the plugin ----------------------------------------------
def test_cpu_studies_pass_through_the_plugin_with_the_table(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped CPU files, unchanged, in a fresh project: 3 steps instead of 8-10, and one
    pair of each file (5 launches, not 8: CI runs every pair of both files at full size
    anyway, through the ci tier; this test is about the plugin -> report table path)."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    pytester.makeini("[pytest]\n")
    for rel in CPU_FILES:  # they name the shipped debug config by short name
        (pytester.path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, pytester.path / rel)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-m",
        "convergence",
        "--convergence-tier",
        "ci",
        "--convergence-steps",
        "3",
        "--convergence-report",
        "report",
        "-k",
        "tp2-accum4 or fsdp2-cpu-offload",
        timeout=900,
    )
    result.assert_outcomes(passed=2)
    md = (pytester.path / "report" / "report.md").read_text(encoding="utf-8")
    assert "## Resources" in md
    section = md[md.index("## Resources") :]
    assert "### dp_vs_tp.toml — control ddp2-accum2" in section
    assert "### zero_stages.toml — control ddp2" in section
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ")
        for line in section.splitlines()
        if line.startswith("| ")
    }
    assert "fsdp2-no-reshard" not in rows  # deselected: not run, not in the table
    for job, layout in (
        ("ddp2-accum2", "ddp2 +accum:2"),
        ("tp2-accum4", "tp2 +accum:4"),
        ("ddp2", "ddp2"),
        ("fsdp2-cpu-offload", "fsdp2 +offload"),
    ):
        cells = rows[job]
        assert cells[2] == layout
        assert all(c != "-" for c in (cells[4], cells[6], cells[8])), cells  # ran, measured
        if cells[1] == "test":
            assert cells[3] == "PASS" and float(cells[10].rstrip(" |")) < 1e-4
    html = (pytester.path / "report" / "report.html").read_text(encoding="utf-8")
    assert "<h2>Resources</h2>" in html and "fsdp2-cpu-offload" in html
