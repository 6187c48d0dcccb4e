"""torchtitan (0.3.x, the ``torchtitan`` extra) as a backend.

A job becomes ``torchrun ... -m torchtitan.train --module M --config C [overrides]``. In 0.3.0
a config is a Python function in a model's ``config_registry`` (``llama3`` /
``llama3_debugmodel``), parsed by ``torchtitan.config.ConfigManager`` with tyro; overrides are
``--section.key=value``, booleans are flags (``--debug.deterministic`` /
``--debug.no-deterministic``) and the activation checkpoint mode is a tyro subcommand
(``activation-checkpoint:none``) that must come after every other option.

    [defaults]
    backend = "torchtitan"
    train_config = "debug_1gpu.toml"     # hashed into the run-cache key, not parsed
    backend_options = { module = "llama3", config = "llama3_debugmodel" }
    overrides = { "training.seq_len" = 256 }

``backend_options``: ``module``, ``config``, ``hf_assets_path`` and ``dataset_path`` (default: a
tiny word-level tokenizer and a synthetic corpus generated once under ``assets_dir``, because
the wheel ships neither torchtitan's ``tests/assets`` tokenizer nor its c4_test data),
``dataset`` (a torchtitan dataset name, default ``c4_test``: a local JSON-lines loader),
``assets_dir``.

Seed checkpoint, the torchtitan way: one process (``torchrun --nproc-per-node 1``) with
``--checkpoint.enable --checkpoint.create_seed_checkpoint`` writes ``<seed>/checkpoint/step-0``;
every layout loads it with ``--checkpoint.initial_load_path`` (model only) and
``--checkpoint.load_only`` (no saves).

Metrics: TensorBoard under ``<dump>/tb/<timestamp>/`` (torchtitan's tags; with PP the last
stage's rank logs the loss; the learning rate as ``lr/<optimizer class>``), read at the
precision torchtitan writes them (float32 ``add_scalar``).

Live metrics: the TensorBoard folder is tailed while the job runs (convergence.metrics.tb_tail:
torchtitan's writer appends each step's scalars to the event file as they come, despite its
``flush_secs=120``), so a torchtitan job shows progress with an ETA, is stopped at a NaN loss
or when the sequential test has decided (no stop request exists in torchtitan: the job's
processes are ended), and is idle-limited from its first step on. The console line is not
used: it prints the loss with 5 decimals, coarser than the paired tolerance (~1e-5).

One module per concern: ``argv`` (a job as torchtitan's command line), ``config_parser``
(torchtitan's own tyro parser, its messages mapped back to experiment keys), ``assets`` (the
synthetic tokenizer and corpus), ``degrees`` (parallel degrees against the model), ``backend``
(the Backend class), ``launch`` (the entry point of every job, a wrapper of torchtitan.train),
``model_parts`` and ``step_log`` (what the wrapper adds to each model part and step), and
``patches`` (every change to torchtitan's and torch's modules, with the versions each is for).
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torchtitan") is None:  # get_backend turns this into a SpecError
    raise ImportError("torchtitan is not installed")

from convergence.backends.torchtitan.backend import TorchtitanBackend

__all__ = ["TorchtitanBackend"]
