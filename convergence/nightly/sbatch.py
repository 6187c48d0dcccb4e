"""The sbatch script of the nightly run: ``convergence nightly`` renders it from settings.

Why a rendered script rather than a Python driver inside the allocation: Slurm users read,
edit and resubmit batch scripts; one plain bash file (``scripts/nightly.sbatch`` is the
documented example, kept equal to the template by a test) shows every step a night takes, and
its exit status is pytest's, so Slurm marks a failing night FAILED.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from convergence.spec.errors import SpecError


@dataclass(frozen=True, kw_only=True)
class NightlySettings:
    """What ``convergence nightly`` puts into the sbatch script."""

    experiments: tuple[str, ...]
    """Experiment TOML files or folders, as pytest arguments (relative to ``rootdir``)."""
    out: str
    """Folder for the nights (``nights/<night>/``), Slurm output and ``history.jsonl``."""
    rootdir: str | None = "."
    """Where pytest runs (the project checkout); None: the folder ``sbatch`` was run from
    (``$SLURM_SUBMIT_DIR``), as for this repository's own scripts/nightly.sbatch."""
    history: str | None = None
    """History file; default ``<out>/history.jsonl``."""
    python: str = sys.executable
    nodes: int = 1
    time: str = "08:00:00"
    job_name: str = "convergence-nightly"
    partition: str | None = None
    gpus_per_node: int | None = None
    exclusive: bool = True
    """Whole nodes: the allocation's CPUs/GPUs all belong to the night's jobs (timings stay
    comparable across nights)."""
    sbatch_options: tuple[str, ...] = ()
    """Extra ``#SBATCH`` lines' options, e.g. ``--account=ml`` or ``--exclusive``."""
    pytest_args: tuple[str, ...] = ()
    """Extra pytest arguments, e.g. ``-n 4``."""
    decide_args: tuple[str, ...] = ()
    """Extra ``convergence decide`` arguments: ``--hook CMD``, ``--post URL``, ``--window N``."""
    calibrate: str | None = "debug"
    """What ``convergence calibrate --if-missing`` measures the noise floors on before pytest
    (a train config or an experiment file): only when no calibration matches the node's stack,
    so a night after a driver, CUDA, NCCL or torch upgrade recalibrates and the others cost
    nothing. None: no calibration step (the verdicts use the shipped CPU defaults, and say so)."""
    selftest: tuple[str, ...] = ()
    """Experiment files ``convergence selftest`` runs on every ``selftest_every_days`` (the
    suite's power on them, appended to ``<out>/power.jsonl``; ``convergence decide --power``
    flags a drop as drift). Empty: no selftest step."""
    selftest_every_days: float = 7.0
    reuse_controls: bool = False
    """Reuse cached control runs across nights. Off by default: each night re-runs its
    controls (``--convergence-refresh``), so the control's own curve shows the stack drifting
    (torch, CUDA, NCCL, drivers) night after night; the cache key covers the stack too, but
    only what it can see."""

    def __post_init__(self) -> None:
        if not self.experiments:
            raise SpecError(
                "no experiments given",
                key="--experiments",
                fix="pass experiment TOML files or folders",
            )
        if self.nodes < 1:
            raise SpecError("must be at least 1", key="--nodes", fix="use --nodes 1 or more")

    @property
    def history_path(self) -> str:
        return self.history or f"{self.out}/history.jsonl"


