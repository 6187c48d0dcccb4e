"""cache_key: canonical, sensitive to every input; code_version follows the sources."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from convergence.cache.key import (
    cache_key,
    canonical_json,
    code_version,
    hardware_fingerprint,
    sources_hash,
)

BASE: dict[str, Any] = dict(
    train_config_text="[model]\ndim = 64\n",
    backend_version="builtin-1",
    code_version="c0",
    torch_version="2.13.0+cpu",
    hardware="cpu:x x2",
)


@dataclass(frozen=True, kw_only=True)
class Layout:
    dp_shard: int
    tp: int


def job(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "fsdp2",
        "steps": 100,
        "seed": 42,
        "layout": Layout(dp_shard=2, tp=1),
        "overrides": ["a=1", "b=2"],
    }
    base.update(over)
    return base


def test_key_is_a_stable_sha256_independent_of_dict_order() -> None:
    k1 = cache_key(job(), **BASE)
    reordered = dict(reversed(list(job().items())))
    assert re.fullmatch(r"[0-9a-f]{64}", k1)
    assert cache_key(reordered, **BASE) == k1
    assert cache_key(job(), **BASE) == k1


@pytest.mark.parametrize("field", sorted(BASE))
def test_every_input_changes_the_key(field: str) -> None:
    changed = dict(BASE, **{field: BASE[field] + " "})
    assert cache_key(job(), **changed) != cache_key(job(), **BASE)


@pytest.mark.parametrize(
    "over",
    [
        {"seed": 43},
        {"layout": Layout(dp_shard=2, tp=2)},
        {"overrides": ["b=2", "a=1"]},
        {"steps": 100.0},
    ],
)
def test_job_identity_changes_the_key(over: dict[str, Any]) -> None:
    # list order matters (override order can matter); 100 vs 100.0 differ in JSON on purpose
    assert cache_key(job(**over), **BASE) != cache_key(job(), **BASE)


def test_unhashable_values_are_named() -> None:
    with pytest.raises(TypeError, match=r"job\.extra has type object"):
        canonical_json({"extra": object()})
    with pytest.raises(ValueError, match=r"job\.lr is nan"):
        canonical_json({"lr": float("nan")})
    assert canonical_json({"p": Path("/a"), "s": {2, 1}}) == '{"p":"/a","s":[1,2]}'


def test_sources_hash_follows_edits(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "trainer").mkdir(parents=True)
    (pkg / "trainer" / "loop.py").write_text("lr = 1\n")
    (pkg / "notes.txt").write_text("not code")
    before = sources_hash(pkg)
    (pkg / "notes.txt").write_text("changed, still not code")
    assert sources_hash(pkg) == before
    (pkg / "trainer" / "loop.py").write_text("lr = 2\n")
    assert sources_hash(pkg) != before
    assert re.fullmatch(r"[0-9a-f]{64}", code_version())


def test_hardware_fingerprint_names_the_machine() -> None:
    fp = hardware_fingerprint()
    assert fp.startswith(("cpu:", "cuda:"))
    assert fp == hardware_fingerprint()


def test_stack_fingerprint_follows_the_numerics_environment() -> None:
    from convergence.cache.stack import accelerator_stack, numerics_env, stack_fingerprint

    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    assert numerics_env(base) == {"OMP_NUM_THREADS": "1"}  # PATH changes no number
    keys = {
        stack_fingerprint(env)
        for env in (
            base,
            {**base, "NCCL_ALGO": "Tree"},
            {**base, "NCCL_ALGO": "Ring"},
            {**base, "NCCL_PROTO": "LL128"},
            {**base, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
            {**base, "OMP_NUM_THREADS": "2"},
        )
    }
    assert len(keys) == 6
    assert stack_fingerprint({**base, "HOME": "/elsewhere"}) == stack_fingerprint(base)
    stack = accelerator_stack()
    import torch

    if torch.version.cuda is None:
        assert "cuda" not in stack and "nccl" not in stack  # only what is present
    else:
        assert stack["cuda"] == torch.version.cuda


# -- external trainers' sources ---------------------------------------------------------------


def _torchtitan_version(pythonpath: Path) -> str:
    import subprocess
    import sys

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(pythonpath), str(Path(__file__).resolve().parents[1])]),
    }
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from convergence.backends.torchtitan.backend import TorchtitanBackend, "
            "source_dir; print(TorchtitanBackend().version()); print(source_dir())",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    version, where = out.stdout.split()
    assert Path(where) == (pythonpath / "torchtitan").resolve()  # the checkout is what runs
    return version


def test_editing_a_torchtitan_source_checkout_changes_the_key(tmp_path: Path) -> None:
    """A lab's source checkout on PYTHONPATH: an edit to one of its files is a new backend
    version, hence a new cache key for every torchtitan control (and seed checkpoint)."""
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtitan is not installed")
    checkout = tmp_path / "torchtitan-src"
    shutil.copytree(
        list(spec.submodule_search_locations)[0],
        checkout / "torchtitan",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    before = _torchtitan_version(checkout)
    assert before.startswith("torchtitan-") and "+src." in before
    assert _torchtitan_version(checkout) == before  # stable
    trainer = checkout / "torchtitan" / "trainer.py"
    trainer.write_text(trainer.read_text() + "\n# a local fix\n")
    assert _torchtitan_version(checkout) != before


def test_command_backend_keys_the_trainers_sources(tmp_path: Path) -> None:
    from convergence.backends.command import CommandBackend
    from convergence.spec.errors import SpecError
    from convergence.spec.job import JobSpec

    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "train.py").write_text("print('v1')\n")
    (tmp_path / "cfg.toml").write_text("x = 1\n")

    def job(sources: str | None) -> JobSpec:
        options = [("command", "trainer/train.py --out {dump_dir}")]
        if sources is not None:
            options.append(("sources", sources))
        return JobSpec(
            name="j",
            train_config=tmp_path / "cfg.toml",
            backend="command",
            backend_options=tuple(options),
            source=str(tmp_path / "exp.toml"),
        )

    backend = CommandBackend()
    keyed = job("['trainer/**/*.py']")
    backend.preflight(keyed)
    assert backend.source_files(keyed) == [(tmp_path / "trainer" / "train.py").resolve()]
    before, plain = backend.config_text(keyed), backend.config_text(job(None))
    (tmp_path / "trainer" / "train.py").write_text("print('v2')\n")
    assert backend.config_text(keyed) != before  # an edit to the trainer: a new key
    assert backend.config_text(job(None)) == plain  # without sources: command text only
    with pytest.raises(SpecError) as info:
        backend.preflight(job("['nothing/*.py']"))
    assert info.value.key == "backend_options.sources"


def test_report_says_when_command_controls_are_keyed_by_command_text_only() -> None:
    import dataclasses

    import report_examples as ex

    from convergence.report.data.schema import build_report

    outcome = ex.passing_pair()
    assert (
        "cache_key"
        not in build_report([outcome], environment={}, started_at=None, wall_s=None)["environment"]
    )
    command = dataclasses.replace(
        outcome.pair.control, backend="command", backend_options=(("command", "train.py"),)
    )
    unkeyed = dataclasses.replace(outcome, pair=dataclasses.replace(outcome.pair, control=command))
    env = build_report([unkeyed], environment={}, started_at=None, wall_s=None)["environment"]
    assert "keyed by their command text only" in env["cache_key"]
    keyed = dataclasses.replace(
        command, backend_options=(("command", "train.py"), ("sources", "['train.py']"))
    )
    outcome = dataclasses.replace(outcome, pair=dataclasses.replace(outcome.pair, control=keyed))
    assert (
        "cache_key"
        not in build_report([outcome], environment={}, started_at=None, wall_s=None)["environment"]
    )
