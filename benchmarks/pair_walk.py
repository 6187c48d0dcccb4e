"""The walk of one pair from ``Runner.run_pair`` to its verdict, counted file by file.

Runs one real small pair (the ``command`` backend: a tiny Python script writing JSONL, started
directly, two launches) under ``sys.setprofile`` in this process and records, for each file of
``convergence/``, how many times control *enters* it from another file of ``convergence/``:

- an entry is a Python call whose callee file differs from its caller's file, the caller being
  the nearest frame up the stack that is in ``convergence/`` (so a call made through the
  standard library -- a ``with`` block's ``contextlib``, a ``functools`` wrapper, ``sorted``'s
  key -- counts from the convergence line that started it);
- entries are counted by distinct call site (caller file:line -> callee function): a poll loop
  that calls the metrics reader 50 times counts once, a second line that calls it counts again;
- module bodies (imports done on the way) are not part of the walk and are not counted, nor
  are reads of a value: a property getter, a dunder method other than a constructor, a call or
  a ``with`` block (``len(curve)``, ``job.world_size``, a dataclass's ``__post_init__``);
- a *climb back* is an entry into a file that already has a frame on the stack (a callback
  into the caller's file, or a helper that calls back up): the back-and-forth the walk is about.

    python benchmarks/pair_walk.py [--steps 3] [--no-write]

Prints a table (file, distinct entries, from where) and writes its section of BENCHMARKS.md.
tests/test_pair_walk.py runs the same trace and bounds the entries per file.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import tempfile
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import convergence

REPO = Path(__file__).resolve().parents[1]
#: The package traced: the one imported (PYTHONPATH may point at another checkout).
PACKAGE = str(Path(convergence.__file__).resolve().parent) + "/"

#: Dunder methods that are steps of the walk (a constructor, a call, a ``with`` block); every
#: other dunder (``__len__``, ``__eq__``, ``__post_init__``...) reads or checks a value.
STEP_DUNDERS = frozenset({"__init__", "__call__", "__enter__", "__exit__"})

#: The trainer of the traced pair: the command backend's shape of an in-house trainer (its own
#: key names), writing every step at once so that the walk, not the training, is measured.
TRAINER = """
import json, sys
from pathlib import Path

dump, steps = Path(sys.argv[1]), int(sys.argv[2])
dump.mkdir(parents=True, exist_ok=True)
with (dump / "log.jsonl").open("w") as log:
    for step in range(1, steps + 1):
        log.write(json.dumps({"step": step, "train_loss": 4.0 / step, "gnorm": 1.0}) + "\\n")
