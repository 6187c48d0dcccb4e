"""Re-judge the false-alarm benchmark's saved curves (far.py) under each rule, no training.

Rules (each applied to the same saved runs):

- ``old``: the verdict before issue 47 -- the trajectory rules (loss, grad norm, per-part grad
  norm, data fingerprint) of the regime, no update norm, no anchored check, no control health
  "reference unreliable";
- ``today``: today's default -- the trajectory rules with ``update_norm_parts``, control
  health's "reference unreliable" (an error, counted apart), and the automatic anchored check
  every 10 steps where the pair has >= 100 steps (TODAY_MIN_STEPS: not at 60 steps);
- ``today+a10``: today's rules with the anchored check every 10 steps at any length (what a
  60-step pair gets with ``anchor_every = 10``);
- ``anchored-judge``: the candidate (convergence/stats/anchored.py judged_from_anchors) -- the
  trajectory rules gate the first TRAJECTORY_HORIZON (10) steps only (where the runs have not
  separated), the anchored check every 10 steps judges "same function" over the whole run,
  the data fingerprint every step; ``anchored-judge/k<K>/e<N>``: its twin k and spacing.

A pair is a false alarm when a correct layout fails (status "failed"); "unreliable" (today's
health error) is counted apart. The rate's interval is Clopper-Pearson, 95 %, two-sided.
Beside it: the per-anchor share of the one-step tolerance (share = |gap| / tolerance, the
largest over the gating metrics and parts of an anchor) of the correct pairs, and the per-pair
rate it bounds (see ``share_rows``).

    python benchmarks/detection/far_judge.py                   # every saved group, the tables
    python benchmarks/detection/far_judge.py --configs a b c   # the tuning configs only
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as scipy_stats

sys.path.insert(0, str(Path(__file__).resolve().parent))  # far

from far import CURVES, HELD_BACK, TUNING

from convergence.checks.anchored import AUTO_EVERY
from convergence.metrics.curve import Curve, RunMetrics
from convergence.metrics.jsonl import read_jsonl, read_part_norms
from convergence.regimes import default_rules
from convergence.spec.pair import ComparisonRule
from convergence.stats.anchored import (
    CONFIRMING_STEP,
    TRAJECTORY_HORIZON,
    anchored_verdict,
    judged_from_anchors,
)
from convergence.stats.health import unreliable_from, unreliable_reference
from convergence.stats.registry import compare_all
from convergence.stats.types import MetricVerdict

RULES = ("old", "today", "today+a10", "anchored-judge")
#: "today": the automatic anchors' threshold as shipped when this benchmark began (5b1be20);
#: the chosen rule lowered it (convergence/checks/anchored.py AUTO_MIN_STEPS).
TODAY_MIN_STEPS = 100
#: Not a rule to choose: today's rules with the anchors the runs were collected with (every
#: 5), what the Runner itself judged then -- the re-judge is checked against it
#: (tests/test_far_judge.py).
AS_RUN = "as-run"


def metrics_of(rows: list[dict[str, Any]]) -> RunMetrics:
    """A saved run's rows as the library reads a metrics.jsonl (read_jsonl + part norms)."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
        path = Path(f.name)
    try:
        return {**read_jsonl(path), **read_part_norms(path)}
    finally:
        path.unlink()


def cut(run: RunMetrics, upto: int) -> RunMetrics:
    return {m: c.upto(upto) for m, c in run.items()}


def every_nth(run: RunMetrics, every: int, confirming: bool = False) -> RunMetrics:
    """An anchored run's steps after anchors at multiples of ``every`` only (the saved runs
    anchor more densely: an anchor every 10 is a subset of an anchor every 5); with
    ``confirming`` (the twin regime) each anchor's confirming step K+2 too
    (stats/anchored.py CONFIRMING_STEP) -- in a run with an anchor at every step, the step
    from the control's state K+1: as a 2-step anchored job's K+2 but for the one step of
    rounding its K+1 carries (the real pairs' own K+2: BENCHMARKS.md "The confirming step")."""
    out: RunMetrics = {}
    for m, c in run.items():
        keep = (c.steps - 1) % every == 0
        if confirming and every > 1:
            keep |= (c.steps - CONFIRMING_STEP) % every == 0
        out[m] = Curve(m, c.steps[keep], c.values[keep])
    return out


