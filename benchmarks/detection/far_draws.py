"""The false-alarm rate of the anchored judge from dense anchors (issue 47's 1 % target), no
training: re-judge the far benchmark's saved curves (far.py ``--anchor-every 1``).

A pair of the false-alarm benchmark costs minutes, and 0 alarms in n pairs bound the rate at
1 - 0.025 ** (1 / n): 368 pairs for 1 %. Past step 10 the default verdict's judge is the
anchored check, whose evidence is a one-step gap per anchor -- one step from a control state,
so each anchor is a fresh draw. A control run with an anchor at *every* step therefore gives one
draw per step per layout for the price of one anchored job per layout, and from those dense
anchors disjoint series at the judge's spacing (AUTO_EVERY = 10) are pseudo-pairs: for a
60-step run the 5 anchors {k, k+10, ..., k+40}, k = 1..10, no anchor in two series (the real
pair's anchors 10..50 are the series k = 10).

Everything is judged by the library itself (convergence/stats/anchored.py
``anchored_verdict``): a pseudo-pair's verdict is the anchored verdict of its anchored steps
with its own twins' steps from the same anchors (bf16: the twin tolerance is a maximum over a
pair's anchors, so it must come from the series' own anchors, not from all 59), persistence
rule included; an anchor's share is that verdict for the anchor alone under the series'
tolerance (its largest |gap| / tolerance over metrics and parts).

    python benchmarks/detection/far_draws.py            # print the tables
    python benchmarks/detection/far_draws.py --write    # and replace them in BENCHMARKS.md

The assumption, stated with the tables: the states are along one control trajectory per
(config, seed), and draws from different states are treated as independent -- checked by the
rank correlation of the shares at consecutive anchors (lag 1) and at the series' spacing (lag
10).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats

sys.path.insert(0, str(Path(__file__).resolve().parent))  # far, far_judge

from far import CURVES, HELD_BACK
from far_judge import Group, clopper_pearson, judge_pair, load, trajectory_rules

from convergence.checks.anchored import AUTO_EVERY
from convergence.metrics.curve import Curve, RunMetrics
from convergence.stats.anchored import PERSISTENT_FRACTION, anchored_verdict

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "BENCHMARKS.md"
BEGIN, END = "<!-- draws:generated:begin -->", "<!-- draws:generated:end -->"
#: Whether the twins' confirming steps size the envelope beside their judged ones (``--envelope
#: judged``: the judged steps only, for the comparison).
TWINS_CONFIRMING_SIZE = True
#: Shares above these are counted for the tail (0.5: the persistence rule's fraction).
TAIL_LEVELS = (0.5, 0.75)
#: The tail fit uses the draws above this quantile.
TAIL_QUANTILE = 0.9


def anchors_of(anchored: RunMetrics) -> list[int]:
    """The anchors an anchored run started from (its logged step - 1)."""
    loss = anchored.get("loss") or next(iter(anchored.values()))
    return sorted(int(s) - 1 for s in loss.steps.tolist())


def pair_anchors(steps: int, every: int = AUTO_EVERY) -> int:
    """How many anchors the judge gives a pair of ``steps`` steps at spacing ``every``: the
    multiples of ``every`` below ``steps`` (60 steps: 10..50, 5 anchors)."""
    return (steps - 1) // every


def disjoint_series(anchors: Iterable[int], every: int, length: int) -> list[tuple[int, ...]]:
    """Series of ``length`` anchors ``every`` apart from the available ``anchors``, no anchor in
    two series: greedily from the smallest unused anchor (1..59 at 10 x 5: {1, 11, .., 41},
    {2, ..}, .., {10, .., 50}; 51..59 start no whole series and stay out)."""
    have = set(anchors)
    used: set[int] = set()
    out: list[tuple[int, ...]] = []
    for start in sorted(have):
        series = tuple(start + every * j for j in range(length))
        if all(a in have and a not in used for a in series):
            out.append(series)
            used.update(series)
    return out


def at_anchors(run: RunMetrics, anchors: Iterable[int]) -> RunMetrics:
    """An anchored run's steps after the given anchors only (anchor a: logged step a + 1)."""
    steps = np.asarray([a + 1 for a in anchors], np.int64)
    return {
        m: Curve(m, c.steps[np.isin(c.steps, steps)], c.values[np.isin(c.steps, steps)])
        for m, c in run.items()
    }


