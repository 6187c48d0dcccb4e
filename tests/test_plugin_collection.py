"""The plugin at collection time: options, marker, TOML items, errors, tiers, -m selection.

Nothing here launches a job (collection never does); the end-to-end runs are in
test_plugin_e2e.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from experiments import experiment_doc, write_toml

REPO = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = REPO / "train_configs" / "debug.toml"

EXPERIMENT = experiment_doc(
    defaults={"train_config": str(DEBUG_CONFIG), "steps": 8, "seed": 42},
    control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
    tests=[
        {"name": "fsdp2-tp2", "parallelism": {"dp_shard": 2, "tp": 2}},
        {"name": "fsdp2-nightly", "parallelism": {"dp_shard": 2, "tp": 2}, "tier": "nightly"},
    ],
)


def experiment() -> dict[str, Any]:
    """A fresh copy of EXPERIMENT to change."""
    return copy.deepcopy(EXPERIMENT)


PY_TEST = f"""
import pytest

@pytest.mark.convergence(train_config="{DEBUG_CONFIG}", steps=8)
def test_python_pair(convergence_pair):
    pass

def test_with_fixture_only(convergence_pair):
    pass

def test_plain():
    pass
"""


@pytest.fixture(scope="module", autouse=True)
def _warm_imports(tmp_path_factory: pytest.TempPathFactory) -> None:
    """In-process pytester runs forget the modules imported inside them, and C extensions
    (torch, numpy.fft) cannot be imported twice in one process: load an experiment here once,
    before any pytester snapshot, so every module collection needs is already imported."""
    import convergence.report
    import convergence.run.runner  # noqa: F401
    from convergence.launch.pool import detect_devices
    from convergence.preflight import load_checked, validate_devices

    path = write_toml(tmp_path_factory.mktemp("warm") / "exp.toml", EXPERIMENT)
    for pair in load_checked(path, rootdir=REPO).pairs:
        validate_devices(pair, available_devices=len(detect_devices().devices))


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini("[pytest]\n")
    write_toml(pytester.path / "experiments" / "exp.toml", EXPERIMENT)
    return pytester


def test_options_and_ini_keys_are_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    out = result.stdout.str()
    for flag in (
        "backend",
        "launcher",
        "devices",
        "steps",
        "cache-dir",
        "refresh",
        "report",
        "no-early-stop",
        "alpha",
        "tier",
        "workdir",
    ):
        assert f"--convergence-{flag}" in out
        assert f"convergence_{flag.replace('-', '_')} " in out
    assert "convergence_paths" in out


def test_marker_registered_under_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.convergence(steps=3)
        def test_marked():
            pass
    """)
    # Only the unknown-mark warning is made an error: in-process pytester under an xdist
    # worker may also warn that `convergence` was imported before assertion rewriting (a
    # fact of the test harness, not of the plugin).
    result = pytester.runpytest("--strict-markers", "-W", "error::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.convergence(**defaults): *"])


def test_toml_pairs_become_items_with_the_test_names(project: pytest.Pytester) -> None:
    result = project.runpytest("--collect-only", "-q", "--convergence-tier", "nightly")
    result.stdout.fnmatch_lines(
        ["experiments/exp.toml::fsdp2-tp2", "experiments/exp.toml::fsdp2-nightly"]
    )
    assert result.ret == 0
    # Nothing was launched: no run folders.
    assert not (project.path / ".convergence" / "runs").exists()


def test_higher_tiers_are_deselected_with_a_reason(project: pytest.Pytester) -> None:
    result = project.runpytest("--collect-only", "-q")
    out = result.stdout.str()
    assert "experiments/exp.toml::fsdp2-tp2" in out
    assert "fsdp2-nightly" not in out.split("convergence: deselected")[0]
    result.stdout.fnmatch_lines(
        [
            "*convergence: deselected 1 nightly pair(s) above "
            "--convergence-tier quick; run them with "
            "--convergence-tier nightly*",
            "*1 deselected*",
        ]
    )
    result = project.runpytest("--collect-only", "-q", "--convergence-tier", "ci")
    result.stdout.fnmatch_lines(["*1 deselected*"])


