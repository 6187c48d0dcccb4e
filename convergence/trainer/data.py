"""Training data addressed by global sample index, so every layout reads the same samples.

Optimizer step s (1-based) with global batch B = local_batch_size * dp * grad_accum_steps reads
samples [(s-1)*B, s*B) of the sample order; microstep m reads its contiguous slice of
local_batch_size * dp samples, and dp rank r its contiguous local_batch_size slice of that.
Whatever the DP degree, accumulation or microbatching, the union over ranks and microsteps of
one optimizer step is the same set of samples -- the precondition for comparing layouts.

Two sources:
- "synthetic": a seeded Markov language. Its entropy floor sum_i pi_i H(P_i) (pi the stationary
  distribution, P_i the transition row of token i) is the exact expected loss of the optimal
  predictor, because every sample starts from a stationary draw: no correct run can go below.
  Two options give the language structure that only attention to an exact earlier position
  can use (both off in the shipped configs):
  - `data.lag` = k: token t is drawn from the transition row of token t-k (k interleaved
    chains, each started from a stationary draw); with k = 1 a plain chain.
  - `data.copy_span` = N: the first N tokens are uniform and the last N repeat them, at the
    distance D = seq_len+1-N (token t = token t-D for t >= D); the chain runs in between.
  The floor stays exact, position by position (every chain token is a stationary draw):
  targets 1..N-1 cost log(vocab), the N..N+k-1 chain starts H(pi), the other chain steps
  H = sum_i pi_i H(P_i), the copies 0; entropy_floor is their mean over the seq_len targets.
  With padding (pad_fraction) the later, copied targets are cut more often, so the true floor
  is a little higher: the value stays a valid lower bound.

  Measured (BENCHMARKS.md): on the debug model, 30 steps, neither option makes a rotary
  position bug under CP show in the loss earlier than on the plain chain (step 27-28 vs 16;
  copy_span 16: not at all): the tiny model does not learn positional attention that fast.
  What catches it at step 1 is the per-part gradient norm (rank/norms.py grad_norms).
- "text": a local file, byte-level (vocab 256) or tokenised with a tokenizer.json file; windows
  of seq_len+1 tokens in a seeded order per epoch; the tail `val_fraction` is held out.

Padding (`data.pad_fraction`, synthetic): a sample may be cut at a seeded random length; the
positions after the cut hold IGNORE_INDEX, so its targets there are ignored by the loss and its
inputs there are token 0. Ranks then hold different numbers of valid tokens, which is what the
trainer's global token weighting (loss.py) must get right.

The loop, validation and the numerics probe all read an optimizer step through `read_step`, which
also returns the step's data fingerprint: one path, so a data bug shows in the fingerprint that
the verdict compares, and the probe sees the very batches the loop trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from convergence.rank.sample_hash import FINGERPRINT_BITS, sample_hash
from convergence.spec.errors import SpecError
from convergence.trainer.config import TrainConfig

TRAIN, VAL = 0, 1
#: Label of a position that carries no loss (padding): torch's cross_entropy default.
IGNORE_INDEX = -100
#: Above this vocabulary the synthetic language uses sparse rows (this many successors each).
DENSE_VOCAB_LIMIT = 1024
SPARSE_SUCCESSORS = 64


class SampleSource(Protocol):
    """Samples by index: (n, seq_len+1) int64 tokens; inputs are [:, :-1], targets [:, 1:]."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def entropy_floor(self) -> float | None: ...

    def samples(self, indices: np.ndarray, split: int) -> np.ndarray: ...


