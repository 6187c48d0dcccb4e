"""The default regime: paired only when both sides are deterministic fp32 (compute and
reduction) and uncompiled, as the README says; anything else falls out of the paired regime."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from convergence.preflight import load_checked

ROOT = Path(__file__).resolve().parents[1]

BODY = """
[defaults]
train_config = "debug"
steps = 12

[control]
name = "fsdp2"
parallelism = {{ dp_shard = 2 }}

[[test]]
name = "fsdp2-tp2"
parallelism = {{ dp_shard = 2, tp = 2 }}
{extra}
"""


def regime_of(tmp_path: Path, extra: str) -> str:
    path = tmp_path / "exp.toml"
    path.write_text(textwrap.dedent(BODY.format(root=ROOT, extra=extra)))
    (pair,) = load_checked(path, rootdir=ROOT).pairs
    assert pair.rule_for("loss").method == pair.regime  # the default rules follow the regime
    return pair.regime


def test_fp32_deterministic_is_paired(tmp_path: Path) -> None:
    assert regime_of(tmp_path, "") == "paired"


@pytest.mark.parametrize("extra", [
    'techniques = { reduce_dtype = "bfloat16" }',  # only the gradient reduction in bf16
    'techniques = { param_dtype = "bfloat16" }',
    'techniques = { param_dtype = "float16", reduce_dtype = "float16" }',
    "techniques = { compile = true }",
    "techniques = { deterministic = false }",
    'overrides = { "training.reduce_dtype" = "bfloat16" }',  # behind techniques' back
    'overrides = { "training.deterministic" = false }',
], ids=["reduce_bf16", "param_bf16", "fp16", "compile", "nondeterministic",
        "override_reduce_bf16", "override_nondeterministic"])
def test_anything_but_deterministic_fp32_is_not_paired(tmp_path: Path, extra: str) -> None:
    assert regime_of(tmp_path, extra) == "seed"


def test_an_explicit_regime_wins(tmp_path: Path) -> None:
    extra = 'techniques = { reduce_dtype = "bfloat16" }\nregime = "paired"'
    assert regime_of(tmp_path, extra) == "paired"


def test_data_rule_comes_first_and_only_with_the_same_seed(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(textwrap.dedent(BODY.format(root=ROOT, extra="")))
    (pair,) = load_checked(path, rootdir=ROOT).pairs
    assert pair.rules[0].metric == "data_fingerprint" and pair.rules[0].gate
    other_seed = BODY.format(root=ROOT, extra='seed = 43\nregime = "seed"')
    path.write_text(textwrap.dedent(other_seed))
    (pair,) = load_checked(path, rootdir=ROOT).pairs
    assert "data_fingerprint" not in [rule.metric for rule in pair.rules]
