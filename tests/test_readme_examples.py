"""The documentation's examples cannot rot: every code block of README.md and of the site's
how-to, explanation and home pages (docs/) is either run here, in a temporary folder at CPU
size, or named in SKIPPED with the reason and the test that covers it (the tutorial's blocks:
tests/test_docs_tutorial.py; the generated reference pages: tests/test_docs_site.py).

- TOML and Python examples become a user repository (the experiment files, the hook module,
  the marked Python test, the pyproject snippet); README's ``pytest -m convergence`` collects
  all of them there (``--collect-only``: the first example asks for 200 steps and 8 ranks).
- One tiny pair runs for real: README's minimal experiment ("Use it in your repository": your
  own TP hook in ``replace_tp`` mode) through README's ``pytest -m convergence
  --convergence-report report``, at 3 steps. Its run folders then feed ``convergence compare``
  and ``convergence export-golden`` exactly as README writes them.
- The built-in trainer's command line runs for 2 steps on one rank.
- Commands too slow to run here (the quick start through ``convergence run``) are parsed by
  the real argument parser, so a renamed flag fails.

Issue 24: "a docs test that runs every shell command and TOML example in README".
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from docs_blocks import fenced_blocks, indented_blocks

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("readme_examples")

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: The pages whose examples are checked here: README first, then the site's pages (the
#: tutorial has its own test, the reference pages are generated).
PAGES = [
    README,
    REPO / "docs" / "index.md",
    *sorted((REPO / "docs" / "how-to").glob("*.md")),
    *sorted((REPO / "docs" / "explanation").glob("*.md")),
]


def page_text() -> str:
    """Every checked page's text, one after the other."""
    return "\n\n".join(page.read_text(encoding="utf-8") for page in PAGES)


#: Commands that do not run here: the reason, and what covers them instead.
SKIPPED: dict[str, str] = {
    "pip install": "installing: tests/test_install_wheel.py builds a wheel and installs it with "
    "its extras syntax into a fresh venv",
    'pytest -m "not slow" --convergence-tier ci -n 2 --dist loadgroup': "the project's own suite: .ci/run runs this "
    "command (this test included)",
    "salloc": "needs a Slurm allocation: tests/test_slurm.py runs the Slurm launcher on a real "
    "one-node Slurm",
    "pytest -m convergence --convergence-launcher slurm": "needs a Slurm allocation: "
    "tests/test_slurm.py",
    "convergence calibrate": "minutes of calibration runs: tests/test_calibration.py runs "
    "`convergence calibrate debug --steps 4` (slow-marked) and, in CI, the file, selection and "
    "verdict paths it feeds",
}

#: Blocks that are output or a file tree, not something to run (matched on the first line).
NOT_EXAMPLES = (
    "e2e.toml::",
    "convergence/        the library",
    "pair                rep",  # README's matrix
    "layout     bug",  # README's selftest table
    "--8<--",  # a snippet of the pictures' run (docs/images, scripts/docs_images.py)
)


def code_blocks(text: str) -> list[tuple[str | None, str]]:
    """A page's code blocks as (language, text): fenced ones with their language, README's
    indented ones with None."""
    fenced: list[tuple[str | None, str]] = list(fenced_blocks(text))
    return fenced + [(None, block) for block in indented_blocks(text)]


def all_blocks() -> list[tuple[str | None, str]]:
    """The checked pages' blocks; a block that several pages show (the pyproject lines) once."""
    seen: dict[str, tuple[str | None, str]] = {}
    for page in PAGES:
        for lang, block in code_blocks(page.read_text(encoding="utf-8")):
            seen.setdefault(block, (lang, block))
    return list(seen.values())


def classify(blocks: list[tuple[str | None, str]]) -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = {"toml": [], "python": [], "shell": [], "other": []}
    kinds["toml_other"] = []
    for lang, block in blocks:
        first = block.splitlines()[0]
        if first.startswith(NOT_EXAMPLES) or lang == "text":
            kinds["other"].append(block)
        elif first == "# pyproject.toml" or (
            first.startswith("# experiments/") and ".toml" in first.split()[1]
        ):
            kinds["toml"].append(block)
        elif lang == "toml":
            kinds["toml_other"].append(block)  # a snippet of another file: it must parse
        elif lang == "python" or "import " in block or first.startswith("# my_project/"):
            kinds["python"].append(block)
        else:
            kinds["shell"].append(block)
    return kinds


def commands(shell_blocks: list[str]) -> list[str]:
    """One command per line (``\\`` continuations joined, ``&&`` split, comments dropped)."""
    out: list[str] = []
    for block in shell_blocks:
        for line in block.replace("\\\n", " ").splitlines():
            if line.lstrip().startswith("#"):
                continue
            line = re.sub(r"\s+#.*$", "", line).strip()
            out += [part.strip() for part in line.split("&&") if part.strip()]
    return out


