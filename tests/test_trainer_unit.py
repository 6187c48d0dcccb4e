"""Pieces of the trainer in one process: config checks, data, schedule, model, grad norm."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from convergence.rank.hooks import load_hook
from convergence.rank.norms import grad_norms, parameter_part, parts_geomean
from convergence.spec.errors import SpecError
from convergence.trainer.config import load_train_config
from convergence.trainer.config_checks import check_config
from convergence.trainer.data import TRAIN, VAL, BatchPlan, MarkovLanguage, build_source
from convergence.trainer.model import ModelArgs, build_model
from convergence.trainer.optim import (
    clip_grads_,
    global_grad_norm,
    lr_at,
    model_parts,
    optimizer_step,
)
from experiments import builtin_pair

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug.toml"


def cfg(*overrides: str):  # type: ignore[no-untyped-def]
    return load_train_config(DEBUG, list(overrides))


@pytest.mark.parametrize(
    ("overrides", "world", "key", "words"),
    [
        (["--parallelism.tp=3"], None, "parallelism.tp", "n_heads"),
        (["--parallelism.tp=4"], None, "parallelism.tp", "n_kv_heads"),
        (["--parallelism.pp=3"], None, "parallelism.pp", "n_layers"),
        (
            [
                "--parallelism.pp=2",
                "--parallelism.pp_schedule=Interleaved1F1B",
                "--parallelism.pp_stages_per_rank=3",
            ],
            None,
            "parallelism.pp",
            "n_layers",
        ),
        (["--parallelism.cp=3"], None, "parallelism.cp", "seq_len"),
        (
            ["--parallelism.pp=2", "--parallelism.pp_microbatches=3"],
            None,
            "parallelism.pp_microbatches",
            "local_batch_size",
        ),
        (["--parallelism.dp_shard=2"], 4, "parallelism", "world size"),
        (["--parallelism.sequence_parallel=true"], None, "parallelism.sequence_parallel", "tp"),
        (["--training.cpu_offload=true"], None, "training.cpu_offload", "dp_shard"),
        (
            ["--parallelism.dp_replicate=2", "--training.param_dtype=bfloat16"],
            2,
            "training.param_dtype",
            "silently train in float32",
        ),
        (
            ["--parallelism.tp=2", "--training.reduce_dtype=bfloat16"],
            2,
            "training.reduce_dtype",
            "no FSDP",
        ),
        (["--parallelism.hook=nocolon"], None, "parallelism.hook", "package.module:function"),
        (["--model.n_kv_heads=3"], None, "model.n_kv_heads", "divide"),
        (["--activation_checkpoint.mode=some"], None, "activation_checkpoint.mode", "mode"),
        (
            [
                "--parallelism.dp_shard=2",
                "--parallelism.pp=2",
                "--parallelism.pp_schedule=InterleavedZeroBubble",
            ],
            4,
            "parallelism.pp_schedule",
            "gradients would be wrong",
        ),
        (
            [
                "--parallelism.dp_replicate=2",
                "--parallelism.pp=2",
                "--parallelism.pp_schedule=ZBVZeroBubble",
            ],
            4,
            "parallelism.pp_schedule",
            "misses",
        ),
        # Refused by torch's schedule constructors (build_schedule), so refused here first.
        (
            ["--parallelism.pp=2", "--parallelism.pp_microbatches=1"],
            2,
            "parallelism.pp_microbatches",
            "at least one microbatch per pipeline stage",
        ),
        (
            [
                "--parallelism.pp=2",
                "--parallelism.pp_schedule=DualPipeV",
                "--parallelism.pp_microbatches=2",
            ],
            2,
            "parallelism.pp_microbatches",
            "2 microbatches < 4 stages",
        ),
        (
            [
                "--parallelism.pp=2",
                "--parallelism.pp_schedule=1F1B",
                "--parallelism.pp_stages_per_rank=2",
            ],
            2,
            "parallelism.pp_stages_per_rank",
            "one stage per rank",
        ),
        (
            [
                "--parallelism.pp=2",
                "--parallelism.pp_schedule=ZBVZeroBubble",
                "--parallelism.pp_stages_per_rank=4",
            ],
            2,
            "parallelism.pp_stages_per_rank",
            "exactly 2 stages per rank",
        ),
        (
            [
                "--parallelism.pp=2",
                "--parallelism.pp_schedule=Interleaved1F1B",
                "--parallelism.pp_stages_per_rank=1",
            ],
            2,
            "parallelism.pp_stages_per_rank",
            ">= 2 stages per rank",
        ),
        (["--parallelism.pp_schedule=Zero"], None, "parallelism.pp_schedule", "unknown schedule"),
        (
            ["--training.forward_noise_tp=1"],
            None,
            "training.forward_noise_tp",
            "not a TP degree the twin can round as",
        ),
    ],
)
def test_check_config_names_key_and_constraint(
    overrides: list[str], world: int | None, key: str, words: str
) -> None:
    with pytest.raises(SpecError) as info:
        check_config(cfg(*overrides), world)
    assert info.value.key == key
    assert words in str(info.value) and info.value.fix
    assert "debug.toml" in str(info.value)


def test_check_config_accepts_the_tested_layouts() -> None:
    check_config(cfg(), 1)
    check_config(
        cfg(
            "--parallelism.dp_shard=2",
            "--parallelism.tp=2",
            "--parallelism.pp=2",
            "--parallelism.cp=2",
            "--parallelism.sequence_parallel=true",
        ),
        16,
    )
    check_config(cfg("--parallelism.pp=2", "--parallelism.pp_schedule=Interleaved1F1B"), 2)
    check_config(cfg("--parallelism.dp_shard=2", "--training.param_dtype=bfloat16"), 2)


def test_issue_layout_interleaved_zero_bubble_with_fsdp_names_key_and_fix() -> None:
    """{dp_shard=2, pp=2, InterleavedZeroBubble}: refused by the collection-time check (not in
    build_schedule after launch), naming the key and a schedule that works."""
    with pytest.raises(SpecError) as info:
        check_config(
            cfg(
                "--parallelism.dp_shard=2",
                "--parallelism.pp=2",
                "--parallelism.pp_schedule=InterleavedZeroBubble",
            ),
            4,
        )
    assert info.value.key == "parallelism.pp_schedule"
    assert "Interleaved1F1B" in info.value.fix and "pp only" in info.value.fix


@pytest.mark.parametrize(
    ("layout", "key", "words"),
    [
        (
            {"dp_shard": 2, "pp": 2, "pp_schedule": "InterleavedZeroBubble"},
            "parallelism.pp_schedule",
            "gradients would be wrong",
        ),
        (
            {"pp": 2, "pp_microbatches": 1},
            "parallelism.pp_microbatches",
            "at least one microbatch per pipeline stage",
        ),
    ],
)
def test_unsupported_pp_layout_fails_loading_the_experiment(
    tmp_path: Path, layout: dict[str, object], key: str, words: str
) -> None:
    """What pytest collection does with an experiment file (preflight.load_checked: parse, then
    the builtin backend's preflight -> check_config): refused before any job is launched."""
    from convergence.preflight import load_checked

    path = builtin_pair(
        tmp_path,
        control={"name": "pp2", "parallelism": {"pp": 2}},
        tests=[{"name": "bad", "parallelism": layout}],
    )
    with pytest.raises(SpecError) as info:
        load_checked(path, rootdir=tmp_path)
    assert info.value.key == f"test[0].{key}"
    assert words in str(info.value) and info.value.fix and str(path) in str(info.value)


def test_pp_rules_resolve_defaults_like_the_trainer() -> None:
    from convergence.trainer import pp_rules

    assert pp_rules.stages_per_rank("1F1B", 0, pp=2) == 1
    assert pp_rules.stages_per_rank("Interleaved1F1B", 0, pp=2) == 2
    assert pp_rules.stages_per_rank("Interleaved1F1B", 0, pp=1) == 1  # no PP: one "stage"
    assert pp_rules.stages_per_rank("LoopedBFS", 3, pp=2) == 3
    assert pp_rules.microbatches(2, 2, 0) == 4 and pp_rules.microbatches(2, 2, 8) == 8
    assert pp_rules.stage_ids(0, 2, 2, "DualPipeV") == [0, 3]
    assert pp_rules.stage_ids(1, 4, 2, "Interleaved1F1B") == [1, 5]
    # Every schedule with its defaults is accepted with pp alone (8 layers, batch 8).
    for schedule in pp_rules.SCHEDULES:
        assert (
            pp_rules.layout_problem(
                schedule=schedule,
                pp=2,
                stages_configured=0,
                microbatches_configured=0,
                n_layers=8,
                local_batch_size=8,
                data_parallel=1,
            )
            is None
        ), schedule


def test_markov_entropy_floor_is_the_empirical_optimum() -> None:
    lang = MarkovLanguage.build(vocab_size=64, seq_len=128, seed=3, concentration=0.1, order_seed=0)
    tokens = lang.samples(np.arange(400), TRAIN)
    probs = np.diff(np.concatenate([np.zeros((64, 1)), lang.cum_probs], axis=1), axis=1)
    nll = -np.log(probs[tokens[:, :-1], tokens[:, 1:]]).mean()
    assert abs(nll - lang.entropy_floor) < 0.03  # 51k tokens: sampling noise ~0.005
    assert np.allclose(lang.stationary @ probs, lang.stationary, atol=1e-12)


@pytest.mark.parametrize(("lag", "copy_span"), [(2, 0), (3, 0), (1, 16), (2, 8)])
def test_lagged_and_copy_floor_is_the_empirical_optimum(lag: int, copy_span: int) -> None:
    lang = MarkovLanguage.build(
        vocab_size=64,
        seq_len=64,
        seed=3,
        concentration=0.1,
        order_seed=0,
        lag=lag,
        copy_span=copy_span,
    )
    tokens = lang.samples(np.arange(1500), TRAIN)
    distance = 65 - copy_span
    if copy_span:
        assert (tokens[:, distance:] == tokens[:, :copy_span]).all()
    probs = np.diff(np.concatenate([np.zeros((64, 1)), lang.cum_probs], axis=1), axis=1)
    # The optimal predictor, position by position (data.py's docstring): -log p(target).
    nll = []
    for t in range(1, 65):
        if t < copy_span:
            nll.append(np.full(len(tokens), math.log(64)))
        elif t < copy_span + lag:
            nll.append(-np.log(lang.stationary[tokens[:, t]]))
        elif t < distance:
            nll.append(-np.log(probs[tokens[:, t - lag], tokens[:, t]]))
        else:
            nll.append(np.zeros(len(tokens)))
    assert abs(float(np.mean(nll)) - lang.entropy_floor) < 0.03  # 96k targets
    plain = MarkovLanguage.build(vocab_size=64, seq_len=64, seed=3, concentration=0.1, order_seed=0)
    assert lang.markov_entropy == pytest.approx(plain.entropy_floor, rel=1e-12)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("--data.copy_span=33", "data.copy_span"),
        ("--data.copy_span=-1", "data.copy_span"),
        ("--data.lag=0", "data.lag"),
        ("--data.lag=40", "data.lag"),
    ],
)
def test_bad_synthetic_structure_names_the_key(override: str, key: str) -> None:
    with pytest.raises(SpecError) as info:
        build_source(cfg(override))
    assert info.value.key == key and info.value.fix


