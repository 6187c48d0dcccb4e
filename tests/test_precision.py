"""Precision techniques (float8, float8 all-gather, MXFP8 through torchao) in the built-in
trainer, and their pairs' verdict (the margin regime) end to end on CPU/gloo.

The end-to-end pairs run real torchrun jobs of the debug model with emulated float8 matmuls;
their outcome depends on rounding, so they assert what the rule implies (a correct recipe is
never "failed"; a planted bug that clips the largest values is), never a number of this run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from convergence.backends.builtin import BuiltinBackend, job_overrides
from convergence.spec.errors import NotRunnableHere, SpecError
from convergence.spec.job import JobSpec
from convergence.spec.layout import ParallelLayout, Techniques
from convergence.trainer.config import load_train_config
from convergence.trainer.config_checks import check_config
from experiments import builtin_pair

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
DETECTION = ROOT / "benchmarks" / "detection"
HAS_TORCHAO = __import__("importlib").util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(
    not HAS_TORCHAO and not os.environ.get("CI"),
    reason='torchao is not installed: pip install "pytest-convergence[precision]"',
)


# -- the spec and the train config ------------------------------------------------------------


def test_the_techniques_are_checked_with_their_key_and_fix() -> None:
    with pytest.raises(SpecError, match="unknown float8 recipe") as bad:
        Techniques(float8="blockwise")  # type: ignore[arg-type]
    assert bad.value.key == "float8" and "tensorwise" in bad.value.fix
    with pytest.raises(SpecError) as gather:
        Techniques(float8="rowwise", float8_all_gather=True)
    assert gather.value.key == "float8_all_gather"
    with pytest.raises(SpecError) as both:
        Techniques(float8="tensorwise", mxfp8=True)
    assert both.value.key == "mxfp8"


@pytest.mark.parametrize(
    "tech",
    [
        Techniques(float8="tensorwise"),
        Techniques(float8="rowwise"),
        Techniques(float8="tensorwise", float8_all_gather=True),
        Techniques(mxfp8=True),
    ],
)
def test_a_precision_technique_changes_the_numbers_on_purpose(tech: Techniques) -> None:
    assert tech.numerics_changed and not tech.bitwise_pairable
    assert not Techniques(param_dtype="bfloat16").numerics_changed


def job(tech: Techniques, **degrees: int) -> JobSpec:
    return JobSpec(
        name="t",
        train_config=str(ROOT / "train_configs" / "debug.toml"),
        steps=4,
        layout=ParallelLayout(**degrees),
        techniques=tech,
    )


def test_the_builtin_backend_passes_them_to_the_trainer() -> None:
    tech = Techniques(param_dtype="bfloat16", float8="tensorwise", float8_all_gather=True)
    overrides = job_overrides(job(tech, dp_shard=2))
    assert "--precision.float8=tensorwise" in overrides
    assert "--precision.float8_all_gather=true" in overrides
    cfg = BuiltinBackend().effective_config(job(tech, dp_shard=2))
    assert cfg.precision.float8 == "tensorwise" and cfg.precision.float8_all_gather


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (["--precision.float8=tensorwise", "--parallelism.tp=2"], "parallelism.tp"),
        (
            ["--precision.float8=tensorwise", "--precision.float8_all_gather=true"],
            "precision.float8_all_gather",
        ),
        (["--precision.float8=blockwise"], "precision.float8"),
        (["--precision.mxfp8=true", "--precision.float8=rowwise"], "precision.mxfp8"),
        (["--precision.kernels=fast"], "precision.kernels"),
    ],
)
def test_the_trainer_refuses_what_it_cannot_run(override: list[str], key: str) -> None:
    cfg = load_train_config("debug", override)
    with pytest.raises(SpecError) as err:
        check_config(cfg, None)
    assert err.value.key == key and err.value.fix


def test_hardware_kernels_without_a_gpu_are_a_skip_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # torch sees no GPU
    spec = job(Techniques(param_dtype="bfloat16", float8="rowwise"), dp_shard=2)
    spec = spec.__class__(**{**spec.__dict__, "overrides": (("precision.kernels", "hardware"),)})
    if not HAS_TORCHAO:
        pytest.skip("torchao missing: the skip names that first")
    with pytest.raises(NotRunnableHere) as err:
        BuiltinBackend().preflight(spec)
    assert err.value.key == "precision.kernels" and "auto" in err.value.fix


@needs_torchao
@pytest.mark.parametrize(
    ("overrides", "kind"),
    [
        (["--precision.float8=tensorwise"], "Float8Linear"),
        (["--precision.float8=rowwise"], "Float8Linear"),
        (["--precision.mxfp8=true"], "MXFP8TrainingWeightWrapperTensor"),
    ],
)
def test_the_linears_are_converted_but_the_lm_head(overrides: list[str], kind: str) -> None:
    import torch
    from torch import nn

    from convergence.trainer import precision
    from convergence.trainer.model import ModelArgs, build_model

    cfg = load_train_config("debug", overrides)
    model = build_model(ModelArgs.from_config(cfg.model, seq_len=cfg.data.seq_len), "meta")
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    precision.convert(model, cfg, torch.device("cpu"))
    converted = {
        n
        for n, m in model.named_modules()
        if kind in (type(m).__name__, type(getattr(m, "weight", None)).__name__)
    }
    assert "output" not in converted  # the LM head stays in high precision
    assert converted == {n for n in linears if n != "output"}


@needs_torchao
def test_the_inverted_scale_bug_multiplies_the_weights_matmuls_by_its_scale_squared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The planted bug does what its docstring says (benchmarks/detection), in process: the
    forward of a float8 linear comes out scale^2 too large, scale = 448 / amax(weight)."""
    import torch
    from torch import nn
    from torchao.float8 import Float8LinearConfig, float8_ops
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.syspath_prepend(str(DETECTION))
    from detection_bugs.precision import inverted_weight_scale

    for op in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default):
        monkeypatch.setitem(float8_ops.FLOAT8_OPS_TABLE, op, float8_ops.FLOAT8_OPS_TABLE[op])
    torch.manual_seed(0)
    linear = Float8Linear.from_float(
        nn.Linear(32, 32, bias=False),
        config=Float8LinearConfig(emulate=True),  # tensorwise: the default recipe
    )
    x = torch.randn(16, 32)
    with torch.no_grad():
        right = linear(x)
        inverted_weight_scale(linear, None)
        wrong = linear(x)
    scale = torch.finfo(torch.float8_e4m3fn).max / linear.weight.abs().max()
    assert torch.allclose(wrong, right * scale**2, rtol=1e-3, atol=0)


