"""The detection benchmark's cases: planted bugs that must fail, correct pairs that must pass.

Every case is one test side against a control of the same group (same seed, same precision):
FSDP on 2 ranks, the debug model, 16 samples of 64 tokens per optimizer step. Bugs name a hook
in the ``detection_bugs`` package (next to this file) and the metric(s) expected to catch them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

PKG = "detection_bugs"
STEPS = 30
SEED = 7


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    kind: str
    """"bug" (must fail) or "correct" (must pass)."""
    parallelism: dict[str, Any]
    techniques: dict[str, Any] = field(default_factory=dict)
    local_batch_size: int | None = None
    """Samples per DP rank per microstep; None: the train config's (8)."""
    hook: str | None = None
    hook_mode: str = "after"
    seed: int = SEED
    precision: str = "fp32"
    """Control group: "fp32" (paired regime) or "bf16" (twin regime: control and its twin)."""
    expect: tuple[str, ...] = ()
    """Bugs: the gating metrics expected to fail (each of them)."""
    note: str = ""
    """What the bug is (one line for the table); details in the hook's docstring."""
    resume: dict[str, Any] | None = None
    """The test side's ``resume`` table (stop at at_step, checkpoint, resume; the resume
    bugs' hooks break the loader only), None: one uninterrupted job."""
    max_norm: float | None = None
    """Control group: the gradient clipping threshold of both sides (``training.max_norm``);
    None: the train config's (1.0, above the debug model's gradient norm ~0.3: no clipping)."""


FSDP2 = {"dp_shard": 2}
FSDP2_TP2 = {"dp_shard": 2, "tp": 2}
FSDP2_TP2_SP = {"dp_shard": 2, "tp": 2, "sequence_parallel": True}
ACCUM2 = {"grad_accum_steps": 2}

BUGS: tuple[Case, ...] = (
    Case(
        name="tp-sp-norm-grad-not-synced",
        kind="bug",
        parallelism=FSDP2_TP2_SP,
        hook=f"{PKG}.tensor_parallel:norm_grad_not_synced",
        expect=("grad_norm",),
        note="SP norm weight grad stays a TP-local partial sum (weight.to_local())",
    ),
    Case(
        name="tp-sp-norm-grad-reduced-twice",
        kind="bug",
        parallelism=FSDP2_TP2_SP,
        hook=f"{PKG}.tensor_parallel:norm_grad_reduced_twice",
        expect=("grad_norm",),
        note="SP norm weight grad all-reduced over TP twice (x tp, norm weights only)",
    ),
    Case(
        name="tp-rowwise-not-reduced",
        kind="bug",
        parallelism=FSDP2_TP2,
        hook=f"{PKG}.tensor_parallel:rowwise_output_not_reduced",
        hook_mode="replace_tp",
        expect=("loss",),
        note="row-wise linear (layer 1 wo) without its all-reduce",
    ),
    Case(
        name="fsdp-dp-rank-dropped",
        kind="bug",
        parallelism=FSDP2,
        hook=f"{PKG}.gradient_scale:drop_one_dp_rank",
        expect=("grad_norm",),
        note="gradient reduction misses DP rank 1's contribution",
    ),
    Case(
        name="ddp-sum-not-average",
        kind="bug",
        parallelism={"dp_replicate": 2},
        hook=f"{PKG}.gradient_scale:sum_instead_of_average",
        expect=("grad_norm",),
        note="DP gradients summed, not averaged (x dp)",
    ),
    Case(
        name="hsdp-sum-not-average",
        kind="bug",
        parallelism={"dp_replicate": 2, "dp_shard": 2},
        local_batch_size=4,
        hook=f"{PKG}.gradient_scale:sum_instead_of_average",
        expect=("grad_norm",),
        note="HSDP gradients summed over all 4 DP ranks (x dp)",
    ),
    Case(
        name="fsdp-tp-divided-by-world",
        kind="bug",
        parallelism=FSDP2_TP2,
        hook=f"{PKG}.gradient_scale:divided_by_world_size",
        expect=("grad_norm",),
        note="gradient divided by world size (4), not dp degree (2)",
    ),
    Case(
        name="dp-ranks-read-same-shard",
        kind="bug",
        parallelism=FSDP2,
        hook=f"{PKG}.sequence_and_data:every_dp_rank_reads_rank0_shard",
        expect=("loss",),
        note="every DP rank reads rank 0's samples (inputs and labels)",
    ),
    Case(
        name="pp-microbatch-loss-summed",
        kind="bug",
        parallelism={"dp_shard": 2, "pp": 2, "pp_schedule": "1F1B"},
        hook=f"{PKG}.gradient_scale:pp_microbatch_loss_summed",
        expect=("grad_norm",),
        note="PP microbatch losses summed, not averaged (grads x microbatches)",
    ),
    Case(
        name="cp-mask-ignores-offset",
        kind="bug",
        parallelism={"dp_shard": 2, "cp": 2},
        hook=f"{PKG}.sequence_and_data:cp_mask_without_offset",
        expect=("loss",),
        note="CP causal mask built without the rank's sequence offset",
    ),
    Case(
        name="cp-rope-ignores-offset",
        kind="bug",
        parallelism={"dp_shard": 2, "cp": 2},
        hook=f"{PKG}.sequence_and_data:cp_rope_without_offset",
        expect=("grad_norm_parts",),
        note="CP rotary angles start at position 0 on every rank (offset dropped)",
    ),
    Case(
        name="grad-accum-not-divided",
        kind="bug",
        parallelism=FSDP2,
        techniques=ACCUM2,
        local_batch_size=4,
        hook=f"{PKG}.gradient_scale:accumulation_not_divided",
        expect=("grad_norm",),
        note="accumulated microstep gradients not divided (x 2)",
    ),
    Case(
        name="lr-stepped-per-microbatch",
        kind="bug",
        parallelism=FSDP2,
        techniques=ACCUM2,
        local_batch_size=4,
        hook=f"{PKG}.schedule:lr_stepped_per_microbatch",
        expect=("loss",),
        note="LR scheduler stepped per microbatch (schedule 2x fast)",
    ),
)

