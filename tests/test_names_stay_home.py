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
        if literals & NAMES or any(_class_default(side) for side in (node.left, *node.comparators)):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found + _name_sets(path) + _concrete_isinstance(path)


def _class_default(node: ast.AST) -> bool:
    """``JobSpec.backend``, ``PairSpec.regime``: a class's default name, a name in disguise."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr in ("backend", "regime")
        and isinstance(node.value, ast.Name)
        and node.value.id[:1].isupper()
    )


#: Backend names that are also words of their own: ``command`` is the command backend's
#: option key too (``ARGV_OPTIONS = ("command",)``), so a tuple holding only it is no set of
#: backend names.
ALSO_KEYS = frozenset({"command"})


def _name_sets(path: Path) -> list[str]:
    """Sets, tuples and lists holding a backend's name (``MOVABLE = frozenset({"builtin"})``,
    ``TRAINERS = ("builtin", "torchtitan")``): a membership test in waiting. A tuple or list
    holding only a name that is also a key is left alone."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            continue
        names = {e.value for e in node.elts if isinstance(e, ast.Constant)} & set(SHIPPED_BACKENDS)
        if names and (isinstance(node, ast.Set) or names - ALSO_KEYS or len(names) > 1):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def _concrete_isinstance(path: Path) -> list[str]:
    """``isinstance(backend, BuiltinBackend)``: a concrete backend's class outside its home."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            classes = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if any(c.endswith("Backend") and c != "Backend" for c in classes):
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
    probe.write_text(
        'def f(job):\n    return job.backend == "builtin" or "seed" in (job.x,)\n'
        'MOVABLE = frozenset({"builtin"})\n'
        'TRAINERS = ("builtin", "torchtitan")\n'
        'OWN = ["torchtitan"]\n'
        'KEYS = ("command",)\n'  # an option key, not a set of names: not counted
        "def g(job, backend):\n"
        "    return job.backend == JobSpec.backend or isinstance(backend, BuiltinBackend)\n"
    )
    try:
        assert len(_name_comparisons(probe)) == 7
    finally:
        probe.unlink()
