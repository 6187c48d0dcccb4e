"""Soak: many small pairs, a third of them faulty, through pytest (one process, then -n 2).

Every pair runs the faulty trainer (tests/fixtures/faulty/trainer.py) under real torchrun via the
command backend. Faults rotate through: a rank raises, a rank is SIGKILLed, NaN loss, inf loss,
a rank hangs, a rank is stopped (SIGSTOP), the torchrun agent is stopped after the last step
(hangs end through a short --convergence-idle-limit). Reported: pairs run, faults contained
(each faulty pair ended as expected with its own message -- a stopped agent's complete run is
kept and passes -- and each good pair passed), processes of any job still alive afterwards (by
PID: the launcher's pids.json and the PIDs the ranks wrote), wall time.

Then the cache of the one-process session is damaged and used again: a manifest that lists no
files, one that omits the metrics file (whose content is then changed), a truncated metrics
file -- each must be rerun, never trusted -- and the cache mounted read-only into another
project (a shared reference cache; needs root for the mount namespace): a hit, nothing written. Writes the ``soak`` section of
BENCHMARKS.md.

    python benchmarks/soak.py [--pairs 30] [--idle-limit 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "faulty"))

from _report import machine, write_section
from faulty_project import (
    FaultyTest,
    alive,
    cache_entries,
    experiment,
    job_pids,
    kill_pids,
    make_project,
    odd_config,
    run_dirs,
    run_pytest,
    saved_outcomes,
)

from convergence.cache.store import MANIFEST, RunCache

GOOD_PAIR = "p00-ok"
CACHE_DAMAGES = ("empty manifest", "manifest omits metrics (metrics edited)", "truncated metrics")

FAULTS: dict[str, tuple[tuple[str, ...], str, str]] = {
    # kind: (trainer options, pair status, text the error must hold)
    "raise": (
        ("--fault", "raise", "--fault-rank", "1", "--at", "2"),
        "error",
        "rank 1 failed: RuntimeError: injected fault",
    ),
    "sigkill": (
        ("--fault", "sigkill", "--fault-rank", "1", "--at", "2"),
        "error",
        "rank 1 was killed by SIGKILL",
    ),
    "nan": (("--fault", "nan", "--at", "2"), "failed", "loss is nan at step 2"),
    "inf": (("--fault", "inf", "--at", "3"), "failed", "loss is inf at step 3"),
    "hang": (("--fault", "hang", "--fault-rank", "1", "--at", "2"), "error", "hung: no new line"),
    "sigstop": (
        ("--fault", "sigstop", "--fault-rank", "1", "--at", "2"),
        "error",
        "is stopped (SIGSTOP or a debugger)",
    ),
    "stop_agent": (("--fault", "stop_agent"), "passed", ""),
}


def plan(num_pairs: int) -> list[tuple[FaultyTest, str | None]]:
    """Every third pair is faulty, the kinds in turn."""
    kinds = list(FAULTS)
    out: list[tuple[FaultyTest, str | None]] = []
    for i in range(num_pairs):
        if i % 3 == 2:
            kind = kinds[(i // 3) % len(kinds)]
            out.append(
                (
                    FaultyTest(
                        name=f"p{i:02d}-{kind}", fault_args=FAULTS[kind][0], early_stop=False
                    ),
                    kind,
                )
            )
        else:
            out.append((FaultyTest(name=f"p{i:02d}-ok"), None))
    return out


def _control_entry(cache: Path) -> Path:
    entries = cache_entries(cache, "ddp2")
    if len(entries) != 1:
        raise SystemExit(f"expected one cached control in {cache}, found {entries}")
    return entries[0]


def _damage(entry: Path, kind: str) -> None:
    metrics = entry / "dump" / "metrics.jsonl"
    manifest = json.loads((entry / MANIFEST).read_text())
    if kind == "empty manifest":
        manifest["files"] = {}
    elif kind.startswith("manifest omits metrics"):
        manifest["files"] = {
            k: v for k, v in manifest["files"].items() if not k.endswith("metrics.jsonl")
        }
        edited = [{**json.loads(line), "loss": 0.5} for line in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps(r) + "\n" for r in edited))  # a modified control
    else:
        metrics.write_bytes(metrics.read_bytes()[:-20])
    (entry / MANIFEST).write_text(json.dumps(manifest))


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
    }


def read_only_cache(root: Path, project: Path) -> tuple[bool, str]:
    """The session's cache used from another project through a read-only bind mount (a
    shared reference cache mounted read-only: not writable even by root): the control must
    be a hit and the cache left exactly as it was. Needs root (a private mount namespace)."""
    cache = project / ".convergence" / "cache"
    user = make_project(
        root / "other-project", {"soak.toml": (project / "experiments" / "soak.toml").read_text()}
    )
    before = _snapshot(cache)
    c = shlex.quote(str(cache))
    # sh runs pytest's argv ("$@", after the "sh" that becomes $0) once the mount is read-only.
    wrap = [
        "unshare",
        "-m",
        "sh",
        "-c",
        f'mount --bind {c} {c} && mount -o remount,ro,bind {c} && exec "$@"',
        "sh",
    ]
    proc = run_pytest(
        user,
        f"experiments/soak.toml::{GOOD_PAIR}",
        f"--convergence-cache-dir={cache}",
        wrap=wrap,
        timeout=900,
    )
    outcome = saved_outcomes(user / ".convergence").get(GOOD_PAIR) or {}
    hit = outcome.get("status") == "passed" and (outcome.get("control") or {}).get("cached")
    unchanged = _snapshot(cache) == before
    if hit and unchanged and proc.returncode == 0:
        return True, "hit (read-only mount), cache unchanged"
    return False, (
        f"rc {proc.returncode}, status {outcome.get('status')}, cached "
        f"{(outcome.get('control') or {}).get('cached')}, unchanged {unchanged}: "
        f"{proc.stdout[-400:]}"
    )


def damaged_cache(project: Path, kind: str) -> tuple[bool, str]:
    """Damage the cached control, run a good pair again: the control must rerun (not be
    trusted), the pair pass, and a verified entry replace the damaged one."""
    entry = _control_entry(project / ".convergence" / "cache")
    _damage(entry, kind)
    proc = run_pytest(project, f"experiments/soak.toml::{GOOD_PAIR}")
    outcome = saved_outcomes(project / ".convergence").get(GOOD_PAIR) or {}
    rerun = (outcome.get("control") or {}).get("cached") is False
    fresh = RunCache.verify(entry) is None
    if outcome.get("status") == "passed" and rerun and fresh and proc.returncode == 0:
        return True, "rerun, pair passed, fresh entry verified"
    return False, (
        f"rc {proc.returncode}, status {outcome.get('status')}, rerun {rerun}, "
        f"fresh {fresh}: {proc.stdout[-400:]}"
    )


def soak(root: Path, num_pairs: int, idle_limit: float, workers: int | None) -> dict[str, object]:
    pairs = plan(num_pairs)
    project = make_project(
        root,
        {
            "soak.toml": experiment(
                tests=[t for t, _ in pairs], train_config=odd_config(root), steps=4
            )
        },
    )
    args = [f"--convergence-idle-limit={idle_limit}", "-q"]
    if workers:
        args += ["-n", str(workers), "--convergence-devices", str(2 * workers)]
    started = time.monotonic()
    proc = run_pytest(project, *args, timeout=3600)
    wall = time.monotonic() - started
    workdir = project / ".convergence"
    outcomes = saved_outcomes(workdir)
    contained = good = 0
    problems = []
    for test, kind in pairs:
        o = outcomes.get(test.name)
        if o is None:
            problems.append(f"{test.name}: no outcome")
            continue
        if kind is None:
            good += o["status"] == "passed"
            if o["status"] != "passed":
                problems.append(f"{test.name}: {o['status']} {o['error']}")
            continue
        _, status, text = FAULTS[kind]
        if o["status"] == status and text in (o["error"] or ""):
            contained += 1
        else:
            problems.append(f"{test.name}: {o['status']} {(o['error'] or '')[:200]}")
    pids: set[int] = set()
    for run_dir in run_dirs(workdir):
        pids |= job_pids(run_dir)
    left = alive(pids)
    kill_pids(left)
    cache_checks: list[tuple[str, bool, str]] = []
    if not workers:  # the cache faults, once, on the one-process session's cache
        if os.geteuid() == 0:
            cache_checks.append(("read-only mount", *read_only_cache(root, project)))
        for kind in CACHE_DAMAGES:
            cache_checks.append((kind, *damaged_cache(project, kind)))
    return {
        "workers": workers or 1,
        "cache": cache_checks,
        "pairs": len(outcomes),
        "planned": num_pairs,
        "faulty": sum(k is not None for _, k in pairs),
        "contained": contained,
        "good_passed": good,
        "good": sum(k is None for _, k in pairs),
        "pids_checked": len(pids),
        "leftover": len(left),
        "wall_s": wall,
        "exit": proc.returncode,
        "problems": problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--idle-limit", type=float, default=30.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    for workers in (None, 2):
        with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
            row = soak(Path(tmp), args.pairs, args.idle_limit, workers)
        print(row, flush=True)
        rows.append(row)
    lines = [
        f"{args.pairs} pairs (command backend, 2 ranks per job under real torchrun, 4 steps), "
        f"every third one faulty (rank raises, rank SIGKILLed, NaN loss, inf loss, rank hangs, "
        f"rank stopped, agent stopped after the last step; "
        f"--convergence-idle-limit {args.idle_limit:g}), run by "
        "`python benchmarks/soak.py`.",
        "",
        "| run | pairs run | faults contained | good pairs passed | PIDs audited | "
        "leftover processes | wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {'-n ' + str(r['workers']) if r['workers'] > 1 else 'one process'} | "
            f"{r['pairs']}/{r['planned']} | {r['contained']}/{r['faulty']} | "
            f"{r['good_passed']}/{r['good']} | {r['pids_checked']} | {r['leftover']} | "
            f"{r['wall_s']:.0f} s |"
        )
    lines += [
        "",
        "The one-process session's cache, then used again (a good pair each time):",
        "",
        "| cache fault | as expected | what happened |",
        "|---|---|---|",
    ]
    for r in rows:
        for kind, ok, detail in r["cache"]:  # type: ignore[attr-defined]
            lines.append(f"| {kind} | {'yes' if ok else 'NO'} | {detail[:160]} |")
    problems = [p for r in rows for p in r["problems"]]  # type: ignore[attr-defined]
    if problems:
        lines += ["", "Not as expected:", *[f"- {p}" for p in problems]]
    lines += ["", f"Machine: {machine()}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_section("soak", text)


if __name__ == "__main__":
    main()