CORRECT: tuple[Case, ...] = (
    Case(name="fsdp2-noop-hook", kind="correct", parallelism=FSDP2, hook=f"{PKG}.correct:noop"),
    Case(name="ddp2", kind="correct", parallelism={"dp_replicate": 2}),
    Case(name="fsdp4", kind="correct", parallelism={"dp_shard": 4}, local_batch_size=4),
    Case(
        name="hsdp2x2",
        kind="correct",
        parallelism={"dp_replicate": 2, "dp_shard": 2},
        local_batch_size=4,
    ),
    Case(name="fsdp2-tp2", kind="correct", parallelism=FSDP2_TP2),
    Case(name="fsdp2-tp2-sp", kind="correct", parallelism=FSDP2_TP2_SP),
    Case(
        name="fsdp2-tp2-sp-local-norm",
        kind="correct",
        parallelism=FSDP2_TP2_SP,
        hook=f"{PKG}.correct:norm_on_local_shard",
    ),
    Case(name="tp2", kind="correct", parallelism={"tp": 2}, local_batch_size=16),
    Case(
        name="fsdp2-pp2-gpipe",
        kind="correct",
        parallelism={"dp_shard": 2, "pp": 2, "pp_schedule": "GPipe"},
    ),
    Case(
        name="fsdp2-pp2-1f1b",
        kind="correct",
        parallelism={"dp_shard": 2, "pp": 2, "pp_schedule": "1F1B"},
    ),
    Case(
        name="fsdp2-pp2-interleaved1f1b",
        kind="correct",
        parallelism={"dp_shard": 2, "pp": 2, "pp_schedule": "Interleaved1F1B"},
    ),
    # Zero bubble splits the backward: the trainer refuses it with per-block FSDP (see
    # pipeline.fsdp_per_block_ok), so it runs without data parallelism here.
    Case(
        name="pp2-zerobubble",
        kind="correct",
        parallelism={"pp": 2, "pp_schedule": "InterleavedZeroBubble"},
        local_batch_size=16,
    ),
    Case(name="fsdp2-cp2", kind="correct", parallelism={"dp_shard": 2, "cp": 2}),
    Case(name="tp2-cp2", kind="correct", parallelism={"tp": 2, "cp": 2}, local_batch_size=16),
    Case(
        name="fsdp2-accum2",
        kind="correct",
        parallelism=FSDP2,
        techniques=ACCUM2,
        local_batch_size=4,
    ),
    Case(
        name="fsdp2-ac-full",
        kind="correct",
        parallelism=FSDP2,
        techniques={"activation_checkpoint": "full"},
    ),
    Case(
        name="fsdp2-tp2-pp2",
        kind="correct",
        parallelism={"dp_shard": 2, "tp": 2, "pp": 2, "pp_schedule": "1F1B"},
    ),
    # Other seeds (another seed checkpoint and sample order, another control).
    Case(name="fsdp2-tp2-seed1", kind="correct", parallelism=FSDP2_TP2, seed=1),
    Case(name="ddp2-seed1", kind="correct", parallelism={"dp_replicate": 2}, seed=1),
    Case(name="fsdp2-cp2-seed2", kind="correct", parallelism={"dp_shard": 2, "cp": 2}, seed=2),
    Case(
        name="fsdp2-pp2-1f1b-seed2",
        kind="correct",
        parallelism={"dp_shard": 2, "pp": 2, "pp_schedule": "1F1B"},
        seed=2,
    ),
    # bf16 mixed precision (FSDP param_dtype): not bitwise pairable -> the twin regime.
    Case(
        name="bf16-fsdp2-tp2",
        kind="correct",
        parallelism=FSDP2_TP2,
        techniques={"param_dtype": "bfloat16"},
        precision="bf16",
    ),
)

