"""Print one of README.md's commands, as README writes them, for .ci/run's newcomer phase.

    python .ci/readme_commands.py install|quickstart|tests|nightly

- install: the first line of the "Quick start" block (its comment dropped);
- quickstart: the second line of that block;
- tests: the project's test command (the block that starts with ``pytest -m "not slow"``);
- nightly: the ``--collect-only`` command README promises exits 0 (in running text).

Standard library only: it runs before anything is installed. When README's commands change,
CI follows them; a README without one of them fails here, naming what is missing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(text: str) -> list[list[str]]:
    """README's indented code blocks (4 spaces, after a blank line), as lines."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    previous_blank = True
    for line in text.splitlines():
        if line.startswith("    ") and (current is not None or previous_blank):
            if current is None:
                current = []
                blocks.append(current)
            current.append(line.strip())
        elif line.strip():
            current = None
        previous_blank = not line.strip()
    return [[line for line in block if line] for block in blocks]


def _command(line: str) -> str:
    """The command without its trailing ``# comment``."""
    return re.sub(r"\s+#\s.*$", "", line).strip()


def commands(text: str) -> dict[str, str]:
    quick = text.split("## Quick start", 1)[1]
    first = _blocks(quick)[0]
    found = {"install": _command(first[0]), "quickstart": _command(first[1])}
    for block in _blocks(quick):
        if block[0].startswith('pytest -m "not slow"'):
            found["tests"] = _command(block[0])
            break
    nightly = re.search(r"`(pytest -m convergence [^`]*--collect-only)`", text)
    if nightly:
        found["nightly"] = nightly.group(1)
    return found


def main() -> int:
    which = sys.argv[1] if len(sys.argv) == 2 else ""
    found = commands(README.read_text(encoding="utf-8"))
    if which not in found:
        print(
            f"README.md has no {which or '<name>'!r} command (have: {', '.join(found)})",
            file=sys.stderr,
        )
        return 2
    print(found[which])
    return 0


if __name__ == "__main__":
    sys.exit(main())
