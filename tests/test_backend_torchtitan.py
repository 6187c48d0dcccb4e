"""The torchtitan backend against the real torchtitan 0.3.0: its own config parser (CPU, no
process group) accepts the argv built for each layout and rejects bad overrides at collection;
TensorBoard output in torchtitan's layout is read back. Training on CPU through the launcher
shim: tests/test_torchtitan_train.py and experiments/torchtitan/cpu.toml."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from experiments import write_experiment

if not os.environ.get("CI"):  # in CI (.ci/run installs it) a missing torchtitan must fail
    pytest.importorskip(
        "torchtitan",
        reason="torchtitan is not installed (pip install 'pytest-convergence[torchtitan]' triton)",
    )

import torch

from convergence.backends import get_backend
from convergence.backends.torchtitan import TorchtitanBackend
from convergence.backends.torchtitan.argv import SEED_FOLDER, SEED_STEP
from convergence.backends.torchtitan.assets import ensure_assets
from convergence.backends.torchtitan.config_parser import parse
from convergence.preflight import load_checked
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.layout import ParallelLayout, Techniques

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((ROOT / "experiments" / "torchtitan").glob("*.toml"))
BACKEND = TorchtitanBackend()


def job(layout: ParallelLayout | None = None, **changes: Any) -> JobSpec:
    base = JobSpec(
        name="j",
        train_config=ROOT / "pyproject.toml",
        backend="torchtitan",
        layout=layout or ParallelLayout(dp_shard=2),
        local_batch_size=8,
        steps=7,
        seed=5,
        overrides=(("training.seq_len", "256"),),
        source="exp.toml",
    )
    return dataclasses.replace(base, **changes)


def train_config(j: JobSpec, dump: Path, seed: Path | None = None) -> Any:
    """What torchtitan itself makes of the train entry (our wrapper's options removed, as the
    wrapper does before torchtitan parses ``sys.argv``)."""
    from convergence.backends.torchtitan.launch import split_argv

    entry = BACKEND.train_entry(j, dump, seed)
    assert entry[:2] == ["-m", "convergence.backends.torchtitan.launch"]
    options, rest = split_argv(entry[2:])
    assert options.log == str(dump / "convergence_steps.jsonl")
    return parse(tuple(rest))


LAYOUTS = {
    "fsdp": ParallelLayout(dp_shard=4),
    "hsdp": ParallelLayout(dp_replicate=2, dp_shard=2),
    "fsdp-tp-sp": ParallelLayout(dp_shard=2, tp=2, sequence_parallel=True),
    "fsdp-tp-pp": ParallelLayout(dp_shard=2, tp=2, pp=2, pp_schedule="Interleaved1F1B"),
    "fsdp-pp-gpipe": ParallelLayout(dp_shard=2, pp=2, pp_schedule="GPipe", pp_microbatches=8),
    "cp": ParallelLayout(dp_shard=2, cp=2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_real_parser_accepts_layout(name: str, tmp_path: Path) -> None:
    layout = LAYOUTS[name]
    j = job(layout)
    BACKEND.preflight(j)
    cfg = train_config(j, tmp_path / "dump", tmp_path / "seed")
    par = cfg.parallelism
    assert (
        par.data_parallel_replicate_degree,
        par.data_parallel_shard_degree,
        par.tensor_parallel_degree,
        par.pipeline_parallel_degree,
        par.context_parallel_degree,
    ) == (layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp, layout.cp)
    assert par.enable_sequence_parallel is layout.sequence_parallel
    # torchtitan's default "spmd_types" leaves plain tensors torch 2.13's fully_shard refuses.
    assert par.spmd_backend == "partial_dtensor"
    assert par.pipeline_parallel_schedule == layout.pp_schedule
    if layout.pp > 1:
        # local batch 8 split into the layout's microbatches
        assert par.pipeline_parallel_microbatch_size == 8 // layout.microbatches
        assert cfg.training.disable_cuda_graphs
    assert cfg.training.steps == 7 and cfg.training.local_batch_size == 8
    assert cfg.training.seq_len == 256
    assert cfg.debug.seed == 5 and cfg.debug.deterministic
    assert cfg.metrics.enable_tensorboard and cfg.metrics.log_freq == 1
    assert cfg.dump_folder == str(tmp_path / "dump")
    assert cfg.activation_checkpoint is None  # Techniques default "none"
    assert cfg.checkpoint.enable and cfg.checkpoint.load_only
    assert cfg.checkpoint.initial_load_path == str(tmp_path / "seed" / SEED_FOLDER / SEED_STEP)
    assert BACKEND.tokens_per_step(j) == 8 * layout.dp * 256


def test_techniques_map_to_torchtitan(tmp_path: Path) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC

    tech = Techniques(
        activation_checkpoint="full",
        compile=True,
        param_dtype="bfloat16",
        reshard_after_forward=False,
        grad_accum_steps=2,
        deterministic=False,
        cpu_offload=True,
    )
    j = job(
        techniques=tech,
        overrides=(
            ("training.seq_len", "256"),
            ("activation_checkpoint.preserve_rng_state", "true"),
        ),
    )
    BACKEND.preflight(j)
    cfg = train_config(j, tmp_path)
    assert isinstance(cfg.activation_checkpoint, FullAC.Config)
    assert cfg.activation_checkpoint.preserve_rng_state is True  # override after the subcommand
    assert cfg.compile.enable and cfg.training.enable_cpu_offload
    assert cfg.training.mixed_precision_param == "bfloat16"
    assert cfg.parallelism.fsdp_reshard_after_forward == "never"
    assert not cfg.debug.deterministic
    assert cfg.training.global_batch_size == 8 * 2 * 2  # local x DP x accumulation
    assert BACKEND.tokens_per_step(j) == 8 * 2 * 2 * 256


def test_user_overrides_win_and_booleans_become_flags(tmp_path: Path) -> None:
    j = job(
        overrides=(
            ("training.seq_len", "128"),
            ("debug.deterministic", "false"),
            ("metrics.log_freq", "3"),
        )
    )
    cfg = train_config(j, tmp_path)
    assert cfg.training.seq_len == 128 and not cfg.debug.deterministic
    assert cfg.metrics.log_freq == 3
    assert BACKEND.tokens_per_step(j) == 8 * 2 * 128


def test_seed_entry_is_one_rank_creating_the_checkpoint(tmp_path: Path) -> None:
    j = job(LAYOUTS["fsdp-tp-pp"], backend_options=(("assets_dir", str(tmp_path / "a")),))
    entry = BACKEND.seed_entry(j, tmp_path / "seed")
    # A rank's entry, started by the launcher as a one-rank job (a process group, forked from
    # the warm server where there is one), not a torchrun of its own.
    assert BACKEND.capabilities.seed_is_a_job
    assert entry[:2] == ["-m", "convergence.backends.torchtitan.launch"]
    start = 1
    cfg = parse(tuple(entry[start + 1 :]))
    assert cfg.checkpoint.enable and cfg.checkpoint.create_seed_checkpoint
    assert cfg.checkpoint.folder == str(tmp_path / "seed" / SEED_FOLDER)
    par = cfg.parallelism
    assert (
        par.data_parallel_shard_degree,
        par.tensor_parallel_degree,
        par.pipeline_parallel_degree,
    ) == (1, 1, 1)
    assert cfg.debug.seed == 5
    # One seed checkpoint per model and seed, whatever the layout.
    assert BACKEND.seed_identity(j) == BACKEND.seed_identity(job(ParallelLayout(dp_shard=2)))
    assert BACKEND.seed_identity(j) != BACKEND.seed_identity(job(seed=6))
    assert (tmp_path / "a" / "tokenizer" / "tokenizer.json").is_file()


def test_generated_assets_feed_torchtitans_tokenizer_and_dataset(tmp_path: Path) -> None:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    root = ensure_assets(tmp_path / "assets")
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(root / "tokenizer"))
    assert tokenizer.bos_id == 1 and tokenizer.eos_id == 2
    assert tokenizer.get_vocab_size() <= 2048  # the debug model's vocabulary
    dataset = HuggingFaceTextDataset(
        dataset_name="c4_test", dataset_path=str(root / "corpus"), tokenizer=tokenizer, seq_len=64
    )
    sample = next(iter(dataset))
    tokens = sample[0]["input"] if isinstance(sample[0], dict) else sample[0]
    assert tokens.shape[-1] == 64
    assert int(tokens.min()) >= 1  # no <unk> (id 0): every corpus word is in the vocabulary


def error_of(j: JobSpec) -> SpecError:
    with pytest.raises(SpecError) as info:
        BACKEND.preflight(j)
    return info.value


def test_unknown_override_fails_with_torchtitans_message() -> None:
    err = error_of(job(overrides=(("training.stepz", "3"),)))
    assert err.file == "exp.toml" and err.key == "overrides.training.stepz"
    assert "Unrecognized options" in str(err) and "--training.steps" in str(err)


def test_bad_override_value_fails_with_torchtitans_message() -> None:
    err = error_of(job(overrides=(("training.seq_len", "long"),)))
    assert err.key == "overrides.training.seq_len"
    assert "invalid literal for int()" in str(err)


def test_technique_torchtitan_refuses_names_our_key() -> None:
    err = error_of(job(techniques=Techniques(param_dtype="float16")))
    assert err.key == "techniques.param_dtype" and "float16" in str(err)


def test_bad_options_fail() -> None:
    err = error_of(job(backend_options=(("config", "llama3_nosuch"),)))
    assert err.key == "backend_options.config" and "llama3_debugmodel" in str(err)
    err = error_of(job(backend_options=(("modul", "llama3"),)))
    assert err.key == "backend_options.modul"
    err = error_of(job(LAYOUTS["fsdp-tp-pp"], local_batch_size=6))
    assert err.key == "local_batch_size" and "microbatches" in str(err)


def test_bad_override_fails_the_pair_at_collection(tmp_path: Path) -> None:
    path = _tt_pair(
        tmp_path,
        {"overrides": {"parallelism.tensor_paralel_degree": 2}},
        local_batch_size=8,
    )
    with pytest.raises(SpecError) as info:
        load_checked(path, rootdir=tmp_path)
    err = info.value
    assert err.file == str(path)
    assert err.key == "overrides.parallelism.tensor_paralel_degree"
    assert "fsdp2-tp2" in str(err) and "--parallelism.tensor-parallel-degree" in str(err)


def _tt_pair(tmp_path: Path, test: dict[str, Any], **defaults: Any) -> Path:
    """tt.toml: a torchtitan FSDP2 control against FSDP2+TP2 (the file is its own train
    config); ``test`` adds to the test's table, ``defaults`` to ``[defaults]``."""
    return write_experiment(
        tmp_path,
        file="tt.toml",
        defaults={"backend": "torchtitan", "train_config": "tt.toml", **defaults},
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[{"name": "fsdp2-tp2", "parallelism": {"dp_shard": 2, "tp": 2}, **test}],
    )


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.name for p in EXPERIMENTS])
def test_shipped_experiments_validate_at_collection(path: Path) -> None:
    exp = load_checked(path, rootdir=ROOT)
    assert exp.pairs
    for pair in exp.pairs:
        # GPU sizes are nightly; cpu.toml, resume.toml, moe.toml and precision.toml are the
        # tiny CPU pairs CI trains for real.
        ci = ("cpu.toml", "resume.toml", "moe.toml", "precision.toml")
        assert pair.tier == ("ci" if path.name in ci else "nightly")
        assert pair.control.backend == pair.test.backend == "torchtitan"
        assert BACKEND.tokens_per_step(pair.control) == BACKEND.tokens_per_step(pair.test)


