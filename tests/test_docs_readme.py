"""What the docs promise is what the code does (issue 24): the key table names every spec key,
`--help` says what the CLI does, the numbers the pages quote are BENCHMARKS.md's, and the
hook's cache hash imports nothing. README is the front door; the content it had moved into the
site's pages (docs/), and each check reads the page that now holds it (issue 52). The
generated reference pages are compared with the code in tests/test_docs_site.py."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest

from convergence import docs
from convergence.cli.app import build_parser
from convergence.run.jobs import _hook_source_hash

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text(encoding="utf-8")
BENCHMARKS = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")


def page(name: str) -> str:
    """A page of the site, ``how-to/gpu.md``."""
    return (DOCS / name).read_text(encoding="utf-8")


def flat(text: str) -> str:
    """Whitespace as single spaces: a sentence may wrap anywhere."""
    return re.sub(r"\s+", " ", text)


#: Every page of the site (generated ones included) and README.
ALL_PAGES = "\n\n".join([README, *(p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md"))])


def test_an_undocumented_spec_key_fails_the_table() -> None:
    rows = [row for row in docs.key_rows() if "probe" not in row[1]]
    assert docs.undocumented(rows) == ["pair.probe_on_failure", "pair.probe"]
    assert docs.undocumented(docs.key_rows()) == []


def test_key_reference_names_every_pp_schedule_and_method() -> None:
    """Points 13-14: ZBVZeroBubble/DualPipeV, the twin method, probe and [experiment]."""
    table = page("reference/experiment-keys.md").split("## Default tolerances")[0]
    for word in (
        "ZBVZeroBubble",
        "DualPipeV",
        '"twin"',
        "`probe`",
        "`probe_on_failure`",
        "`[experiment]`",
    ):
        assert word in table, word


def _help(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return re.sub(r"\s+", " ", out.getvalue())


@pytest.mark.parametrize("command", ["run", "ab"])
def test_cli_workdir_help_says_what_the_cli_does(command: str) -> None:
    """Point 16: the CLI's workdir is ./.convergence, not pytest's rootdir."""
    text = _help(command)
    assert "./.convergence, in the folder you run it from" in text
    workdir_help = text.split("--workdir DIR ", 1)[1].split(" --", 1)[0]
    assert "rootdir" not in workdir_help, workdir_help


def test_ab_and_compare_help_say_what_their_workdir_and_runs_are() -> None:
    """Issue 52: `ab --help` said its --workdir holds a cache that ab never uses; `compare
    --help` named no golden file for B, which compare reads like A."""
    ab = _help("ab").split("--workdir DIR ", 1)[1].split(" --", 1)[0]
    assert "no run cache" in ab and "and cache" not in ab, ab
    compare = _help("compare")
    assert "test: run folder, TensorBoard folder, JSONL or golden" in compare, compare
    workdir = compare.split("--workdir DIR ", 1)[1]
    assert "calibration" in workdir and "and cache" not in workdir, workdir


def test_compare_reads_a_golden_file_as_b(tmp_path: Path) -> None:
    """What the help says: a golden file as the test side is judged like any run."""
    import json

    import numpy as np

    from convergence.cli import main
    from convergence.metrics.curve import Curve
    from convergence.metrics.golden import export_golden

    steps, values = [1, 2, 3], [3.0, 2.5, 2.2]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.json"
    a.write_text(
        "".join(
            json.dumps({"step": s, "loss": v}) + "\n" for s, v in zip(steps, values, strict=True)
        )
    )
    export_golden({"loss": Curve("loss", np.asarray(steps), np.asarray(values))}, b)
    rc = main(["compare", str(a), str(b), "--metric", "loss", "--workdir", str(tmp_path)])
    assert rc == 0


def test_compare_help_names_every_gating_metric_and_twin() -> None:
    """Point 15: grad_norm_parts, update_norm_parts and data_fingerprint gate too; twin is a
    regime."""
    text = _help("compare")
    assert "loss, grad_norm, grad_norm_parts, update_norm_parts, data_fingerprint gate" in text
    assert "twin (the envelope from the control's twin" in text
    assert "paired, twin or seed" in text


def _section(name: str) -> str:
    return BENCHMARKS.split(f"<!-- {name}:begin -->")[1].split(f"<!-- {name}:end -->")[0]


def test_benchmark_markers_are_balanced() -> None:
    """Point 19: every section BENCHMARKS.md's scripts rewrite has both markers."""
    begins = re.findall(r"<!-- ([\w-]+):begin -->", BENCHMARKS)
    ends = re.findall(r"<!-- ([\w-]+):end -->", BENCHMARKS)
    assert begins == ends and "progress-eta" in begins


