"""`convergence cache list|verify|prune` on a real cache folder."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from convergence.cache.store import RunCache
from convergence.cli import main

KEY_A = "aa" + "0" * 62
KEY_B = "bb" + "1" * 62


def _run(folder: Path, name: str) -> Path:
    (folder / "dump").mkdir(parents=True)
    (folder / "dump" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (folder / "job.json").write_text(json.dumps({"name": name}))
    return folder


@pytest.fixture
def cache(tmp_path: Path) -> RunCache:
    store = RunCache(tmp_path / "cache")
    store.put(KEY_A, _run(tmp_path / "a", "fsdp2 control"))
    store.put(KEY_B, _run(tmp_path / "b", "ddp2 control"))
    return store


def test_list_names_every_entry(cache: RunCache, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "list", "--cache-dir", str(cache.root)]) == 0
    out = capsys.readouterr().out
    assert "fsdp2 control" in out and "ddp2 control" in out
    assert "2 entries" in out


def test_verify_finds_a_damaged_entry_and_deletes_it_when_asked(
    cache: RunCache, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = cache.entry_dir(KEY_B) / "dump" / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 9.0}\n')  # same size, other bytes
    assert main(["cache", "verify", f"--cache-dir={cache.root}"]) == 1
    out = capsys.readouterr().out
    assert "corrupt " + KEY_B[:12] in out
    assert "checksum mismatch" in out and "1 of 2 entries verified" in out
    assert main(["cache", "verify", "--cache-dir", str(cache.root), "--delete"]) == 0
    assert not cache.entry_dir(KEY_B).exists() and cache.get(KEY_A) is not None


def test_prune_deletes_only_entries_unused_for_longer(
    cache: RunCache, capsys: pytest.CaptureFixture[str]
) -> None:
    old = time.time() - 10 * 86400
    os.utime(cache.entry_dir(KEY_A), (old, old))
    assert main(["cache", "prune", "--cache-dir", str(cache.root), "--older-than", "7"]) == 0
    assert "pruned 1 of 2 entries" in capsys.readouterr().out
    assert not cache.entry_dir(KEY_A).exists() and cache.get(KEY_B) is not None


def test_a_missing_cache_folder_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cache", "list", "--cache-dir", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "no run cache at" in err and "--convergence-cache-dir" in err
