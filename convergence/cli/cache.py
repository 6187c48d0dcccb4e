"""``convergence cache``: look after a run cache outside a test session.

    convergence cache list   [--cache-dir DIR]                  entries, age, size, job
    convergence cache verify [--cache-dir DIR] [--delete]       checksum every entry
    convergence cache prune  [--cache-dir DIR] --older-than DAYS

The default DIR is ``.convergence/cache`` (pytest's default under a project with a config
file); pass the folder you give ``--convergence-cache-dir`` otherwise. A session never needs
this: it verifies an entry before using it and reruns a corrupt one. It is for a shared cache
(is every entry sound? how big is it?) and for keeping its size in check.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from convergence.cache.store import RunCache
from convergence.spec.errors import SpecError
from convergence.spec.run_dir import RunDir

EXIT_OK, EXIT_FAILED = 0, 1
DEFAULT_DIR = Path(".convergence") / "cache"


def add_cache_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cache = sub.add_parser("cache", help="list, verify or prune a run cache")
    actions = cache.add_subparsers(dest="cache_command", required=True)
    for name, text in (
        ("list", "list the entries"),
        ("verify", "checksum every entry"),
        ("prune", "delete entries not used for a while"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument(
            "--cache-dir",
            type=Path,
            default=DEFAULT_DIR,
            metavar="DIR",
            help=f"the cache folder (default {DEFAULT_DIR})",
        )
        action.set_defaults(func=cmd_cache)
    actions.choices["verify"].add_argument(
        "--delete", action="store_true", help="delete the entries that fail"
    )
    actions.choices["prune"].add_argument(
        "--older-than", type=float, required=True, metavar="DAYS", help="entries older than this"
    )


def _open(folder: Path) -> RunCache:
    if not folder.is_dir():
        raise SpecError(
            f"no run cache at {folder}",
            key="--cache-dir",
            fix="pass the folder you give --convergence-cache-dir (default "
            f"{DEFAULT_DIR} in the project folder)",
        )
    return RunCache(folder)


def _size(entry: Path) -> int:
    return sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())


def _job_name(entry: Path) -> str:
    try:
        job = json.loads(RunDir(entry).job_record.read_text())
    except (OSError, ValueError):
        return "seed checkpoint" if (entry / "seed").is_dir() else "?"
    return str(job.get("name") or job.get("job", {}).get("name", "?"))


def _age_days(entry: Path, now: float) -> float:
    return (now - entry.stat().st_mtime) / 86400


def cmd_cache(args: argparse.Namespace) -> int:
    cache = _open(args.cache_dir)
    entries = cache.entries()
    now = time.time()
    if args.cache_command == "list":
        total = 0
        for entry in entries:
            size = _size(entry)
            total += size
            print(
                f"{entry.name[:12]}  {_age_days(entry, now):6.1f} d  "
                f"{size / 2**20:8.1f} MiB  {_job_name(entry)}"
            )
        print(f"{len(entries)} entries, {total / 2**20:.1f} MiB in {cache.root}")
        return EXIT_OK
    if args.cache_command == "verify":
        bad = 0
        for entry in entries:
            problem = RunCache.verify(entry)
            if problem is None:
                continue
            bad += 1
            action = ""
            if args.delete:
                cache.remove(entry)
                action = " (deleted)"
            print(f"corrupt {entry.name[:12]} ({_job_name(entry)}): {problem}{action}")
        print(f"{len(entries) - bad} of {len(entries)} entries verified in {cache.root}")
        return EXIT_FAILED if bad and not args.delete else EXIT_OK
    old = [e for e in entries if _age_days(e, now) > args.older_than]
    freed = 0
    for entry in old:
        freed += _size(entry)
        cache.remove(entry)
    print(
        f"pruned {len(old)} of {len(entries)} entries older than {args.older_than:g} days "
        f"({freed / 2**20:.1f} MiB) from {cache.root}"
    )
    return EXIT_OK