def test_guarantees_page_quotes_benchmarks_numbers() -> None:
    """Points 11-12: the catalogue's size and results are BENCHMARKS.md's, per regime (the
    guarantees page holds what README said)."""
    text = flat(page("explanation/guarantees.md"))
    fp32 = _section("detection")
    caught = re.search(r"Detection rate: \*\*(\d+)/(\d+)\*\*", fp32)
    alarms = re.search(r"False-alarm rate: \*\*(\d+)/(\d+)\*\*", fp32)
    assert caught and alarms
    assert f"catalogue of {caught.group(2)} planted" in text
    assert f"**{caught.group(1)}/{caught.group(2)} bugs caught**" in text
    assert f"**{alarms.group(1)}/{alarms.group(2)} false alarms**" in text
    # The fp32 table's one bf16 pair ran in the seed regime; the page must not call it twin.
    assert re.search(r"\| bf16-fsdp2-tp2 \| fsdp2-tp2 \| 7 \| seed \|", fp32)
    assert "bf16 (twin regime)" not in text and "its bf16 pair ran in the seed regime" in text
    bf16 = _section("detection-bf16")
    twin_caught = re.search(r"Detection rate: \*\*(\d+/\d+)\*\*", bf16)
    twin_alarms = re.search(r"False-alarm rate: \*\*(\d+/\d+)\*\*", bf16)
    assert twin_caught and twin_alarms and "twin regime for bf16" in bf16
    assert f"**{twin_caught.group(1)}**" in text and f"**{twin_alarms.group(1)}** false" in text


def test_hook_example_in_hooks_py_replaces_tp() -> None:
    """Point 17: the worked example's hand-written TP plan (convergence/rank/hooks.py) must
    run in replace_tp mode."""
    import ast

    source = (REPO / "convergence" / "rank" / "hooks.py").read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source)) or ""  # read, not imported: torch costs seconds
    example = doc.split("# experiments/my_tp.toml", 1)[1]
    assert 'hook_mode = "replace_tp"' in example.split("\n\n", 1)[0]


def test_hook_source_hash_imports_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point 18: hashing a hook's source for the cache key runs no user code, not even its
    parent package's __init__ (importlib.util.find_spec would)."""
    pkg = tmp_path / "readme_hookpkg"
    (pkg / "sub").mkdir(parents=True)
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "sub" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "sub" / "mod.py").write_text("def fn(model, ctx):\n    return None\n")
    monkeypatch.chdir(tmp_path)
    digest = _hook_source_hash("readme_hookpkg.sub.mod:fn")
    assert digest is not None and len(digest) == 64
    assert not marker.exists(), "the hook's package was imported"
    assert "readme_hookpkg" not in sys.modules
    assert _hook_source_hash("readme_hookpkg.nope:fn") is None


def test_install_lines_do_not_assume_the_public_index() -> None:
    """Point 4: not on PyPI; installed from a clone or a wheel, extras written the same way."""
    assert not re.search(r'pip install\s+"?pytest-convergence', README)
    assert 'pip install "./pytest-convergence[xdist]"' in README
    assert "not on the public package index" in README


def test_readme_says_the_run_state_ignores_itself_and_points_the_right_way() -> None:
    """Point 5 and issue 52: the workdir writes its own .gitignore (README told users to add a
    line they do not need); the hook section is above its use."""
    for text in (flat(README), flat(page("how-to/experiments.md"))):
        assert "writes a `.gitignore` (`*`) into" in text, text
        assert ".convergence/ >> .gitignore" not in text
    assert "(see below)" not in README
    assert README.index("## Your own parallelism") < README.index("# your parallelism (see above)")


def test_security_model_names_who_is_trusted() -> None:
    """Point 20: the manifest detects damage, not a planted entry."""
    text = flat(page("explanation/security.md"))
    assert "detects a damaged or half-written entry, not a planted one" in text
    assert "anyone who can write the run cache folder" in text


def test_numerics_probe_is_for_jobs_with_a_probe_mode(tmp_path: Path) -> None:
    """Point 10: README scopes the probe to built-in and torchtitan jobs (the backends whose
    capabilities say probe), as wants_probe does: a command pair is never probed."""
    from convergence.regimes import REGISTRY
    from convergence.run.probe import wants_probe
    from convergence.spec.experiment import make_pair

    (tmp_path / "t.toml").write_text("")
    side = {
        "train_config": "t.toml",
        "backend": "command",
        "backend_options": {"command": ["train.py", "{dump_dir}"]},
        "parallelism": {"dp_shard": 2},
    }
    pair = make_pair(
        name="cmd",
        control=side,
        test=side,
        rootdir=tmp_path,
        source=str(tmp_path / "e.toml"),
        regimes=REGISTRY,
    )
    assert pair.regime == "paired" and not wants_probe(pair, "failed")
    text = flat(page("explanation/reading-the-verdict.md"))
    assert "runs when both sides are such jobs (`command` pairs get no localisation)" in text


def test_stale_sentences_of_issue_36_are_gone() -> None:
    """ab's --help names every gating metric; README's pointer to decide's summary points up
    (it is above); CHANGELOG says the twin envelope sums the twins, as the code does."""
    text = _help("ab")
    assert "loss and grad norm gating" not in text
    assert "per-part grad norm and data fingerprint gating" in text
    assert "decide`'s summary (below)" not in ALL_PAGES
    # the bisect page points at the nightly page's section that prints the command
    assert "## The trend decides" in page("how-to/slurm-nightly.md")
    assert "(slurm-nightly.md#the-trend-decides)" in page("how-to/bisect.md")
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "takes the farthest" not in changelog
    assert "--out nightly.sbatch" not in ALL_PAGES


