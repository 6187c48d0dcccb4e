"""Backends and regimes are known by what they state, not by name: outside ``backends/`` and
``regimes/`` no module of the library or the plugin compares a value with a backend's or a
regime's name written as a string literal (``job.backend == "builtin"``, ``regime in ("paired",
"twin")``). What a backend can do is ``Backend.capabilities`` / ``code_identity``; what a
regime does is its attributes and methods (convergence/regimes/base.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from convergence.backends.registry import SHIPPED as SHIPPED_BACKENDS
from convergence.regimes.registry import SHIPPED as SHIPPED_REGIMES

REPO = Path(__file__).resolve().parents[1]
HOMES = ("convergence/backends/", "convergence/regimes/")
NAMES = frozenset(SHIPPED_BACKENDS) | {r.name for r in SHIPPED_REGIMES}
EQUALITY = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def _name_comparisons(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Compare) or not all(
            isinstance(op, EQUALITY) for op in node.ops
        ):
            continue
        literals = {
            n.value
            for side in (node.left, *node.comparators)
            for n in ast.walk(side)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        if literals & NAMES:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_backends_and_regimes_compares_their_names() -> None:
    found = [
        hit
        for package in ("convergence", "pytest_convergence")
        for path in sorted((REPO / package).rglob("*.py"))
        if not str(path.relative_to(REPO)).startswith(HOMES)
        for hit in _name_comparisons(path)
    ]
    assert found == [], "ask the backend or the regime instead:\n" + "\n".join(found)


def test_the_check_sees_a_name_comparison(tmp_path: Path) -> None:
    probe = REPO / "tests" / "fixtures" / "_names_probe.py"
    probe.write_text('def f(job):\n    return job.backend == "builtin" or "seed" in (job.x,)\n')
    try:
        assert len(_name_comparisons(probe)) == 2
    finally:
        probe.unlink()
