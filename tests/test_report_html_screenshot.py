"""Render report.html in headless Chromium and check the screenshot is a real page.

Skipped when Chromium is not installed (``apt-get install -y chromium``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from report_examples import all_examples

from convergence.report import write_reports

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (apt-get install -y chromium)"
)


def _screenshot(html: Path, png: Path, profile: Path) -> None:
    assert CHROMIUM is not None
    argv = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--screenshot={png}",
        "--window-size=1280,2000",
        html.as_uri(),
    ]
    # Own process group: on a timeout the renderer/GPU helpers go too, not just the parent.
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("chromium did not finish the screenshot within 120 s")
    assert png.is_file(), out.decode(errors="replace")[-2000:]


def _has_colour(rgb: np.ndarray, hex_colour: str, min_pixels: int) -> bool:
    target = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]) / 255
    return int((np.abs(rgb - target).max(axis=-1) < 0.02).sum()) >= min_pixels


def test_html_renders_in_chromium(tmp_path: Path) -> None:
    paths = write_reports(all_examples(), tmp_path / "report", environment={})
    png = tmp_path / "shot.png"
    _screenshot(paths["html"], png, tmp_path / "profile")
    img = matplotlib.image.imread(png)
    assert img.shape[:2] == (2000, 1280)
    rgb = img[..., :3]
    q = (rgb * 255).astype(np.uint32)
    colours = np.unique((q[..., 0] << 16) | (q[..., 1] << 8) | q[..., 2])
    assert len(colours) > 200, "screenshot looks blank"
    # The matrix's verdict cells are painted: pass green, fail red, error amber.
    assert _has_colour(rgb, "#dafbe1", 200)
    assert _has_colour(rgb, "#ffebe9", 200)
    assert _has_colour(rgb, "#fff1c2", 200)
