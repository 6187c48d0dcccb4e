"""RunCache: verified entries, atomic puts, cross-process claims, refresh, disk full."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from convergence.cache.store import MANIFEST, CacheError, RunCache

WORKER = Path(__file__).parent / "fixtures" / "fake_trainers" / "cache_worker.py"
KEY = "ab" + "0123456789abcdef" * 3 + "0123456789abcd"


def make_run(folder: Path, payload: str = "x") -> Path:
    (folder / "tb").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n' * 50)
    (folder / "run_meta.json").write_text(json.dumps({"payload": payload}))
    (folder / "tb" / "events.out.tfevents.1").write_bytes(os.urandom(2048))
    return folder


def test_put_then_get_returns_verified_copy(tmp_path: Path) -> None:
    cache = RunCache(tmp_path / "cache")
    src = make_run(tmp_path / "run")
    entry = cache.put(KEY, src)
    assert entry == tmp_path / "cache" / "ab" / KEY
    assert cache.get(KEY) == entry
    assert (entry / "tb" / "events.out.tfevents.1").read_bytes() == (
        src / "tb" / "events.out.tfevents.1"
    ).read_bytes()
    manifest = json.loads((entry / MANIFEST).read_text())
    assert set(manifest["files"]) == {"metrics.jsonl", "run_meta.json", "tb/events.out.tfevents.1"}
    assert list((tmp_path / "cache" / ".tmp").iterdir()) == []
    assert cache.get("cd" + KEY[2:]) is None


@pytest.mark.parametrize(
    "damage",
    [
        "flip_byte",
        "truncate_file",
        "delete_file",
        "truncate_manifest",
        "delete_manifest",
        "empty_manifest",
        "manifest_omits_metrics",
    ],
)
def test_damaged_entry_is_a_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    cache = RunCache(tmp_path / "cache")
    entry = cache.put(KEY, make_run(tmp_path / "run"))
    events = entry / "tb" / "events.out.tfevents.1"
    if damage == "flip_byte":  # same size: only the checksum can tell
        data = bytearray(events.read_bytes())
        data[100] ^= 0xFF
        events.write_bytes(bytes(data))
    elif damage == "truncate_file":
        events.write_bytes(events.read_bytes()[:100])
    elif damage == "delete_file":
        (entry / "metrics.jsonl").unlink()
    elif damage == "truncate_manifest":
        text = (entry / MANIFEST).read_text()
        (entry / MANIFEST).write_text(text[: len(text) // 2])
    elif damage in ("empty_manifest", "manifest_omits_metrics"):
        # A valid manifest that vouches for less than the entry holds proves nothing: with it,
        # an edited (or missing) metrics file would be trusted as the control's.
        manifest = json.loads((entry / MANIFEST).read_text())
        if damage == "empty_manifest":
            manifest["files"] = {}
        else:
            del manifest["files"]["metrics.jsonl"]
            (entry / "metrics.jsonl").write_text('{"step": 1, "loss": 0.1}\n')
        (entry / MANIFEST).write_text(json.dumps(manifest))
    else:
        (entry / MANIFEST).unlink()
    assert cache.get(KEY) is None
    assert not entry.exists()


def test_corrupt_entry_is_rerun_through_claim(tmp_path: Path) -> None:
    cache = RunCache(tmp_path / "cache")
    entry = cache.put(KEY, make_run(tmp_path / "run", payload="old"))
    (entry / "run_meta.json").write_text('{"payload": "tampered"}')
    with cache.claim(KEY) as claim:
        assert not claim.hit and claim.path is None
        claim.commit(make_run(tmp_path / "run2", payload="new"))
    with cache.claim(KEY) as again:
        assert again.hit and again.path is not None
        assert json.loads((again.path / "run_meta.json").read_text()) == {"payload": "new"}


def test_failed_job_commits_nothing(tmp_path: Path) -> None:
    cache = RunCache(tmp_path / "cache")
    with pytest.raises(RuntimeError):
        with cache.claim(KEY):
            raise RuntimeError("job failed")
    assert cache.get(KEY) is None
    with cache.claim(KEY) as claim:  # the lock was released
        assert claim.path is None


def test_refresh_reruns_and_replaces(tmp_path: Path) -> None:
    cache = RunCache(tmp_path / "cache")
    cache.put(KEY, make_run(tmp_path / "a", payload="first"))
    with cache.claim(KEY, refresh=True) as claim:
        assert claim.path is None and not claim.hit
        path = claim.commit(make_run(tmp_path / "b", payload="second"))
    assert json.loads((path / "run_meta.json").read_text()) == {"payload": "second"}
    assert cache.get(KEY) == path


def test_two_processes_claiming_one_key_run_the_job_once(tmp_path: Path) -> None:
    counter = tmp_path / "runs.txt"
    argv = [
        sys.executable,
        str(WORKER),
        str(tmp_path / "cache"),
        KEY,
        str(counter),
        str(tmp_path / "work"),
    ]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["hit", "ran"]
    assert len(counter.read_text().split()) == 1
    refreshed = subprocess.run([*argv, "--refresh"], capture_output=True, text=True, timeout=60)
    assert refreshed.stdout.strip() == "ran"
    assert len(counter.read_text().split()) == 2


def test_sweeps_temp_folders_of_dead_writers(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "cache" / ".tmp" / f"{KEY}.{dead.pid}.deadbeef"
    mine = tmp_path / "cache" / ".tmp" / f"{KEY}.{os.getpid()}.cafecafe"
    stale.mkdir(parents=True)
    mine.mkdir()
    RunCache(tmp_path / "cache")
    assert not stale.exists() and mine.exists()


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    cache = RunCache(tmp_path / "cache")
    with pytest.raises(ValueError, match="lowercase hex"):
        cache.get("../../etc")
    src = make_run(tmp_path / "run")
    (src / MANIFEST).write_text("{}")
    with pytest.raises(ValueError, match="may not hold a file named manifest.json"):
        cache.put(KEY, src)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Path:
    """A real 256 KiB tmpfs (needs root); skipped where mounting is not allowed."""
    mnt = tmp_path / f"tiny-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_disk_full_during_put_leaves_no_half_entry(tmp_path: Path, tiny_fs: Path) -> None:
    cache = RunCache(tiny_fs / "cache")
    src = make_run(tmp_path / "run")
    (src / "big.bin").write_bytes(os.urandom(1 << 20))  # 1 MiB > 256 KiB
    with pytest.raises(CacheError, match="disk full.*nothing was stored"):
        cache.put(KEY, src)
    assert not cache.entry_dir(KEY).exists()
    assert list((tiny_fs / "cache" / ".tmp").iterdir()) == []
    assert cache.get(KEY) is None


def test_a_file_where_the_cache_needs_a_folder_is_named(tmp_path: Path) -> None:
    """A stray file named .tmp (or a file as the cache root) is one clear error, not a
    traceback: it names the file and the fix."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / ".tmp").write_text("stray")
    with pytest.raises(CacheError, match=r"\.tmp is a file.*fix: remove"):
        RunCache(tmp_path / "cache")
    (tmp_path / "plain").write_text("not a folder")
    with pytest.raises(CacheError, match=r"plain is a file.*--convergence-cache-dir"):
        RunCache(tmp_path / "plain")


