"""convergence.report is three groups in layers: data -> sections -> formats, over shared
helpers; no import cycle, every import at the top of its module (matplotlib lazily on purpose;
the seed band is read from the verdict, so no module needs the scipy-heavy stats.seed_band)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPORT = Path(__file__).resolve().parents[1] / "convergence" / "report"
PACKAGE = "convergence.report"

HELPERS = {"fmt", "files", "figure", "markup"}
"""Shared by every group; they import no other report module but each other."""
LAYERS = {"helpers": 0, "data": 1, "sections": 2, "formats": 3}
LAZY: set[tuple[str, str]] = set()
"""Function-local imports of convergence.* allowed, with the reason at the import."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(REPORT.rglob("*.py")):
        parts = path.relative_to(REPORT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((PACKAGE, *parts))] = path
    return out


def _layer(module: str) -> str | None:
    rest = module.removeprefix(PACKAGE).lstrip(".").split(".")
    if rest == [""]:
        return None  # the package itself: the public API, above every layer
    return "helpers" if rest[0] in HELPERS else rest[0]


def _top_level_imports(module: str, path: Path) -> set[str]:
    """Report modules imported at the top of ``module`` (a package's own submodules count,
    the package itself not)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PACKAGE))
    return (found & set(_modules())) - {module}


def test_groups_import_only_lower_layers_and_there_is_no_cycle() -> None:
    modules = _modules()
    graph = {m: _top_level_imports(m, p) for m, p in modules.items()}
    for module, deps in graph.items():
        layer = _layer(module)
        if layer is None:
            continue
        assert layer in LAYERS, f"{module}: not in a group ({sorted(LAYERS)})"
        for dep in deps:
            dep_layer = _layer(dep)
            assert dep_layer is not None and LAYERS[dep_layer] <= LAYERS[layer], (
                f"{module} ({layer}) imports {dep} ({dep_layer})"
            )
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import cycle: " + " -> ".join((*path, module))
        if module in done:
            return
        for dep in graph[module]:
            visit(dep, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_no_function_local_imports_of_the_library() -> None:
    local = set()
    for path in _modules().values():
        tree = ast.parse(path.read_text())
        top = set(tree.body)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in top:
                names = (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else [a.name for a in node.names]
                )
                local.update(
                    (path.relative_to(REPORT).as_posix(), n)
                    for n in names
                    if n.startswith("convergence")
                )
    assert local == LAZY


def test_every_module_imports_on_its_own() -> None:
    """Each module imported first, in a fresh set of report modules (a cycle would fail with
    a partially initialised module); one interpreter for all of them."""
    code = (
        "import importlib, sys\n"
        f"for name in {sorted(_modules())!r}:\n"
        f"    for loaded in [m for m in sys.modules if m.startswith({PACKAGE!r})]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
        "print('matplotlib' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"  # matplotlib only once a figure is drawn