def test_hooks_are_located_at_collection_and_only_after_mode_exists() -> None:
    BACKEND.preflight(job(hook="os.path:join"))
    err = error_of(job(hook="no_such_pkg_xyz.mod:fn"))
    assert err.key == "hook" and "no_such_pkg_xyz" in str(err)
    err = error_of(job(hook="os.path:join", hook_mode="replace_tp"))
    assert err.key == "hook_mode" and "after" in err.fix
    entry = BACKEND.train_entry(job(hook="os.path:join"), Path("/d"), None)
    assert "--convergence.hook=os.path:join" in entry
    assert "--convergence.hook_mode=after" in entry


def test_get_backend_returns_it() -> None:
    backend = get_backend("torchtitan")
    assert backend.name == "torchtitan"
    assert backend.version().startswith("torchtitan-0.3.0+src.")  # + a hash of its sources


def write_scalars(folder: Path, tags: dict[str, list[float]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for tag, values in tags.items():
        for step, value in enumerate(values, start=1):
            writer.add_scalar(tag, value, step)
    writer.close()


def test_read_metrics_from_torchtitans_tensorboard_layout(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    # save_for_all_ranks under PP: rank 0 (first stage) logs the -1 placeholder loss.
    write_scalars(
        dump / "tb" / "20260101-1200" / "rank_0",
        {"loss_metrics/global_avg_loss": [-1.0, -1.0, -1.0]},
    )
    write_scalars(
        dump / "tb" / "20260101-1200" / "rank_1",
        {
            "loss_metrics/global_avg_loss": [7.5, 7.25, 7.0],
            "grad_norm": [1.5, 1.25, 1.0],
            "memory/max_reserved(GiB)": [2.0, 2.0, 2.0],
        },
    )
    metrics = BACKEND.read_metrics(job(), dump)
    assert metrics["loss"].steps.tolist() == [1, 2, 3]
    assert metrics["loss"].values.tolist() == [7.5, 7.25, 7.0]
    assert metrics["grad_norm"].values.tolist() == [1.5, 1.25, 1.0]
    assert metrics["peak_mem_mib"].values.tolist() == [2048.0] * 3
    # No run_meta of a run's own here: only what the backend knows of its generated corpus.
    assert set(BACKEND.read_meta(job(), dump)) <= {"entropy_floor"}


def test_live_metrics_tail_the_same_tensorboard_folder(tmp_path: Path) -> None:
    """While the job runs: its tb folder is tailed (progress, NaN, early stop) on the rank
    with the real loss, the records keep torchtitan's tags and record_keys maps them; no stop
    file (torchtitan has none: an early stop ends the job)."""
    from convergence.metrics.tags import resolve_map
    from convergence.metrics.tb_tail import TensorBoardTail

    dump = tmp_path / "dump"
    write_scalars(
        dump / "tb" / "20260101-1200" / "rank_0",
        {"loss_metrics/global_avg_loss": [-1.0, -1.0, -1.0]},
    )
    write_scalars(
        dump / "tb" / "20260101-1200" / "rank_1",
        {"loss_metrics/global_avg_loss": [7.5, 7.25, 7.0], "lr/AdamW": [1e-3] * 3},
    )
    path = BACKEND.metrics_path(job(), dump)
    assert path == dump / "tb" and BACKEND.metrics_format(job()) == "tensorboard"
    assert BACKEND.stop_file(job(), dump) is None
    records = TensorBoardTail(path).drain()
    keys = resolve_map({}, BACKEND.record_keys(job()))
    assert keys["loss_metrics/global_avg_loss"] == "loss" and keys["lr/AdamW"] == "lr"
    assert [r["loss_metrics/global_avg_loss"] for r in records] == [7.5, 7.25, 7.0]


def test_config_text_keys_module_config_and_file() -> None:
    a = json.loads(BACKEND.config_text(job()))
    b = json.loads(BACKEND.config_text(job(backend_options=(("config", "x"),))))
    assert a["config"] == "llama3_debugmodel" and b["config"] == "x"
    assert "[project]" in a["train_config"]


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torchtitan trains on CUDA only (no CUDA device here)"
)
def test_debug_model_pair_converges_on_gpu(tmp_path: Path) -> None:
    from convergence.run.runner import Runner, RunSettings

    exp = load_checked(ROOT / "experiments" / "torchtitan" / "debug_1gpu.toml", rootdir=ROOT)
    outcome = Runner(RunSettings(work_dir=tmp_path, steps=30)).run_pair(exp.pairs[0])
    assert outcome.status == "passed", outcome.error or outcome.verdicts
    loss = outcome.control.metrics["loss"] if outcome.control else None
    assert loss is not None and len(loss) == 30 and loss.values[-1] < loss.values[0]


def test_degree_checks_read_torchtitans_model_args() -> None:
    # The debug model has 16 attention heads and 6 layers.
    err = error_of(job(ParallelLayout(dp_shard=1, tp=3)))
    assert err.key == "parallelism.tp" and "16 attention heads" in str(err)
    err = error_of(
        job(
            ParallelLayout(dp_shard=1, tp=2, sequence_parallel=True),
            overrides=(("training.seq_len", "63"),),
        )
    )
    assert err.key == "overrides.training.seq_len"
    err = error_of(
        job(ParallelLayout(dp_shard=1, pp=4, pp_schedule="Interleaved1F1B"), local_batch_size=8)
    )
    assert err.key == "parallelism.pp" and "6 layers" in str(err)
    err = error_of(
        job(
            ParallelLayout(dp_shard=1, pp=2, pp_schedule="1F1B", pp_stages_per_rank=3),
            local_batch_size=12,
        )
    )
    assert err.key == "parallelism.pp_stages_per_rank"


def test_noise_twin_keeps_the_samples_and_changes_the_reduction(tmp_path: Path) -> None:
    control = job(techniques=Techniques(param_dtype="bfloat16"))
    twin = BACKEND.noise_twin(control)
    assert twin.layout == control.layout  # same DP ranks: the same dataset chunks
    assert twin.local_batch_size == 4 and twin.techniques.grad_accum_steps == 2
    assert BACKEND.tokens_per_step(twin) == BACKEND.tokens_per_step(control)
    cfg = train_config(twin, tmp_path)
    assert cfg.training.local_batch_size == 4 and cfg.training.global_batch_size == 16
    with pytest.raises(SpecError) as info:
        BACKEND.noise_twin(job(local_batch_size=3))
    assert info.value.key == "regime"


def test_bf16_torchtitan_pair_gets_the_twin_regime_at_collection(tmp_path: Path) -> None:
    path = _tt_pair(
        tmp_path,
        {},
        local_batch_size=4,
        techniques={"param_dtype": "bfloat16"},
        overrides={"training.seq_len": 64},
    )
    (pair,) = load_checked(path, rootdir=tmp_path).pairs
    assert pair.regime == "twin"
    twin = BACKEND.noise_twin(pair.control)
    assert twin is not None and twin.local_batch_size == 2


def test_probe_always_is_accepted_for_torchtitan_at_collection(tmp_path: Path) -> None:
    """torchtitan jobs have the numerics probe (through the launcher wrapper), so a pair may
    ask for it on every run; its words reach the wrapper behind torchtitan's own."""
    from convergence.run.probe import wants_probe

    path = _tt_pair(
        tmp_path, {"probe": "always"}, local_batch_size=4, overrides={"training.seq_len": 64}
    )
    (pair,) = load_checked(path, rootdir=tmp_path).pairs
    assert BACKEND.capabilities.probe and pair.probe_always
    assert wants_probe(pair, "passed") and wants_probe(pair, "failed")
    entry = BACKEND.train_entry(pair.test.asking(probe_step=2), Path("/d"), None)
    assert entry[:2] == ["-m", "convergence.backends.torchtitan.launch"]
    assert "--convergence.probe_step=2" in entry and "--metrics.no-enable_tensorboard" in entry
    assert not any(w.startswith("--probe.") for w in entry)  # the built-in trainer's words
    # The wrapper takes its option off; torchtitan's parser reads the rest.
    from convergence.backends.torchtitan.launch import split_argv

    assert split_argv(entry[2:])[0].probe_step == 2
    assert not BACKEND.effective_config(pair.test.asking(probe_step=2)).metrics.enable_tensorboard


DEEPSEEK = (("module", "deepseek_v3"), ("config", "deepseek_v3_debugmodel"))


def test_ep_maps_to_torchtitans_expert_parallel_degree(tmp_path: Path) -> None:
    j = job(ParallelLayout(dp_shard=2, ep=2), backend_options=DEEPSEEK)
    BACKEND.preflight(j)
    cfg = train_config(j, tmp_path / "dump", tmp_path / "seed")
    assert cfg.parallelism.expert_parallel_degree == 2
    assert cfg.parallelism.data_parallel_shard_degree == 2  # EP borrows ranks, adds none
    # torchtitan refuses CUDA graphs with its all-to-all token dispatcher.
    assert cfg.training.disable_cuda_graphs
    # Without ep the command line is as it was (no expert degree word: same cache keys).
    plain = BACKEND.argv(job(backend_options=DEEPSEEK))
    assert not any("expert_parallel_degree" in word for word in plain)


@pytest.mark.parametrize(
    ("layout", "options", "says"),
    [
        (ParallelLayout(dp_shard=2, ep=2), (), "dense torchtitan model"),
        (ParallelLayout(dp_shard=3, ep=3), DEEPSEEK, "does not divide the model's 8 experts"),
    ],
    ids=["dense-model", "experts-not-divisible"],
)
def test_impossible_torchtitan_ep_is_refused_with_key_and_fix(
    layout: ParallelLayout, options: tuple[tuple[str, str], ...], says: str
) -> None:
    with pytest.raises(SpecError) as info:
        BACKEND.preflight(job(layout, backend_options=options))
    assert says in str(info.value) and info.value.key == "parallelism.ep"
    assert info.value.fix


def test_float8_all_gather_is_refused_for_torchtitan_with_key_and_fix() -> None:
    """torchtitan 0.3.0's float8 converter has no float8 all-gather: an error of the file (no
    device runs it), not a skip (convergence/backends/torchtitan/converters.py)."""
    tech = Techniques(param_dtype="bfloat16", float8="tensorwise", float8_all_gather=True)
    with pytest.raises(SpecError) as info:
        BACKEND.preflight(job(techniques=tech))
    assert "no float8 all-gather" in str(info.value)
    assert info.value.key == "techniques.float8_all_gather" and info.value.fix