def test_samples_depend_only_on_index_and_split() -> None:
    source = build_source(cfg())
    a = source.samples(np.array([5, 6, 7]), TRAIN)
    b = source.samples(np.array([7, 5]), TRAIN)
    assert (a[2] == b[0]).all() and (a[0] == b[1]).all()
    assert not (source.samples(np.array([5]), VAL) == a[0]).all()
    other_order = build_source(cfg("--training.seed=7"))
    assert not (other_order.samples(np.array([5]), TRAIN) == a[0]).all()


@pytest.mark.parametrize(
    ("dp", "accum", "local"), [(1, 1, 16), (2, 1, 8), (4, 1, 4), (1, 2, 8), (2, 2, 4)]
)
def test_every_layout_reads_the_same_samples_per_step(dp: int, accum: int, local: int) -> None:
    for step in (1, 2, 9):
        seen = np.concatenate(
            [
                BatchPlan(local_batch_size=local, dp=dp, dp_rank=r, grad_accum_steps=accum).indices(
                    step, m
                )
                for r in range(dp)
                for m in range(accum)
            ]
        )
        assert sorted(seen) == list(range((step - 1) * 16, step * 16))


def test_text_source_holds_out_a_tail(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 400)
    source = build_source(cfg("--data.source=text", f"--data.path={text}", "--data.seq_len=16"))
    train = source.samples(np.arange(10), TRAIN)
    assert train.shape == (10, 17) and train.max() < 256
    assert source.samples(np.arange(2), VAL).shape == (2, 17)


