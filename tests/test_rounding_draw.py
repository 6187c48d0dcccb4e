"""The emulated rounding draw (convergence/rank/rounding_draw.py): a deterministic function
of the numbers, one rounding step at most, another result for each draw."""

from __future__ import annotations

import pytest
import torch

from convergence.rank.rounding_draw import (
    ROUNDING_DRAW_ENV,
    RoundingDrawError,
    apply_rounding_draw,
    perturb_output,
    rounding_draw,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draw_moves_values_by_at_most_one_rounding_step_and_is_a_function_of_them(
    dtype: torch.dtype,
) -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(dtype)
    once, again = perturb_output(x, 1), perturb_output(x.clone(), 1)
    assert torch.equal(once, again)  # same numbers in, same numbers out: a cache stays valid
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    # x * (1 + u a) with |u| < 1 rounds to x or a neighbour: relative change < 2 units.
    rel = ((once.float() - x.float()).abs() / x.float().abs()).max().item()
    assert 0 < rel <= 2 * unit * (1 + 1e-6) * 2
    moved = (once != x).float().mean().item()
    assert 0.05 < moved < 0.95  # a draw, not a shift of everything
    other = perturb_output(x, 2)
    assert not torch.equal(once, other)


def test_draw_zero_registers_nothing_and_a_draw_registers_every_linear() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    before = model(x)
    assert apply_rounding_draw([model], 0) == 0 and torch.equal(model(x), before)
    assert apply_rounding_draw([model], 3) == 2
    after = model(x)
    assert not torch.equal(after, before) and torch.allclose(after, before, rtol=1e-6)
    after.sum().backward()  # the perturbation keeps the graph
    assert model[0].weight.grad is not None


def test_the_variable_is_read_and_bad_values_name_it_and_the_fix() -> None:
    assert rounding_draw({}) == 0 and rounding_draw({ROUNDING_DRAW_ENV: " 2 "}) == 2
    for bad in ("x", "-1", "1.5"):
        with pytest.raises(RoundingDrawError, match=f"{ROUNDING_DRAW_ENV}.*non-negative integer"):
            rounding_draw({ROUNDING_DRAW_ENV: bad})


def test_the_run_cache_keys_the_draw() -> None:
    from convergence.cache.stack import numerics_env

    assert numerics_env({ROUNDING_DRAW_ENV: "1"}) == {ROUNDING_DRAW_ENV: "1"}


def test_ci_draw_reaches_the_rounding_tests_and_their_jobs_only(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """.ci/run's CONVERGENCE_ROUNDING_TESTS_DRAW: the project's conftest.py puts it in the
    environment of the tests marked ``rounding`` (and so of the jobs they start), not of the
    others, and leaves no trace after a test."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pytester.makeconftest((root / "conftest.py").read_text(encoding="utf-8"))
    pytester.makeini("[pytest]\nmarkers =\n    rounding: rounding-sensitive\n")
    pytester.makepyfile(
        test_draws=f"""
        import os, subprocess, sys
        import pytest

        def job_draw():  # what a job started by the test sees
            code = "import os; print(os.environ.get({ROUNDING_DRAW_ENV!r}, 'unset'))"
            return subprocess.run([sys.executable, "-c", code], capture_output=True,
                                  text=True, check=True).stdout.strip()

        def test_plain_before():
            assert job_draw() == "unset"

        @pytest.mark.rounding
        def test_rounding():
            assert os.environ[{ROUNDING_DRAW_ENV!r}] == "3" and job_draw() == "3"

        def test_plain_after():
            assert job_draw() == "unset"
        """
    )
    monkeypatch.delenv(ROUNDING_DRAW_ENV, raising=False)
    monkeypatch.setenv("CONVERGENCE_ROUNDING_TESTS_DRAW", "3")
    pytester.runpytest("-p", "no:cacheprovider", "-p", "no:xdist").assert_outcomes(passed=3)
    monkeypatch.delenv("CONVERGENCE_ROUNDING_TESTS_DRAW")
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=2, failed=1)  # without it, the rounding test runs at draw 0