@dataclass(frozen=True, kw_only=True)
class MarkovLanguage:
    """First-order Markov chain over `vocab_size` tokens with Dirichlet(concentration) rows."""

    vocab_size: int
    seq_len: int
    successors: np.ndarray
    """(vocab, k) int64: the tokens each token can be followed by."""
    cum_probs: np.ndarray
    """(vocab, k) float64: cumulative transition probabilities over `successors`."""
    stationary: np.ndarray
    """(vocab,) float64: stationary distribution pi."""
    entropy_floor: float
    """sum_i pi_i H(P_i) in nats/token."""
    order_seed: int
    """training.seed: picks which sample each global index is (the sample order)."""
    pad_fraction: float = 0.0
    """Fraction of samples cut short with IGNORE_INDEX after the cut (module docstring)."""
    copy_span: int = 0
    """Last tokens of each sample that repeat its first ones (module docstring)."""
    lag: int = 1
    """Token t follows the chain from token t-lag (lag interleaved chains; module docstring)."""
    markov_entropy: float = 0.0
    """H = sum_i pi_i H(P_i): the floor per Markov target (entropy_floor without copies)."""

    @classmethod
    def build(
        cls,
        *,
        vocab_size: int,
        seq_len: int,
        seed: int,
        concentration: float,
        order_seed: int,
        pad_fraction: float = 0.0,
        copy_span: int = 0,
        lag: int = 1,
    ) -> MarkovLanguage:
        rng = np.random.default_rng(seed)
        k = vocab_size if vocab_size <= DENSE_VOCAB_LIMIT else SPARSE_SUCCESSORS
        if k == vocab_size:
            successors = np.tile(np.arange(vocab_size), (vocab_size, 1))
        else:
            successors = np.stack(
                [rng.choice(vocab_size, size=k, replace=False) for _ in range(vocab_size)]
            )
        probs = rng.dirichlet(np.full(k, concentration), size=vocab_size)
        # A tiny floor keeps every row's support full, so the chain is irreducible and
        # aperiodic and pi is unique; renormalised so rows sum to 1 exactly.
        probs = probs + 1e-6
        probs /= probs.sum(axis=1, keepdims=True)
        stationary = _stationary(successors, probs, vocab_size)
        row_entropy = -(probs * np.log(probs)).sum(axis=1)
        cum = np.cumsum(probs, axis=1)
        cum[:, -1] = 1.0
        markov = float(stationary @ row_entropy)
        return cls(
            vocab_size=vocab_size,
            seq_len=seq_len,
            successors=successors,
            cum_probs=cum,
            stationary=stationary,
            entropy_floor=_floor(markov, stationary, vocab_size, seq_len, copy_span, lag),
            order_seed=order_seed,
            pad_fraction=pad_fraction,
            copy_span=copy_span,
            lag=lag,
            markov_entropy=markov,
        )

    def samples(self, indices: np.ndarray, split: int) -> np.ndarray:
        # One independent generator per (language, order seed, split, sample index): sample i
        # is the same tokens whichever rank or microstep asks for it.
        uniforms = np.stack(
            [
                np.random.default_rng([self.order_seed, split, int(i)]).random(self.seq_len + 1)
                for i in indices
            ]
        )
        stationary_cum = np.cumsum(self.stationary)
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        n, lag = self.copy_span, self.lag
        # The span to copy: uniform tokens, so nothing but attention to it predicts the copy.
        out[:, :n] = np.minimum(
            (uniforms[:, :n] * self.vocab_size).astype(np.int64), self.vocab_size - 1
        )
        # The chain: `lag` interleaved Markov chains, each started from a stationary draw.
        out[:, n : n + lag] = np.minimum(
            np.searchsorted(stationary_cum, uniforms[:, n : n + lag], side="right"),
            self.vocab_size - 1,
        )
        for t in range(n + lag, self.seq_len + 1):
            cum = self.cum_probs[out[:, t - lag]]
            pick = (cum <= uniforms[:, t : t + 1]).sum(axis=1)
            out[:, t] = self.successors[out[:, t - lag], np.minimum(pick, cum.shape[1] - 1)]
        if n:
            out[:, self.seq_len + 1 - n :] = out[:, :n]
        if self.pad_fraction > 0:
            pad_tail(out, indices, self.pad_fraction, [self.order_seed, split])
        return out


def _floor(
    markov: float, stationary: np.ndarray, vocab: int, seq_len: int, copy_span: int, lag: int
) -> float:
    """Expected loss per target of the optimal predictor (module docstring)."""
    if copy_span == 0 and lag == 1:
        return markov  # every target is a chain step
    positive = stationary[stationary > 0]
    fresh = float(-(positive * np.log(positive)).sum())
    n, distance = copy_span, seq_len + 1 - copy_span
    total = 0.0
    for t in range(1, seq_len + 1):
        if t < n:
            total += math.log(vocab)  # the span to copy: uniform, unpredictable
        elif t < n + lag:
            total += fresh  # a chain's stationary start: independent of the past
        elif t < distance:
            total += markov  # a chain step: H given the token `lag` back
        # else a copy of the token `distance` back: 0 for the optimal predictor
    return total / seq_len