def test_decide_shows_its_defaults() -> None:
    text = _help("decide")
    for default in ("(default 20)", "(default 5)", "(default 6)"):
        assert default in text, text
    nightly = page("how-to/slurm-nightly.md")
    assert "`--window 20`" in nightly and "`--k 6`" in nightly and "`--min-nights 5`" in nightly


def test_calibrate_takes_none_as_its_help_says() -> None:
    """`--bf16-layouts none` ("none: skip the twin") used to be rejected by argparse."""
    args = build_parser().parse_args(["calibrate", "debug", "--bf16-layouts", "none"])
    assert args.bf16_layouts == ["none"]  # cmd_calibrate drops it: no bf16 layouts
    args = build_parser().parse_args(["calibrate", "debug", "--fp32-layouts", "none"])
    assert args.fp32_layouts == ["none"]


#: typing names by the Python release that added them (after 3.10).
_TYPING_SINCE = {
    (3, 11): {
        "NotRequired",
        "Required",
        "Self",
        "LiteralString",
        "Never",
        "assert_never",
        "assert_type",
        "reveal_type",
        "dataclass_transform",
        "TypeVarTuple",
        "Unpack",
    },
    (3, 12): {"override", "TypeAliasType"},
    (3, 13): {"ReadOnly", "TypeIs", "NoDefault"},
}


def test_declared_python_is_what_the_code_needs() -> None:
    """Issue 52: pyproject declared Python >= 3.10 while report/data/records.py imports
    ``typing.NotRequired`` (3.11): the plugin could not import on 3.10. The declared floor,
    ruff's target, README's compatibility table and the typing names the code imports agree."""
    import ast
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    declared = project["project"]["requires-python"]
    assert declared.startswith(">="), declared
    floor = tuple(int(x) for x in declared[2:].split("."))
    assert project["tool"]["ruff"]["target-version"] == f"py{floor[0]}{floor[1]}"
    assert f"Python >= {floor[0]}.{floor[1]}" in README
    too_new = set().union(*(names for since, names in _TYPING_SINCE.items() if since > floor))
    for path in [
        *(REPO / "convergence").rglob("*.py"),
        *(REPO / "pytest_convergence").rglob("*.py"),
    ]:
        tree = ast.parse(path.read_text(encoding="utf-8"), feature_version=floor[:2])
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "typing":
                late = {a.name for a in node.names} & too_new
                assert not late, f"{path}: typing.{late} is newer than Python {declared}"
    assert "tomli" not in " ".join(project["project"]["dependencies"])


def test_readme_states_the_torch_floors_the_code_declares() -> None:
    """The quick start's torch floor and the compatibility table are pyproject's and the
    registry's (issue 36: README said torch >= 2.6, which the trainer cannot run on)."""
    import tomllib

    from convergence.backends.registry import TORCH_SERIES
    from convergence.spec.pp_schedules import TORCH_FLOORS as PP_FLOORS

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(d for d in deps if d.startswith("torch>="))[len("torch>=") :]
    assert f"any torch >= {floor} build works" in README
    table = README.split("### Compatibility", 1)[1].split("\n\n", 2)[1]
    assert f"torch >= {floor}" in table
    assert f"torch {TORCH_SERIES['torchtitan']['0.3']}.x" in table
    assert f"torch >= {PP_FLOORS['DualPipeV']}" in table
    # the site's compatibility page shows the same table
    assert table in page("reference/compatibility.md")


def test_the_paired_guarantee_states_the_codes_floors() -> None:
    """Issue 52: the guarantee said "2e-5 relative" for the paired regime while the loss's
    floor is absolute (atol x (1 + growth sqrt(step))) and the grad norm's relative plus an
    absolute floor. The sentence names the code's numbers, each in its kind."""
    from convergence.stats.paired_band import PAIRED_DEFAULTS

    text = flat(page("explanation/guarantees.md"))
    loss, grad = PAIRED_DEFAULTS["loss"], PAIRED_DEFAULTS["grad_norm"]
    assert PAIRED_DEFAULTS["grad_norm_parts"] == grad
    assert (
        f"absolute {loss.atol:.0e} x (1 + {loss.growth:g} sqrt(step)) plus {loss.rtol:.0e} of "
        "the loss" in text
    ), text
    assert (
        f"the global gradient norm by more than {grad.rtol:.0e} of its value plus an absolute "
        f"{grad.atol:.0e} x (1 + {grad.growth:g} sqrt(step))" in text
    ), text
    # its worked number: the loss's tolerance at step 30 for a loss of 6
    at_30 = loss.atol * (1 + loss.growth * 30**0.5) + loss.rtol * 6
    assert f"({at_30:.1e} at step 30 for a loss of 6)" in text, at_30
