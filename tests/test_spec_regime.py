"""The default regime: paired only when both sides are deterministic fp32 (compute and
reduction) and uncompiled, as the README says; anything else with the same seed is the twin
regime (noise measured on a twin of the control), and other seeds the seed band."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from convergence.preflight import load_checked
from convergence.spec.layout import Techniques
from experiments import write_experiment

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, extra: dict[str, Any], *, dp_shard: int = 2, **defaults: Any) -> Path:
    """An FSDP control against FSDP+TP on the debug config; ``extra`` adds to the test's table,
    ``defaults`` to ``[defaults]``."""
    return write_experiment(
        tmp_path,
        defaults={"train_config": "debug", "steps": 12, **defaults},
        control={"name": "fsdp2", "parallelism": {"dp_shard": dp_shard}},
        tests=[{"name": "fsdp2-tp2", "parallelism": {"dp_shard": dp_shard, "tp": 2}, **extra}],
    )


def regime_of(tmp_path: Path, extra: dict[str, Any]) -> str:
    (pair,) = load_checked(write(tmp_path, extra), rootdir=ROOT).pairs
    assert pair.rule_for("loss").method == pair.regime  # the default rules follow the regime
    return pair.regime


BF16 = {"techniques": {"param_dtype": "bfloat16"}}


def test_fp32_deterministic_is_paired(tmp_path: Path) -> None:
    assert regime_of(tmp_path, {}) == "paired"


@pytest.mark.parametrize(
    "extra",
    [
        {"techniques": {"reduce_dtype": "bfloat16"}},  # only the gradient reduction in bf16
        {"techniques": {"param_dtype": "bfloat16"}},
        {"techniques": {"param_dtype": "float16", "reduce_dtype": "float16"}},
        {"techniques": {"compile": True}},
        {"techniques": {"deterministic": False}},
        {"overrides": {"training.reduce_dtype": "bfloat16"}},  # behind techniques' back
        {"overrides": {"training.deterministic": False}},
    ],
    ids=[
        "reduce_bf16",
        "param_bf16",
        "fp16",
        "compile",
        "nondeterministic",
        "override_reduce_bf16",
        "override_nondeterministic",
    ],
)
def test_anything_but_deterministic_fp32_is_twin(tmp_path: Path, extra: dict[str, Any]) -> None:
    assert regime_of(tmp_path, extra) == "twin"


def test_other_seeds_are_the_seed_band(tmp_path: Path) -> None:
    assert regime_of(tmp_path, {"seed": 43, **BF16}) == "seed"


def test_an_explicit_regime_wins(tmp_path: Path) -> None:
    extra = {"techniques": {"reduce_dtype": "bfloat16"}, "regime": "paired"}
    assert regime_of(tmp_path, extra) == "paired"


def test_data_rule_comes_first_and_only_with_the_same_seed(tmp_path: Path) -> None:
    (pair,) = load_checked(write(tmp_path, {}), rootdir=ROOT).pairs
    assert pair.rules[0].metric == "data_fingerprint" and pair.rules[0].gate
    other_seed = write(tmp_path, {"seed": 43, "regime": "seed"})
    (pair,) = load_checked(other_seed, rootdir=ROOT).pairs
    assert "data_fingerprint" not in [rule.metric for rule in pair.rules]


def test_the_twin_reads_the_same_samples_on_twice_the_dp_degree(tmp_path: Path) -> None:
    from convergence.backends import get_backend

    (pair,) = load_checked(write(tmp_path, BF16), rootdir=ROOT).pairs
    twin = get_backend("builtin").noise_twin(pair.control)
    assert twin is not None
    assert (twin.layout.dp_shard, twin.local_batch_size) == (4, 4)  # debug.toml: 8 per rank
    assert twin.name == "fsdp2-twin" and twin.seed == pair.control.seed
    assert twin.techniques == pair.control.techniques
    backend = get_backend("builtin")
    assert backend.tokens_per_step(twin) == backend.tokens_per_step(pair.control)


def test_the_forward_twin_is_the_control_with_rounding_level_forward_noise(tmp_path: Path) -> None:
    from convergence.backends import get_backend

    (pair,) = load_checked(write(tmp_path, BF16), rootdir=ROOT).pairs
    backend = get_backend("builtin")
    control = dataclasses.replace(pair.control, techniques=Techniques(param_dtype="bfloat16"))
    fwd = backend.forward_twin(control)
    assert fwd is not None and fwd.name == "fsdp2-fwd-twin"
    # Same layout, samples and seed; only the trainer's forward noise, at bf16's unit roundoff.
    assert (fwd.layout, fwd.seed, fwd.techniques) == (
        control.layout,
        control.seed,
        control.techniques,
    )
    assert dict(fwd.overrides)["training.forward_noise"] == repr(2.0**-8)
    cfg = backend.effective_config(fwd)  # type: ignore[attr-defined]
    assert cfg.training.forward_noise == 2.0**-8 and cfg.training.forward_noise_tp == 2
    # TP2 is the trainer's default: that twin carries no degree (its cache key is as before);
    # a TP4 test's twin rounds in quarters, a job of its own.
    assert "training.forward_noise_tp" not in dict(fwd.overrides)
    fwd4 = backend.forward_twin(control, tp=4)
    assert fwd4 is not None and fwd4.name == "fsdp2-fwd-twin-tp4"
    assert backend.effective_config(fwd4).training.forward_noise_tp == 4  # type: ignore[attr-defined]
    # An fp32 forward re-rounds at the fp32 floor, which the relative floor covers: no job.
    fp32 = dataclasses.replace(pair.control, techniques=Techniques())
    assert backend.forward_twin(fp32) is None


def test_odd_batch_halves_the_dp_degree_and_doubles_accumulation(tmp_path: Path) -> None:
    from convergence.backends import get_backend

    path = write(tmp_path, BF16, dp_shard=4, local_batch_size=3)
    (pair,) = load_checked(path, rootdir=ROOT).pairs
    twin = get_backend("builtin").noise_twin(pair.control)
    assert twin is not None and twin.layout.dp_shard == 2 and twin.techniques.grad_accum_steps == 2
    assert twin.local_batch_size == 3


def test_no_twin_is_a_collection_error_naming_the_fix(tmp_path: Path) -> None:
    from convergence.spec.errors import SpecError

    path = write(tmp_path, BF16, local_batch_size=3)
    with pytest.raises(SpecError) as err:
        load_checked(path, rootdir=ROOT)
    text = str(err.value)
    assert "no noise twin" in text and "regime" in text and 'regime = "seed"' in text
    assert str(path) in text


def test_a_twin_method_outside_the_twin_regime_is_refused(tmp_path: Path) -> None:
    from convergence.spec.errors import SpecError

    path = write(tmp_path, {"compare": {"loss": "twin"}})
    with pytest.raises(SpecError) as err:
        load_checked(path, rootdir=ROOT)
    assert "compare.loss" in str(err.value) and 'regime = "twin"' in str(err.value)