@dataclass
class Group:
    config: str
    seed: int
    precision: str
    steps: int
    anchor_every: int
    control: RunMetrics
    twins: list[RunMetrics]
    anchored_twins: list[RunMetrics]
    pairs: dict[str, dict[str, Any]]
    tests: dict[str, RunMetrics] = field(default_factory=dict)
    anchored: dict[str, RunMetrics] = field(default_factory=dict)
    source: str = "far"
    """"far" (this benchmark's runs) or "envelope" (issue 28's saved 60-step bf16 curves:
    loss, grad norm and per-part grad norm only, no anchored runs: the old rule only)."""

    def twins_every(self, every: int) -> list[RunMetrics]:
        """The anchored twins' steps after the anchors ``every`` apart (their one-step noise
        is a maximum over the anchors: the spacing judged must be the spacing sized by)."""
        return [every_nth(t, every, self.regime == "twin") for t in self.anchored_twins]

    @property
    def regime(self) -> str:
        return "twin" if self.twins else "paired"


def load(path: Path) -> Group:
    data = json.loads(gzip.decompress(path.read_bytes()))
    runs = data["runs"]
    control_names = sorted(n for n in runs if n.startswith("control-"))
    plain = [n for n in control_names if "twin" not in n]
    twins = [n for n in control_names if "twin" in n and "anchored" not in n]
    anchored_twins = [n for n in control_names if "twin" in n and "anchored" in n]
    # the noise twin first, then the forward-noise twin (the regime's order)
    order = sorted(twins, key=lambda n: "fwd" in n)
    a_order = sorted(anchored_twins, key=lambda n: "fwd" in n)
    group = Group(
        config=data["config"],
        seed=data["seed"],
        precision=data["precision"],
        steps=data["steps"],
        anchor_every=data["anchor_every"],
        control=metrics_of(runs[next(n for n in plain if "anchored" not in n)]),
        twins=[metrics_of(runs[n]) for n in order],
        anchored_twins=[metrics_of(runs[n]) for n in a_order],
        pairs=data["pairs"],
    )
    for case, pair in data["pairs"].items():
        tests = [n for n in pair["jobs"] if n.startswith(f"test-{case}-")]
        main = [n for n in tests if "-anchored-" not in n]
        side = [n for n in tests if "-anchored-" in n]
        if main:
            group.tests[case] = metrics_of(runs[main[0]])
        if side:
            group.anchored[case] = metrics_of(runs[side[0]])
    return group


#: Issue 28's saved bf16 curves of the tuning configs (60 steps, seeds 7-9: correct FSDP+TP,
#: +SP, +CP, +PP interleaved), on which the twin envelope was tuned.
ENVELOPE = sorted((CURVES.parent.parent / "envelope" / "curves").glob("[abc]-[789]*.json.gz"))


def _run_metrics(saved: dict[str, list[list[float]]]) -> RunMetrics:
    return {
        m: Curve(m, np.asarray(v[0], np.int64), np.asarray(v[1], np.float64))
        for m, v in saved.items()
    }


def load_envelope(path: Path) -> list[Group]:
    """One group per saved pair (each kept its own copy of the control group's curves)."""
    data = json.loads(gzip.decompress(path.read_bytes()))
    data.pop("_meta", None)
    out = []
    for case in data.values():
        if not isinstance(case, dict) or "error" in case or not case.get("twins"):
            continue
        name = case["case"]
        out.append(
            Group(
                config=case["config"],
                seed=case["seed"],
                precision="bf16",
                steps=len(case["control"]["loss"][0]),
                anchor_every=0,
                control=_run_metrics(case["control"]),
                twins=[_run_metrics(t) for t in case["twins"]],
                anchored_twins=[],
                pairs={name: {"kind": case["kind"]}},
                tests={name: _run_metrics(case["test"])},
                source="envelope",
            )
        )
    return out


