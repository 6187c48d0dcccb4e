"""The train configs shipped with the package, named by short name (``"debug"``).

They are package data, so a wheel install carries them: an experiment in any repository can
say ``train_config = "debug"``. ``convergence configs`` lists them.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent


def shipped_configs() -> dict[str, Path]:
    """Short name -> path of every shipped train config."""
    return {p.stem: p for p in sorted(CONFIG_DIR.glob("*.toml"))}


def shipped_config(name: str) -> Path | None:
    """The shipped config called ``name`` (``"debug"`` or ``"debug.toml"``), or None."""
    stem = name[:-5] if name.endswith(".toml") else name
    if not stem or "/" in stem or "\\" in stem:
        return None
    return shipped_configs().get(stem)


def describe() -> str:
    """One line per shipped config: name, path, the first line of its comment."""
    lines = []
    for name, path in shipped_configs().items():
        first = next(
            (ln.lstrip("# ").strip() for ln in path.read_text().splitlines() if ln.startswith("#")),
            "",
        )
        lines.append(f"{name:12s} {first}  ({path})")
    return "\n".join(lines)
