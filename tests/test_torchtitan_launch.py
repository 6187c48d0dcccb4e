"""The torchtitan launcher shim's pieces, each against the real torch / torchtitan code it
replaces or wraps (the whole shim trains in tests/test_torchtitan_train.py and
experiments/torchtitan/cpu.toml)."""

from __future__ import annotations

import inspect
import os

import pytest

if not os.environ.get("CI"):  # in CI (.ci/run installs it) a missing torchtitan must fail
    pytest.importorskip(
        "torchtitan",
        reason="torchtitan is not installed (pip install 'pytest-convergence[torchtitan]' triton)",
    )

import torch
from torch.nn.attention.flex_attention import (
    AuxRequest,
    create_block_mask,
    flex_attention,
)

from convergence.backends.torchtitan.launch import split_argv, tyro_form
from convergence.backends.torchtitan.patches import eager_flex_attention, patch_pipeline_step


def test_our_options_are_removed_before_torchtitan_parses() -> None:
    options, rest = split_argv(
        [
            "--module",
            "llama3",
            "--convergence.log=/d/s.jsonl",
            "--convergence.hook=a.b:c",
            "--training.steps=3",
            "--convergence.cpu",
        ]
    )
    assert rest == ["--module", "llama3", "--training.steps=3"]
    assert options.log == "/d/s.jsonl" and options.hook == "a.b:c" and options.cpu is True
    assert options.hook_mode == "after"
    with pytest.raises(SystemExit, match="unknown option"):
        split_argv(["--convergence.hokk=x"])


def test_probe_words_are_ours_and_booleans_move_before_the_subcommand() -> None:
    """The probe is the wrapper's option; a ``--key=true|false`` word after the
    activation-checkpoint subcommand becomes tyro's flag before it."""
    argv = ["--module", "llama3", "--training.steps=4", "activation-checkpoint:none"]
    words = ["--convergence.probe_step=3", "--metrics.enable_tensorboard=false"]
    options, rest = split_argv([*argv, *words])
    assert options.probe_step == 3
    assert rest == [
        "--module",
        "llama3",
        "--training.steps=4",
        "--metrics.no-enable_tensorboard",
        "activation-checkpoint:none",
    ]
    assert not split_argv(argv)[0].probe_step
    assert tyro_form(["--a.b=true", "x"]) == ["--a.b", "x"]
    with pytest.raises(SystemExit, match="unknown option"):
        split_argv(["--convergence.probe_stpe=2"])


def test_eager_attention_equals_flex_with_a_document_mask() -> None:
    """The CPU replacement computes what flex attention computes (forward; flex has no CPU
    backward, which is why it is replaced) for a block-causal document mask."""
    torch.manual_seed(0)
    batch, heads, seq, dim = 2, 4, 64, 16
    docs = torch.tensor([[0] * 20 + [1] * 44, [0] * 64])

    def document_causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx)

    mask = create_block_mask(document_causal, batch, None, seq, seq, device="cpu")
    q, k, v = (torch.randn(batch, heads, seq, dim, dtype=torch.float64) for _ in range(3))
    expected = flex_attention(q, k, v, block_mask=mask)
    got, aux = eager_flex_attention(
        q,
        k,
        v,
        score_mod=None,
        block_mask=mask,
        scale=None,
        enable_gqa=False,
        return_aux=AuxRequest(lse=False),
        kernel_options={},
    )
    assert aux is None
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_pipeline_schedules_take_microbatch_lists() -> None:
    from torch.distributed.pipelining import schedules

    patch_pipeline_step()
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        params = inspect.signature(cls.step).parameters
        assert {"arg_mbs", "kwarg_mbs", "target_mbs"} <= set(params)


def test_every_patch_names_its_releases_and_other_releases_are_refused() -> None:
    from convergence.backends.torchtitan import patches

    # Version shims only: what a job adds is ConvergenceTrainer's (trainer_class.py), which
    # is listed for the torchtitan release whose loop it follows.
    assert set(patches.PATCHES) == {
        "pick_cpu_device",
        "patch_timeouts",
        "patch_pipeline_step",
        "patch_attention",
        "force_sum_reduction",
        "titan_main",
        "ConvergenceTrainer",
    }
    assert patches.unsupported_releases() is None  # this session's releases are the pinned ones
    assert patches.unsupported_releases({"torchtitan": "0.3.1.dev0", "torch": "2.13.1"}) is None
    assert patches.release("2.13.0+cpu") == (2, 13, 0)
    assert patches.release("2.130.0") != (2, 13)
    refusal = patches.unsupported_releases({"torchtitan": "0.4.0", "torch": "2.13.0+cpu"})
    assert refusal is not None
    assert "patch_attention is for torchtitan 0.3.x (installed: 0.4.0)" in refusal
    assert "torch 2.13.x" not in refusal  # torch is fine: only torchtitan is named
    assert "ConvergenceTrainer is for torchtitan 0.3.x" in refusal
    other_torch = patches.unsupported_releases({"torchtitan": "0.3.0", "torch": "2.14.0"})
    assert other_torch is not None and "patch_pipeline_step is for torch 2.13.x" in other_torch
    assert "ConvergenceTrainer" not in other_torch  # pinned to torchtitan's loop only
    assert "convergence/backends/torchtitan/patches.py" in refusal