@dataclass(frozen=True)
class Judged:
    status: str  # passed / failed / unreliable
    first: int | None
    by: str  # which verdict failed first ("-" when passed)
    anchor_shares: tuple[float, ...] = ()
    trajectory_worst: float = math.nan
    """The largest max |test - control| / tolerance of the gating trajectory verdicts (for
    the anchored judge: over its first TRAJECTORY_HORIZON steps): the trajectories' margin."""


def worst_ratio(verdicts: Sequence[MetricVerdict]) -> float:
    ratios = [
        float(v.details["max_ratio"])
        for v in verdicts
        if v.gate and v.metric not in ("anchored", "data_fingerprint") and "max_ratio" in v.details
    ]
    return max(ratios, default=math.nan)


def trajectory_rules(regime: str, *, update: bool) -> tuple[ComparisonRule, ...]:
    return tuple(
        r for r in default_rules(regime) if r.gate and (update or r.metric != "update_norm_parts")
    )


def _first_failure(verdicts: Sequence[MetricVerdict]) -> tuple[int | None, str]:
    failing = [v for v in verdicts if v.gate and not v.passed]
    if not failing:
        return None, "-"
    head = min(failing, key=lambda v: v.first_divergent_step or 10**9)
    return head.first_divergent_step, head.metric


def anchor_shares(
    group: Group, rules: Sequence[ComparisonRule], anchored: RunMetrics, every: int
) -> tuple[float, ...]:
    """Each anchor's share of its one-step tolerance: the anchored verdict of that anchor
    alone, its largest ratio over metrics and parts."""
    steps = sorted({int(s) for c in every_nth(anchored, every).values() for s in c.steps.tolist()})
    out = []
    controls = [group.control, *group.twins]
    twins = group.twins_every(every)
    for step in steps:
        one = {
            m: Curve(m, c.steps[c.steps == step], c.values[c.steps == step])
            for m, c in anchored.items()
        }
        v = anchored_verdict(rules, controls, one, every=every, anchored_twins=twins)
        out.append(
            float(v.details.get("max_ratio", max(v.details["max_ratio_by_metric"].values())))
        )
    return tuple(out)