@needs_torchao
def test_the_mixed_cast_bug_saturates_the_gradients_above_amax_over_128(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The planted bug grads_cast_e4m3 (benchmarks/detection), in process on torchao's
    emulated float8 linear: the forward is untouched, and the backward's output gradient is
    scaled for e5m2 (57344 / amax) but cast to e4m3fn, so every entry above amax / 128
    saturates -- the input's gradient is exactly the one from that clamped gradient, and
    both gradients sit far further from high precision than correct float8's."""
    import copy

    import torch
    from torch import nn
    from torchao.float8 import Float8LinearConfig, float8_linear
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.syspath_prepend(str(DETECTION))
    from detection_bugs.precision import grads_cast_e4m3

    # The hook patches this name; monkeypatch puts the original back after the test.
    monkeypatch.setattr(
        float8_linear, "hp_tensor_to_float8_dynamic", float8_linear.hp_tensor_to_float8_dynamic
    )
    torch.manual_seed(0)
    high = nn.Linear(64, 64, bias=False)
    linear = Float8Linear.from_float(
        copy.deepcopy(high),
        config=Float8LinearConfig(emulate=True),  # tensorwise, e5m2 grads
    )
    x, g = torch.randn(32, 64), torch.randn(32, 64)

    def run(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        module.zero_grad()
        inp = x.clone().requires_grad_(True)
        out = module(inp)
        out.backward(g)
        assert inp.grad is not None and module.weight.grad is not None
        return out.detach(), inp.grad, module.weight.grad.clone()

    _, *exact = run(high)
    right_out, *right = run(linear)
    grads_cast_e4m3(linear, None)
    wrong_out, *wrong = run(linear)

    assert torch.equal(wrong_out, right_out)  # only the backward's e5m2 casts change
    e5m2_scale = torch.finfo(torch.float8_e5m2).max / g.abs().max()
    clamped = (g * e5m2_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / e5m2_scale
    assert (g.abs() > g.abs().max() / 128).float().mean() > 0.9  # nearly all of a Gaussian g
    w = linear.weight.detach()
    w_scale = torch.finfo(torch.float8_e4m3fn).max / w.abs().max()
    w8 = (w * w_scale).to(torch.float8_e4m3fn).float() / w_scale
    assert torch.allclose(wrong[0], clamped @ w8, rtol=1e-5, atol=1e-7)
    for got, ok, hp in zip(wrong, right, exact, strict=True):
        bug_error = ((got - hp).norm() / hp.norm()).item()
        float8_error = ((ok - hp).norm() / hp.norm()).item()
        assert bug_error > 0.5 and bug_error > 8 * float8_error, (bug_error, float8_error)


def collect_shipped(tmp_path: Path, experiment: str, env: dict[str, str]) -> str:
    """``pytest -m convergence`` (nightly tier) on a shipped precision experiment in a fresh
    interpreter with ``env``; its output, after asserting that it exited 0."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs"]
        + ["--convergence-workdir", str(tmp_path), experiment]
        + ["-m", "convergence", "--convergence-tier", "nightly"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    return out


# -- the GPU acceptance pairs on a machine without a GPU -------------------------------------


def test_the_hardware_float8_pairs_skip_without_a_gpu_naming_the_key(tmp_path: Path) -> None:
    """experiments/precision/gpu.toml (benchmarks/gpu_check.sh's float8 part) asks for the
    GPU's own float8 kernels: here, where torch sees no GPU, each pair is skipped with the fix
    (never trained on an emulated fallback and called a hardware result)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = collect_shipped(tmp_path, "experiments/precision/gpu.toml", env)
    assert "3 skipped" in out, out
    assert out.count('with precision.kernels = "hardware" needs a GPU with float8') == 3, out


# -- without torchao ------------------------------------------------------------------------


def test_without_torchao_the_precision_pairs_skip_naming_the_install(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(FIXTURES / "no_torchao"), *filter(None, [env.get("PYTHONPATH")])]
    )
    out = collect_shipped(tmp_path, "experiments/precision/cpu.toml", env)
    assert "4 skipped" in out, out
    assert "needs torchao, which is not installed in this environment" in out, out
    assert 'pip install "pytest-convergence[precision]"' in out, out


# -- end to end: the margin regime's three outcomes -----------------------------------------


def run_pairs(tmp_path: Path, *tests: dict[str, object], steps: int = 40) -> tuple[int, str, dict]:  # type: ignore[type-arg]
    """One pytest session on a bf16 FSDP2 control (2 ranks) and ``tests``; its report.json."""
    builtin_pair(
        tmp_path / "experiments",
        file="prec.toml",
        train_config="debug",
        steps=steps,
        seed=42,
        parallelism={"dp_shard": 2},
        techniques={"param_dtype": "bfloat16"},
        control={"name": "bf16"},
        tests=tests,
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, COLUMNS="200")
    env["PYTHONPATH"] = os.pathsep.join([str(DETECTION), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("GITHUB_STEP_SUMMARY", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q"]
        + ["experiments/prec.toml", "-m", "convergence", "--convergence-report", "report"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = result.stdout + result.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    return result.returncode, out, report


@needs_torchao
@pytest.mark.rounding
@pytest.mark.slow  # 9 jobs: 1.5-5 min here. CI tier of the same properties: the shipped
# experiments/precision/cpu.toml pair (correct float8 tensorwise, tier ci) and the rule's "worse" on
# synthetic pairs (tests/test_stats_noninferiority.py)
def test_float8_passes_or_is_inconclusive_and_a_planted_bug_fails(tmp_path: Path) -> None:
    code, out, report = run_pairs(
        tmp_path,
        {"name": "float8", "techniques": {"float8": "tensorwise"}},
        {
            "name": "float8-local-amax",
            "techniques": {"float8": "tensorwise"},
            "hook": "detection_bugs.precision:local_amax_scale",
        },
        steps=24,
    )
    pairs = {p["name"]: p for p in report["pairs"]}
    assert code != 0, out  # the bug fails the session
    assert pairs["float8"]["regime"] == "margin", out  # chosen by default
    # A correct recipe is never "failed": as good, or not enough evidence (with a number).
    assert pairs["float8"]["status"] in ("passed", "inconclusive"), out
    loss = next(v for v in pairs["float8"]["verdicts"] if v["metric"] == "loss")
    assert loss["method"] == "margin" and loss["evidence"]["num_pairs"] == 3
    if loss["inconclusive"]:
        assert loss["evidence"]["replicates_needed"] or loss["evidence"]["more_steps"], loss
    # Values above a quarter of the true amax saturate: worse by more than the margin.
    assert pairs["float8-local-amax"]["status"] == "failed", out
    bad = [v for v in pairs["float8-local-amax"]["verdicts"] if v["gate"] and not v["passed"]]
    assert bad and not any(v["inconclusive"] for v in bad if v["metric"] == "loss"), bad
    # 1 control, its 2 seed replicates (shared), and 3 test jobs per pair.
    assert "FAIL" in out and "float8-local-amax" in out


def loss_windows(tmp_path: Path) -> list[dict]:  # type: ignore[type-arg]
    """The loss verdict's windows of the last session's one pair (its saved outcome)."""
    session = sorted((tmp_path / ".convergence" / "sessions").iterdir())[-1]
    (saved,) = session.glob("*.outcome.json")
    outcome = json.loads(saved.read_text())
    loss = next(v for v in outcome["verdicts"] if v["metric"] == "loss")
    return list(loss["details"]["windows"])


@pytest.mark.rounding
def test_too_few_replicates_for_the_margin_read_inconclusive_with_the_number(
    tmp_path: Path,
) -> None:
    # A test marked as a deliberate change (regime = "margin") whose forward is perturbed at
    # bf16 rounding level (the twin regime's forward noise: no systematic effect), 2 pairs.
    # Session 1, margin 10 nats, measures each window's bounds; session 2 sets the margin just
    # below the largest excludable difference E (so the pairs cannot be powered: never a
    # pass) and the rule then says which outcome: inconclusive where every window's lower
    # bound L stays at or under the margin, failed otherwise.
    test: dict[str, object] = {
        "name": "noisy",
        "regime": "margin",
        "replicates": 2,
        "overrides": {"training.forward_noise": 0.004},
        "compare": {"loss": {"method": "margin", "margin": 10.0}, "grad_norm": "off"},
    }
    run_pairs(tmp_path, test, steps=16)
    windows = loss_windows(tmp_path)
    margin = 0.99 * max(w["excludable"] for w in windows)
    test["compare"] = {"loss": {"method": "margin", "margin": margin}, "grad_norm": "off"}
    code, out, report = run_pairs(tmp_path, test, steps=16)
    windows = loss_windows(tmp_path)  # the same curves: the runs are bitwise deterministic
    (pair,) = report["pairs"]
    assert code != 0, out  # never a pass, in the exit status either
    assert report["summary"]["passed"] == 0
    loss = next(v for v in pair["verdicts"] if v["metric"] == "loss")
    assert not loss["passed"]
    if any(w["lower"] > margin for w in windows):
        assert pair["status"] == "failed", out
        return
    assert pair["status"] == "inconclusive", out
    assert report["summary"]["inconclusive"] == 1
    assert loss["inconclusive"]
    needed = loss["evidence"]["replicates_needed"]
    assert needed is not None and needed > 2, loss
    assert f"(replicates = {needed})" in loss["message"], loss
    assert "INCONCLUSIVE" in out and "1 inconclusive" in out, out


def test_a_float8_jobs_cache_key_covers_torchaos_release() -> None:
    from convergence.torchao_info import torchao_version

    backend = BuiltinBackend()
    plain = backend.config_text(job(Techniques(param_dtype="bfloat16"), dp_shard=2))
    float8 = backend.config_text(job(Techniques(float8="tensorwise"), dp_shard=2))
    assert "torchao" not in plain  # a job without torchao keeps its key
    version = torchao_version()
    if version is not None:
        assert float8 == f"{plain}\n# torchao {version}\n"
