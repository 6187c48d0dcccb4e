"""A content-addressed store of finished runs, safe across processes.

Layout: ``<root>/<key[:2]>/<key>/`` holds the run's files plus ``manifest.json`` (sha256 and
size of every file). An entry is only trusted after every checksum matches; a corrupt or
truncated one is removed and reported as a miss. Writes go to ``<root>/.tmp`` first (same
filesystem), the manifest is written last, and one ``rename`` makes the entry appear whole.

A cache folder this process cannot write (a shared reference cache mounted read-only, or
another user's) is used read-only: verified entries are hits, nothing is locked, deleted or
stored, and a miss runs the job without keeping it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import filelock

from convergence.launch.process_tree import pid_alive
from convergence.spec.errors import RunFailed

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_TMP = ".tmp"
_LOCKS = ".locks"

log = logging.getLogger(__name__)


class CacheError(RunFailed, RuntimeError):
    """The cache could not store a run (e.g. disk full); nothing half-written was left."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy files (following symlinks) one by one, so an OSError such as ENOSPC surfaces as
    itself (``shutil.copytree`` collects errors into a ``shutil.Error``)."""
    if not src.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "run folder is not a directory", str(src))
    dst.mkdir(parents=True)
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(exist_ok=True)
        elif path.is_file():
            shutil.copyfile(path, target)


def _read_only(root: Path) -> bool:
    """An existing cache folder that we may not write into (access(2) also reports a
    read-only mount, even to root)."""
    return root.is_dir() and not os.access(root, os.W_OK | os.X_OK)


def _ensure_folder(root: Path, sub: str, what: str) -> None:
    path = root / sub
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (root, path) if p.exists() and not p.is_dir()), path)
        raise CacheError(
            f"run cache {root}: {blocker} is a file, but the cache needs a folder there (for "
            f"{what}); fix: remove {blocker}, or use another cache folder "
            f"(--convergence-cache-dir DIR)"
        ) from None
    except OSError as exc:
        raise CacheError(
            f"run cache {root}: cannot create {path}: {exc.strerror or exc}; fix: "
            f"use a writable cache folder (--convergence-cache-dir DIR)"
        ) from None


def _check_key(key: str) -> None:
    if len(key) < 8 or not all(c in "0123456789abcdef" for c in key):
        raise ValueError(f"cache key must be a lowercase hex digest, got {key!r}")


class Claim:
    """The right to produce one entry: see :meth:`RunCache.claim`."""

    def __init__(self, cache: RunCache, key: str, path: Path | None) -> None:
        self.cache = cache
        self.key = key
        self.path = path
        """The entry when it is (now) in the cache, else None: run the job, then commit."""
        self.hit = path is not None
        """The entry was already there when the claim was taken."""

    def commit(self, run_dir: Path) -> Path:
        """Store the finished run's folder; returns the entry (also set as :attr:`path`).
        A read-only cache stores nothing and returns ``run_dir`` itself."""
        if self.cache.read_only:
            self.path = Path(run_dir)
        else:
            self.path = self.cache.put(self.key, run_dir)
        return self.path


class RunCache:
    """``get``/``put`` verified entries; ``claim`` so concurrent workers run a job once."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.read_only = _read_only(self.root)
        """The folder exists but this process may not write it: reads only (module docstring)."""
        if self.read_only:
            log.warning(
                "run cache %s is read-only: cached runs are used, new ones are not stored",
                self.root,
            )
            return
        for sub, what in ((_TMP, "runs being stored"), (_LOCKS, "lock files")):
            _ensure_folder(self.root, sub, what)
        self._sweep_tmp()

    def entry_dir(self, key: str) -> Path:
        _check_key(key)
        return self.root / key[:2] / key

    # -- reading --------------------------------------------------------------------------

    def get(self, key: str) -> Path | None:
        """The verified entry, or None (missing, or corrupt: then it is deleted)."""
        entry = self.entry_dir(key)
        if not entry.is_dir():
            return None
        problem = self.verify(entry)
        if problem is None:
            if not self.read_only:
                try:  # last use, for `convergence cache prune --older-than`
                    os.utime(entry)
                except OSError:
                    pass
            return entry
        if self.read_only:
            log.warning(
                "run cache: entry %s is corrupt (%s); read-only cache, running again "
                "without touching it",
                entry,
                problem,
            )
            return None
        log.warning(
            "run cache: entry %s is corrupt (%s); deleting it and running again", entry, problem
        )
        self._discard(entry)
        return None

    @staticmethod
    def verify(entry: Path) -> str | None:
        """None if every file matches the manifest, else what is wrong."""
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
            files: dict[str, Any] = manifest["files"]
            if manifest.get("version") != MANIFEST_VERSION or not isinstance(files, dict):
                return "unknown manifest version"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"unreadable {MANIFEST}: {exc}"
        # The manifest must account for the whole entry: one that lists nothing, or omits a
        # file (a metrics file lost, or one edited after the fact), proves nothing about it.
        if not files:
            return f"{MANIFEST} lists no files"
        present = {
            p.relative_to(entry).as_posix()
            for p in entry.rglob("*")
            if p.is_file() and p.name != MANIFEST
        }
        unlisted = sorted(present - set(files))
        if unlisted:
            return f"files not in {MANIFEST}: {', '.join(unlisted[:3])}"
        for rel, meta in files.items():
            path = entry / rel
            try:
                if path.stat().st_size != meta["size"]:
                    return f"{rel}: size {path.stat().st_size} != {meta['size']}"
                if file_sha256(path) != meta["sha256"]:
                    return f"{rel}: checksum mismatch"
            except (OSError, KeyError, TypeError) as exc:
                return f"{rel}: {exc}"
        return None

    # -- writing --------------------------------------------------------------------------

    def put(self, key: str, src_dir: Path) -> Path:
        """Copy ``src_dir`` into the cache atomically; replaces an existing entry."""
        entry = self.entry_dir(key)
        if self.read_only:
            raise CacheError(f"run cache {self.root} is read-only: cannot store run {key[:12]}")
        src_dir = Path(src_dir)
        if (src_dir / MANIFEST).exists():
            raise ValueError(
                f"{src_dir / MANIFEST}: the run folder may not hold a file named "
                f"{MANIFEST} (the cache writes its own); rename it"
            )
        tmp = self.root / _TMP / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            _copy_tree(src_dir, tmp)
            self._write_manifest(tmp, key)
            entry.parent.mkdir(parents=True, exist_ok=True)
            if entry.exists():
                self._discard(entry)  # refresh: the old entry goes first, then the new appears
            os.rename(tmp, entry)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise CacheError(
                    f"run cache {self.root}: disk full while storing run {key[:12]} from "
                    f"{src_dir}; nothing was stored. Free space or move the cache elsewhere "
                    "(--convergence-cache-dir DIR)"
                ) from exc
            if isinstance(exc, OSError):
                raise CacheError(
                    f"run cache {self.root}: could not store run {key[:12]} from "
                    f"{src_dir}: {exc}; nothing was stored"
                ) from exc
            raise
        return entry

    @staticmethod
    def _write_manifest(folder: Path, key: str) -> None:
        files = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            files[path.relative_to(folder).as_posix()] = {
                "sha256": file_sha256(path),
                "size": path.stat().st_size,
            }
        manifest = {"version": MANIFEST_VERSION, "key": key, "created": time.time(), "files": files}
        with (folder / MANIFEST).open("w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())

    # -- coordination ---------------------------------------------------------------------

    def lock(self, key: str, timeout: float | None = None) -> filelock.FileLock:
        """A cross-process lock for ``key`` (``with cache.lock(key): ...``)."""
        _check_key(key)
        return filelock.FileLock(
            str(self.root / _LOCKS / f"{key}.lock"), timeout=-1 if timeout is None else timeout
        )

    @contextmanager
    def claim(
        self, key: str, *, refresh: bool = False, timeout: float | None = None
    ) -> Iterator[Claim]:
        """Hold ``key`` so no other worker runs the same job meanwhile::

            with cache.claim(key) as c:
                if c.path is None:          # miss (or refresh): run, then store
                    c.commit(run_dir)
                use(c.path)

        A second worker asking for the same key waits here, then sees the entry as a hit.
        ``refresh=True`` ignores an existing entry (the job reruns and replaces it).
        """
        if self.read_only:  # no lock file can be made; nothing is written to race over
            yield Claim(self, key, None if refresh else self.get(key))
            return
        with self.lock(key, timeout):
            yield Claim(self, key, None if refresh else self.get(key))

    # -- housekeeping ---------------------------------------------------------------------

    def entries(self) -> list[Path]:
        """Every entry folder (verified or not), oldest first."""
        found = [
            p
            for p in self.root.glob("??/*")
            if p.is_dir() and len(p.parent.name) == 2 and not p.parent.name.startswith(".")
        ]
        return sorted(found, key=lambda p: p.stat().st_mtime)

    def remove(self, entry: Path) -> None:
        """Delete one entry (under its key's lock, so no reader sees it half gone)."""
        if self.read_only:
            raise CacheError(f"run cache {self.root} is read-only: cannot remove {entry.name}")
        with self.lock(entry.name):
            self._discard(entry)

    def _discard(self, entry: Path) -> None:
        """Remove an entry so that it vanishes at once (rename), then delete it."""
        trash = self.root / _TMP / f"trash.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(entry, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def _sweep_tmp(self) -> None:
        """Delete temp folders left by crashed writers (their pid is dead)."""
        for tmp in (self.root / _TMP).iterdir():
            parts = tmp.name.split(".")
            if len(parts) == 3 and parts[1].isdigit() and not pid_alive(int(parts[1])):
                shutil.rmtree(tmp, ignore_errors=True)