def judge_pair(group: Group, case: str, rule: str) -> Judged | None:
    test = group.tests.get(case)
    if test is None or (group.source == "envelope" and rule != "old"):
        return None
    controls = [group.control, *group.twins]
    anchored = group.anchored.get(case)
    steps = group.steps
    if rule == "old":
        verdicts = compare_all(trajectory_rules(group.regime, update=False), controls, test)
        first, by = _first_failure(verdicts)
        return Judged(
            "failed" if by != "-" else "passed", first, by, trajectory_worst=worst_ratio(verdicts)
        )
    rules = trajectory_rules(group.regime, update=True)
    if rule in ("today", "today+a10", "as-run"):
        verdicts = list(compare_all(rules, controls, test))
        every = AUTO_EVERY if (rule == "today+a10" or steps >= TODAY_MIN_STEPS) else 0
        if rule == "as-run":  # what the Runner judged at collection: the saved spacing
            every = group.anchor_every
        shares: tuple[float, ...] = ()
        if every and anchored is not None:
            a = every_nth(anchored, every, group.regime == "twin")
            verdicts.append(
                anchored_verdict(
                    rules, controls, a, every=every, anchored_twins=group.twins_every(every)
                )
            )
            shares = anchor_shares(group, rules, anchored, every)
        first, by = _first_failure(verdicts)
        if by == "-":
            return Judged("passed", None, "-", shares, worst_ratio(verdicts))
        found = unreliable_from(
            group.control.get("grad_norm"),
            [t["grad_norm"] for t in group.twins if "grad_norm" in t],
        )
        status = "unreliable" if unreliable_reference(verdicts, found) else "failed"
        return Judged(status, first, by, shares, worst_ratio(verdicts))
    if rule.startswith("anchored-judge"):
        # "anchored-judge[/k<K>][/e<N>]": the twin rules' one-step k set to K (ONE_STEP_K
        # otherwise; the parts' k follows it, PART_K_FACTOR x K), anchors every N (10)
        options = dict((o[0], float(o[1:])) for o in rule.split("/")[1:])
        every = int(options.get("e", AUTO_EVERY))
        one_step = tuple(
            dataclasses.replace(r, z=options["k"]) if "k" in options and r.method == "twin" else r
            for r in rules
        )
        verdicts = list(compare_all(rules, controls, test))
        shares = ()
        if anchored is not None:
            one = anchored_verdict(
                one_step,
                controls,
                every_nth(anchored, every, group.regime == "twin"),
                every=every,
                anchored_twins=group.twins_every(every),
            )
            # the library's own demotion of trajectory failures past its horizon
            verdicts = [*judged_from_anchors(verdicts, one), one]
            shares = anchor_shares(group, one_step, anchored, every)
        first, by = _first_failure(verdicts)
        early = compare_all(
            rules,
            [cut(c, TRAJECTORY_HORIZON) for c in controls],
            cut(test, TRAJECTORY_HORIZON),
        )
        return Judged("failed" if by != "-" else "passed", first, by, shares, worst_ratio(early))
    raise ValueError(rule)


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    alpha = 1 - level
    low = 0.0 if k == 0 else float(scipy_stats.beta.ppf(alpha / 2, k, n - k + 1))
    high = 1.0 if k == n else float(scipy_stats.beta.ppf(1 - alpha / 2, k + 1, n - k))
    return low, high


def n_for_upper(target: float = 0.01, level: float = 0.95) -> int:
    """Pairs needed, all passing, for the upper end of the interval to reach ``target``."""
    n = 1
    while clopper_pearson(0, n, level)[1] > target:
        n += 1
    return n


def load_all(configs: Sequence[str], folder: Path = CURVES) -> list[Group]:
    return [load(p) for p in sorted(folder.glob("*.json.gz")) if p.name.split("-", 1)[0] in configs]


def correct_judged(groups: Sequence[Group], rule: str) -> list[Judged]:
    return [
        j
        for g in groups
        for case, pair in g.pairs.items()
        if pair["kind"] == "correct" and (j := judge_pair(g, case, rule)) is not None
    ]


def false_alarm_rows(groups: Sequence[Group], label: str) -> list[str]:
    """One row per precision and rule: n, false alarms, the rate and its interval."""
    out = []
    for precision in ("fp32", "bf16"):
        mine = [g for g in groups if g.precision == precision]
        for rule in RULES:
            judged = correct_judged(mine, rule)
            n = len(judged)
            if n == 0:
                continue
            k = sum(j.status == "failed" for j in judged)
            u = sum(j.status == "unreliable" for j in judged)
            low, high = clopper_pearson(k, n)
            configs = "".join(sorted({g.config for g in mine}))
            seeds = len({(g.config, g.seed) for g in mine})
            traj = [j.trajectory_worst for j in judged if not math.isnan(j.trajectory_worst)]
            shares = [s for j in judged for s in j.anchor_shares]
            out.append(
                f"| {label} | {configs} ({seeds} control groups) | {precision} | {rule} | {n} | "
                f"{k} | {k / n:.1%} | [{low:.1%}, {high:.1%}] | {u} | "
                f"{max(traj) if traj else math.nan:.2g} | "
                f"{max(shares) if shares else math.nan:.2g} |"
            )
    return out


FALSE_ALARM_HEAD = [
    "| part | configs | precision | rule | n pairs | false alarms | rate | 95 % CI "
    "(Clopper-Pearson) | unreliable (error, not counted) | worst trajectory ratio | worst "
    "anchor share |",
    "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|",
]


