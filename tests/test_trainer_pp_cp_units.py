"""Context parallel and pipeline parallel units, checked with real torchrun/gloo processes.

Each worker script under tests/fixtures/ppcp/ runs every check of its kind in ONE torchrun
launch (process start-up dominates on 2 cores) and rank 0 writes the worst deviations from the
single-process reference as JSON; the tests below only read that JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from convergence.trainer.context_parallel import causal_mask_with_offset

FIXTURES = Path(__file__).parent / "fixtures" / "ppcp"
REPO = Path(__file__).resolve().parents[1]


def run_torchrun(script: str, nproc: int, out: Path, *args: str,
                 timeout: float = 240) -> dict[str, Any]:
    """Launch `script` on `nproc` gloo ranks; return the JSON rank 0 wrote to `out`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(FIXTURES / script), str(out), *args]
    proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{script} on {nproc} ranks failed (rc {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


# ---------------------------------------------------------------- context parallel


def test_causal_mask_offset_is_global_causal() -> None:
    """Chunk r's mask rows equal rows [r*L, (r+1)*L) of the full causal mask."""
    seq, cp = 12, 3
    full = torch.ones(seq, seq).tril().bool()
    local = seq // cp
    for rank in range(cp):
        mask = causal_mask_with_offset(local, seq, rank * local, torch.device("cpu"))
        assert torch.equal(mask, full[rank * local:(rank + 1) * local])


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def cp_results(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp(f"cp{request.param}") / "result.json"
    return run_torchrun("cp_worker.py", request.param, out)


@pytest.mark.parametrize("kind", ["sdpa_mha", "sdpa_gqa"])
def test_cp_sdpa_matches_full_causal_sdpa(cp_results: dict[str, Any], kind: str) -> None:
    errs = cp_results[kind]
    for key in ("out", "dq", "dk", "dv"):
        assert errs[key] <= 1e-6, (kind, key, errs)
    # Negative control: without the query offset the result is far off, so the check has teeth.
    assert errs["unshifted_out"] > 1e-2, errs


@pytest.mark.parametrize("kind", ["tiny_model", "trainer_model"])
def test_cp_model_matches_single_process(cp_results: dict[str, Any], kind: str) -> None:
    errs = cp_results[kind]
    if errs is None:
        pytest.skip("convergence.trainer.model is not importable")
    assert errs["loss_abs"] <= 1e-6 * max(1.0, errs["loss"]), errs
    assert errs["grad_rel"] <= 1e-5, errs
