"""The run spine stays a walk down, not back and forth (issue 25), and a job's effective train
config is worked out once.

The walk is benchmarks/pair_walk.py's trace: one real command-backend pair (a tiny script, two
direct launches) run through ``Runner.run_pair`` under ``sys.setprofile``; each file of
convergence/ is counted by the distinct call sites (caller file:line -> callee function) from
which control enters it from another file (value reads -- properties, ``len()`` -- are not
steps). The effective-config check runs collection, the device check and the runner's own
questions for a twin pair on the built-in trainer, with no launch.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from pair_walk import walk_one_pair  # noqa: E402

from convergence.backends import effective, get_backend  # noqa: E402
from convergence.preflight import load_checked, validate_devices  # noqa: E402
from convergence.regimes import get_regime  # noqa: E402
from experiments import builtin_pair  # noqa: E402

#: Entered from at most this many distinct call sites: once or twice, the issue's goal.
ONCE_OR_TWICE = 2

#: The files that need more, measured (benchmarks/pair_walk.py; BENCHMARKS.md "Pair walk"), and
#: why. None of these is back and forth: each is a sequence of different calls going down.
MORE: dict[str, tuple[int, str]] = {
    "backends/command.py": (
        11,
        "the Backend Protocol asks one question per method (the cache key's config text and "
        "version, the seed identity, the launch's entry, metrics path and format, stop file "
        "and launch mode, the curves, the metadata, the live record keys), each once per "
        "job; a third party implements the same methods",
    ),
    "run/jobs.py": (
        8,
        "the pair level (runner.py) on the job level it holds: the pair's view of it "
        "(reporting_to, the pair's printer), the session's job settings on each side, the "
        "pair folder's name, each side's backend, the controls' and the test's runs",
    ),
    "stats/_common.py": (
        8,
        "the comparisons' helper functions (incomplete, align, worst, first_true, the "
        "per-step check and tolerance), one call each from stats/paired_band.py; and the "
        "verdict on no compared step (uncompared) from stats/registry.py (a metric a run "
        "does not log) and the fingerprint's alignment from stats/fingerprint.py",
    ),
    "launch/process_tree.py": (
        4,
        "the launcher's process-tree tracker: made, polled, listed at the end, leftovers "
        "killed, and the pool's pid check",
    ),
    "metrics/jsonl.py": (
        4,
        "the live tail (made, polled, drained at the end) and the final read of the curves",
    ),
    "launch/watch.py": (3, "the job's watchdog: made, polled, finished"),
    "metrics/tags.py": (
        3,
        "the key-name map, resolved by the JSONL reader and the monitor, and the records "
        "assembled into curves",
    ),
    "calibration/select.py": (
        5,
        "the judge's calibration in force for the judgement (a context manager: made, "
        "entered, left), its label and JSON on each verdict (run/judge.py), the "
        "calibrated paired tolerance (stats/paired_band.py), and the early-stop monitor's "
        "calibration in force while its checks are built (stats/sequential.py)",
    ),
    "checks/registry.py": (
        3,
        "the pair as it runs (the Runner: as_run) and its checks (the Runner: checks_of, for "
        "their jobs; the judge: for their verdicts)",
    ),
    "stats/registry.py": (
        3,
        "the judge's comparisons and whether a verdict's method is calibrated (run/judge.py), "
        "the early-stop checks (stats/sequential.py)",
    ),
}


def test_a_pairs_walk_goes_down_and_enters_each_file_from_few_places(tmp_path: Path) -> None:
    outcome, walk = walk_one_pair(tmp_path, steps=3)
    assert outcome.status == "passed", outcome.error
    counts = walk.counts()
    assert len(counts) > 20  # the trace saw the whole walk: launcher, cache, metrics, stats
    # No callback or helper climbs back into a file that is still on the stack.
    assert walk.climbs == set()
    # The Runner's own file is entered once: from its caller, at run_pair.
    assert walk.entries["run/runner.py"] == {("<outside>", 0, "Runner.run_pair")}
    too_many = {f: n for f, n in counts.items() if n > MORE.get(f, (ONCE_OR_TWICE, ""))[0]}
    assert too_many == {}, walk.table()


def _twin_pair(folder: Path) -> Path:
    config = folder / "debug.toml"  # a copy: rewritten in place below
    config.write_text((ROOT / "train_configs" / "debug.toml").read_text())
    return builtin_pair(
        folder,
        file="twin.toml",
        steps=5,
        train_config=str(config),
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[
            {
                "name": "fsdp2-tp2-bf16",
                "parallelism": {"dp_shard": 2, "tp": 2},
                "techniques": {"param_dtype": "bfloat16"},
            }
        ],
    )


def test_the_effective_train_config_is_worked_out_once_per_job(tmp_path: Path) -> None:
    pair = load_checked(_twin_pair(tmp_path), rootdir=ROOT).pairs[0]
    assert pair.regime == "twin"
    # Collection (load_checked), the device check and the runner's questions (the regime's
    # control jobs: the twin derivation; each job's seed identity) all ask for it.
    validate_devices(pair, available_devices=8)
    backend = get_backend("builtin")
    jobs = (*get_regime(pair.regime).control_jobs(pair, backend), pair.test)
    # The control, its noise twin, the noise twin of the control with the test's numerics, the test.
    assert len(jobs) == 4
    for job in jobs:
        backend.seed_identity(job)
    assert {job: effective.computed["builtin", job] for job in jobs} == dict.fromkeys(jobs, 1)

    # The file rewritten in place is read again (its stamp is part of the key).
    config = Path(pair.control.train_config)
    config.write_text(config.read_text().replace("seq_len = 64", "seq_len = 128"))
    assert backend.tokens_per_step(pair.control) == 128 * 8 * 2
    assert effective.computed["builtin", pair.control] == 2
