"""The pair's float8 / MXFP8 techniques as torchtitan's own converters
(convergence/backends/torchtitan/converters.py): what torchtitan 0.3.0 can train where, and
the launcher's words for it. The converted run itself: experiments/torchtitan/precision.toml
(ci tier: torchtitan's float8 converter against a bf16 control, margin regime)."""

from __future__ import annotations

import os

import pytest

if not os.environ.get("CI"):  # in CI (.ci/run installs it) a missing torchtitan must fail
    pytest.importorskip(
        "torchtitan",
        reason="torchtitan is not installed (pip install 'pytest-convergence[torchtitan]' triton)",
    )

from convergence.backends.torchtitan.converters import refusal
from convergence.backends.torchtitan.launch import split_argv


def test_cpu_runs_emulated_tensorwise_and_a_gpu_rowwise() -> None:
    assert refusal(float8="tensorwise", mxfp8=False, cpu=True) is None
    assert refusal(float8="rowwise", mxfp8=False, cpu=False) is None


@pytest.mark.parametrize(
    ("float8", "mxfp8", "cpu", "says"),
    [
        ("rowwise", False, True, "emulates tensorwise scaling only"),
        ("tensorwise", False, False, "only row-wise float8 recipes on a GPU"),
        ("none", True, True, "needs an SM100 GPU"),
    ],
)
def test_a_recipe_torchtitan_would_silently_replace_is_refused(
    float8: str, mxfp8: bool, cpu: bool, says: str
) -> None:
    why = refusal(float8=float8, mxfp8=mxfp8, cpu=cpu)
    assert why is not None and says in why


def test_the_launcher_reads_the_converter_options() -> None:
    options, rest = split_argv(["--convergence.float8=tensorwise", "--convergence.mxfp8", "--x=1"])
    assert (options.float8, options.mxfp8, rest) == ("tensorwise", True, ["--x=1"])