def _skip_reason(command: str) -> str | None:
    return next((why for prefix, why in SKIPPED.items() if command.startswith(prefix)), None)


def _env(repo: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    # The ranks import the hook from the user repository; this checkout's code wins.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(repo)])
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=_env(cwd), capture_output=True, text=True, timeout=timeout
    )


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "pytest":
        return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *words[1:]]
    if words[0] == "convergence":
        return [
            sys.executable,
            "-c",
            "from convergence.cli import main; raise SystemExit(main())",
            *words[1:],
        ]
    return words


@pytest.fixture(scope="module")
def readme() -> dict[str, list[str]]:
    return classify(all_blocks())


@pytest.fixture(scope="module")
def user_repo(tmp_path_factory: pytest.TempPathFactory, readme: dict[str, list[str]]) -> Path:
    """The pages' TOML and Python examples, written where they say they live."""
    repo = tmp_path_factory.mktemp("readme_repo")
    experiments = 0
    for block in readme["toml"]:
        first = block.splitlines()[0]
        if first == "# pyproject.toml":
            (repo / "pyproject.toml").write_text(block)
            continue
        named = Path(first.split()[1])
        if len(named.parts) > 2:  # in a folder of its own (torchtitan's): exactly there
            path = repo / named
        else:
            experiments += 1  # examples share names (my_layouts.toml): keep each
            path = repo / "experiments" / f"readme_{experiments}.toml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(block)
    for block in readme["python"]:
        first = block.splitlines()[0]
        if first.startswith(("# my_project/", "# experiments/")):
            path = repo / first[2:].strip()
        else:
            path = repo / "readme_snippets" / f"snippet_{len(list(repo.rglob('*.py')))}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block)
    (repo / "my_project" / "__init__.py").touch()
    # README's pyproject has testpaths = ["tests"]: the repository's ordinary tests
    (repo / "tests").mkdir(exist_ok=True)
    (repo / "tests" / "test_plain.py").write_text("def test_plain():\n    pass\n")
    # The command-trainer example's train config and its `sources` (a trainer of yours)
    (repo / "my_trainer.toml").write_text("[training]\nsteps = 100\n")
    (repo / "train.py").write_text("")
    return repo


def _file_with(repo: Path, test_name: str) -> str:
    """The experiments/readme_N.toml that holds the test ``test_name`` (relative path)."""
    for path in sorted((repo / "experiments").glob("readme_*.toml")):
        if f'name = "{test_name}"' in path.read_text():
            return path.relative_to(repo).as_posix()
    raise AssertionError(f"no example experiment holds a test {test_name!r}")


def test_every_readme_block_is_known(readme: dict[str, list[str]]) -> None:
    """A new block must be classified; every example kind is present, and every TOML snippet
    of another file parses."""
    import tomllib

    assert len(readme["toml"]) >= 6 and len(readme["python"]) >= 4, readme
    assert len(readme["other"]) >= 4, readme["other"]
    for block in readme["toml_other"]:
        tomllib.loads(block)
    for command in commands(readme["shell"]):
        assert command.split()[0] in ("pytest", "pip", "salloc", "convergence", "torchrun"), (
            f"README command {command!r}: run it in tests/test_readme_examples.py or add it "
            f"to SKIPPED with the reason"
        )


def test_python_examples_compile(readme: dict[str, list[str]]) -> None:
    for block in readme["python"]:
        compile(block, "<README>", "exec")


