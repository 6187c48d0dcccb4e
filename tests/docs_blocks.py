"""Code blocks of the documentation pages, as the tests (and scripts/docs_images.py) read them.

README.md writes its blocks indented by four spaces (GitHub and .ci/readme_commands.py read
them so); the site's pages write fenced blocks with a language (```toml). Both are read here.
A block whose first line is a comment naming a file (``# my_project/parallel.py``,
``# experiments/my_tp.toml``) is that file; ``# experiments/my_tp.toml (appended)`` is more
of it.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
FENCE = re.compile(r"^```(\w*)\s*$")


def indented_blocks(text: str) -> list[str]:
    """Indented code blocks (4 spaces, after a blank line), dedented."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    previous_blank = True
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line.strip()) and not line.startswith("    "):
            in_fence = not in_fence
            current = None
            previous_blank = False
            continue
        if in_fence:
            continue
        if line.startswith("    ") and (current is not None or previous_blank):
            if current is None:
                current = []
                blocks.append(current)
            current.append(line)
        elif not line.strip() and current is not None:
            current.append("")
        else:
            current = None
        previous_blank = not line.strip()
    return [textwrap.dedent("\n".join(b)).strip() + "\n" for b in blocks]


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Fenced code blocks as (language, text)."""
    out: list[tuple[str, str]] = []
    lang: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        match = FENCE.match(line.strip())
        if match and lang is None:
            lang, body = match.group(1), []
        elif line.strip() == "```" and lang is not None:
            out.append((lang, textwrap.dedent("\n".join(body)).strip() + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    return out


def blocks(path: Path) -> list[str]:
    """Every code block of a page (its fenced ones, then its indented ones), as text."""
    text = path.read_text(encoding="utf-8")
    return [body for _, body in fenced_blocks(text)] + indented_blocks(text)


def named_file(block: str) -> tuple[str, bool] | None:
    """``(path, appended)`` when the block's first line names the file it is."""
    match = re.match(r"#\s+([\w./-]+\.(?:py|toml))(\s+\(appended\))?", block.splitlines()[0])
    return (match.group(1), bool(match.group(2))) if match else None


def write_project(page: Path, into: Path) -> list[Path]:
    """Write every block of ``page`` that names a file into the folder ``into`` (a package
    folder gets its ``__init__.py``); returns the files written."""
    written: list[Path] = []
    for lang, body in fenced_blocks(page.read_text(encoding="utf-8")):
        named = named_file(body) if lang in ("python", "toml") else None
        if named is None:
            continue
        rel, appended = named
        path = into / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".py" and path.parent != into:
            (path.parent / "__init__.py").touch()
        if appended:
            with path.open("a", encoding="utf-8") as out:
                out.write("\n" + body.split("\n", 1)[1])
        else:
            path.write_text(body, encoding="utf-8")
        if path not in written:
            written.append(path)
    return written