def test_lr_schedule_warmup_then_cosine_to_min() -> None:
    c = cfg("--training.steps=110", "--lr_scheduler.warmup_steps=10")
    peak = c.optimizer.lr
    assert lr_at(1, c) == pytest.approx(peak / 10)
    assert lr_at(10, c) == pytest.approx(peak)
    assert lr_at(60, c) == pytest.approx(peak * (0.1 + 0.9 * 0.5))
    assert lr_at(110, c) == pytest.approx(peak * 0.1)
    lin = cfg("--training.steps=110", "--lr_scheduler.decay_type=linear")
    assert lr_at(60, lin) == pytest.approx(peak * (0.1 + 0.9 * 0.5))


def test_model_chunks_run_without_embeddings_or_output() -> None:
    args = ModelArgs.from_config(cfg().model, seq_len=64)
    assert args.ffn_hidden_dim == 192  # 8/3 * 64 rounded up to 32
    model = build_model(args, "cpu")
    torch.manual_seed(0)
    model.init_weights()
    tokens = torch.randint(0, 256, (2, 64))
    full = model(tokens)
    assert full.shape == (2, 64, 256)
    # Split by hand into two PP-style stages; the composition must equal the whole.
    first, second = build_model(args, "cpu"), build_model(args, "cpu")
    first.load_state_dict(model.state_dict())
    second.load_state_dict(model.state_dict())
    del first.layers["2"], first.layers["3"], second.layers["0"], second.layers["1"]
    first.norm, first.output, second.tok_embeddings = None, None, None
    assert torch.allclose(second(first(tokens)), full, atol=1e-6)
    # A position offset changes the rotary angles (context parallel relies on it).
    assert not torch.allclose(model(tokens[:, 32:], position_offset=32), model(tokens[:, 32:]))