def with_confirming(group: Group, anchors: Sequence[int]) -> list[int]:
    """``anchors`` and, in the twin regime, each one's next anchor (whose step is the
    confirming step K+2 of a 2-step anchored job, but from the control's state K+1), where
    the dense run has it."""
    if group.regime != "twin":
        return list(anchors)
    have = set(anchors_of(next(iter(group.anchored.values())))) if group.anchored else set()
    return sorted({*anchors, *(a + 1 for a in anchors if a + 1 in have)})


@dataclass(frozen=True)
class PseudoPair:
    config: str
    seed: int
    precision: str
    layout: str
    anchors: tuple[int, ...]
    passed: bool
    shares: tuple[float, ...]
    """Each anchor's share of the series' one-step tolerance, in anchor order."""
    message: str


def judge_series(
    group: Group, layout: str, anchors: Sequence[int], every: int = AUTO_EVERY
) -> PseudoPair:
    """One pseudo-pair: the library's anchored verdict of the layout's steps from ``anchors``,
    the twins' steps from the same anchors sizing the tolerance; and each anchor's share."""
    rules = trajectory_rules(group.regime, update=True)  # the gating rules the judge uses
    controls = [group.control, *group.twins]
    # The twin regime's confirming step K+2 (stats/anchored.py CONFIRMING_STEP): here the
    # dense anchored runs' step from the control's state K+1, for the test and the twins.
    taken = with_confirming(group, anchors)
    sized = taken if TWINS_CONFIRMING_SIZE else anchors
    twins = [at_anchors(t, sized) for t in group.anchored_twins]
    test = at_anchors(group.anchored[layout], taken)
    verdict = anchored_verdict(
        rules, controls, test, every=every, anchored_twins=twins, anchors=anchors
    )
    shares = []
    for a in anchors:
        one = anchored_verdict(
            rules,
            controls,
            at_anchors(test, [a]),
            every=every,
            anchored_twins=twins,
            anchors=[a],
        )
        shares.append(float(one.details["max_ratio"]))
    return PseudoPair(
        group.config,
        group.seed,
        group.precision,
        layout,
        tuple(anchors),
        verdict.passed,
        tuple(shares),
        verdict.message,
    )


def pseudo_pairs(
    group: Group, every: int = AUTO_EVERY, first: int = AUTO_EVERY
) -> list[PseudoPair]:
    """The correct layouts' pseudo-pairs: disjoint series of the anchors from ``first`` on.
    Default 10, the judge's own first anchor: every anchor past TRAJECTORY_HORIZON, where the
    anchored check is the judge (60 steps: {10, .., 50}, {11, .., 51}, .., {19, .., 59});
    ``first = 1`` also takes the states of the first steps, which a real pair's anchors never
    see ({1, .., 41}, .., {10, .., 50})."""
    out = []
    length = pair_anchors(group.steps, every)
    for layout, pair in sorted(group.pairs.items()):
        if pair["kind"] != "correct" or layout not in group.anchored:
            continue
        anchors = [a for a in anchors_of(group.anchored[layout]) if a >= first]
        for series in disjoint_series(anchors, every, length):
            out.append(judge_series(group, layout, series, every))
    return out


def run_wide_shares(group: Group, layout: str, every: int = AUTO_EVERY) -> dict[int, float]:
    """Each dense anchor's share under one tolerance for the whole run (the twins' steps from
    all its anchors): for the correlation between anchors of different series only."""
    rules = trajectory_rules(group.regime, update=True)
    controls = [group.control, *group.twins]
    test = group.anchored[layout]
    out = {}
    for a in anchors_of(test):
        v = anchored_verdict(
            rules,
            controls,
            at_anchors(test, [a]),
            every=every,
            anchored_twins=group.anchored_twins,
            anchors=[a],
        )
        out[a] = float(v.details["max_ratio"])
    return out


def lag_correlation(shares: dict[int, float], lag: int) -> tuple[float, int]:
    """Spearman correlation of (share at a, share at a + lag) within one run; and n. Within a
    run, not pooled: pooled over layouts it would measure that one layout's shares sit higher
    than another's, not that one anchor's gap predicts the next."""
    x = [s for a, s in shares.items() if a + lag in shares]
    y = [shares[a + lag] for a in shares if a + lag in shares]
    if len(x) < 3:
        return math.nan, len(x)
    return float(scipy_stats.spearmanr(x, y).statistic), len(x)