_HEADER = """\
#!/bin/bash
# Nightly loss-convergence run (pytest-convergence), written by `convergence nightly`.
#
#   sbatch {script}            # or: sbatch --begin=20:00 {script}; cron/scrontab for nightly
#
# Each night:
#   0. `convergence calibrate --if-missing` measures the noise floors when no calibration
#      matches this node's stack (GPU model, driver, CUDA/NCCL, torch): the first night and the
#      first after an upgrade; the verdicts then use them and say so.
#   1. pytest -m convergence --convergence-tier nightly --convergence-launcher slurm runs every
#      pair of the experiments below; each job is one `srun ... torchrun` step of this
#      allocation (a slice of a node, or whole nodes; rendezvous on its first node); controls
#      are re-run each night (--convergence-refresh) unless the script says otherwise; a pair
#      larger than the allocation is skipped with the reason. JUnit XML and
#      report.json/.md/.html + plots go to $OUT/nights/<night>/.
#   2. `convergence record` appends one line per pair (verdict, final loss delta, the
#      control's final loss, step time, tokens/s, peak memory) to the history file, even
#      when pairs failed.
#   3. `convergence trend` rewrites $OUT/trend/ (trend.md, trend.json, trend*.png with one
#      panel per pair, tensorboard/<pair>/) from the whole history, so the latest trend is
#      always next to the nights.
#   4. `convergence decide` compares tonight with the band of the last green nights (control
#      final loss, max |dloss|, step time, tokens/s, peak memory), writes
#      $OUT/trend/decision.md/.json and fires the notification hooks on a drift or a pair
#      that turned red.
#   5. The script exits with pytest's status, so Slurm marks a failing night as FAILED; when
#      pytest passed, with decide's: 10 drift, 11 a pair turned red.
#
# Edit the #SBATCH lines for your site (partition, account, GPUs), or regenerate with
#   convergence nightly --experiments ... --out ... [--partition P] [--gpus-per-node G] ...
"""

_BODY = """\
# A failing set-up step (cd, mkdir) ends the night here; from pytest on, each step's status
# is collected and none stops the others (set +e below).
set -euo pipefail

cd {rootdir}
OUT={out}
HISTORY={history}
PYTHON={python}
NIGHT="$(date -u +%Y%m%dT%H%M%SZ)-${{SLURM_JOB_ID:-nojob}}"
NIGHT_DIR="$OUT/nights/$NIGHT"
mkdir -p "$NIGHT_DIR"
export MPLBACKEND=Agg
# The commit this night tests (before anything can move HEAD): recorded per pair, so that a
# pair turning red gets a `convergence bisect LAST_GREEN THIS_COMMIT PAIR` line.
COMMIT="$(git rev-parse HEAD 2>/dev/null || true)"
{calibrate}
set +e
"$PYTHON" -m pytest -m convergence --convergence-tier nightly --convergence-launcher slurm \\
    --junitxml "$NIGHT_DIR/junit.xml" --convergence-report "$NIGHT_DIR/report" \\
    -p no:cacheprovider{refresh}{pytest_args} \\
    {experiments}
status=$?

if [ -f "$NIGHT_DIR/report/report.json" ]; then
    "$PYTHON" -m convergence.cli record "$NIGHT_DIR/report/report.json" "$HISTORY" \\
        --night "$NIGHT" --pytest-status "$status" --commit "$COMMIT" || status=$((status == 0 ? 3 : status))
else
    echo "no report.json for night $NIGHT (pytest exit status $status)" >&2
    status=$((status == 0 ? 3 : status))
fi{selftest}
if [ -f "$HISTORY" ]; then
    # the trend across every night so far; a failure here never hides the night's own status
    "$PYTHON" -m convergence.cli trend "$HISTORY" --out "$OUT/trend" \\
        || echo "trend report failed for night $NIGHT" >&2
    "$PYTHON" -m convergence.cli decide "$HISTORY" --out "$OUT/trend"{power}{decide_args}
    decided=$?
    case $decided in
        10|11) if [ "$status" -eq 0 ]; then status=$decided; fi ;;
    esac
fi
exit $status
"""


def _q(text: str) -> str:
    return shlex.quote(text)


def _workdir(pytest_args: tuple[str, ...]) -> str | None:
    """The ``--convergence-workdir`` among the pytest arguments, if any."""
    for i, arg in enumerate(pytest_args):
        if arg == "--convergence-workdir" and i + 1 < len(pytest_args):
            return pytest_args[i + 1]
        if arg.startswith("--convergence-workdir="):
            return arg.split("=", 1)[1]
    return None


