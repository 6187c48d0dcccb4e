"""The suite's own hygiene: module-scoped fixtures run once per session under xdist.

Under `-n 2 --dist loadgroup` a module-scoped fixture runs once per worker that receives one
of the module's tests; for a fixture that trains, that doubles the module's cost. A module with
one must therefore pin its tests to one worker with `pytestmark = xdist_group(...)` (or list
why not below).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

#: Modules whose module-scoped fixtures do not train (cheap), so spreading their tests over both
#: workers is worth more than running the fixture once.
CHEAP_MODULE_FIXTURES = {"test_plugin_collection.py"}


def _module_scoped_fixtures(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and any(
                kw.arg == "scope"
                and isinstance(kw.value, ast.Constant)
                and kw.value.value in ("module", "session")
                for kw in deco.keywords
            ):
                names.append(node.name)
    return names


def _has_xdist_group(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return "xdist_group" in ast.unparse(node.value)
    return False


def test_modules_with_shared_runs_run_on_one_worker() -> None:
    missing = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        fixtures = _module_scoped_fixtures(tree)
        if fixtures and path.name not in CHEAP_MODULE_FIXTURES and not _has_xdist_group(tree):
            missing.append(f"{path.name} ({', '.join(fixtures)})")
    assert not missing, (
        "modules with module-scoped fixtures but no `pytestmark = pytest.mark.xdist_group(...)`"
        " (their fixtures would run once per xdist worker): " + "; ".join(missing)
    )


@pytest.mark.xdist_group("suite_sharing")
def test_a_grouped_test_carries_its_group_under_loadgroup(request: pytest.FixtureRequest) -> None:
    """Under `-n 2 --dist loadgroup` (CI), the scheduler groups by the node id's @suffix: if it
    is missing, every xdist_group is silently ignored (pytest 9 + xdist 3.8 did that)."""
    if not (hasattr(request.config, "workerinput") and request.config.getvalue("loadgroup")):
        pytest.skip("not an xdist worker with --dist loadgroup")
    assert request.node.nodeid.endswith("@suite_sharing"), request.node.nodeid
