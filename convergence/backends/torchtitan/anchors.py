"""The anchored check for torchtitan jobs, through torchtitan's own DCP checkpointing.

The control and the anchored job each ask their trainer for their part
(convergence/checks/anchored.py: JobSpec.request); here the requests become torchtitan's words
and the launcher's:

    control   request anchor_every=N
              --checkpoint.enable --checkpoint.folder=<dump>/anchors --checkpoint.interval=N
              (torchtitan saves model, optimizer, LR schedulers, dataloader and train state
              after every N-th step, each rank its own shards; with confirming_anchors also
              after each one's next step: interval 1, the launcher keeps those), and the launcher
              (--convergence.anchor_every=N) starts from the seed checkpoint whatever the
              folder holds, skips torchtitan's forced save of the last step (no step follows
              it to compare) and, after each save, rank 0 writes <folder>/MANIFEST: what the
              run trained for and the anchors written so far
    anchored  request anchored_from=F (torchtitan logs every step already, and the anchored
              loop validates nothing)
              --checkpoint.enable --checkpoint.folder=F --checkpoint.load_only
              and the launcher (--convergence.anchored_from=F) checks the manifest, then
              replaces torchtitan's loop: for each anchor K, ``checkpointer.load(step=K)``
              (DCP reshards it onto this layout), one ``train_step`` on the batch the control
              trained at K+1, logged as step K+1 -- one process, one Trainer, every anchor

Its metrics (TensorBoard, the wrapper's step records) are one curve over the steps K+1, as the
built-in trainer's anchored job logs them; convergence/stats/anchored.py judges them.

What torchtitan 0.3 cannot load is refused at collection (the backend's ``Capabilities``:
``anchors_keep_dp``): its dataloader keeps one position per data-parallel rank and refuses
another DP degree at load, so the test keeps the control's DP degree (as a resume does).

The launcher's side (``save_anchors``, ``train_from_anchors``, ``check_probe_anchor``: called by
``ConvergenceTrainer.train``, convergence/backends/torchtitan/trainer_class.py) imports torch
inside the functions: this module is read at collection.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from convergence.backends.torchtitan import resume
from convergence.spec.run_dir import DumpDir, anchor_of
from convergence.spec.trainer_request import TrainerRequest, saves_anchor_after

#: What the control trained for and its anchors so far (rank 0, in the anchors folder).
MANIFEST = "convergence_anchors.json"


def torchtitan_words(request: TrainerRequest, dump_dir: Path) -> list[str]:
    """torchtitan's checkpoint options for the request's anchors (none: no words). They come
    after the seed checkpoint's load words (argv.load_args), and win over them. A control
    keeps its anchors where convergence/checks/anchored.py reads them (spec/run_dir.py)."""
    if request.anchor_every:
        return [
            "--checkpoint.enable",
            f"--checkpoint.folder={DumpDir(dump_dir).anchors}",  # absolute
            # Confirming anchors need the steps K+1 too: torchtitan offers every step and
            # save_anchors keeps the anchors' own.
            f"--checkpoint.interval={1 if request.confirming_anchors else request.anchor_every}",
            "--checkpoint.no-load_only",
            # Keep every anchor: no purge thread.
            "--checkpoint.keep_latest_k=0",
        ]
    if request.anchored_from is not None:
        return [
            "--checkpoint.enable",
            f"--checkpoint.folder={request.anchored_from}",
            "--checkpoint.load_only",  # load, never save: the anchors are the control's
        ]
    return []


def launch_words(request: TrainerRequest) -> list[str]:
    """The launcher's options (convergence/backends/torchtitan/launch.py)."""
    if request.anchor_every:
        confirming = ["--convergence.confirming_anchors"] if request.confirming_anchors else []
        return [f"--convergence.anchor_every={request.anchor_every}", *confirming]
    if request.anchored_from is not None:
        return [f"--convergence.anchored_from={request.anchored_from}"]
    return []


# -- the launcher's side -------------------------------------------------------------------------