def test_grad_norm_and_clip_match_torch_on_plain_tensors() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    copies = [p.grad.clone() for p in params]
    norm = global_grad_norm(params, None)
    clip_grads_(params, 0.5, norm)
    ref = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in range(3)]
    for r, g in zip(ref, copies, strict=True):
        r.grad = g
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
    for p, r in zip(params, ref, strict=True):
        assert torch.allclose(p.grad, r.grad, rtol=1e-6)
    assert math.isclose(
        torch.cat([p.grad.flatten() for p in params]).norm().item(), 0.5, rel_tol=1e-5
    )


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("layers.3.attention.wq.weight", "attention.wq"),
        ("layers.0._checkpoint_wrapped_module.attention.wk.weight", "attention.wk"),
        ("_orig_mod.layers.1.feed_forward.w2.weight", "feed_forward.w2"),
        ("layers.2.attention_norm.weight", "attention_norm"),
        ("tok_embeddings.weight", "tok_embeddings"),
        ("norm.weight", "norm"),
    ],
)
def test_parameter_part_is_the_same_for_every_layer_and_wrapper(name: str, part: str) -> None:
    assert parameter_part(name) == part


def test_grad_norms_per_part_add_up_to_the_total() -> None:
    model = build_model(ModelArgs.from_config(cfg().model, seq_len=16), "cpu")
    parts = model_parts(build_model(ModelArgs.from_config(cfg().model, seq_len=16), "meta"))
    assert {
        "attention.wq",
        "attention.wk",
        "feed_forward.w1",
        "tok_embeddings",
        "output",
        "norm",
    } <= set(parts)
    tokens = torch.randint(0, 256, (2, 16))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    named = list(model.named_parameters())
    total, per_part = grad_norms(named, parts, None)
    assert total.item() == global_grad_norm([p for _, p in named], None).item()
    assert per_part.pow(2).sum().item() == pytest.approx(total.item() ** 2, rel=1e-12)
    wq = math.sqrt(
        sum(
            float(p.grad.double().pow(2).sum())
            for n, p in named
            if n.endswith("attention.wq.weight")
        )
    )
    assert per_part[parts.index("attention.wq")].item() == pytest.approx(wq, rel=1e-12)
    # The geometric mean moves by the average relative change of the parts: scaling one
    # part's gradient by (1 + e) moves it by ~e / K, while the total may barely move.
    base = parts_geomean(per_part)
    bumped = per_part.clone()
    bumped[parts.index("attention.wq")] *= 1.01
    assert parts_geomean(bumped) / base == pytest.approx(1.01 ** (1 / len(parts)), rel=1e-12)
    assert parts_geomean(torch.zeros(3)) == 0.0