def test_toml_examples_collect_in_a_testpaths_repository(
    user_repo: Path, readme: dict[str, list[str]]
) -> None:
    """README's ``pytest -m convergence`` in a repository made of README's examples: every
    experiment and the marked Python test are collected, none is an error."""
    assert "pytest -m convergence" in commands(readme["shell"])
    proc = _run(
        [*_argv("pytest -m convergence"), "--collect-only", "-q", "--convergence-devices", "8"],
        user_repo,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    layouts = _file_with(user_repo, "fsdp2-tp2-pp2")
    assert f"{layouts}::fsdp2-tp2-pp2" in out, out
    assert f"{layouts}::fsdp2-tp2-cp2" in out, out  # the sweep's grid
    assert f"{_file_with(user_repo, 'fsdp2-my-tp2')}::fsdp2-my-tp2" in out, out
    # every example experiment (the how-to pages' too: late bugs, your own trainer) collects
    for path in sorted((user_repo / "experiments").glob("readme_*.toml")):
        assert f"experiments/{path.name}::" in out, (path.name, out)
    assert "experiments/test_my_tp.py::test_my_tp[fsdp2-tp2]" in out, out
    # torchtitan's example as pasted (its train_config is the file itself): collected, and
    # skipped with the reason where torchtitan is not installed
    assert "experiments/torchtitan/my_layouts.toml::fsdp2-tp2-sp" in out, out


def test_a_plain_pytest_runs_no_readme_convergence_test(user_repo: Path) -> None:
    """Issue 36: README's marked Python example lived in `tests/` and ran its jobs in every
    plain `pytest`; where README puts it, only `-m convergence` reaches it."""
    proc = _run([*_argv("pytest"), "--collect-only", "-q"], user_repo)
    out = proc.stdout + proc.stderr
    assert "test_my_tp" not in out, out
    assert "my_layouts" not in out, out


def test_minimal_experiment_runs_and_its_runs_compare(
    user_repo: Path, readme: dict[str, list[str]]
) -> None:
    """The one real pair: README's minimal experiment with README's hook, 3 steps; then
    README's ``convergence compare`` and ``convergence export-golden`` on its run folders."""
    shell = commands(readme["shell"])
    command = "pytest -m convergence --convergence-report report"
    assert command in shell
    proc = _run(
        [*_argv(command), _file_with(user_repo, "fsdp2-my-tp2"), "--convergence-steps", "3"],
        user_repo,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    report = json.loads((user_repo / "report" / "report.json").read_text())
    (pair,) = report["pairs"]
    assert pair["name"] == "fsdp2-my-tp2" and pair["status"] == "passed", pair
    control, test = pair["control"]["run_dir"], pair["test"]["run_dir"]

    compare = next(c for c in shell if c.startswith("convergence compare RUN_A"))
    proc = _run(_argv(compare.replace("RUN_A", control).replace("RUN_B", test)), user_repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loss" in proc.stdout, proc.stdout

    export = next(c for c in shell if c.startswith("convergence export-golden"))
    proc = _run(_argv(export.replace("RUN_DIR", control)), user_repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    golden = json.loads((user_repo / "golden.json").read_text())
    assert golden and "loss" in json.dumps(golden)


def test_slow_cli_commands_parse(readme: dict[str, list[str]]) -> None:
    """``convergence run experiments/quickstart.toml`` trains 4 pairs (minutes): its words
    are parsed by the real parser, and its file exists."""
    from convergence.cli.app import build_parser

    parser = build_parser()
    run = next(c for c in commands(readme["shell"]) if c.startswith("convergence run"))
    args = parser.parse_args(shlex.split(run)[1:])
    assert (REPO / args.experiment).is_file(), run


def test_builtin_trainer_command_line(tmp_path: Path, readme: dict[str, list[str]]) -> None:
    line = next(c for c in commands(readme["shell"]) if c.startswith("torchrun"))
    assert "-m convergence.trainer --config debug" in line
    words = [w for w in shlex.split(line.replace("[--section.key=value ...]", ""))]
    words[words.index("N")] = "1"
    words += ["--training.steps=2", "--metrics.val_every=0", f"--metrics.dump_folder={tmp_path}"]
    argv = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    proc = _run(argv, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_every_command_is_run_or_skipped_with_a_reason(readme: dict[str, list[str]]) -> None:
    run_here = (
        "pytest -m convergence",
        "convergence run",
        "convergence compare",
        "convergence export-golden",
        "torchrun",
    )
    for command in commands(readme["shell"]):
        if _skip_reason(command):
            continue
        assert command.startswith(run_here), (
            f"README command {command!r} is neither run here nor in SKIPPED with a reason"
        )


def test_inline_convergence_commands_parse() -> None:
    """The ``convergence ...`` commands the pages name in running text (cache, nightly, record,
    trend, ab, report): each subcommand and flag exists in the real parser (optional parts in
    [brackets] included; DAYS, N and G are numbers)."""
    from convergence.cli.app import build_parser

    text = page_text()
    spans = {re.sub(r"\s+", " ", s) for s in re.findall(r"`(convergence [^`]+)`", text)}
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.choices and "run" in a.choices).choices
    checked = 0
    for span in sorted(spans):
        words = shlex.split(span.replace("[", " ").replace("]", " "))[1:]
        assert words[0] in subcommands, span
        if "--help" in words:
            continue  # every --help is in the generated reference (tests/test_docs_site.py)
        if len(words) == 1:
            continue  # the command's name in a sentence, its arguments elsewhere
        words = ["30" if w in ("DAYS", "N", "G") else w for w in words]
        words = ["debug" if w == "SOURCE" else w for w in words]
        parser.parse_args(words)
        checked += 1
    assert checked >= 8, spans