def share_rows(groups: Sequence[Group], label: str, anchors: int = 5) -> list[str]:
    """The per-anchor share of the one-step tolerance over the correct pairs (anchors every
    10), per precision and layout (each layout has its own rounding) and pooled ("all"): the
    count above 1, the per-anchor rate's upper end and the per-pair rate it bounds. (A
    log-normal tail fit was tried: with 5 draws a layout it gave nonsense, so none is shown.)"""
    out = []
    for precision in ("fp32", "bf16"):
        mine = [g for g in groups if g.precision == precision]
        layouts = sorted({c for g in mine for c, p in g.pairs.items() if p["kind"] == "correct"})
        for layout in [*layouts, "all"]:
            shares = [
                s
                for g in mine
                for case in g.pairs
                if g.pairs[case]["kind"] == "correct"
                and layout in (case, "all")
                and (j := judge_pair(g, case, "today+a10")) is not None
                for s in j.anchor_shares
            ]
            if not shares:
                continue
            over = sum(x > 1 for x in shares)
            # Each anchor is one draw of a one-step gap from a new state: N draws, k above 1,
            # bound the per-anchor rate (Clopper-Pearson); a pair of ``anchors`` anchors fails
            # with at most 1 - (1 - upper) ** anchors (independent draws assumed).
            upper = clopper_pearson(over, len(shares))[1]
            out.append(
                f"| {label} | {precision} | {layout} | {len(shares)} | {over} | "
                f"{float(np.median(shares)):.3g} / {max(shares):.3g} | {upper:.1%} | "
                f"{1 - (1 - upper) ** anchors:.0%} |"
            )
    return out


SHARE_HEAD = [
    "| part | precision | layout | anchors | share > 1 | share median / max | per-anchor rate, "
    "upper end (CP 95 %) | implied per-pair rate, upper end (5 anchors: 60 steps) |",
    "|---|---|---|---:|---:|---|---:|---:|",
]


def detection_rows(groups: Sequence[Group]) -> list[str]:
    out = []
    for g in groups:
        for case, pair in g.pairs.items():
            if pair["kind"] != "bug":
                continue
            start = int(case.rsplit("-from-", 1)[1]) if "-from-" in case else 1
            cells = []
            for rule in RULES:
                j = judge_pair(g, case, rule)
                if j is None:
                    cells.append("-")
                elif j.status == "passed":
                    cells.append("**missed**")
                else:
                    cells.append(f"{j.first} ({j.by})")
            out.append(
                f"| {g.config} | {g.precision} | {g.seed} | {case} | {start} | "
                + " | ".join(cells)
                + " |"
            )
    return out


def detection_head() -> list[str]:
    return [
        "| config | precision | seed | planted bug | starts at | " + " | ".join(RULES) + " |",
        "|---|---|---:|---|---:|" + "---|" * len(RULES),
    ]


def detection_summary(groups: Sequence[Group]) -> list[str]:
    """Per rule: bugs caught, and caught within the first quarter of the run (early bugs) or
    within 20 steps of their start (late ones)."""
    out = []
    for rule in RULES:
        caught = quarter = n = 0
        for g in groups:
            for case, pair in g.pairs.items():
                if pair["kind"] != "bug" or (j := judge_pair(g, case, rule)) is None:
                    continue
                n += 1
                start = int(case.rsplit("-from-", 1)[1]) if "-from-" in case else 1
                if j.status != "passed":
                    caught += 1
                    limit = g.steps // 4 if start == 1 else start + 20
                    quarter += j.first is not None and j.first <= limit
        if n:
            out.append(f"| {rule} | {n} | {caught} | {quarter} |")
    return out


