"""The pytest process imports no costly package before its first job (issue 30).

A real subprocess collects the quick start and reports what it imported: collection (spec
parsing, the built-in trainer's config check, device detection) must not need torch, scipy,
matplotlib or tensorboard. Not a timing: a module in sys.modules is a fact on any machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from convergence import torch_info
from convergence.launch.pool import detect_devices
from convergence.torch_info import torch_build, torch_version
from experiments import builtin_pair

REPO = Path(__file__).resolve().parents[1]
COSTLY = ("torch", "scipy", "matplotlib", "tensorboard", "torchtitan")

PROBE = """
import json, sys
import pytest
rc = pytest.main(sys.argv[1:])
print("MODULES=" + json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
sys.exit(rc)
"""


def _loaded_top_modules(stdout: str) -> set[str]:
    """The top-level packages a probe printed on its ``MODULES=`` line."""
    line = next(x for x in stdout.splitlines() if x.startswith("MODULES="))
    return set(json.loads(line.removeprefix("MODULES=")))


def _collect(
    paths: list[str], env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``pytest -m convergence --collect-only`` of ``paths`` under the probe, from the
    repository (it must succeed); its output and the top-level packages it had loaded."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "-m", "convergence", "--collect-only", "-q"]
        + ["-p", "no:cacheprovider", *paths],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, _loaded_top_modules(proc.stdout)


@pytest.mark.parametrize("paths", [["experiments/quickstart.toml"], []], ids=["quickstart", "bare"])
def test_collect_only_of_the_quick_start_imports_no_torch(paths: list[str]) -> None:
    """Named or bare (`testpaths`: the project's conftest skips test modules that hold no
    convergence test unimported), collection loads none of the costly packages."""
    env = dict(os.environ)
    build = torch_build()
    if build is None or build.has_gpu:
        # A GPU build must ask torch how many GPUs it sees: hide them, so that what is checked
        # is that nothing else in collection imports torch.
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc, loaded = _collect(paths, env)
    assert "experiments/quickstart.toml::" in proc.stdout
    assert loaded & set(COSTLY) == set(), proc.stdout


def test_collecting_a_pair_with_a_hook_imports_no_torch(tmp_path: Path) -> None:
    """The collection checks locate a pair's hook (convergence/rank/hooks.py find_hook_module,
    the backend's preflight) without importing it, and without torch: the hook API's module
    loads no torch at its top (it did while it lived in trainer/, ~2 s per pytest process)."""
    build = torch_build()
    if build is None or build.has_gpu:
        pytest.skip("a GPU build asks torch how many GPUs it sees")
    experiment = builtin_pair(tmp_path, tests=[{"name": "hooked", "hook": "planted_bugs:noop"}])
    hooks = REPO / "tests" / "fixtures" / "hooks"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hooks), env.get("PYTHONPATH")) if p)
    proc, loaded = _collect([str(experiment)], env)
    assert "::hooked" in proc.stdout, proc.stdout
    assert loaded & set(COSTLY) == set(), proc.stdout


def test_the_build_read_from_the_file_is_the_imported_torchs() -> None:
    import torch

    build = torch_build()
    assert build is not None
    assert (build.version, build.cuda, build.hip) == (
        str(torch.__version__),
        torch.version.cuda,
        torch.version.hip,
    )


def _fake_torch(tmp_path: Path, cuda: str, hip: str) -> Path:
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('the fake torch is not imported')\n")
    (package / "version.py").write_text(
        "from typing import Optional\n\n__version__ = '9.9.9'\n"
        f"cuda: Optional[str] = {cuda}\ngit_version = 'x'\nhip: Optional[str] = {hip}\n"
    )
    return tmp_path


@pytest.mark.parametrize(
    ("cuda", "hip", "expected"),
    [("None", "None", False), ("'12.4'", "None", True), ("None", "'6.2.4'", True)],
)
def test_torch_build_is_read_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: str, hip: str, expected: bool
) -> None:
    monkeypatch.syspath_prepend(str(_fake_torch(tmp_path, cuda, hip)))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    torch_build.cache_clear()
    try:
        build = torch_build()
        assert build is not None and build.has_gpu is expected
        assert build.version == torch_version() == "9.9.9"
        assert torch_info.may_see_gpus() is expected
    finally:
        torch_build.cache_clear()


def test_an_unreadable_build_defers_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _fake_torch(tmp_path, "None", "None")
    (root / "torch" / "version.py").write_text("__version__ = '9.9.9'\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    torch_build.cache_clear()
    try:
        assert torch_build() is None
        assert torch_info.may_see_gpus() is True
    finally:
        torch_build.cache_clear()


@pytest.mark.parametrize("value", ["", "-1", " -1,0"])
def test_cuda_visible_devices_hiding_all_gpus_means_cpu_slots(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    monkeypatch.setattr(torch_info, "torch_build", lambda: None)  # torch is never asked
    found = detect_devices(cpu_slots=3)
    assert (found.kind, found.devices) == ("cpu", ("0", "1", "2"))


RUNNER_PROBE = """
import json, sys
from pathlib import Path
from convergence.run.runner import Runner, RunSettings
import convergence.stats.registry
Runner(RunSettings(work_dir=Path(sys.argv[1])))
print("MODULES=" + json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_building_the_runner_and_the_verdicts_imports_no_torch_or_scipy(tmp_path: Path) -> None:
    """The session's Runner (calibration stack, cache, pool) and the verdict registry are built
    before the first job and before the first verdict: on a CPU build neither imports torch nor
    scipy (the seed regime imports scipy when it runs; jobs import torch in their own
    processes). Together they cost the pytest process ~7.6 s of CPU on the quick start."""
    build = torch_build()
    if build is None or build.has_gpu:
        pytest.skip("a GPU build asks torch for its CUDA stack")
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER_PROBE, str(tmp_path / "wd")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    loaded = _loaded_top_modules(proc.stdout)
    assert loaded & set(COSTLY) == set(), proc.stdout


def test_the_accelerator_stack_told_without_torch_is_the_imported_torchs() -> None:
    """The run cache's key and the calibration's stack must not change with whether torch was
    imported first: the stack read from version.py equals the one asked of torch."""
    code = (
        "import json, sys\n"
        "from convergence.cache.stack import accelerator_stack\n"
        "first = accelerator_stack(); had = 'torch' in sys.modules\n"
        "import torch\n"
        "print(json.dumps([first, accelerator_stack(), had]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    without, with_torch, had = json.loads(proc.stdout.splitlines()[-1])
    assert without == with_torch
    build = torch_build()
    if build is not None and not build.has_gpu:
        assert had is False
