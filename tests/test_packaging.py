"""pyproject.toml lists the packages by hand (the shipped configs' package is mapped from the
top-level train_configs/ folder, which `packages.find` cannot express): a package folder added
under convergence/ must be listed, or the wheel would silently lack it."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _setuptools() -> dict[str, object]:
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert isinstance(tool, dict)
    return tool


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for top in ("convergence", "pytest_convergence")
        for p in (REPO / top).rglob("__init__.py")
    }
    listed = set(_setuptools()["packages"])  # type: ignore[call-overload]
    assert found | {"convergence.configs"} == listed, (
        f"pyproject.toml [tool.setuptools] packages: add {sorted(found - listed)}, "
        f"remove {sorted(listed - found - {'convergence.configs'})}"
    )


def test_the_shipped_configs_are_the_top_level_train_configs_folder() -> None:
    mapping = _setuptools()["package-dir"]
    assert mapping == {"convergence.configs": "train_configs"}
    assert (REPO / "train_configs" / "__init__.py").is_file()
    assert (REPO / "train_configs" / "debug.toml").is_file()
    assert not (REPO / "convergence" / "configs").exists()
