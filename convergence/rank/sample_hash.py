"""The per-sample hash the data fingerprint sums, the same in both trainers: the built-in
trainer's ``read_step`` (convergence/trainer/data.py) and the torchtitan launcher's step log
(convergence/backends/torchtitan/step_log.py) hash each sample's inputs and targets with it, so
the fingerprints of a builtin and a torchtitan job reading the same samples are equal."""

from __future__ import annotations

import hashlib

import torch

#: Per-sample hashes are this many bits, so a sum over 2**15 samples times 2**15 ranks still
#: fits an int64 all-reduce without overflow, and the result (mod 2**48) is exact as a float64
#: in metrics.jsonl.
FINGERPRINT_BITS = 48


def sample_hash(inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Sum over the rows of a per-sample 48-bit hash of its inputs and targets, mod 2**48.

    A sum, so the same samples give the same value whichever rank or microstep holds them; a
    sample read twice (or another sample read instead) changes it.
    """
    rows = torch.cat([inputs, targets], dim=1).cpu().numpy().astype("<i8")
    total = 0
    for row in rows:
        digest = hashlib.blake2b(row.tobytes(), digest_size=8).digest()
        total += int.from_bytes(digest, "little") >> (64 - FINGERPRINT_BITS)
    return total % (1 << FINGERPRINT_BITS)  # 2**48, as an int for the type checker