def pad_tail(out: np.ndarray, indices: np.ndarray, fraction: float, seed: list[int]) -> None:
    """Cut a seeded `fraction` of the samples after 1..seq_len valid targets (in place).

    Own generator per sample (not the token stream's), so padding never changes the tokens
    before the cut and a sample is padded alike whichever rank reads it.
    """
    seq_len = out.shape[1] - 1
    for row, index in enumerate(indices):
        rng = np.random.default_rng([*seed, int(index), 1])
        if rng.random() < fraction:
            num_valid = int(rng.integers(1, seq_len + 1))
            out[row, num_valid + 1 :] = IGNORE_INDEX


def _stationary(successors: np.ndarray, probs: np.ndarray, vocab: int) -> np.ndarray:
    """pi with pi = pi P, by power iteration (converges: the chain is irreducible, aperiodic)."""
    pi = np.full(vocab, 1.0 / vocab)
    for _ in range(10_000):
        new = np.bincount(
            successors.ravel(), weights=(pi[:, None] * probs).ravel(), minlength=vocab
        ).astype(np.float64)  # float already (weights)
        new /= new.sum()
        if np.abs(new - pi).max() < 1e-15:
            return new
        pi = new
    return pi


@dataclass(frozen=True, kw_only=True)
class TextSource:
    """Windows of a tokenised local file; a seeded permutation of windows per epoch."""

    vocab_size: int
    seq_len: int
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    order_seed: int
    entropy_floor: float | None = None

    def samples(self, indices: np.ndarray, split: int) -> np.ndarray:
        tokens = self.train_tokens if split == TRAIN else self.val_tokens
        num_windows = (len(tokens) - 1) // self.seq_len
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            epoch, pos = divmod(int(index), num_windows)
            if split == TRAIN:
                # A fresh permutation per epoch, the same one on every rank and layout.
                pos = int(
                    np.random.default_rng([self.order_seed, epoch]).permutation(num_windows)[pos]
                )
            start = pos * self.seq_len
            out[row] = tokens[start : start + self.seq_len + 1]
        return out


def _tokenize(text: str, tokenizer: str, base: Path) -> tuple[np.ndarray, int]:
    if tokenizer == "byte":
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64), 256
    path = Path(tokenizer)
    path = path if path.is_absolute() else base / path
    try:
        from tokenizers import Tokenizer  # optional dependency, only for tokenizer files
    except ImportError as exc:
        raise SpecError(
            "the 'tokenizers' package is needed for a tokenizer file",
            key="data.tokenizer",
            fix='pip install tokenizers, or use "byte"',
        ) from exc
    tok = Tokenizer.from_file(str(path))
    return np.asarray(tok.encode(text).ids, dtype=np.int64), tok.get_vocab_size()


def _check_ranges(cfg: TrainConfig) -> None:
    """The synthetic source's knobs, each inside the range it is defined on."""
    data, half = cfg.data, cfg.data.seq_len // 2
    ranges = (
        ("pad_fraction", 0.0 <= data.pad_fraction < 1.0, "[0, 1)", "use 0 (no padding) up to 0.99"),
        (
            "lag",
            1 <= data.lag <= half,
            f"[1, seq_len // 2 = {half}]",
            "use 1 (a plain Markov chain) or a small lag such as 2 or 3",
        ),
        (
            "copy_span",
            0 <= data.copy_span <= half,
            f"[0, seq_len // 2 = {half}]",
            f"use 0 (pure Markov) up to {half}",
        ),
    )
    for key, inside, interval, fix in ranges:
        if not inside:
            raise SpecError(
                f"{key}={getattr(data, key)} is not in {interval}",
                file=cfg.source,
                key=f"data.{key}",
                fix=fix,
            )


