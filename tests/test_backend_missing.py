"""A pair whose backend is not installed, or cannot import with this torch, is a skip with a
reason naming the cause and the fix, in every tier (``--convergence-strict``: an error).

Tested in pytest subprocesses whose interpreter really lacks torchtitan (a path finder that
does not see it, tests/fixtures/no_torchtitan) or whose torch lacks what torchtitan 0.3.0
imports, as torch 2.11 does (tests/fixtures/torch_too_old_for_torchtitan): not only where CI
installed torchtitan next to a torch it works with."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from convergence.backends.registry import TORCH_SERIES, torch_mismatch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
CPU_TOML = "experiments/torchtitan/cpu.toml"


def pytest_in(shim: str, workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest in a subprocess whose interpreter starts with ``fixtures/<shim>/sitecustomize``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(FIXTURES / shim), *filter(None, [env.get("PYTHONPATH")])]
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs"]
        + ["--convergence-workdir", str(workdir), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_without_torchtitan_its_pairs_skip_naming_the_install(tmp_path: Path) -> None:
    result = pytest_in(
        "no_torchtitan", tmp_path, CPU_TOML, "-m", "convergence", "--convergence-tier", "ci"
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "2 skipped" in out, out
    assert "torchtitan is not installed in this environment" in out, out
    assert 'pip install "./pytest-convergence[torchtitan]"' in out, out
    assert "invalid experiment" not in out, out


def test_without_torchtitan_strict_makes_it_a_collection_error(tmp_path: Path) -> None:
    result = pytest_in(
        "no_torchtitan",
        tmp_path,
        CPU_TOML,
        "-m",
        "convergence",
        "--convergence-tier",
        "ci",
        "--convergence-strict",
    )
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "torchtitan is not installed in this environment" in out, out


def test_without_torchtitan_the_readme_nightly_collection_exits_0(tmp_path: Path) -> None:
    """README "Run it on a GPU cluster": this command exits 0 in this repository."""
    result = pytest_in(
        "no_torchtitan",
        tmp_path,
        "-m",
        "convergence",
        "--convergence-tier",
        "nightly",
        "--convergence-devices",
        "8",
        "--collect-only",
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "cpu.toml::fsdp2-tp2-sp" in out, out  # listed (and skipped when run)


def test_a_torch_older_than_torchtitan_needs_is_a_skip_naming_both(tmp_path: Path) -> None:
    if not os.environ.get("CI") and importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed (pip install -e '.[torchtitan]' triton)")
    result = pytest_in(
        "torch_too_old_for_torchtitan",
        tmp_path,
        CPU_TOML,
        "-m",
        "convergence",
        "--convergence-tier",
        "ci",
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "2 skipped" in out, out
    # The import that failed (not torchtitan's "Cannot import config_registry" alone), and
    # the torch it needs; never the old "fix the override" on backend_options.module.
    assert "cannot import name 'DataParallelMeshDims'" in out, out
    assert "needs torch 2.13.x" in out, out
    assert "fix the override" not in out, out


def test_torchtitan_0_3_needs_torch_2_13_exactly() -> None:
    """Issue 52: the registry said torch >= 2.12 while the patches refuse anything but 2.13.x
    (a user on 2.11 was told to install 2.12, then refused again; the extra let pip pick 2.14)."""
    assert torch_mismatch("torchtitan", "0.3.0", "2.11.0") == "2.13"
    assert torch_mismatch("torchtitan", "0.3.0", "2.12.0+cu128") == "2.13"
    assert torch_mismatch("torchtitan", "0.3.0", "2.14.0") == "2.13"
    assert torch_mismatch("torchtitan", "0.3.1", "2.13.0+cpu") is None
    assert torch_mismatch("torchtitan", "0.3.0", "2.13.2") is None
    assert torch_mismatch("torchtitan", "0.4.0", "2.6.0") is None  # not known: its import checks


def test_every_place_states_the_same_torch_for_torchtitan() -> None:
    """The registry, every patch pinned to a torch, pyproject's extra and the refusal message
    say one torch series (2.13.x): none can move without the others. (The pins with no torch
    -- the trainer subclass and torchtitan's main -- reach into torchtitan only.)"""
    from packaging.specifiers import SpecifierSet

    from convergence.backends.torchtitan import anchors, probe, resume  # noqa: F401 (pins)
    from convergence.backends.torchtitan.patches import PATCHES, unsupported_releases

    series = TORCH_SERIES["torchtitan"]["0.3"]
    assert {pin.torch for pin in PATCHES.values() if pin.torch} == {series}, PATCHES
    assert {pin.torchtitan for pin in PATCHES.values()} == {"0.3"}, PATCHES
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (torch_req,) = [r for r in extras["torchtitan"] if r.startswith("torch>")]
    spec = SpecifierSet(torch_req[len("torch") :])
    admitted = [v for v in ("2.11.0", "2.12.0", "2.13.0", "2.13.1", "2.14.0") if v in spec]
    assert admitted == ["2.13.0", "2.13.1"], torch_req
    refusal = unsupported_releases({"torchtitan": "0.3.0", "torch": "2.14.0"})
    assert refusal is not None and f"torch {series}.x" in refusal, refusal
    assert "pytest-convergence[torchtitan]'" not in refusal  # not on the public index
    assert unsupported_releases({"torchtitan": "0.3.0", "torch": "2.13.0"}) is None


def test_a_torch_outside_the_series_is_refused_before_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.14 (which the old ``torch>=2.12`` extra let pip pick) is named, with the fix."""
    from convergence.backends import registry

    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed (pip install -e '.[torchtitan]' triton)")
    versions = {"torchtitan": "0.3.0", "torch": "2.14.0"}
    monkeypatch.setattr(registry, "_installed", versions.get)
    problem = registry.requirement_problem("torchtitan")
    assert problem is not None
    text = str(problem)
    assert "torch 2.13.x only" in text and "torch 2.14.0" in text, text
    assert "torch==2.13.*" in text, text


def test_on_a_gpu_host_the_skip_names_fixes_that_add_devices(tmp_path: Path) -> None:
    """--convergence-devices only caps a GPU host's GPUs: the skip names gloo GPU sharing and
    running on CPU instead (it used to say "raise --convergence-devices")."""
    from convergence.launch.pool import DeviceSet
    from convergence.preflight import load_checked, validate_devices
    from convergence.spec.errors import NotRunnableHere
    from experiments import builtin_pair

    path = builtin_pair(
        tmp_path,
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[{"name": "fsdp2-tp2", "parallelism": {"dp_shard": 2, "tp": 2}}],
    )
    (pair,) = load_checked(path, rootdir=tmp_path).pairs
    gpus = DeviceSet(kind="gpu", devices=("0", "1"))
    # auto places it on CPU (TP does not run over gloo on CUDA); forced onto the GPUs it skips
    assert validate_devices(pair, available_devices=gpus).placement.startswith("cpu")
    with pytest.raises(NotRunnableHere) as gpu_skip:
        validate_devices(pair, available_devices=gpus, device_mode="cuda")
    assert "raise --convergence-devices" not in str(gpu_skip.value.fix)
    assert "--convergence-device auto or cpu" in str(gpu_skip.value.fix)
    with pytest.raises(NotRunnableHere) as cpu_skip:
        validate_devices(pair, available_devices=DeviceSet(kind="cpu", devices=("0", "1")))
    assert "raise --convergence-devices" in str(cpu_skip.value.fix)  # CPU slots: a real fix


def test_dualpipev_is_a_skip_on_a_torch_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.8 has no ScheduleDualPipeV (2.9 has): on it a DualPipeV pair is skipped with the
    reason, not a collection error (the old-torch CI phase runs 2.8 for real; here torch's
    version is what the backend is told)."""
    import convergence.backends.builtin as builtin
    from convergence.preflight import load_checked
    from convergence.spec.errors import NotRunnableHere
    from convergence.torch_info import older_than
    from experiments import builtin_pair

    assert older_than("2.8.0+cu128", "2.9") and not older_than("2.9.1", "2.9")
    path = builtin_pair(
        tmp_path,
        control={"name": "single", "parallelism": {}},
        tests=[
            {
                "name": "pp2-dualpipev",
                "parallelism": {"pp": 2, "pp_schedule": "DualPipeV", "pp_microbatches": 4},
            }
        ],
    )
    monkeypatch.setattr(builtin, "torch_version", lambda: "2.8.0")
    skipped: dict[str, NotRunnableHere] = {}
    load_checked(path, rootdir=tmp_path, not_runnable=skipped)
    (reason,) = skipped.values()
    assert "needs torch >= 2.9" in str(reason) and "this is torch 2.8.0" in str(reason)
    monkeypatch.setattr(builtin, "torch_version", lambda: "2.13.0")
    load_checked(path, rootdir=tmp_path)  # runnable: no skip, no error