#: Resume at the middle of the run, on the same layout or onto FSDP2+TP2 (issue 29).
RESUME_AT = STEPS // 2
SAME = {"at_step": RESUME_AT}
ONTO_TP2 = {"at_step": RESUME_AT, "parallelism": FSDP2_TP2}

RESUME_BUGS: tuple[Case, ...] = (
    Case(
        name="resume-optimizer-state-dropped",
        kind="bug",
        parallelism=FSDP2,
        resume=SAME,
        hook=f"{PKG}.resume:optimizer_state_dropped",
        expect=("loss",),
        note="optimizer rebuilt empty at the resume (Adam's first step again)",
    ),
    Case(
        name="resume-optimizer-state-dropped-onto-tp2",
        kind="bug",
        parallelism=FSDP2,
        resume=ONTO_TP2,
        hook=f"{PKG}.resume:optimizer_state_dropped",
        expect=("loss",),
        note="the same, resuming onto FSDP2+TP2",
    ),
    Case(
        name="resume-scheduler-restarted",
        kind="bug",
        parallelism=FSDP2,
        resume=SAME,
        hook=f"{PKG}.resume:scheduler_restarted",
        expect=("loss",),
        note="LR schedule back at step 0 at the resume (warmup again)",
    ),
    Case(
        name="resume-data-restarted",
        kind="bug",
        parallelism=FSDP2,
        resume=ONTO_TP2,
        hook=f"{PKG}.resume:data_restarted",
        expect=("data_fingerprint",),
        note="data loader back at sample 0 at the resume (onto FSDP2+TP2)",
    ),
)

RESUME_CORRECT: tuple[Case, ...] = (
    Case(name="resume-fsdp2", kind="correct", parallelism=FSDP2, resume=SAME),
    Case(name="resume-fsdp2-onto-tp2", kind="correct", parallelism=FSDP2, resume=ONTO_TP2),
    # Nothing in the built-in trainer draws from the generators after the initialisation
    # (no dropout; samples by index): a reseeded RNG changes no number, so the pair passes.
    Case(
        name="resume-rng-reset",
        kind="correct",
        parallelism=FSDP2,
        resume=SAME,
        hook=f"{PKG}.resume:rng_reset",
    ),
)

#: A test whose numerics differ from its fp32 control's (issue 28, "noise from the noisier
#: side"): bf16 gradient reduction or bf16 parameters against an fp32 control. Not bitwise
#: pairable -> the twin regime, whose envelope then also holds the noise twin of the control
#: run with the test's numerics.
BF16_REDUCE = {"reduce_dtype": "bfloat16"}
BF16_PARAMS = {"param_dtype": "bfloat16"}
PRECISION: tuple[Case, ...] = (
    Case(name="fsdp2-bf16-reduce", kind="correct", parallelism=FSDP2, techniques=BF16_REDUCE),
    Case(name="fsdp2-bf16-params", kind="correct", parallelism=FSDP2, techniques=BF16_PARAMS),
    Case(
        name="fsdp-dp-rank-dropped-bf16-reduce",
        kind="bug",
        parallelism=FSDP2,
        techniques=BF16_REDUCE,
        hook=f"{PKG}.gradient_scale:drop_one_dp_rank",
        expect=("grad_norm",),
        note="DP rank 1's gradient dropped, in a bf16-reduce test against an fp32 control",
    ),
    Case(
        name="fsdp-dp-rank-dropped-bf16-params",
        kind="bug",
        parallelism=FSDP2,
        techniques=BF16_PARAMS,
        hook=f"{PKG}.gradient_scale:drop_one_dp_rank",
        expect=("grad_norm",),
        note="DP rank 1's gradient dropped, in a bf16-param test against an fp32 control",
    ),
)

