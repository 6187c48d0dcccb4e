"""Print `export` lines that point uv at the package sources pip is configured with.

    eval "$(python .ci/uv_env.py)"

.ci/run installs its own virtualenvs with uv (`uv pip install`: it unpacks wheels and compiles
their bytecode in parallel, ~1.5x faster than pip on the 2-core CI machine; issue 48, CI time). uv reads neither pip.conf nor PIP_* variables, and a CI machine's registry mirror, local
wheel folder (the CPU torch) and constraints live there: without this, uv would look at the
public index the CI machine cannot reach. The README's install line stays pip's, as a user
runs it. Standard library only.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

# pip's option -> (uv's variable, uv's separator between several values)
_OPTIONS = {
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "find-links": ("UV_FIND_LINKS", ","),
    "constraint": ("UV_CONSTRAINT", " "),
    "cert": ("SSL_CERT_FILE", " "),
}


def pip_options() -> dict[str, list[str]]:
    """pip's effective settings: `pip config list` lines such as `global.find-links='/w'`.

    Environment variables (`:env:.`) are listed by pip too and win over files, as in pip.
    """
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    by_source: dict[str, dict[str, list[str]]] = {"file": {}, "env": {}}
    for line in listed.splitlines():
        match = re.fullmatch(r"(:env:|[\w-]+)\.([\w-]+)='(.*)'", line.strip())
        if match is None:
            continue
        source = "env" if match[1] == ":env:" else "file"
        by_source[source][match[2]] = match[3].split()
    return by_source["file"] | by_source["env"]


def main() -> None:
    options = pip_options()
    # pip treats all its indexes as one pool and picks the best version; uv by default stops
    # at the first index that has a package (its defence against dependency confusion), which
    # misses versions that live only on a later mirror here.
    print("export UV_INDEX_STRATEGY=unsafe-best-match")
    for option, (variable, separator) in _OPTIONS.items():
        if options.get(option):
            print(f"export {variable}={shlex.quote(separator.join(options[option]))}")


if __name__ == "__main__":
    main()