def build_source(cfg: TrainConfig) -> SampleSource:
    data = cfg.data
    _check_ranges(cfg)
    if data.source == "synthetic":
        return MarkovLanguage.build(
            vocab_size=cfg.model.vocab_size,
            seq_len=data.seq_len,
            seed=data.seed,
            concentration=data.synthetic_concentration,
            order_seed=cfg.training.seed,
            pad_fraction=data.pad_fraction,
            copy_span=data.copy_span,
            lag=data.lag,
        )
    for key, default in (("pad_fraction", 0), ("copy_span", 0), ("lag", 1)):
        if getattr(data, key) != default:
            raise SpecError(
                f"{key} applies to the synthetic source only",
                file=cfg.source,
                key=f"data.{key}",
                fix='remove it, or use data.source = "synthetic"',
            )
    base = Path(cfg.source).parent if cfg.source else Path.cwd()
    path = Path(data.path) if Path(data.path).is_absolute() else base / data.path
    if not path.is_file():
        raise SpecError(
            f"text file {str(path)!r} not found",
            file=cfg.source,
            key="data.path",
            fix="point data.path at a local UTF-8 text file",
        )
    tokens, vocab = _tokenize(path.read_text(encoding="utf-8"), data.tokenizer, base)
    if vocab > cfg.model.vocab_size:
        raise SpecError(
            f"tokenizer has {vocab} tokens but the model only {cfg.model.vocab_size}",
            file=cfg.source,
            key="model.vocab_size",
            fix=f"set it to >= {vocab}",
        )
    num_val = max(data.seq_len + 1, int(len(tokens) * data.val_fraction))
    if len(tokens) - num_val < 2 * (data.seq_len + 1):
        raise SpecError(
            "text file too short for seq_len",
            file=cfg.source,
            key="data.path",
            fix="use a longer file or a smaller data.seq_len",
        )
    return TextSource(
        vocab_size=cfg.model.vocab_size,
        seq_len=data.seq_len,
        train_tokens=tokens[:-num_val],
        val_tokens=tokens[-num_val:],
        order_seed=cfg.training.seed,
    )


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """Which global sample indices a rank reads: the arithmetic of the module docstring."""

    local_batch_size: int
    dp: int
    dp_rank: int
    grad_accum_steps: int
    offset: int = 0
    """Shift of every index: the data position a resume restored minus where its step count
    puts it (convergence.trainer.resume). 0 in a run that was not resumed -- and in a correct
    resume, which continues at sample step * global_batch_size."""

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.dp * self.grad_accum_steps

    def indices(self, step: int, microstep: int) -> np.ndarray:
        """Sample indices of optimizer `step` (1-based), `microstep` (0-based), this rank."""
        start = (
            self.offset
            + (step - 1) * self.global_batch_size
            + microstep * self.local_batch_size * self.dp
            + self.dp_rank * self.local_batch_size
        )
        return np.arange(start, start + self.local_batch_size)


Batch = tuple[torch.Tensor, torch.Tensor]


def get_batch(source: SampleSource, indices: np.ndarray, split: int, device: torch.device) -> Batch:
    """(inputs, targets), each (n, seq_len) int64 on `device`; padded inputs read token 0."""
    tokens = torch.from_numpy(source.samples(indices, split))
    return tokens[:, :-1].clamp(min=0).to(device), tokens[:, 1:].to(device)


@dataclass(frozen=True, kw_only=True)
class StepData:
    """What one optimizer step (or one validation batch) reads, on this rank."""

    batches: list[Batch]
    """(inputs, targets) of every microstep, this data-parallel rank's samples."""
    num_tokens: int
    """Valid targets (!= IGNORE_INDEX) of the whole global batch, all ranks and microsteps."""
    fingerprint: int
    """Order-independent hash of the global batch's inputs and targets (FINGERPRINT_BITS)."""


def read_step(
    source: SampleSource,
    plan: BatchPlan,
    step: int,
    split: int,
    device: torch.device,
    data_group: dist.ProcessGroup | None,
) -> StepData:
    """Every microstep's batch of optimizer `step` (1-based), plus the global valid-token count
    and fingerprint: one int64 all-reduce over the data-parallel ranks (`data_group`, None when
    there is one). Ranks that share samples (TP, CP, PP peers) reduce in their own data group,
    so each counts the samples once."""
    batches = [
        get_batch(source, plan.indices(step, micro), split, device)
        for micro in range(plan.grad_accum_steps)
    ]
    num_tokens = sum(int((targets != IGNORE_INDEX).sum()) for _, targets in batches)
    fingerprint = sum(sample_hash(inputs, targets) for inputs, targets in batches)
    totals = torch.tensor(
        [num_tokens, fingerprint % 2**FINGERPRINT_BITS], dtype=torch.int64, device=device
    )
    if data_group is not None:
        dist.all_reduce(totals, group=data_group)
    return StepData(
        batches=batches, num_tokens=int(totals[0]), fingerprint=int(totals[1]) % 2**FINGERPRINT_BITS
    )
