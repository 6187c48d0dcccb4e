"""Imports of the project's own modules sit at the top of a module. The exceptions are lazy
imports kept for a measured reason (torch, scipy, plugin start-up, an optional backend, a
cycle); each says so in a comment on its line or the line above, so that the next reader does
not have to guess, and a new hidden import fails here."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OWN = ("convergence", "pytest_convergence")


def _function_local_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(n == p or n.startswith(p + ".") for n in names for p in OWN):
                found.append((node.lineno, names[0]))
    return found


def test_every_function_local_import_of_our_modules_says_why() -> None:
    unexplained = []
    for package in OWN:
        for path in sorted((REPO / package).rglob("*.py")):
            lines = path.read_text().splitlines()
            for lineno, module in _function_local_imports(path):
                # The reason may head a group: the import's own line or the 4 lines above it.
                near = lines[max(0, lineno - 5):lineno]
                if not any(word in text.lower() for text in near
                           for word in ("lazy", "type_checking")):
                    unexplained.append(f"{path.relative_to(REPO)}:{lineno} {module}")
    assert not unexplained, ("function-local imports without a reason (move them to the top, "
                             "or say why they are lazy):\n" + "\n".join(unexplained))
