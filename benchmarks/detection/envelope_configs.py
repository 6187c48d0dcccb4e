"""The twin envelope on model/data configs it was not tuned on (issue 28, parts 1-3).

Three train configs of our own (benchmarks/detection/envelope/: A the debug model on synthetic
Markov data, B a wider GQA model on byte-level text, C another size with longer sequences and a
lag-3 synthetic language), bf16 parameters with fp32 reduction on both sides (the GPU default),
60 steps, early stopping off so every curve is whole. Per config: the correct FSDP+TP, FSDP+TP+SP,
FSDP+CP and FSDP+PP(Interleaved1F1B) pairs and planted bugs of the detection catalogue; plus the
precision-changing pairs (fp32 control, bf16-reduce test: correct and with a bug).

Every curve -- control, each twin the regime runs (noise twin, forward-noise twin, the twin
with the test's numerics), test -- is saved (``--save``), so the verdict and its variants can
be recomputed without rerunning (``--load``). The table gives, per pair and gating metric, the
ratio max |test - control| / tolerance under the default envelope (> 1 fails) and the first
failing step, and the early gaps |Δ| at steps 1-3 of each twin and of the test.

    python benchmarks/detection/envelope_configs.py --configs a b c --seeds 7 --save /tmp/env.json
    python benchmarks/detection/envelope_configs.py --load /tmp/env.json --no-write
    python benchmarks/detection/envelope_configs.py --load benchmarks/detection/envelope/curves/*.json.gz

The curves behind BENCHMARKS.md's section are kept, gzipped, in envelope/curves/.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # catalogue, pairs, run
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _report

from _report import machine, write_section
from catalogue import ALL, BF16_REDUCE, PRECISION, Case
from run import as_bf16, run_cases

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule
from convergence.stats.twin_envelope import TWIN_DEFAULTS, TwinEnvelope, twin_tolerance

HERE = Path(__file__).resolve().parent
CONFIGS = {
    "a": HERE / "envelope" / "a_debug_synthetic.toml",
    "b": HERE / "envelope" / "b_wide_gqa_text.toml",
    "c": HERE / "envelope" / "c_long_lag_synthetic.toml",
}
METRICS = ("loss", "grad_norm", "grad_norm_parts")
CORRECT = ("fsdp2-tp2", "fsdp2-tp2-sp", "fsdp2-cp2", "fsdp2-pp2-interleaved1f1b")
BUGS = ("tp-rowwise-not-reduced", "fsdp-dp-rank-dropped", "cp-rope-ignores-offset")


def precision_cases(seed: int) -> list[Case]:
    """fp32 control; the test reduces its gradients (or computes) in bf16: the catalogue's
    precision-changing pairs, plus FSDP+TP with a bf16 reduction and the layout bugs of BUGS
    planted in a bf16-reduce test (the done-when's "the catalogue's bugs in a bf16-reduce test
    still fail": the test's own bf16 noise widens the envelope, so the weak bugs are the ones
    at risk)."""
    by_name = {c.name: c for c in ALL}
    bf16_reduce_bugs = [
        dataclasses.replace(
            by_name[n],
            name=f"{n}-bf16-reduce",
            techniques={**by_name[n].techniques, **BF16_REDUCE},
            seed=seed,
        )
        for n in BUGS
        if n != "fsdp-dp-rank-dropped"  # already in PRECISION
    ]
    return [
        *(dataclasses.replace(c, seed=seed) for c in PRECISION),
        Case(
            name="fsdp2-tp2-bf16-reduce",
            kind="correct",
            parallelism={"dp_shard": 2, "tp": 2},
            techniques=BF16_REDUCE,
            seed=seed,
        ),
        *bf16_reduce_bugs,
        # eager control, compiled test (inductor's fusions reorder float arithmetic): the
        # test's numerics differ, so its twin is the control run compiled
        Case(
            name="fsdp2-compile",
            kind="correct",
            parallelism={"dp_shard": 2},
            techniques=COMPILE,
            seed=seed,
        ),
        dataclasses.replace(
            by_name["fsdp-dp-rank-dropped"],
            name="fsdp-dp-rank-dropped-compile",
            techniques=COMPILE,
            seed=seed,
        ),
        # the same in bf16 on both sides (a GPU user's compile): control bf16 eager
        as_bf16(
            Case(
                name="fsdp2-compile-bf16",
                kind="correct",
                parallelism={"dp_shard": 2},
                techniques=COMPILE,
                seed=seed,
            )
        ),
    ]


COMPILE = {"compile": True}


def cases_for(seed: int, precision_pairs: bool, only_precision: bool = False) -> list[Case]:
    if only_precision:
        return precision_cases(seed)
    by_name = {c.name: c for c in ALL}
    out = [as_bf16(dataclasses.replace(by_name[n], seed=seed)) for n in (*CORRECT, *BUGS)]
    if precision_pairs:
        out += precision_cases(seed)
    return out


def _curves(run: Any) -> dict[str, list[list[float]]]:
    return {m: [c.steps.tolist(), c.values.tolist()] for m, c in run.items() if m in METRICS}


def collect(
    configs: list[str],
    seeds: list[int],
    steps: int,
    precision: bool,
    only_precision: bool = False,
    names: list[str] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in configs:
        for seed in seeds:
            cases = cases_for(seed, precision, only_precision)
            if names:
                cases = [c for c in cases if c.name in names]
            with tempfile.TemporaryDirectory(prefix="envelope-") as tmp:
                rows = run_cases(
                    cases, steps=steps, early_stop=False, work=Path(tmp), config=CONFIGS[key]
                )
            for row in rows:
                o = row.outcome
                name = f"{key}/{row.case.name}/seed{seed}"
                if o.control is None or o.test is None:
                    out[name] = {"kind": row.case.kind, "error": o.error}
                    continue
                out[name] = {
                    "config": key,
                    "case": row.case.name,
                    "kind": row.case.kind,
                    "seed": seed,
                    "status": o.status,
                    "control": _curves(o.control.metrics),
                    "twins": [_curves(t) for t in o.control.twins],
                    "test": _curves(o.test.metrics),
                }
    return out


def _curve(metric: str, data: list[list[float]]) -> Curve:
    return Curve(metric, np.asarray(data[0], np.int64), np.asarray(data[1], np.float64))


def judge(case: dict[str, Any], twins: str = "all") -> dict[str, Any]:
    """Recompute the default verdict from saved curves. ``twins``: "all" (the shipped
    envelope: every twin's noise summed), "max" (the noisiest twin at each step: the envelope
    before the sum, see envelope_candidates.py) or "dp" (the envelope before issue 28: the noise
    twin alone, no pooling of the next steps' gaps)."""
    if twins == "dp":
        saved = dict(TWIN_DEFAULTS)
        TWIN_DEFAULTS.update({m: dataclasses.replace(d, pool=0) for m, d in saved.items()})
        try:
            return _judge(case, twins)
        finally:
            TWIN_DEFAULTS.update(saved)
    return _judge(case, twins)


def _judge(case: dict[str, Any], twins: str) -> dict[str, Any]:
    result: dict[str, Any] = {"failed": False, "first": None, "ratios": {}, "early": {}}
    for metric in METRICS:
        if metric not in case["test"] or metric not in case["control"]:
            continue
        control = _curve(metric, case["control"][metric])
        test = _curve(metric, case["test"][metric])
        kept = case["twins"][:1] if twins == "dp" else case["twins"]
        twin_curves = [_curve(metric, t[metric]) for t in kept if metric in t]
        if twins == "max" and twin_curves:
            # One curve whose gap at each step is the largest twin's: the old construction.
            gap = np.max([np.abs(t.values - control.values) for t in twin_curves], axis=0)
            twin_curves = [Curve(metric, control.steps, control.values + gap)]
        rule = ComparisonRule(metric=metric, method="twin")
        verdict = TwinEnvelope().compare(rule, [control, *twin_curves], test)
        ratio = verdict.details.get("max_ratio")
        result["ratios"][metric] = ratio
        if not verdict.passed:
            result["failed"] = True
            step = verdict.first_divergent_step
            if step is not None and (result["first"] is None or step < result["first"]):
                result["first"] = step
        if metric == "loss":
            gaps = [np.abs(t.values[:3] - control.values[:3]) for t in twin_curves]
            result["early"] = {
                "test": np.abs(test.values[:3] - control.values[:3]).tolist(),
                "twins": [g.tolist() for g in gaps],
            }
            result["growth"] = [_growth(control.values, c.values) for c in (test, *twin_curves)]
    return result


def _growth(control: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """(mean loss |Δ| over steps 2-5, over steps 31-60): the early seed and its growth."""
    n = min(len(control), len(other))
    gap = np.abs(other[:n] - control[:n])
    return float(np.mean(gap[1:5])), float(np.mean(gap[30:60])) if n > 30 else float("nan")


def table(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    lines = [
        "| config | pair | kind | seed | loss ratio | grad norm ratio | parts ratio | "
        "verdict | first failing step | noisiest twin (before the sum) | before issue 28 | "
        "loss |Δ| steps 1/2/3: test ; twins | loss mean |Δ| steps 2-5 → 31-60: test ; twins |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---|---|---|---|",
    ]
    counts = {
        "correct": 0,
        "false_alarm": 0,
        "bug": 0,
        "caught": 0,
        "quarter": 0,
        "old_fa": 0,
        "max_fa": 0,
        "max_quarter": 0,
    }
    for name, case in data.items():
        if "error" in case:
            lines.append(f"| {name} | | {case['kind']} | | error: {case['error']} |")
            continue
        new, was, old = judge(case), judge(case, twins="max"), judge(case, twins="dp")
        kind = case["kind"]
        counts[kind] += 1
        if kind == "correct":
            counts["false_alarm"] += new["failed"]
            counts["max_fa"] += was["failed"]
            counts["old_fa"] += old["failed"]
            verdict = "**false alarm**" if new["failed"] else "pass"
        else:
            counts["caught"] += new["failed"]
            counts["quarter"] += new["failed"] and (new["first"] or 99) <= 15
            counts["max_quarter"] += was["failed"] and (was["first"] or 99) <= 15
            verdict = "caught" if new["failed"] else "**missed**"
        early = new["early"]
        fmt = lambda xs: "/".join(f"{x:.1e}" for x in xs)
        lines.append(
            f"| {case['config']} | {case['case']} | {kind} | {case['seed']} | "
            + " | ".join(
                f"{new['ratios'][m]:.2g}" if new["ratios"].get(m) is not None else "-"
                for m in METRICS
            )
            + f" | {verdict} | {new['first'] or '-'} | "
            + f"{'fail @' + str(was['first']) if was['failed'] else 'pass'} | "
            + f"{'fail' if old['failed'] else 'pass'} | "
            + f"{fmt(early.get('test', []))} ; "
            + " ; ".join(fmt(t) for t in early.get("twins", []))
            + " | "
            + " ; ".join(f"{a:.1e}→{b:.1e}" for a, b in new.get("growth", []))
            + " |"
        )
    return "\n".join(lines), counts


FINDINGS = """What the data say (seed 7 on all three configs; the other seeds in the tables above):

- The DP twin's forward pass is bit-identical to the control's: its loss gap is 0 at step 1 on
  every config, while TP, SP and CP already differ there. On the wide GQA text config (B) the
  TP/SP/CP gap over steps 2-5 is 1.6-2.1x the DP twin's, and chaos grows both by about the same
  factor (2-3x from steps 2-5 to 31-60): a larger initial perturbation, the same growth, as the
  issue supposed. Interleaved PP starts at the DP twin's size but grew faster (4.5x) on B. On A
  the layouts' early gap equals the DP twin's and nothing failed before issue 28; on C the TP
  pairs left the DP-only envelope late (step 49, 1.1-1.2x).
- The forward-noise twin (Backend.forward_twin) perturbs, at every step, the outputs of the
  layers another layout re-rounds (attention wo, FFN w2) by the bf16 unit roundoff: its early
  gap is 0.5-3x the layouts' and it grows like them. It is what lets C's TP pairs pass. A
  first version that perturbed every linear was 1.1-5x noisier than the layouts and delayed
  the CP rope bug from step 1 to 15 (A) and 16 (C); on wo/w2 it is caught at step 1 (A, B)
  and 4 (C), the row-wise bug at 12 (A), 1 (B), 9 (C), as with the DP twin alone (with the
  noisiest-twin envelope of that time; the summed one: below).
- bf16 reduce against an fp32 control: the control's twin measures fp32 noise (grad norm gap
  ~1e-7), three orders below the test's; the twin run with the test's numerics measures the
  bf16 reduction's, but at step 1 it landed 5x closer to the control than the test did (0.8x at
  step 3), and a ratio of two single draws is heavy-tailed. Pooling the next two steps' gaps
  into each step's noise (TwinDefaults.pool) fixed it without changing any bug's first failing
  step. The pooling is also what lets B's TP+SP (1.3x at step 9) and interleaved-PP (1.1x at
  step 1) pairs pass: the forward twin alone did not, so the two parts are both needed.
- Seed 8 does not follow seed 7's story. On B the layouts' early gap is 0.16-0.38x the DP
  twin's, but it grew 10-20x by steps 31-60 (the twins: 2.2-2.4x), and with the noisiest twin
  as the envelope the interleaved-PP pair left it at step 40 (loss, 1.4x); on C the TP and
  TP+SP pairs left it at step 43 (per-part grad norm 1.7x and 1.2x). The gap at one step is a
  heavy-tailed draw: on C the gaps of every run jump 10-100x together at a few steps (37, 43,
  55) and at step 43 the TP layout drew ~5x the noisiest twin's draw.
- The fix (envelope_candidates.py, section "Twin envelope constructions"): the envelope is k x
  the *sum* of the twins' running maxima, not the largest. Each twin isolates one source of
  rounding (reduction order; forward re-rounding; the test's precision) and a TP layout
  carries several at once; to first order perturbations superpose, so its gap is bounded by
  the sum. On seeds 7-8 it gave 0/31 false alarms with every bug by step 15 at the same k = 3;
  pooling more steps ahead, the twins' gaps to each other, and a growth floor (step/s)^alpha
  each left one config failing or moved a bug past step 15. Hold-out, seed 9 of A, B and C
  (collected after the choice, not retuned): 0/12 false alarms (the noisiest twin: 1/12, C's
  TP pair at step 46, 1.38x), 9/9 bugs by step 13. The same C TP pair reached 0.997 of the
  summed envelope (grad norm, step 46): it passes with no margin. The price: the row-wise bug,
  the least visible, fails at steps 12-14 instead of 5-12. On these curves the window of k
  with 0 false alarms and every bug by step 15 is ~1.2x wide for every construction tried:
  the sum is not a larger margin, it is a construction with a reason that puts k = 3 in it.
- Seed 8 of A (the four layouts and three bugs; collected a session after the sum was
  shipped, judged without retuning) completes three seeds on every config: 0/4 false alarms
  (worst 0.24), the row-wise bug at step 12, the others at 1-2. Over A, B and C at seeds 7-9
  the four layouts give 0/36 false alarms.
- bf16-reduce tests against an fp32 control: the correct pairs pass at seeds 7-9 and the
  dropped DP rank fails at step 1 through the wider envelope the test's own noise brings (the
  row-wise and CP rope bugs below); the whole catalogue planted in a bf16-reduce test is in
  "Verdict quality with a bf16-reduce test against an fp32 control" (16/16 caught).
- Eager against compiled (fp32; the test compiles each block with inductor on CPU, the twin is
  the control run compiled): on this model inductor's CPU kernels round as eager does to within
  1e-7 of loss over 60 steps, so the correct pair sits at 0.005 of its envelope at seeds 7-9 and
  the dropped-DP-rank bug in a compiled test fails at step 1. In bf16 (eager bf16 control,
  compiled bf16 test) inductor's fusions do move the curve: the loss gap at steps 1-3 is up to
  1.7e-4, and the pair would have failed at seeds 7-9 with the envelope before issue 28; with
  the twin compiled as the test is it passes at 0.27-0.31. A GPU compile (other fusions and
  reduction orders) will be noisier again; the twin with the test's numerics is what measures
  it there.
- The row-wise and CP rope bugs planted in a bf16-reduce test (A, seeds 7-9): caught at steps
  9/6/5 and 1/2/1, through the envelope widened by the test's own bf16 reduction.
"""


def seed_and_growth(data: dict[str, Any]) -> str:
    """Per config and correct bf16 layout: the early loss gap (mean |Δ| over steps 2-5) and its
    growth (mean over 31-60 / early), the test's against the DP twin's and the forward twin's:
    is the layout's initial perturbation larger, and does chaos grow it at the same rate?"""
    lines = [
        "| config | layout | seed | early gap: test / DP twin | growth: test | DP twin | "
        "fwd twin | fwd twin early / test early |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in data.values():
        if "error" in case or case["kind"] != "correct" or case["case"] not in CORRECT:
            continue
        control = np.asarray(case["control"]["loss"][1])
        test_g = _growth(control, np.asarray(case["test"]["loss"][1]))
        twin_g = [_growth(control, np.asarray(t["loss"][1])) for t in case["twins"]]
        if len(twin_g) < 2:
            continue
        lines.append(
            f"| {case['config']} | {case['case']} | {case['seed']} | "
            f"{test_g[0] / twin_g[0][0]:.2g} | {test_g[1] / test_g[0]:.2g} | "
            f"{twin_g[0][1] / twin_g[0][0]:.2g} | {twin_g[1][1] / twin_g[1][0]:.2g} | "
            f"{twin_g[1][0] / test_g[0]:.2g} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[7])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-precision", action="store_true", help="skip the fp32-control pairs")
    parser.add_argument("--only-precision", action="store_true", help="only the fp32-control pairs")
    parser.add_argument("--cases", nargs="*", help="only these pairs (catalogue names)")
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path, nargs="*")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--long", action="store_true", help="write the long-horizon section (runs of --steps)"
    )
    args = parser.parse_args()
    start = time.monotonic()
    if args.load:
        data: dict[str, Any] = {}
        metas = []
        for path in args.load:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            loaded = json.loads(raw)
            metas.append(loaded.pop("_meta", {}))
            data.update(loaded)
        meta = {
            "collect_min": sum(m.get("collect_min", 0.0) for m in metas),
            "machine": metas[0].get("machine", machine()) if metas else machine(),
            "notes": sorted({m["forward_twin"] for m in metas if "forward_twin" in m}),
        }
    else:
        data = collect(
            args.configs,
            args.seeds,
            args.steps,
            not args.no_precision,
            args.only_precision,
            args.cases,
        )
        meta = {"collect_min": (time.monotonic() - start) / 60, "machine": machine()}
        if args.save:
            raw = json.dumps({**data, "_meta": meta}).encode()
            args.save.write_bytes(gzip.compress(raw) if args.save.suffix == ".gz" else raw)
    text, counts = table(data)
    body = "\n\n".join(
        (
            "## Twin envelope on other models (benchmarks/detection/envelope_configs.py)",
            f"Machine: {meta['machine']} (2 cores shared with other jobs). Configs in "
            "benchmarks/detection/envelope/: A debug model on synthetic Markov data; B dim 128, "
            "8 heads / 2 kv heads (GQA) on byte-level text (Python stdlib sources); C dim 96, "
            "6 / 2 heads, seq_len 128, lag-3 synthetic language. bf16 params, fp32 reduce, "
            f"{args.steps} steps, early stopping off; control FSDP(2). Ratio = max over steps "
            "of |test - control| / tolerance under the default envelope (> 1 fails): k x the "
            "sum over the twins of each one's running max |twin - control| (noise twin "
            "FSDP(4), forward-noise twin, and for precision-changing pairs the noise twin run "
            "with the test's numerics). 'noisiest twin': the same curves judged with the "
            "largest twin gap at each step instead of the sum (the envelope before this "
            "change); 'before issue 28': with the noise twin alone and no pooling of the next "
            "steps' gaps. Seed 9 of A, B and C is the hold-out: collected after the sum was chosen "
            "on seeds 7-8 (benchmarks/detection/envelope_candidates.py), judged without "
            "retuning; so is seed 8 of A (collected a session later).",
            f"Correct pairs: **{counts['false_alarm']}/{counts['correct']}** false alarms "
            f"(noisiest twin: {counts['max_fa']}/{counts['correct']}; before issue 28: "
            f"{counts['old_fa']}/{counts['correct']}). Planted bugs: "
            f"**{counts['caught']}/{counts['bug']}** caught, {counts['quarter']} of them by "
            f"step 15 (first quarter; noisiest twin: {counts['max_quarter']}). "
            f"Collection: {meta['collect_min']:.1f} min."
            + "".join(f" Forward twin: {note}." for note in meta.get("notes", [])),
            text,
            "Where the layouts' extra noise comes from (loss; early = mean |Δ| over steps 2-5, "
            "growth = mean |Δ| over steps 31-60 / early):",
            seed_and_growth(data),
            FINDINGS,
        )
    )
    if args.long:
        body = long_horizon(data, meta, text, counts)
    print(body)
    if not args.no_write:
        write_section("twin-envelope-long" if args.long else "twin-envelope-configs", body)
    return 0


def windows(data: dict[str, Any], width: int = 50) -> str:
    """Per pair: the worst ratio |test - control| / tolerance in each window of steps (all
    gating metrics), so a late false alarm or a late loss of power shows where it happens."""
    lines: list[str] = []
    for case in data.values():
        if "error" in case:
            continue
        worst: dict[int, float] = {}
        for metric in METRICS:
            control = _curve(metric, case["control"][metric])
            test = _curve(metric, case["test"][metric])
            twins = [_curve(metric, t[metric]) for t in case["twins"] if metric in t]
            tol = twin_tolerance(ComparisonRule(metric=metric, method="twin"), control, twins)
            n = min(len(control.values), len(test.values))
            ratio = np.abs(test.values[:n] - control.values[:n]) / tol.at(
                control.steps[:n], control.values[:n]
            )
            for start in range(0, n, width):
                w = start // width
                worst[w] = max(worst.get(w, 0.0), float(np.nanmax(ratio[start : start + width])))
        if not lines:
            heads = [f"steps {w * width + 1}-{(w + 1) * width}" for w in sorted(worst)]
            lines = [
                "| config | pair | seed | kind | " + " | ".join(heads) + " |",
                "|---|---|---:|---|" + "---:|" * len(heads),
            ]
        lines.append(
            f"| {case['config']} | {case['case']} | {case['seed']} | {case['kind']} | "
            + " | ".join(f"{worst[w]:.2g}" for w in sorted(worst))
            + " |"
        )
    return "\n".join(lines)


def long_horizon(
    data: dict[str, Any], meta: dict[str, Any], text: str, counts: dict[str, int]
) -> str:
    steps = max(len(c["control"]["loss"][0]) for c in data.values() if "error" not in c)
    firsts = [judge(c)["first"] for c in data.values() if "error" not in c and c["kind"] == "bug"]
    return "\n\n".join(
        (
            "## Twin envelope, long horizon (benchmarks/detection/envelope_configs.py --long)",
            f"Machine: {meta['machine']} (2 cores shared with other jobs). Configs "
            f"{', '.join(sorted({c['config'].upper() for c in data.values() if 'config' in c}))}"
            " (A: the debug model on synthetic Markov data; B: the wide GQA model on byte-level "
            "text, at seed 8, where the layouts' gaps grew 10-20x by step 60), bf16 params, "
            f"fp32 reduce, {steps} steps, early "
            "stopping off, the shipped envelope (k = 3 x the twins' running maxima summed). "
            f"Collection: {meta['collect_min']:.1f} min.",
            f"Correct pairs: **{counts['false_alarm']}/{counts['correct']}** false alarms. "
            f"Planted bugs: **{counts['caught']}/{counts['bug']}** caught, first failing "
            f"steps {firsts} (first quarter: step <= {steps // 4}).",
            text,
            "Worst ratio per window of steps (> 1 fails):",
            windows(data),
            LONG_FINDINGS,
        )
    )


LONG_FINDINGS = """What the long runs say (A at seed 7, B at seed 8):

- No false alarm over 500 steps: the four layouts' worst ratio per 50-step window stays at
  0.09-0.55 on both configs, highest in the first 250 steps. The running maximum does not let
  late chaos through.
- Every bug fails early: the dropped DP rank and the CP rope offset at step 1, the row-wise
  all-reduce at step 14 (A) and 1 (B); a pair fails at its first step outside, so each of these
  verdicts is a fail.
- The envelope grows over the first 100-200 steps with the twins' own gaps (chaos: 5-7x) and
  then stays: the correct pairs' worst ratio falls from ~0.3-0.4 to ~0.1-0.2, and the weak bugs'
  ratios fall too, because their own signal shrinks while the noise grows -- the CP rope bug on
  A from 2.9 (steps 1-50) to 0.47 (451-500), below 1 after step ~150; the row-wise bug on B
  from 40 to 0.5, below 1 after step ~100. The verdicts above do not change (a pair fails at its
  first step outside), but a bug of that size that *starts* late (a resume onto a broken layout
  at step 400) would pass. A trailing-window maximum instead of the running one changes nothing
  on these curves, down to 50 steps ("Twin envelope: forget or not"): the growth model stays.
"""


if __name__ == "__main__":
    raise SystemExit(main())