def check_anchors(folder: str, wanted: dict[str, Any]) -> list[int]:
    """The anchored job, before anything loads: ``folder`` holds the control's anchors, of
    this run (its manifest, and each listed anchor's DCP metadata); their steps, ascending."""
    path = Path(folder)
    record = path / MANIFEST
    if not record.is_file():
        raise resume.cannot_serve(
            folder, f"{MANIFEST} is missing", "run the control with anchor_every first"
        )
    saved = json.loads(record.read_text(encoding="utf-8"))
    anchors = sorted(int(k) for k in saved.pop("anchors", []))
    missing = [k for k in anchors if not (path / f"step-{k}" / ".metadata").is_file()]
    if not anchors or missing:
        raise resume.cannot_serve(
            folder,
            f"no DCP checkpoint (step-K/.metadata) of anchors {missing}"
            if missing
            else "it lists no anchor",
            "run the control with anchor_every again",
        )
    wrong = resume.differences(saved, wanted)
    if wrong:
        raise resume.cannot_serve(
            folder,
            "its anchors were trained for another run: " + "; ".join(wrong[:4]),
            "take the anchors of this pair's own control"
            + (
                " (keep the control's data-parallel degree)"
                if any(w.startswith("dp_degree") for w in wrong)
                else ""
            ),
        )
    return anchors


def save_anchors(trainer: Any, every: int, confirming: bool = False) -> None:
    """The control, before torchtitan's loop: its checkpointer saves after every ``every``-th
    step (``checkpoint.interval``; with ``confirming``, each one's next step too: the twin
    regime's confirming anchors) but not after the last; rank 0 lists each anchor in the
    manifest once it is written. Always from the seed checkpoint: anchors a previous attempt
    left are never loaded."""
    import torch.distributed as dist

    checkpointer = trainer.checkpointer
    resume.from_the_seed(trainer)
    save = checkpointer.save
    folder = Path(checkpointer.folder)
    written: list[int] = []

    def save_anchor(curr_step: int, last_step: bool = False) -> bool:
        steps = int(trainer.config.training.steps)
        if last_step or not saves_anchor_after(
            curr_step, every=every, confirming=confirming, steps=steps
        ):
            return False
        saved = bool(save(curr_step, last_step=False))
        if saved and (not dist.is_initialized() or dist.get_rank() == 0):
            written.append(curr_step)
            record = {**resume.trainer_manifest(trainer, curr_step), "anchors": written}
            (folder / MANIFEST).write_text(json.dumps(record, indent=1), encoding="utf-8")
        return saved

    # This trainer's checkpointer only (torchtitan 0.3 calls ``save`` after every step).
    checkpointer.save = save_anchor


def train_from_anchors(trainer: Any, folder: str) -> None:
    """The anchored job, in place of torchtitan's loop: one step from each anchor (the module
    docstring)."""
    anchors = check_anchors(folder, resume.trainer_manifest(trainer, 0))
    for anchor in anchors:
        trainer.checkpointer.load(step=anchor)  # model, optimizer, schedule, data, step
        if trainer.step != anchor:
            raise SystemExit(
                f"anchor {folder}/step-{anchor} loaded step {trainer.step}, not {anchor}"
            )
        trainer.step += 1
        trainer.gc_handler.run(trainer.step)
        # A fresh iterator: the dataloader goes on from the position it just loaded.
        batches = trainer.batch_generator(trainer.dataloader)
        trainer.train_step(batches)
        batches.close()


def check_probe_anchor(trainer: Any, path: str) -> None:
    """The anchored check's probe (request resume_from=<anchors>/step<K>, run_dir.anchor_of),
    before torchtitan loads step-K of the anchors folder (``--checkpoint.load_step``): the
    folder holds that anchor, of this run."""
    anchor = anchor_of(Path(path))
    assert anchor is not None
    folder, step = str(anchor[0]), anchor[1]
    if step not in check_anchors(folder, resume.trainer_manifest(trainer, 0)):
        raise resume.cannot_serve(path, f"the control saved no anchor {step}", "probe from one")