def tail_fit(shares: Sequence[float]) -> tuple[float, float, float]:
    """Beyond the TAIL_QUANTILE quantile u: the exponential and the generalised Pareto fits of
    the excesses, each extrapolated to P(share > 1) = (1 - TAIL_QUANTILE) x P(excess > 1 - u);
    and the GPD's shape (> 0: a heavy tail). NaN where there are too few draws."""
    x = np.asarray(shares, np.float64)
    u = float(np.quantile(x, TAIL_QUANTILE))
    excess = x[x > u] - u
    if excess.size < 10 or u >= 1:
        return math.nan, math.nan, math.nan
    p_u = float(np.mean(x > u))
    expo = p_u * math.exp(-(1 - u) / float(excess.mean()))
    shape, _, scale = scipy_stats.genpareto.fit(excess, floc=0)
    gpd = p_u * float(scipy_stats.genpareto.sf(1 - u, shape, loc=0, scale=scale))
    return expo, gpd, float(shape)


#: Layouts whose one-step results are (nearly) the same draw: PP 1F1B and HSDP 2x2 agree at
#: most anchors to the last bit and differ elsewhere by a float32 rounding or so (BENCHMARKS.md
#: "dense anchors"): the stricter count takes them as one layout's draws.
AS_ONE = ("fsdp2-pp2-1f1b", "hsdp2x2")
AS_ONE_ROW = "all, PP 1F1B + HSDP as one"


def as_one(pps: Sequence[PseudoPair], layouts: Sequence[str] = AS_ONE) -> list[PseudoPair]:
    """The pseudo-pairs with those of ``layouts`` merged per (config, seed, precision, series):
    one pseudo-pair that fails if any of them fails, each anchor's share the largest of theirs
    (the conservative reading of "one draw")."""
    out: list[PseudoPair] = []
    merged: dict[tuple[str, int, str, tuple[int, ...]], list[PseudoPair]] = {}
    for p in pps:
        if p.layout in layouts:
            merged.setdefault((p.config, p.seed, p.precision, p.anchors), []).append(p)
        else:
            out.append(p)
    for (config, seed, precision, anchors), these in merged.items():
        worst = min(these, key=lambda p: (p.passed, -max(p.shares)))
        out.append(
            PseudoPair(
                config,
                seed,
                precision,
                "+".join(sorted(p.layout for p in these)),
                anchors,
                all(p.passed for p in these),
                tuple(max(s) for s in zip(*(p.shares for p in these), strict=True)),
                worst.message,
            )
        )
    return out


def table_cells(pps: Sequence[PseudoPair]) -> Iterator[tuple[str, str, list[PseudoPair]]]:
    """(precision, layout, its pseudo-pairs) for each row of the draw and pair tables: per
    precision each layout, then all of them together, then all with AS_ONE counted as one
    layout (where more than one of them is there)."""
    for precision in ("fp32", "bf16"):
        mine = [p for p in pps if p.precision == precision]
        for layout in [*sorted({p.layout for p in mine}), "all"]:
            these = [p for p in mine if layout in (p.layout, "all")]
            if these:
                yield precision, layout, these
        if len({p.layout for p in mine} & set(AS_ONE)) > 1:
            yield precision, AS_ONE_ROW, as_one(mine)


def draw_rows(pps: Sequence[PseudoPair]) -> list[str]:
    out = []
    for precision, layout, these in table_cells(pps):
        shares = [s for p in these for s in p.shares]
        over = sum(s > 1 for s in shares)
        upper = clopper_pearson(over, len(shares))[1]
        x = np.asarray(shares)
        tail = " | ".join(f"{np.mean(x > t):.3g}" for t in TAIL_LEVELS)
        expo, gpd, shape = tail_fit(shares)
        runs = len({(p.config, p.seed) for p in these})
        out.append(
            f"| {precision} | {layout} | {runs} | "
            f"{len(shares)} | {over} | {np.median(x):.3g} / {np.quantile(x, 0.99):.3g} / "
            f"{x.max():.3g} | {upper:.2%} | {tail} | {expo:.2g} / {gpd:.2g} (xi {shape:.2f}) |"
        )
    return out


DRAW_HEAD = [
    "| precision | layout | runs (config, seed) | one-step draws | share > 1 | share median / "
    "p99 / max | per-anchor rate, CP 95 % upper | P(share > 0.5) | P(share > 0.75) | tail fit "
    "P(share > 1): exponential / GPD (shape) |",
    "|---|---|---:|---:|---:|---|---:|---:|---:|---|",
]