READ_ONLY_CHECK = """
import sys
from pathlib import Path
from convergence.cache.store import RunCache
cache = RunCache(Path(sys.argv[1]))
assert cache.read_only
entry = cache.get(sys.argv[2])
assert entry is not None and (entry / "metrics.jsonl").is_file(), entry
with cache.claim(sys.argv[2]) as hit:
    assert hit.path == entry
with cache.claim("cd" + sys.argv[2][2:]) as miss:   # a miss: run locally, nothing stored
    assert miss.path is None
    assert miss.commit(Path(sys.argv[3])) == Path(sys.argv[3])
print("read-only ok")
"""


def test_a_read_only_cache_is_used_for_reading(tmp_path: Path) -> None:
    """A shared reference cache mounted read-only gives hits, and a miss stores nothing.

    As root (who may write anywhere, whatever the modes say) the cache is made read-only the
    way a cluster mounts a shared one: a read-only bind mount in a private mount namespace.
    That needs no other user and no path that another user can reach, so the test does not
    depend on where the checkout lives. Without root, modes 0555/0444 make it read-only."""
    root = tmp_path / "cache"
    RunCache(root).put(KEY, make_run(tmp_path / "run"))
    local = make_run(tmp_path / "local-run")
    argv = [sys.executable, "-c", READ_ONLY_CHECK, str(root), KEY, str(local)]
    if os.geteuid() == 0:
        # sh runs the check's argv ("$@", after the "sh" that becomes $0) once the bind mount
        # of the cache over itself is remounted read-only (EROFS, even for root).
        c = shlex.quote(str(root))
        argv = [
            "unshare",
            "-m",
            "sh",
            "-c",
            f'mount --bind {c} {c} && mount -o remount,ro,bind {c} && exec "$@"',
            "sh",
            *argv,
        ]
        chmod_back: list[Path] = []
    else:
        chmod_back = [root, *root.rglob("*")]
        for path in chmod_back:
            path.chmod(0o555 if path.is_dir() else 0o444)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    finally:
        for path in chmod_back:
            path.chmod(0o755 if path.is_dir() else 0o644)
    if (
        os.geteuid() == 0
        and proc.returncode != 0
        and "mount" in proc.stderr
        and "read-only ok" not in proc.stdout
        and not os.environ.get("CI")
    ):
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "read-only ok" in proc.stdout
    assert sorted(p.name for p in (root / "ab").iterdir()) == [KEY]