def _calibrate_step(source: str | None, workdir: str | None) -> str:
    if source is None:
        return ""
    # Where the session looks for it: its --convergence-workdir (shared storage), else the
    # default <rootdir>/.convergence, which is calibrate's default from the rootdir too.
    where = f" --workdir {_q(workdir)}" if workdir else ""
    return (
        "\n# noise floors for this stack: measured once per stack, then reused (a failure leaves\n"
        "# the verdicts on the shipped defaults, which they say; it never stops the night)\n"
        f'"$PYTHON" -m convergence.cli calibrate --if-missing{where} {_q(source)} \\\n'
        '    || echo "convergence calibrate failed for night $NIGHT" >&2\n'
    )


def _selftest_step(settings: NightlySettings, workdir: str | None) -> str:
    if not settings.selftest:
        return ""
    where = f" --workdir {_q(workdir)}" if workdir else ""
    every = f"{settings.selftest_every_days:g}"
    return (
        f"\n\n# the suite's power on its own experiments, every {every} days: the shipped bugs\n"
        "# planted on each layout (`convergence selftest`); the rows go to $POWER and decide\n"
        "# flags a bug caught before and missed now (or caught later) as drift. A missed bug\n"
        "# never changes the night's status by itself.\n"
        'POWER="$OUT/power.jsonl"\n'
        f"for exp in {' '.join(_q(e) for e in settings.selftest)}; do\n"
        '    "$PYTHON" -m convergence.cli selftest "$exp" --launcher slurm'
        f'{where} --record-power "$POWER" \\\n'
        f'        --night "$NIGHT" --every-days {every} '
        '--json "$NIGHT_DIR/selftest-$(basename "$exp" .toml).json" \\\n'
        '        || echo "selftest of $exp: a bug missed or a false alarm (see its table)" >&2\n'
        "done"
    )


def render_sbatch(settings: NightlySettings, *, script_name: str = "nightly.sbatch") -> str:
    """The sbatch script for ``settings`` (a bash script with ``#SBATCH`` lines)."""
    lines = [_HEADER.format(script=script_name, history=settings.history_path)]
    sbatch = [
        f"--job-name={settings.job_name}",
        f"--nodes={settings.nodes}",
        "--ntasks-per-node=1",
        f"--time={settings.time}",
        f"--output={settings.out}/slurm-%j.out",
    ]
    if settings.partition:
        sbatch.append(f"--partition={settings.partition}")
    if settings.gpus_per_node:
        sbatch.append(f"--gpus-per-node={settings.gpus_per_node}")
    if settings.exclusive:
        sbatch.append("--exclusive")
    sbatch.extend(settings.sbatch_options)
    lines.extend(f"#SBATCH {opt}" for opt in sbatch)
    lines.append("")
    extra = "".join(f" {_q(a)}" for a in settings.pytest_args)
    lines.append(
        _BODY.format(
            rootdir=_q(settings.rootdir)
            if settings.rootdir is not None
            else '"${SLURM_SUBMIT_DIR:?submit this script from the checkout}"',
            out=_q(settings.out),
            history=_q(settings.history_path),
            python=_q(settings.python),
            pytest_args=extra,
            decide_args="".join(f" {_q(a)}" for a in settings.decide_args),
            refresh="" if settings.reuse_controls else " --convergence-refresh",
            calibrate=_calibrate_step(settings.calibrate, _workdir(settings.pytest_args)),
            selftest=_selftest_step(settings, _workdir(settings.pytest_args)),
            power=' --power "$POWER"' if settings.selftest else "",
            experiments=" ".join(_q(e) for e in settings.experiments),
        )
    )
    return "\n".join(lines)


def write_sbatch(settings: NightlySettings, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_sbatch(settings, script_name=str(path)))
    path.chmod(0o755)
    return path