"""


def experiment(folder: Path, steps: int) -> Path:
    """A one-pair command-backend experiment (paired: one control job, one test job)."""
    (folder / "trainer.py").write_text(TRAINER)
    command = json.dumps([str(folder / "trainer.py"), "{dump_dir}", "{steps}"])
    path = folder / "walk.toml"
    path.write_text(
        textwrap.dedent(f"""
        [defaults]
        train_config = "{REPO}/train_configs/debug.toml"
        steps = {steps}
        backend = "command"
        regime = "paired"
        compare = {{ data_fingerprint = "off", grad_norm_parts = "off" }}

        [defaults.backend_options]
        command = {command}
        launch = "direct"
        metrics_file = "log.jsonl"
        keys = {{ loss = "train_loss", grad_norm = "gnorm" }}

        [control]
        name = "ddp1"

        [[test]]
        name = "same"
        """)
    )
    return path


def builtin_experiment(folder: Path, steps: int) -> Path:
    """A one-pair built-in-trainer experiment (paired: a seed checkpoint, 1-rank control,
    2-rank test with half the local batch)."""
    path = folder / "walk_builtin.toml"
    path.write_text(
        textwrap.dedent(f"""
        [defaults]
        train_config = "{REPO}/train_configs/debug.toml"
        steps = {steps}

        [control]
        name = "single"
        parallelism = {{ dp_shard = 1 }}

        [[test]]
        name = "fsdp2"
        parallelism = {{ dp_shard = 2 }}
        local_batch_size = 4
        """)
    )
    return path


EXPERIMENTS: dict[str, Callable[[Path, int], Path]] = {
    "command": experiment,
    "builtin": builtin_experiment,
}


def short(filename: str) -> str:
    """``convergence/run/runner.py`` -> ``run/runner.py``."""
    return filename[len(PACKAGE) :]


@dataclass
class Walk:
    """The entries of one traced call, by callee file."""

    entries: dict[str, set[tuple[str, int, str]]] = field(default_factory=dict)
    """callee file -> {(caller file, caller line, callee function)}; caller ``<outside>``: the
    walk's own start (called from outside convergence/)."""
    climbs: set[tuple[str, int, str, str]] = field(default_factory=set)
    """(caller file, line, callee file, callee function) of entries into a file already on
    the stack."""

    def counts(self) -> dict[str, int]:
        return {f: len(sites) for f, sites in self.entries.items()}

    def table(self) -> str:
        rows = sorted(self.entries.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        lines = [
            "| file | distinct entries | from (caller file x sites) |",
            "|---|---:|---|",
        ]
        for callee, sites in rows:
            callers = Counter(caller for caller, _, _ in sites)
            where = ", ".join(
                f"{c} x{n}" if n > 1 else c for c, n in sorted(callers.items(), key=str)
            )
            lines.append(f"| `{callee}` | {len(sites)} | {where} |")
        return "\n".join(lines)

    def summary(self) -> str:
        counts = self.counts()
        top = max(counts.values(), default=0)
        busiest = ", ".join(f"`{f}`" for f, n in sorted(counts.items()) if n == top)
        return (
            f"{len(counts)} files, {sum(counts.values())} distinct entries, "
            f"{len(self.climbs)} climbs back into a file already on the stack; "
            f"most entered: {busiest} ({top})"
        )


def _nearest_package_frame(frame: FrameType | None) -> FrameType | None:
    while frame is not None and not frame.f_code.co_filename.startswith(PACKAGE):
        frame = frame.f_back
    return frame


def _reads_a_value(frame: FrameType) -> bool:
    """A property getter or a dunder other than STEP_DUNDERS (see the module's docstring)."""
    name = frame.f_code.co_name
    if name.startswith("__") and name.endswith("__"):
        return name not in STEP_DUNDERS
    code = frame.f_code
    if code.co_argcount == 0:
        return False
    owner = frame.f_locals.get(code.co_varnames[0])
    if owner is None:
        return False
    attribute = inspect.getattr_static(type(owner), name, None)
    return isinstance(attribute, (property, functools.cached_property))


def trace(call: Callable[[], Any]) -> tuple[Any, Walk]:
    """``call()`` under a profile hook that records each entry into a file of convergence/."""
    walk = Walk()
    value_reads: dict[CodeType, bool] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        callee = code.co_filename
        if not callee.startswith(PACKAGE) or code.co_name == "<module>":
            return
        if code not in value_reads:
            value_reads[code] = _reads_a_value(frame)
        if value_reads[code]:
            return
        caller_frame = _nearest_package_frame(frame.f_back)
        if caller_frame is None:
            site: tuple[str, int, str] = ("<outside>", 0, code.co_qualname)
        elif caller_frame.f_code.co_filename == callee:
            return  # within one file: not an entry
        else:
            site = (short(caller_frame.f_code.co_filename), caller_frame.f_lineno, code.co_qualname)
            # Already on the stack (above the caller): control climbs back into that file.
            up = caller_frame.f_back
            while up is not None:
                if up.f_code.co_filename == callee:
                    walk.climbs.add((site[0], site[1], short(callee), code.co_qualname))
                    break
                up = up.f_back
        walk.entries.setdefault(short(callee), set()).add(site)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = call()
    finally:
        sys.setprofile(previous)
    return result, walk


def walk_one_pair(folder: Path, steps: int = 3, backend: str = "command") -> tuple[Any, Walk]:
    """Run the pair once (fresh work folder) and trace ``run_pair``.

    The Runner is built before the trace (device detection and the cache sweep are the
    session's, not the pair's) and the pair is parsed and checked before it, as the plugin and
    ``convergence run`` do at collection."""
    from convergence.preflight import load_checked
    from convergence.run.runner import Runner, RunSettings

    pair = load_checked(EXPERIMENTS[backend](folder, steps), rootdir=REPO).pairs[0]
    runner = Runner(RunSettings(work_dir=folder / "work", devices=2))
    return trace(lambda: runner.run_pair(pair))


def _commit(checkout: Path) -> str:
    """The measured checkout's commit, marked when its convergence/ has uncommitted edits."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(checkout), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "convergence")
    return f"commit `{head}`" + (" with uncommitted edits" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--backend",
        choices=sorted(EXPERIMENTS),
        default="command",
        help="command: a tiny script, two launches (the test's pair); builtin: the built-in "
        "trainer, seed checkpoint + 1-rank control + 2-rank test (about a minute on 2 cores)",
    )
    parser.add_argument(
        "--label",
        default="",
        help="names the measured code in the section's title and name (e.g. `before`, with "
        "PYTHONPATH at another checkout): a labelled section is kept beside the current one",
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pair-walk-") as tmp:
        outcome, walk = walk_one_pair(Path(tmp), args.steps, args.backend)
    if outcome.status != "passed":
        raise SystemExit(f"the traced pair did not pass: {outcome.status} {outcome.error}")
    print(walk.summary())
    print(walk.table())
    if args.no_write:
        return
    from _report import machine

    label = f", {args.label}" if args.label else ""
    pair = {
        "command": "one command-backend pair (paired regime, two direct launches of a tiny script)",
        "builtin": "one built-in-trainer pair (paired regime, debug model: a seed checkpoint, "
        "a 1-rank control and a 2-rank test)",
    }[args.backend]
    code = _commit(Path(convergence.__file__).resolve().parents[1])
    body = f"""
## Pair walk: files entered from `run_pair` to the verdict ({args.backend}{label})

`python benchmarks/pair_walk.py --backend {args.backend}` (code measured: {code}): {pair},
{args.steps} steps, fresh work folder, traced with `sys.setprofile`; per file of `convergence/`,
the distinct call sites (caller file:line -> callee function) from which control enters it from
another file (value reads -- properties, `len()` -- not counted). A *climb back* enters a file
that is already on the stack (a callback into its caller's file). tests/test_pair_walk.py
bounds the entries per file of the command walk.

Machine: {machine()}.

{walk.summary()}.

{walk.table()}
"""
    from _report import write_section

    write_section(f"pair-walk-{args.backend}" + (f"-{args.label}" if args.label else ""), body)


if __name__ == "__main__":
    main()