def cost_rows(groups: Sequence[Group]) -> list[str]:
    """Per precision: the control group's jobs and the pairs' cost (wall and CPU seconds of
    the pair's job processes, the anchored job's wall time apart)."""
    out = []
    for precision in ("fp32", "bf16"):
        pairs = [
            (g, p)
            for g in groups
            if g.precision == precision and g.source == "far"
            for p in g.pairs.values()
        ]
        rest = [p for g, p in pairs if not any(n.startswith("control-") for n in p["jobs"])]
        first = [p for g, p in pairs if any(n.startswith("control-") for n in p["jobs"])]
        if not rest:
            continue
        cpu = float(np.mean([p["cpu_s"] for p in rest]))
        wall = float(np.mean([p["wall_s"] for p in rest]))
        anch = [p.get("anchored_wall_s") for p in rest if p.get("anchored_wall_s") is not None]
        test = [p.get("test_wall_s") for p in rest if p.get("test_wall_s") is not None]
        group_cpu = float(np.mean([p["cpu_s"] for p in first])) - cpu
        group_jobs = float(
            np.mean([sum(n.startswith("control-") for n in p["jobs"]) for p in first])
        )
        out.append(
            f"| {precision} | {len(rest)} | {wall:.0f} | {cpu:.0f} | "
            f"{np.mean(test) if test else float('nan'):.0f} | "
            f"{np.mean(anch) if anch else float('nan'):.0f} | {group_jobs:.0f} | {group_cpu:.0f} |"
        )
    return out


COST_HEAD = [
    "| precision | pairs (not the group's first) | pair wall s | pair CPU s | test job wall s "
    "| anchored job wall s | control-group jobs | control group CPU s (first pair minus a pair) |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
]


def main() -> int:
    global RULES
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--held-back",
        action="store_true",
        help="also the held-back configs (d, e): read them once, after the rule is chosen",
    )
    parser.add_argument("--folder", type=Path, default=CURVES)
    parser.add_argument("--pairs", action="store_true", help="one line per pair and rule")
    parser.add_argument(
        "--rules",
        nargs="+",
        help=f"rules to judge by (default {' '.join(RULES)}), e.g. anchored-judge/k3/e5",
    )
    args = parser.parse_args()
    if args.rules:
        RULES = tuple(args.rules)
    tuning = load_all(TUNING, args.folder)
    envelope = [g for path in ENVELOPE for g in load_envelope(path)]
    held = load_all(HELD_BACK, args.folder) if args.held_back else []
    if args.pairs:
        for g in [*tuning, *held]:
            for case, pair in g.pairs.items():
                cells = []
                for rule in RULES:
                    j = judge_pair(g, case, rule)
                    if j is None:
                        continue
                    share = f" {max(j.anchor_shares):.2g}x" if j.anchor_shares else ""
                    cells.append(f"{rule}={j.status}@{j.first}:{j.by}{share}")
                print(
                    f"{g.config} s{g.seed} {g.precision} {pair['kind']:7s} {case:34s} "
                    + " ".join(cells)
                )
    print("\nFalse alarms (correct layouts):\n")
    rows = [
        *false_alarm_rows(tuning, "tuning"),
        *false_alarm_rows(envelope, "tuning (issue 28's saved curves)"),
        *false_alarm_rows(held, "**held back**"),
    ]
    print("\n".join([*FALSE_ALARM_HEAD, *rows]))
    print(f"\npairs needed, all passing, for the upper end <= 1 %: {n_for_upper()}")
    print("\nPer-anchor share of the one-step tolerance (correct pairs, anchors every 10):\n")
    print(
        "\n".join([*SHARE_HEAD, *share_rows(tuning, "tuning"), *share_rows(held, "**held back**")])
    )
    print("\nPlanted bugs (first failing step, the verdict that failed first):\n")
    print("\n".join([*detection_head(), *detection_rows([*tuning, *held])]))
    print("\n| rule | bugs | caught | in the first quarter (late bugs: within 20 steps) |")
    print("|---|---:|---:|---:|")
    print("\n".join(detection_summary([*tuning, *held])))
    print("\nCost per pair:\n")
    print("\n".join([*COST_HEAD, *cost_rows([*tuning, *held])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
