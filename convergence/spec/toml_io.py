"""Reading TOML once at the boundary, with errors that name the file and the fix."""

from __future__ import annotations

import shlex
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from convergence.spec.errors import SpecError


def read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise SpecError("file not found", file=str(path), fix="check the path")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(
            f"malformed TOML: {exc}",
            file=str(path),
            fix="fix the TOML syntax at the reported line and column",
        ) from None
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"not UTF-8 text: {exc}", file=str(path), fix="save the file as UTF-8"
        ) from None


def shell_words(text: str, *, what: str, file: str, key: str, fix: str) -> list[str]:
    """``text`` split as a shell would (never run through one); a SpecError naming ``what``
    when it cannot be split (unbalanced quotes)."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise SpecError(f"cannot split {what}: {exc}", file=file, key=key, fix=fix) from None


def check_keys(table: Mapping[str, Any], allowed: Iterable[str], *, file: str, path: str) -> None:
    """Unknown keys are errors: a typo like ``tensor_paralel`` must never be silently ignored."""
    allowed = list(allowed)
    for key in table:
        if key not in allowed:
            where = f"{path}.{key}" if path else key
            raise SpecError(
                "unknown key",
                file=file,
                key=where,
                fix=f"remove it or use one of: {', '.join(allowed)}",
            )


def expect(value: Any, kind: type | tuple[type, ...], *, file: str, key: str, what: str) -> Any:
    """Type check one TOML value (bool is not an int here)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        raise SpecError(
            f"expected {what}, got {value!r}", file=file, key=key, fix=f"write {key} as {what}"
        )
    return value


def expect_table(value: Any, *, file: str, key: str) -> dict[str, Any]:
    return dict(expect(value, dict, file=file, key=key, what="a table ({ key = value, ... })"))


def require_key(
    table: Mapping[str, Any], name: str, *, file: str, key: str, what: str, fix: str
) -> Any:
    """``table[name]``; SpecError "``what`` has no ``name``" at ``key.name`` otherwise."""
    if name not in table:
        raise SpecError(f"{what} has no {name}", file=file, key=f"{key}.{name}", fix=fix)
    return table[name]


def expect_choice(value: Any, choices: Iterable[str], *, file: str, key: str, what: str) -> Any:
    """``value`` when it is one of ``choices``; SpecError "unknown ``what``" naming them."""
    choices = list(choices)
    if value not in choices:
        raise SpecError(
            f"unknown {what} {value!r}", file=file, key=key, fix=f"use one of: {', '.join(choices)}"
        )
    return value
