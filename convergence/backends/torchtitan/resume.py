"""Resume for torchtitan jobs, through torchtitan's own DCP checkpointing.

A resuming test side is two jobs (convergence/run/resume.py), each asking its trainer for its
part (convergence.spec.trainer_request). Here the requests become torchtitan's words and the
launcher's:

    job 1  request save_at=K, save_folder=F
           --checkpoint.enable --checkpoint.folder=F --checkpoint.interval=K
           (torchtitan saves model, optimizer, LR schedulers, dataloader and train state --
           the step -- at step K, each rank its own shards), and the launcher stops the
           run after step K (--convergence.stop_after=K) and writes F/convergence_resume.json
    job 2  request resume_from=F
           --checkpoint.enable --checkpoint.folder=F --checkpoint.load_only
           torchtitan loads the latest step-N of F (its fault-tolerance branch: DCP reads
           the new layout's shards of every tensor, so FSDP2 -> FSDP2+TP2 reshards) and
           trains on from step N+1 (--convergence.resume_from=F: the launcher checks first
           that F holds a checkpoint of this run, so a missing or foreign checkpoint is an
           error naming F, never torchtitan's silent fresh start from the seed checkpoint)

What torchtitan 0.3 cannot resume is refused at collection (check_resume_layout): its
dataloader keeps one position per data-parallel rank and refuses another DP degree at load
("dp_degree is inconsistent before and after checkpoint, dataloader resharding is not
supported yet", components/dataloader.py), so the DP degree must stay the same.

The launcher's side (``from_the_seed``, ``check_stopped``, ``check_resume``: called by
``ConvergenceTrainer``, convergence/backends/torchtitan/trainer_class.py) imports torch inside
the functions: this module is read at collection.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.run_dir import anchor_of
from convergence.spec.trainer_request import TrainerRequest

#: What job 1 trained for (rank 0, beside torchtitan's step-K folder); job 2 checks it first.
MANIFEST = "convergence_resume.json"
#: Bumped when the manifest's contents change; a manifest of another format is refused.
FORMAT = 1


def torchtitan_words(request: TrainerRequest) -> list[str]:
    """torchtitan's checkpoint options for a phase's request (none: no words). They come
    after the seed checkpoint's load words (argv.load_args), and win over them."""
    if request.save_at:
        return [
            "--checkpoint.enable",
            f"--checkpoint.folder={request.save_folder}",  # absolute: not under dump_folder
            f"--checkpoint.interval={request.save_at}",
            "--checkpoint.no-load_only",
            # A full checkpoint at step K (it is never the last step: 1 <= K < steps), and
            # no purge thread (keep every checkpoint: there is one).
            "--checkpoint.keep_latest_k=0",
        ]
    if request.resume_from is not None:
        anchor = anchor_of(request.resume_from)
        if anchor is not None:  # the anchored check's probe: one of the control's anchors
            folder, step = anchor
            return [
                "--checkpoint.enable",
                f"--checkpoint.folder={folder}",
                "--checkpoint.load_only",
                f"--checkpoint.load_step={step}",
            ]
        return [
            "--checkpoint.enable",
            f"--checkpoint.folder={request.resume_from}",
            "--checkpoint.load_only",  # load, never save: the checkpoint is job 1's
        ]
    return []


def launch_words(request: TrainerRequest) -> list[str]:
    """The launcher's options for a phase (convergence/backends/torchtitan/launch.py). An
    anchor to resume from (``<dump>/anchors/step<K>``, spec/run_dir.py: the anchored check's
    probe) is torchtitan's ``step-K`` in that folder, loaded with ``--checkpoint.load_step``."""
    if request.save_at:
        return [f"--convergence.stop_after={request.save_at}"]
    if request.resume_from is not None:
        return [f"--convergence.resume_from={request.resume_from}"]
    return []


def check_resume_layout(job: JobSpec) -> None:
    """What torchtitan 0.3 cannot resume onto, said at collection (the backend's preflight of
    a resuming test side)."""
    if job.resume is None:
        return
    before, after = job.layout, job.after_resume().layout
    if before.dp != after.dp:
        raise SpecError(
            f"the data-parallel degree changes at the resume ({before.dp} before, {after.dp} "
            "after): torchtitan's dataloader keeps one position per DP rank and refuses "
            "another DP degree when it loads a checkpoint ('dataloader resharding is not "
            "supported yet')",
            key="resume.parallelism",
            fix=f"keep dp_replicate x dp_shard = {before.dp} in the resume layout (add tp, "
            "pp or cp ranks instead), or resume on the built-in backend",
        )


# -- the launcher's side -------------------------------------------------------------------------


def manifest(config: Any, *, step: int, dp_degree: int, global_batch_size: int) -> dict[str, Any]:
    """What a checkpoint was trained for: the model, the data and its order, the optimizer and
    the LR schedule, the run's length -- everything but the layout, which may change."""
    # Through JSON both when written and when checked: tuples become lists alike.
    whole = json.loads(json.dumps(config.to_dict(), default=str))
    training = whole.get("training", {})
    return {
        "format": FORMAT,
        "step": step,
        "model": _numbers(whole.get("model_spec")),
        "optimizer": whole.get("optimizer"),
        "lr_scheduler": whole.get("lr_scheduler"),
        "dataloader": whole.get("dataloader"),
        "training": {
            "steps": training.get("steps"),
            "seq_len": training.get("seq_len"),
            "global_batch_size": global_batch_size,
        },
        "seed": whole.get("debug", {}).get("seed"),
        "dp_degree": dp_degree,
    }