#: Clipping bugs (issue 47): a rank clips with its local gradient norm. Clipping must act for
#: them to matter: max_norm 0.05 is ~1/6 of the debug model's gradient norm (~0.3), so every
#: step clips, on both sides. Beside them the same layouts, correct, in the same group.
CLIP = 0.05
CLIPPING: tuple[Case, ...] = (
    Case(
        name="pp-stage-clips-with-local-norm",
        kind="bug",
        parallelism={"dp_shard": 2, "pp": 2, "pp_schedule": "1F1B"},
        hook=f"{PKG}.clipping:pp_stage_clips_with_local_norm",
        max_norm=CLIP,
        expect=("update_norm_parts",),
        note="each PP stage clips with its own stage's gradient norm (no all-reduce over PP)",
    ),
    Case(
        name="tp-rank-clips-with-local-norm",
        kind="bug",
        parallelism=FSDP2_TP2,
        hook=f"{PKG}.clipping:tp_rank_clips_with_local_norm",
        max_norm=CLIP,
        expect=("update_norm_parts",),
        note="each TP rank clips with its own shard's gradient norm (no all-reduce over TP)",
    ),
    Case(
        name="fsdp2-pp2-1f1b-clipped",
        kind="correct",
        parallelism={"dp_shard": 2, "pp": 2, "pp_schedule": "1F1B"},
        max_norm=CLIP,
    ),
    Case(name="fsdp2-tp2-clipped", kind="correct", parallelism=FSDP2_TP2, max_norm=CLIP),
)

ALL: tuple[Case, ...] = BUGS + RESUME_BUGS + CORRECT + RESUME_CORRECT + PRECISION + CLIPPING

#: Late-onset bugs (issue 41): a catalogue bug switched on at step S of the test side
#: (detection_bugs/late_onset.py). Not in ALL: they need a run longer than S (STEPS is 30).
LATE_START = 50
LATE_STEPS = 100


def late_onset(start: int = LATE_START) -> tuple[Case, ...]:
    """The CP-rope, row-wise all-reduce and data-loader bugs, each from step ``start``."""
    bugs = {
        "cp-rope-ignores-offset": "cp_rope_without_offset",
        "tp-rowwise-not-reduced": "rowwise_output_not_reduced",
        "dp-ranks-read-same-shard": "every_dp_rank_reads_rank0_shard",
    }
    cases = []
    for name, function in bugs.items():
        early = next(case for case in BUGS if case.name == name)
        cases.append(
            replace(
                early,
                name=f"{name}-from-{start}",
                hook=f"{PKG}.late_onset:{function}_from_{start}",
                note=f"{early.note}, from step {start}",
            )
        )
    return tuple(cases)


LATE_ONSET: tuple[Case, ...] = late_onset()

#: A resume onto a broken layout late in a run (issue 41): the test trains FSDP2 up to step
#: ``at`` (bitwise the control's run), checkpoints, and resumes onto FSDP2+CP2 with the CP
#: rotary offset dropped, or onto FSDP2+TP2 with layer 1's row-wise all-reduce left out -- the
#: catalogue bugs, acting from step at+1 only (the hooks change nothing on the FSDP2 job before
#: the resume: no CP, no TP mesh there). Beside them the same resumes onto correct layouts.
LATE_RESUME_AT = 400
LATE_RESUME_STEPS = 500


