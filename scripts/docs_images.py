"""Make the documentation's pictures from a real run of the tutorial (docs/tutorial.md).

    python scripts/docs_images.py

Writes the tutorial's project (the files its code blocks name) into a temporary folder, runs
its two pairs with pytest exactly as the tutorial says (CPU, gloo), and copies into
docs/images/:

- ``tutorial-matrix.txt``: the terminal matrix and the table by dimension, as printed;
- ``tutorial-buggy.png``: the buggy pair's plot; ``tutorial-heatmap.png``: the heatmap;
- ``tutorial-report-html.png``: report.html rendered by headless Chromium (only where
  Chromium is installed; the page then says the screenshot is absent).

Minutes on a 2-core CPU. Rerun it when the report's look changes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from docs_blocks import write_project  # noqa: E402 (tests/ is not a package)

IMAGES = REPO / "docs" / "images"


def matrix_text(out: str) -> str:
    """From the matrix's banner down to the by-dimension table's last row."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "convergence matrix" in line)
    end = next(i for i, line in enumerate(lines) if line.startswith("noise floors:"))
    return "\n".join(lines[start + 1 : end]) + "\n"


def screenshot(html: Path, png: Path) -> bool:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return False
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                f"--user-data-dir={profile}",
                f"--screenshot={png}",
                "--window-size=1200,1600",
                html.as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    return png.is_file()


def main() -> int:
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        write_project(REPO / "docs" / "tutorial.md", project)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(project), str(REPO)])}
        env["COLUMNS"] = "120"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-m",
                "convergence",
                "--convergence-report",
                "report",
            ],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if proc.returncode != 1:  # the buggy pair must fail, the correct one pass
            print(proc.stdout[-4000:], proc.stderr[-4000:])
            return 1
        (IMAGES / "tutorial-matrix.txt").write_text(matrix_text(proc.stdout))
        plots = project / "report" / "plots"
        shutil.copy(plots / "my_tp.toml_fsdp2-my-tp2-buggy.png", IMAGES / "tutorial-buggy.png")
        shutil.copy(plots / "heatmap.png", IMAGES / "tutorial-heatmap.png")
        shot = screenshot(project / "report" / "report.html", IMAGES / "tutorial-report-html.png")
        print(
            "written:",
            *sorted(p.name for p in IMAGES.iterdir()),
            "(no html screenshot: Chromium not installed)" if not shot else "",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
