"""The documentation site (docs/, mkdocs.yml; issue 52): its reference pages are the code's
own words, every page is in the menu, it builds with warnings as errors, README stays the
front door, and what the pages promise about the run folder holds with a real git."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "docs_reference", REPO / "scripts" / "docs_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_are_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regenerated from the code (every TOML key, pytest option and ini key, every CLI
    command's --help, report.json's schema), the pages are what is committed."""
    generator = _generator()
    monkeypatch.setenv("COLUMNS", generator.HELP_WIDTH)
    pages = generator.render_all()
    assert set(pages) == {"experiment-keys.md", "pytest-options.md", "cli.md", "report-json.md"}
    for name, text in pages.items():
        if name == "cli.md" and sys.version_info[:2] != generator.ARGPARSE_PYTHON:
            continue  # argparse lays --help out differently on other Pythons
        committed = (DOCS / "reference" / name).read_text(encoding="utf-8")
        assert committed == text, (
            f"docs/reference/{name} drifted from the code: run python scripts/docs_reference.py"
        )


def test_the_reference_names_every_option_and_subcommand() -> None:
    """What "generated" must cover: each option of the shared table, each subcommand."""
    from convergence.cli.app import build_parser
    from convergence.options import OPTIONS

    options = (DOCS / "reference" / "pytest-options.md").read_text(encoding="utf-8")
    for opt in OPTIONS:
        assert f"`--convergence-{opt.name}`" in options, opt.name
    assert "`convergence_paths`" in options
    cli = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    sub = next(a for a in build_parser()._actions if a.choices and "run" in a.choices)
    for name in sub.choices:
        assert f"## `convergence {name}`" in cli, name


def test_every_page_is_in_the_nav() -> None:
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:", 1)[1]
    listed = set(re.findall(r":\s+([\w/.-]+\.md)\s*$", nav, re.MULTILINE))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - listed == set(), (
        "add these pages to mkdocs.yml's nav (a topic page: a Topics section)"
    )
    assert listed - pages == set(), "nav entries without a page"


@pytest.mark.skipif(
    shutil.which("mkdocs") is None, reason='mkdocs not installed (pip install -e ".[docs]")'
)
def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "tutorial" / "index.html").is_file()


def test_readme_is_the_front_door() -> None:
    """At most ~250 lines: what it is, install, the quick start, your own parallelism, the
    cluster, links into the site (each link to a page that exists)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    for heading in ("## Quick start", "## Your own parallelism", "## Run it on a cluster"):
        assert heading in readme, heading
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert len(links) >= 20
    for link in links:
        assert (REPO / link).is_file(), link
    # the install line names the CPU index: PyPI's Linux torch wheel is the CUDA build
    sys.path.insert(0, str(REPO / ".ci"))
    try:
        from readme_commands import commands
    finally:
        sys.path.remove(str(REPO / ".ci"))
    install = commands(readme)["install"]
    assert "--index-url https://download.pytorch.org/whl/cpu" in install, install


def test_the_run_folder_keeps_itself_out_of_git(tmp_path: Path) -> None:
    """What README and the experiments page say: the first pair writes a .gitignore into the
    workdir, and git then ignores everything in it (a real git repository)."""
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    from pytest_convergence.execute import _ignore_in_git

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    work = tmp_path / ".convergence"
    _ignore_in_git(work)
    (work / "runs").mkdir()
    (work / "runs" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "kept.txt").write_text("x")
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert status.splitlines() == ["?? kept.txt"], status


def _hooks():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "mkdocs_hooks", REPO / "scripts" / "mkdocs_hooks.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pages_show_benchmarks_sections_that_exist() -> None:
    """The guarantees and late-bugs pages embed BENCHMARKS.md's measured tables at build time
    (scripts/mkdocs_hooks.py): every section they name exists, and a missing one fails."""
    hooks = _hooks()
    used = 0
    for page in DOCS.rglob("*.md"):
        text = page.read_text(encoding="utf-8")
        if hooks.INCLUDE.search(text):
            used += 1
            shown = hooks.on_page_markdown(text)
            assert "<!-- benchmarks:" not in shown and "|---|" in shown, page
    assert used >= 2
    shown = hooks.on_page_markdown("<!-- benchmarks:detection -->\n")
    assert "Detection rate: **" in shown and shown.startswith("### Verdict quality")
    with pytest.raises(ValueError, match="no section 'nope'"):
        hooks.on_page_markdown("<!-- benchmarks:nope -->\n")