def test_load_hook_errors_name_the_key() -> None:
    with pytest.raises(SpecError, match="parallelism.hook") as info:
        load_hook("json:no_such_function")
    assert "no_such_function" in str(info.value)
    assert callable(load_hook("convergence.rank.hooks:apply_hook"))


def test_hooks_written_against_the_former_path_still_import() -> None:
    """README's example and users' hooks import ``convergence.trainer.hooks``: the same
    objects as convergence/rank/hooks.py, the hook API's home since both trainers use it."""
    import convergence.rank.hooks as home
    import convergence.trainer.hooks as former
    from convergence.spec.job import HOOK_MODES

    for name in former.__all__:
        expected = HOOK_MODES if name == "HOOK_MODES" else getattr(home, name)
        assert getattr(former, name) is expected, name
    assert load_hook("convergence.trainer.hooks:apply_hook") is home.apply_hook


def test_update_norms_are_the_norms_of_what_the_optimizer_applied() -> None:
    """optimizer_step's update norms are the norms of each part's parameter change, after
    clipping: SGD makes the change lr x the clipped gradient, known in closed form."""
    model = build_model(ModelArgs.from_config(cfg().model, seq_len=16), "cpu")
    parts = model_parts(build_model(ModelArgs.from_config(cfg().model, seq_len=16), "meta"))
    tokens = torch.randint(0, 256, (2, 16))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    named = list(model.named_parameters())
    optimizer = torch.optim.SGD([p for _, p in named], lr=0.1)
    grad_total = global_grad_norm([p for _, p in named], None).item()
    max_norm = grad_total / 4  # clipping acts: the update is lr x max_norm in total
    norms = optimizer_step(optimizer, named, parts, None, max_norm)
    assert norms.grad.item() == pytest.approx(grad_total, rel=1e-12)  # before clipping
    # The change is read off float32 parameters: each element's change carries the rounding
    # of the new value (~6e-8 x |p|, |p| ~ 0.1 here) against a change of ~1e-5 -- 1e-3 of it.
    assert norms.update.item() == pytest.approx(0.1 * max_norm, rel=1e-3)
    # Every part's update is the same fraction of its gradient (one clipping coefficient).
    ratio = norms.update_parts / norms.grad_parts
    assert torch.allclose(ratio, torch.full_like(ratio, 0.1 / 4), rtol=1e-3, atol=0.0)
    assert norms.update_parts.pow(2).sum().item() == pytest.approx(norms.update.item() ** 2)
