"""``python -m convergence.trainer --config X.toml [--section.key=value ...]``."""

from __future__ import annotations

import sys

from convergence.dist_exit import run_and_exit
from convergence.phase_marks import mark, process_start_time
from convergence.spec.errors import SpecError
from convergence.trainer.config import load_train_config


def main(argv: list[str] | None = None) -> int:
    mark("rank_start", at=process_start_time(), cpu_s=0.0)
    args = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in args and not any(a.startswith("--config=") for a in args):
        print(
            "usage: python -m convergence.trainer --config X.toml [--section.key=value ...]",
            file=sys.stderr,
        )
        return 2
    config_path, rest = _split_config(args)
    try:
        cfg = load_train_config(config_path, rest)
        from convergence.trainer import train  # lazy: torch, after cheap argument checks

        mark("rank_imported")

        if cfg.checkpoint.create_seed_checkpoint:
            sha = train.create_seed(cfg)
            print(f"seed checkpoint {cfg.checkpoint.seed_checkpoint} sha256={sha}")
            return 0
        status = train.train(cfg)
    except SpecError as exc:
        print(f"convergence.trainer: invalid config: {exc}", file=sys.stderr)
        return 2
    print(f"convergence.trainer: {status}", file=sys.stderr)
    return 0 if status in ("finished", "stopped", "checkpointed") else 1


def _split_config(args: list[str]) -> tuple[str, list[str]]:
    rest: list[str] = []
    path = ""
    i = 0
    while i < len(args):
        if args[i] == "--config":
            path, i = args[i + 1], i + 2
        elif args[i].startswith("--config="):
            path, i = args[i].split("=", 1)[1], i + 1
        else:
            rest.append(args[i])
            i += 1
    return path, rest


if __name__ == "__main__":
    # Leave without interpreter finalization once outputs are closed: see convergence.dist_exit.
    run_and_exit(main)