def test_tier_from_ini(project: pytest.Pytester) -> None:
    project.makeini("[pytest]\nconvergence_tier = nightly\n")
    result = project.runpytest("--collect-only", "-q")
    result.stdout.fnmatch_lines(["experiments/exp.toml::fsdp2-nightly"])
    assert "deselected" not in result.stdout.str()


def test_bad_ini_value_is_a_usage_error(project: pytest.Pytester) -> None:
    project.makeini("[pytest]\nconvergence_devices = many\n")
    result = project.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*convergence_devices*'many'*"])


def test_marker_selection(project: pytest.Pytester) -> None:
    project.makepyfile(test_api=PY_TEST)
    result = project.runpytest("--collect-only", "-q", "-m", "convergence")
    out = result.stdout.str()
    assert "experiments/exp.toml::fsdp2-tp2" in out
    assert "test_api.py::test_python_pair" in out
    assert "test_api.py::test_with_fixture_only" in out  # marked because it uses the fixture
    assert "test_plain" not in out
    result = project.runpytest("--collect-only", "-q", "-m", "not convergence")
    out = result.stdout.str()
    assert "test_api.py::test_plain" in out
    assert "exp.toml" not in out and "test_python_pair" not in out


def test_unknown_key_is_a_collection_error_naming_file_and_key(project: pytest.Pytester) -> None:
    bad = experiment()
    bad["test"][0]["parallelism"] = {"dp_shard": 2, "tensor_paralel": 2}
    write_toml(project.path / "experiments" / "exp.toml", bad)
    # The harness's own warning (in-process pytester: `convergence` imported before assertion
    # rewriting) names site-packages; the plugin's message must not.
    result = project.runpytest(
        "-m", "convergence", "-W", "ignore::pytest.PytestAssertRewriteWarning"
    )
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert "exp.toml" in out and "tensor_paralel" in out and "fix:" in out
    assert "nothing was launched" in out
    assert "Traceback" not in out and "site-packages" not in out
    assert not (project.path / ".convergence" / "runs").exists()