def pair_rows(pps: Sequence[PseudoPair]) -> list[str]:
    out = []
    for precision, layout, these in table_cells(pps):
        alarms = sum(not p.passed for p in these)
        # outright: an anchor above its tolerance; else only the persistence rule failed it
        outright = sum(not p.passed and max(p.shares) > 1 for p in these)
        upper = clopper_pearson(alarms, len(these))[1]
        worst = max(max(p.shares) for p in these)
        # the persistence rule's margin: the largest second-largest share of two
        # consecutive anchors (both above 0.5 fails a twin rule's metric)
        pers = max(
            (min(a, b) for p in these for a, b in zip(p.shares[:-1], p.shares[1:], strict=True)),
            default=0.0,
        )
        said = f"{pers:.3g}" if precision == "bf16" else f"({pers:.3g}: no such rule)"
        out.append(
            f"| {precision} | {layout} | {len(these)} | {len(these[0].anchors)} | {alarms} "
            f"({outright} / {alarms - outright}) | "
            f"{alarms / len(these):.1%} | {upper:.2%} | {worst:.3g} | {said} |"
        )
    return out


PAIR_HEAD = [
    "| precision | layout | pseudo-pairs | anchors each | alarms (outright / persistence "
    "only) | rate | per-pair rate, CP 95 % "
    "upper | worst share | worst min share of two consecutive anchors (bf16 persistence rule: "
    f"> {PERSISTENT_FRACTION:g} on a metric fails) |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
]


def correlation_rows(groups: Sequence[Group]) -> list[str]:
    out = []
    for precision in ("fp32", "bf16"):
        runs = [
            run_wide_shares(g, layout)
            for g in groups
            if g.precision == precision
            for layout, pair in sorted(g.pairs.items())
            if pair["kind"] == "correct" and layout in g.anchored
        ]
        if not runs:
            continue
        cells = []
        for lag in (1, AUTO_EVERY):
            rhos = [r for r, n in (lag_correlation(run, lag) for run in runs) if not math.isnan(r)]
            if not rhos:
                cells.append("-")
                continue
            # under independence a run's rho is ~N(0, 1/(n-1)): |rho| > 2/sqrt(n-1) is rare
            n = min(len(run) for run in runs) - lag
            cells.append(
                f"{np.median(rhos):.2f} [{min(rhos):.2f}, {max(rhos):.2f}] "
                f"({sum(abs(r) > 2 / math.sqrt(n - 1) for r in rhos)} of {len(rhos)})"
            )
        out.append(f"| {precision} | {len(runs)} | " + " | ".join(cells) + " |")
    return out


CORRELATION_HEAD = [
    "| precision | runs (group x layout) | Spearman rho of consecutive anchors (lag 1): median "
    "[min, max] (runs with abs(rho) > 2/sqrt(n-1)) | the same at the series' spacing (lag 10) |",
    "|---|---:|---|---|",
]


def real_pair_rows(groups: Sequence[Group]) -> list[str]:
    """The same runs as whole pairs under today's default judge (far_judge.py
    "anchored-judge": the trajectories gate the first 10 steps, the anchors 10, 20, .. past
    them): what the pseudo-pairs leave out, the first steps' trajectory gate, is in these."""
    out = []
    for precision in ("fp32", "bf16"):
        judged = [
            j
            for g in groups
            if g.precision == precision
            for case, pair in sorted(g.pairs.items())
            # a pair whose run was an error (e.g. a job killed) is no pair: left out
            if pair["kind"] == "correct"
            and pair["status"] != "error"
            and (j := judge_pair(g, case, "anchored-judge"))
        ]
        if not judged:
            continue
        alarms = sum(j.status != "passed" for j in judged)
        worst = max((j.trajectory_worst for j in judged), default=math.nan)
        out.append(
            f"| {precision} | {len(judged)} | {alarms} | "
            f"{clopper_pearson(alarms, len(judged))[1]:.1%} | {worst:.2g} |"
        )
    return out


REAL_HEAD = [
    "| precision | real pairs | false alarms | per-pair rate, CP 95 % upper | worst first-10-step "
    "trajectory ratio |",
    "|---|---:|---:|---:|---:|",
]


def dense_groups(folder: Path = CURVES, configs: Sequence[str] = HELD_BACK) -> list[Group]:
    """The saved groups with an anchor at every step (far.py --anchor-every 1)."""
    out = []
    for path in sorted(folder.glob("*.json.gz")):
        if path.name.split("-", 1)[0] not in configs:
            continue
        group = load(path)
        if group.anchor_every == 1:
            out.append(group)
    return out


