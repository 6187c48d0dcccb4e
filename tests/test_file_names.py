"""One word, one meaning, also in file names: a module name used in more than one package of
the library or the plugin names the same thing in each (one concept, seen from each layer: the
spec's key, the run tier's jobs, the trainer's side). A new repetition fails here until it is
either renamed (``stats/twin.py`` beside ``regimes/twin.py`` was: the comparison method is
``stats/twin_envelope.py``, the regime ``regimes/twin.py``) or listed with what it means."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("convergence", "pytest_convergence")

#: The repeated names that keep one meaning, and that meaning.
SAME_MEANING = {
    "__main__.py": "a package's command-line entry (the trainer's, the CLI's)",
    "anchored.py": "the anchored check: its description (checks/) and its statistics (stats/)",
    "anchors.py": "the anchored check: its spec key, its jobs, the trainer's saves and loads",
    "base.py": "the Protocol a pluggable part implements (Backend, Regime)",
    "hooks.py": "the user's hook API: its home (rank/, both trainers) and its former path "
    "(trainer/, re-exported for hooks written against it)",
    "options.py": "the option table, and the plugin's registration of it with pytest",
    "probe.py": "the numerics probe: the trainer's, torchtitan's, its jobs, its report section",
    "registry.py": "lookup of a pluggable part by name (backends, regimes, comparisons)",
    "resumed.py": "the resumed check: its description (checks/) and its statistics (stats/)",
    "resume.py": "resuming a run: the spec key, the trainer, torchtitan, the jobs, the report",
    "stack.py": "the accelerator stack: in the cache key, and what a calibration is valid for",
    "types.py": "a package's data types and Protocols (launch requests; verdicts)",
}


def _repeated_names() -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name != "__init__.py":
                where[path.name].append(str(path.relative_to(REPO)))
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_a_repeated_module_name_keeps_one_meaning() -> None:
    new = {name: paths for name, paths in _repeated_names().items() if name not in SAME_MEANING}
    assert not new, (
        f"module names used in more than one package: {new}; rename one to say what it holds, "
        "or list the name in SAME_MEANING with the one thing it means everywhere"
    )


def test_the_list_holds_no_name_that_is_no_longer_repeated() -> None:
    stale = sorted(set(SAME_MEANING) - set(_repeated_names()))
    assert not stale, f"no longer repeated, remove from SAME_MEANING: {stale}"