def test_malformed_toml_is_a_collection_error(project: pytest.Pytester) -> None:
    # Broken on purpose (an unclosed table header): a literal, not the TOML writer.
    (project.path / "experiments" / "broken.toml").write_text("[control\nname = 1\n")
    result = project.runpytest("--collect-only", "-q")
    result.stdout.fnmatch_lines(["*broken.toml*malformed TOML*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED  # collection errors stop the session


def test_too_few_devices_is_a_skip_naming_the_need_and_strict_makes_it_an_error(
    project: pytest.Pytester,
) -> None:
    # A pair this session cannot run never stops the others (a nightly in a small
    # allocation); the reason names what it needs and how to get it.
    result = project.runpytest("-m", "convergence", "-rs", "--convergence-devices", "2")
    result.assert_outcomes(skipped=1)
    out = result.stdout.str()
    assert "not runnable here" in out and "needs 4 CPU slots, this machine has 2" in out, out
    assert "--convergence-launcher slurm" in out and "--convergence-devices" in out
    assert not (project.path / ".convergence" / "runs").exists()
    strict = project.runpytest(
        "--collect-only", "-q", "--convergence-devices", "2", "--convergence-strict"
    )
    assert strict.ret == pytest.ExitCode.INTERRUPTED
    text = strict.stdout.str()
    assert "needs 4 CPU slots" in text and "key 'test.parallelism'" in text and "fix:" in text


def test_toml_outside_experiments_needs_convergence_paths(pytester: pytest.Pytester) -> None:
    write_toml(pytester.path / "pairs" / "mine.toml", EXPERIMENT)
    write_toml(pytester.path / "other.toml", {"not": "an experiment"})
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest("--collect-only", "-q")
    assert "mine.toml" not in result.stdout.str()
    pytester.makeini("[pytest]\nconvergence_paths = pairs\n")
    result = pytester.runpytest("--collect-only", "-q")
    result.stdout.fnmatch_lines(["pairs/mine.toml::fsdp2-tp2"])
    assert "other.toml" not in result.stdout.str()
    # Named on the command line, a TOML file is collected wherever it is.
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest("--collect-only", "-q", "pairs/mine.toml")
    result.stdout.fnmatch_lines(["pairs/mine.toml::fsdp2-tp2"])


def test_a_folder_named_on_the_command_line_collects_its_experiments(
    pytester: pytest.Pytester,
) -> None:
    """Issue 52: `pytest -m convergence some/folder/` collected nothing (rc 5, no hint) while
    README said files named on the command line are collected. A named folder collects the
    experiment files in it (nested too), by the rule of a listed folder: only files that
    declare themselves, so a train config or a torchtitan job config there is left alone."""
    write_toml(pytester.path / "some" / "folder" / "mine.toml", EXPERIMENT)
    write_toml(pytester.path / "some" / "folder" / "deeper" / "more.toml", EXPERIMENT)
    write_toml(pytester.path / "some" / "folder" / "train.toml", {"model": {"dim": 8}})
    write_toml(pytester.path / "elsewhere" / "other.toml", EXPERIMENT)
    pytester.makeini("[pytest]\n")
    for arg in ("some/folder/", "some/folder", "some"):
        result = pytester.runpytest("-m", "convergence", "--collect-only", "-q", arg)
        assert result.ret == 0, result.stdout.str()
        result.stdout.fnmatch_lines(
            ["some/folder/deeper/more.toml::fsdp2-tp2", "some/folder/mine.toml::fsdp2-tp2"],
            consecutive=False,
        )
        out = result.stdout.str()
        assert "train.toml" not in out and "other.toml" not in out, out


@pytest.mark.parametrize(
    ("extra", "key", "needs"),
    [
        ({"anchor_every": 10}, "anchor_every", "--convergence-steps 11"),
        ({"resume": {"at_step": 10}}, "resume.at_step", "--convergence-steps 11"),
    ],
)
def test_steps_override_below_the_anchors_is_a_collection_error(
    pytester: pytest.Pytester, extra: dict[str, Any], key: str, needs: str
) -> None:
    """Issue 52: `--convergence-steps 5` with `anchor_every = 10` was found after two jobs
    ran; it is a collection error naming the file, the key and the fix (nothing launched)."""
    doc = experiment()
    doc["test"] = [{**doc["test"][0], "steps": 40, **extra}]
    doc["control"]["steps"] = 40
    write_toml(pytester.path / "experiments" / "exp.toml", doc)
    pytester.makeini("[pytest]\n")
    ok = pytester.runpytest("-m", "convergence", "--collect-only", "-q")
    assert ok.ret == 0, ok.stdout.str()
    result = pytester.runpytest("-m", "convergence", "--convergence-steps", "5")
    out = result.stdout.str()
    assert result.ret == 2, out
    assert "nothing was launched" in out and "--convergence-steps 5" in out, out
    assert f".{key}" in out and needs in out and "exp.toml" in out, out
    assert " passed" not in out, out
    fine = pytester.runpytest("-m", "convergence", "--convergence-steps", "11", "--collect-only")
    assert fine.ret == 0, fine.stdout.str()


def test_fixture_rejects_bad_input_before_launching(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(f"""
        import pytest

        @pytest.mark.convergence(train_config="{DEBUG_CONFIG}", steps=8)
        def test_typo(convergence_pair):
            convergence_pair(control={{"parallelism": {{"dp_shard": 2}}}},
                             test={{"parallelism": {{"dp_shard": 2, "tensor_paralel": 2}}}})

        @pytest.mark.convergence(train_config="{DEBUG_CONFIG}", stepz=8)
        def test_bad_marker_key(convergence_pair):
            convergence_pair(control={{"parallelism": {{"dp_shard": 2}}}},
                             test={{"parallelism": {{"dp_shard": 2, "tp": 2}}}})
    """)
    result = pytester.runpytest("-m", "convergence")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "tensor_paralel" in out and "stepz" in out and "nothing was launched" in out
    assert not (pytester.path / ".convergence" / "runs").exists()


def test_xdist_auto_workers_from_devices_and_world_size(project: pytest.Pytester) -> None:
    # The largest job is fsdp2-tp2 (4 ranks): 8 devices give 2 workers.
    # (xdist does not distribute --collect-only: run a plain test, deselecting the pairs.)
    project.makepyfile("def test_plain():\n    pass\n")
    result = project.runpytest_subprocess(
        "-n",
        "auto",
        "-m",
        "not convergence",
        "--convergence-devices",
        "8",
        "-p",
        "no:cacheprovider",
    )
    result.stdout.fnmatch_lines(["*created: 2/2 workers*"])
    result.assert_outcomes(passed=1)


def test_this_repositorys_nightly_collects_in_a_small_allocation() -> None:
    # The shipped experiments hold 16- and 32-device pairs: in an 8-device session they are
    # skips naming what they need, and the night's other pairs still run (exit 0, no error).
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "convergence",
            "--convergence-tier",
            "nightly",
            "--convergence-devices",
            "8",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p
            ),
        },
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "error" not in done.stdout.splitlines()[-1], done.stdout[-500:]


@pytest.mark.parametrize(
    ("markexpr", "collected"),
    [
        ("convergence", True),
        ("convergence and not slow", True),
        ("not convergence", False),
        ("slow", False),
        ("not slow", False),
        (None, False),
    ],
)
def test_convergence_paths_outside_testpaths(
    pytester: pytest.Pytester, markexpr: str | None, collected: bool
) -> None:
    """Issue 24, trap 1: most repositories set ``testpaths = ["tests"]``; ``-m convergence``
    with no path must still collect what ``convergence_paths`` lists -- and a plain run or
    ``-m "not convergence"`` must not start visiting it."""
    pytester.makepyprojecttoml("""
        [tool.pytest.ini_options]
        testpaths = ["tests"]
        convergence_paths = ["experiments"]
        markers = ["slow: slow"]
        """)
    write_toml(pytester.path / "experiments" / "exp.toml", EXPERIMENT)
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_plain.py").write_text("def test_plain():\n    pass\n")
    args = ["--collect-only", "-q"] + ([] if markexpr is None else ["-m", markexpr])
    result = pytester.runpytest(*args)
    out = result.stdout.str()
    assert ("experiments/exp.toml::fsdp2-tp2" in out) is collected, out
    if markexpr in (None, "not convergence", "not slow"):
        assert "tests/test_plain.py::test_plain" in out, out
    # A path on the command line wins: only what it names.
    named = pytester.runpytest("--collect-only", "-q", "-m", "convergence", "tests")
    assert "exp.toml" not in named.stdout.str()


def test_a_train_config_in_a_convergence_paths_folder_is_left_alone(
    pytester: pytest.Pytester,
) -> None:
    """Issue 36: README recommends ``convergence_paths = ["experiments"]`` and a train config
    next to the experiment; a TOML file there that does not declare itself (no [control],
    [[test]] or [[sweep]]) is not collected (it used to be, and failed: "unknown key")."""
    pytester.makepyprojecttoml("""
        [tool.pytest.ini_options]
        testpaths = ["tests"]
        convergence_paths = ["experiments"]
        """)
    write_toml(pytester.path / "experiments" / "exp.toml", EXPERIMENT)
    (pytester.path / "experiments" / "my_train.toml").write_text("[model]\ndim = 64\n")
    (pytester.path / "tests").mkdir()
    result = pytester.runpytest("--collect-only", "-q", "-m", "convergence")
    out = result.stdout.str()
    assert result.ret == 0, out
    assert "experiments/exp.toml::fsdp2-tp2" in out, out
    assert "my_train.toml" not in out, out
