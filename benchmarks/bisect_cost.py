"""What `convergence bisect` costs on the built-in trainer (CPU/gloo, debug model): 8 commits of
a user's repository, the 5th plants a gradient bug in the test's parallelism hook.

Reported: pair runs, control runs executed (the control has no hook: its code is this
package's, so one run serves every commit), per-step wall time and the step the test stopped
at, against one full run of the same pair (no early stop, no cache) -- what each step would
cost without early stop and control reuse.

    python benchmarks/bisect_cost.py [--steps 30] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _report import REPO, machine, write_section

GOOD_HOOK = '''\
def apply(model, ctx):
    """A correct hook: changes nothing."""
    return None
'''
BAD_HOOK = '''\
def apply(model, ctx):
    """A planted bug: layer 0's MLP output weight gets twice its gradient."""
    linear = model.layers["0"].feed_forward.w2

    def add_second_weight_grad(module, args, output):
        extra = module.forward(args[0].detach())
        return output + (extra - extra.detach())

    linear.register_forward_hook(add_second_weight_grad)
'''


def experiment(steps: int) -> str:
    return textwrap.dedent(f"""
        [defaults]
        train_config = "{REPO}/train_configs/debug.toml"
        steps = {steps}
        seed = 11
        probe = "off"

        [control]
        name = "fsdp2"
        parallelism = {{ dp_shard = 2 }}

        [[test]]
        name = "fsdp2-hook"
        parallelism = {{ dp_shard = 2 }}
        hook = "my_hooks:apply"
    """)


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)
    return done.stdout.decode().strip()


def make_repo(folder: Path, steps: int) -> list[str]:
    repo = folder / "trainer"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "b@example.com")
    git(repo, "config", "user.name", "b")
    commits = []
    for i in range(1, 9):
        if i == 1:
            (repo / "exp.toml").write_text(experiment(steps))
            (repo / "my_hooks.py").write_text(GOOD_HOOK)
        elif i == 5:
            (repo / "my_hooks.py").write_text(BAD_HOOK)
        (repo / "notes.txt").write_text(f"{i}\n")
        git(repo, "add", ".")
        git(repo, "commit", "-q", "-m", f"c{i}")
        commits.append(git(repo, "rev-parse", "HEAD"))
    return commits


def cli(args: list[str], cwd: Path) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(cwd)])}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "convergence.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    return done.returncode, time.monotonic() - started, done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        commits = make_repo(folder, args.steps)
        repo = folder / "trainer"
        out_json = folder / "bisect.json"
        code, bisect_wall, text = cli(
            ["bisect", commits[0], "main", "exp.toml::fsdp2-hook"]
            + ["--workdir", str(folder / "work"), "--json", str(out_json)],
            repo,
        )
        print(text)
        if code != 1:
            raise SystemExit(f"bisect exited {code}")
        result = json.loads(out_json.read_text())
        # The reference: the same pair at BAD, run whole (no early stop) with a cold cache.
        code, full_wall, text = cli(
            ["run", "exp.toml", "--no-early-stop", "--workdir", str(folder / "full")], repo
        )
        if code != 1:
            raise SystemExit(f"full run exited {code}:\n{text}")
    steps = result["steps"]
    found = result["first_bad"] == commits[4]
    rows = [
        f"| {i} | {s['commit'][:10]} | {s['status']} | {s['first_divergent_step'] or ''} | "
        f"{s['stopped_early_at'] or args.steps} | "
        f"{'cache' if s['control_cached'] else 'ran'} | {s['wall_s']:.1f} |"
        for i, s in enumerate(steps, 1)
    ]
    controls = sum(1 for s in steps if s["control_cached"] is False)
    cached = [s["wall_s"] for s in steps if s["control_cached"]]
    reused = sum(cached) / len(cached) if cached else float("nan")
    body = "\n".join(
        [
            "## convergence bisect: cost of a bisection (benchmarks/bisect_cost.py)",
            "",
            f"Machine: {machine()}. `python benchmarks/bisect_cost.py --steps {args.steps}`: "
            "debug model, control FSDP(2) without a hook, test FSDP(2) with the user's hook "
            "`my_hooks:apply`; 8 commits, the 5th makes the hook double one weight's gradient.",
            "",
            "| # | commit | verdict | first divergent step | test ran to step | control | wall s |",
            "|---:|---|---|---:|---:|---|---:|",
            *rows,
            "",
            f"Found the planted commit: {found}; {len(steps)} pair runs, {controls} control "
            f"run(s) executed; bisect wall {bisect_wall:.1f} s in all (Python start-up and git "
            f"included). One full run of the pair (control + test to step {args.steps}, no "
            f"early stop, cold cache): {full_wall:.1f} s; the {len(steps)} steps took "
            f"{bisect_wall / full_wall:.1f}x that. A step with the control from the cache: "
            f"{reused:.1f} s on average, {reused / full_wall:.2f}x a full run (the first step "
            "also runs the control and the seed checkpoint). Other jobs share these cores: "
            "compare numbers of one run only.",
        ]
    )
    print(body)
    if not args.no_write:
        write_section("bisect-cost", body)


if __name__ == "__main__":
    main()