def late_resume(at: int = LATE_RESUME_AT) -> tuple[Case, ...]:
    onto_cp2 = {"at_step": at, "parallelism": {"dp_shard": 2, "cp": 2}}
    onto_tp2 = {"at_step": at, "parallelism": FSDP2_TP2}
    rope = next(case for case in BUGS if case.name == "cp-rope-ignores-offset")
    rowwise = next(case for case in BUGS if case.name == "tp-rowwise-not-reduced")
    return (
        replace(
            rope,
            name=f"resume-at-{at}-onto-cp2-rope-ignores-offset",
            parallelism=FSDP2,
            resume=onto_cp2,
            note=f"FSDP2 -> FSDP2+CP2 at step {at}, CP rotary offset dropped after the resume",
        ),
        replace(
            rowwise,
            name=f"resume-at-{at}-onto-tp2-rowwise-not-reduced",
            parallelism=FSDP2,
            resume=onto_tp2,
            note=f"FSDP2 -> FSDP2+TP2 at step {at}, layer 1 wo without its all-reduce after it",
        ),
        Case(
            name=f"resume-at-{at}-fsdp2-onto-cp2",
            kind="correct",
            parallelism=FSDP2,
            resume=onto_cp2,
        ),
        Case(
            name=f"resume-at-{at}-fsdp2-onto-tp2",
            kind="correct",
            parallelism=FSDP2,
            resume=onto_tp2,
        ),
    )


LATE_RESUME: tuple[Case, ...] = late_resume()


def by_name(name: str) -> Case:
    for case in (*ALL, *LATE_ONSET, *LATE_RESUME):
        if case.name == name:
            return case
    raise KeyError(f"no detection case {name!r}")


# -- Mixture of experts: train_configs/moe_debug.toml, FSDP2 vs FSDP2 + EP2 (moe_bugs.py) -------

MOE_STEPS = 20
FSDP2_EP2 = {"dp_shard": 2, "ep": 2}
_MOE = f"{PKG}.moe"


def _moe_bugs() -> tuple[Case, ...]:
    fp32 = (
        Case(
            name="moe-experts-grad-ep-x",
            kind="bug",
            parallelism=FSDP2_EP2,
            hook=f"{_MOE}:experts_reduced_over_efsdp_only",
            expect=("grad_norm_parts",),
            note="experts' grad averaged over their FSDP group only (ep x)",
        ),
        Case(
            name="moe-experts-grad-over-ep",
            kind="bug",
            parallelism=FSDP2_EP2,
            hook=f"{_MOE}:experts_averaged_over_ep_too",
            expect=("grad_norm_parts",),
            note="experts' grad averaged over the EP group as well (1/ep)",
        ),
        Case(
            name="moe-router-grad-not-reduced",
            kind="bug",
            parallelism=FSDP2_EP2,
            hook=f"{_MOE}:router_grad_not_reduced",
            expect=("grad_norm_parts",),
            note="router rows stepped with their rank's own tokens' gradient (no DP reduction)",
        ),
        Case(
            name="moe-aux-loss-local-tokens",
            kind="bug",
            parallelism=FSDP2_EP2,
            hook=f"{_MOE}:aux_loss_from_local_tokens",
            expect=("grad_norm_parts",),
            note="balance loss pooled over the rank's tokens, not per sequence",
        ),
        Case(
            name="moe-combine-dispatch-order",
            kind="bug",
            parallelism=FSDP2_EP2,
            hook=f"{_MOE}:combine_with_dispatch_order",
            expect=("loss",),
            note="combine indexes with the dispatch permutation, not its inverse",
        ),
        Case(
            name="moe-combine-unweighted",
            kind="bug",
            parallelism=FSDP2_EP2,
            hook=f"{_MOE}:combine_without_weights",
            expect=("loss",),
            note="top-k outputs summed without the routing weights",
        ),
    )
    # bf16 (twin regime): the per-part grad norm is what fails first for every one of them
    # (measured, BENCHMARKS.md); early stopping ends the run before the loss would.
    bf16 = tuple(
        replace(
            c,
            name=f"bf16-{c.name}",
            techniques={"param_dtype": "bfloat16"},
            precision="bf16",
            expect=("grad_norm_parts",),
        )
        for c in fp32
    )
    return fp32 + bf16


MOE_BUGS: tuple[Case, ...] = _moe_bugs()


def by_moe_name(name: str) -> Case:
    for case in MOE_BUGS:
        if case.name == name:
            return case
    raise KeyError(f"no MoE detection case {name!r}")