def _numbers(tree: Any, prefix: str = "") -> dict[str, Any]:
    """The numeric and boolean leaves of a config tree by path, and its top-level names: the
    model's shape (a model config also holds functions and sharding reprs, which name memory
    addresses and differ between processes)."""
    out: dict[str, Any] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree or [])
    for key, value in items:
        path = f"{prefix}{key}"
        if isinstance(value, (dict, list)):
            out.update(_numbers(value, f"{path}."))
        elif isinstance(value, (bool, int, float)) or (not prefix and isinstance(value, str)):
            out[path] = value
    return out


def differences(saved: dict[str, Any], wanted: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: checkpoint X, this job Y`` for each leaf that differs (but the step)."""
    out = []
    for key in sorted({*saved, *wanted} - {"step"}):
        a, b = saved.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: checkpoint {_short(a)}, this job {_short(b)}")
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def cannot_serve(folder: str, problem: str, fix: str) -> SystemExit:
    """One line (the launcher quotes a rank's last line): the checkpoint, what is wrong, the
    fix -- as the built-in trainer's ResumeError says it."""
    return SystemExit(f"checkpoint {folder} cannot serve this resume: {problem} (fix: {fix})")


def latest_step(folder: Path) -> int | None:
    """The largest N of a ``step-N`` folder holding DCP's .metadata (torchtitan's rule)."""
    steps = [
        int(path.name.removeprefix("step-"))
        for path in folder.glob("step-*")
        if path.name.removeprefix("step-").isdigit() and (path / ".metadata").is_file()
    ]
    return max(steps) if steps else None


def check_checkpoint(folder: str, wanted: dict[str, Any]) -> None:
    """Job 2, before torchtitan loads: ``folder`` holds job 1's checkpoint, of this run."""
    path = Path(folder)
    if not path.is_dir():
        raise cannot_serve(folder, "the folder does not exist", "run the job up to the resume")
    step = latest_step(path)
    if step is None:
        raise cannot_serve(
            folder, "no step-N folder with DCP's .metadata in it", "run the job up to the resume"
        )
    record = path / MANIFEST
    if not record.is_file():
        raise cannot_serve(folder, f"{MANIFEST} is missing", "run the job up to the resume")
    saved = json.loads(record.read_text(encoding="utf-8"))
    if saved.get("step") != step:
        raise cannot_serve(
            folder,
            f"{MANIFEST} is for step {saved.get('step')}, the latest checkpoint is step-{step}",
            "run the job up to the resume again",
        )
    wrong = differences(saved, wanted)
    if wrong:
        raise cannot_serve(
            folder,
            "it was trained for another run: " + "; ".join(wrong[:4]),
            "resume from this job's own checkpoint",
        )


def dp_degree(trainer: Any) -> int:
    dims = trainer.parallel_dims
    return int(dims.dp_replicate) * int(dims.dp_shard)


def global_batch(trainer: Any) -> int:
    training = trainer.config.training
    size = int(training.global_batch_size)
    return size if size > 0 else int(training.local_batch_size) * dp_degree(trainer)


def from_the_seed(trainer: Any) -> None:
    """Start from the seed checkpoint whatever the checkpoint folder holds (torchtitan 0.3
    loads the latest ``step-N`` of its folder first): a checkpoint or an anchor a previous
    attempt left there is never loaded."""
    trainer.checkpointer._find_load_step = lambda folder="": -1  # this checkpointer only


def trainer_manifest(trainer: Any, step: int) -> dict[str, Any]:
    """:func:`manifest` of a running trainer (its config, DP degree and global batch)."""
    return manifest(
        trainer.config,
        step=step,
        dp_degree=dp_degree(trainer),
        global_batch_size=global_batch(trainer),
    )


def check_stopped(trainer: Any, step: int) -> None:
    """Job 1, after torchtitan's loop (``ConvergenceTrainer.should_continue_training`` ends it
    after ``step``; torchtitan saved it: ``checkpoint.interval``): it stopped there, and rank 0
    writes the manifest beside the checkpoint. The LR schedule still spans the whole run
    (``training.steps`` is unchanged)."""
    import torch.distributed as dist

    if trainer.step != step:
        raise SystemExit(f"stopped at step {trainer.step}, not at the checkpoint's {step}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        record = trainer_manifest(trainer, step)
        folder = Path(trainer.checkpointer.folder)
        (folder / MANIFEST).write_text(json.dumps(record, indent=1), encoding="utf-8")


def check_resume(trainer: Any, folder: str) -> None:
    """Job 2, before torchtitan loads: ``folder`` holds job 1's checkpoint of this run
    (check_checkpoint)."""
    check_checkpoint(folder, trainer_manifest(trainer, 0))