def key(group: Group, layout: str) -> tuple[str, int, str, str]:
    return group.config, group.seed, group.precision, layout


def real_pair_lines(groups: Sequence[Group]) -> list[str]:
    """The real pairs the default judge fails, one line each."""
    out = []
    for g in groups:
        for case, pair in sorted(g.pairs.items()):
            if pair["kind"] != "correct" or pair["status"] == "error":
                continue
            j = judge_pair(g, case, "anchored-judge")
            if j is not None and j.status != "passed":
                shares = ", ".join(f"{s:.2f}" for s in j.anchor_shares)
                out.append(
                    f"- {g.config}-{g.precision}-s{g.seed} {case}: {j.status} at step {j.first} "
                    f"({j.by}); anchor shares at 10..50: {shares}"
                )
    return out


def report(groups: Sequence[Group], alarms: bool = False) -> list[str]:
    pps = [p for g in groups for p in pseudo_pairs(g)]
    early = [p for g in groups for p in pseudo_pairs(g, first=1)]
    names = ", ".join(
        f"{g.config}-{g.precision}-s{g.seed}" for g in sorted(groups, key=lambda g: g.precision)
    )
    lines = [
        f"Groups (config-precision-seed, {len(groups)}): {names}.",
        "",
        "One-step draws (each anchor of a pseudo-pair; share = |gap| / the series' one-step "
        "tolerance, the largest over metrics and parts):",
        "",
        *DRAW_HEAD,
        *draw_rows(pps),
        "",
        f"Pseudo-pairs (disjoint series of anchors {AUTO_EVERY} apart, as many as a real pair "
        "of the run's length gets, from anchor 10 on; the library's anchored verdict, "
        "persistence rule included):",
        "",
        *PAIR_HEAD,
        *pair_rows(pps),
        "",
        "The same from anchor 1 on (series {k, .., k + 40}, k = 1..10: each takes one state of "
        "the first 10 steps, which a real pair's anchors never see):",
        "",
        *PAIR_HEAD,
        *pair_rows(early),
        "",
        "The same runs as real pairs (the default judge: first-10-step trajectories + anchors "
        "10..50):",
        "",
        *REAL_HEAD,
        *real_pair_rows(groups),
        "",
        *real_pair_lines(groups),
        "",
        "Independence check (each run's shares under one run-wide tolerance; the rank "
        "correlation within each run, not pooled):",
        "",
        *CORRELATION_HEAD,
        *correlation_rows(groups),
    ]
    short = [
        f"{g.config}-{g.precision}-s{g.seed} {layout} ({g.pairs[layout]['status']}: "
        f"{len(anchors_of(g.anchored[layout])) if layout in g.anchored else 0} anchored steps)"
        for g in groups
        for layout, pair in sorted(g.pairs.items())
        if pair["kind"] == "correct"
        and not [p for p in pps if (p.config, p.seed, p.precision, p.layout) == key(g, layout)]
    ]
    if short:
        lines += [
            "",
            "Left out (no whole series: the anchored run stopped short): " + "; ".join(short),
        ]
    failing = [p for p in pps if not p.passed]
    if failing and alarms:
        lines += ["", "Alarms (pseudo-pairs from anchor 10):", ""]
        lines += [
            f"- {p.config}-{p.precision}-s{p.seed} {p.layout} anchors {list(p.anchors)}: "
            f"{p.message}"
            for p in failing
        ]
    return lines


def write(lines: Sequence[str], path: Path = BENCHMARKS) -> None:
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folder", type=Path, default=CURVES)
    parser.add_argument("--configs", nargs="+", default=list(HELD_BACK))
    parser.add_argument("--alarms", action="store_true", help="list every pseudo-pair alarm")
    parser.add_argument("--write", action="store_true", help="replace the tables in BENCHMARKS.md")
    parser.add_argument("--envelope", choices=("both", "judged"), default="both")
    args = parser.parse_args()
    global TWINS_CONFIRMING_SIZE
    TWINS_CONFIRMING_SIZE = args.envelope == "both"
    groups = dense_groups(args.folder, args.configs)
    if not groups:
        print(f"no group with an anchor at every step in {args.folder}")
        return 1
    lines = report(groups, alarms=args.alarms)
    print("\n".join(lines))
    if args.write:
        write(lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
