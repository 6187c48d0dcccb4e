"""mkdocs hooks (mkdocs.yml ``hooks:``): pages show BENCHMARKS.md's measured tables as they are.

A page writes ``<!-- benchmarks:NAME -->`` on a line of its own; the build puts the section
``NAME`` of BENCHMARKS.md there (the text between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->``, which the benchmark scripts rewrite), its headings one level down. Read
at build time, so a rerun benchmark is on the site at the next build and nothing is copied
into docs/ to drift. A section that does not exist fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
INCLUDE = re.compile(r"^<!-- benchmarks:([\w-]+) -->$", re.MULTILINE)


def section(name: str, text: str) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise ValueError(f"BENCHMARKS.md has no section {name!r} ({begin} ... {end})")
    body = text.split(begin, 1)[1].split(end, 1)[0].strip()
    return re.sub(r"^(#+) ", r"\1# ", body, flags=re.MULTILINE)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if not INCLUDE.search(markdown):
        return markdown
    text = BENCHMARKS.read_text(encoding="utf-8")
    return INCLUDE.sub(lambda m: section(m.group(1), text), markdown)
