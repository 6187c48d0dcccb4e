"""cache_key: canonical, sensitive to every input; code_version follows the sources."""

from __future__ import annotations

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

BASE: dict[str, Any] = dict(train_config_text="[model]\ndim = 64\n", backend_version="builtin-1",
                            code_version="c0", torch_version="2.13.0+cpu", hardware="cpu:x x2")


@dataclass(frozen=True, kw_only=True)
class Layout:
    dp_shard: int
    tp: int


def job(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": "fsdp2", "steps": 100, "seed": 42,
                            "layout": Layout(dp_shard=2, tp=1), "overrides": ["a=1", "b=2"]}
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


@pytest.mark.parametrize("over", [{"seed": 43}, {"layout": Layout(dp_shard=2, tp=2)},
                                  {"overrides": ["b=2", "a=1"]}, {"steps": 100.0}])
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
    keys = {stack_fingerprint(env) for env in (
        base, {**base, "NCCL_ALGO": "Tree"}, {**base, "NCCL_ALGO": "Ring"},
        {**base, "NCCL_PROTO": "LL128"}, {**base, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
        {**base, "OMP_NUM_THREADS": "2"})}
    assert len(keys) == 6
    assert stack_fingerprint({**base, "HOME": "/elsewhere"}) == stack_fingerprint(base)
    stack = accelerator_stack()
    import torch

    if torch.version.cuda is None:
        assert "cuda" not in stack and "nccl" not in stack  # only what is present
    else:
        assert stack["cuda"] == torch.version.cuda
