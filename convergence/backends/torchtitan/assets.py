"""The tokenizer and corpus a torchtitan job trains on by default: a tiny word-level
tokenizer and a synthetic corpus, generated once per machine under ``assets_dir`` (the wheel
ships neither torchtitan's ``tests/assets`` tokenizer nor its c4_test data)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path

from convergence.spec.job import JobSpec

ASSETS_VERSION = "v1"


def assets_root(job: JobSpec) -> Path:
    """Generated tokenizer/corpus folder (shared by every job; absolute)."""
    explicit = dict(job.backend_options).get("assets_dir")
    if explicit:
        return Path(explicit).expanduser().resolve()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "pytest-convergence" / f"torchtitan-assets-{ASSETS_VERSION}"


def asset_paths(job: JobSpec) -> tuple[str, str]:
    """(hf_assets_path, dataset_path) the job trains with."""
    options = dict(job.backend_options)
    root = assets_root(job)
    return (
        options.get("hf_assets_path", str(root / "tokenizer")),
        options.get("dataset_path", str(root / "corpus")),
    )


BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
NUM_WORDS = 1000  # + specials, below the debug model's 2048-token vocabulary


def _words() -> list[str]:
    rng = random.Random(7)
    letters = "etaoinshrdlucmfwypvbgk"
    words: set[str] = set()
    while len(words) < NUM_WORDS:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))))
    return sorted(words)


SUCCESSORS = 6  # likely successors of each word
P_SUCCESSOR = 0.9  # else any word, uniformly


def entropy_floor() -> float:
    """The corpus's entropy per token in nats, from the chain itself: the next word is one of
    SUCCESSORS with probability P_SUCCESSOR/SUCCESSORS + (1-P_SUCCESSOR)/NUM_WORDS each, any
    other with (1-P_SUCCESSOR)/NUM_WORDS. A lower bound on any model's loss (document
    boundaries only add entropy): the control-health check measures progress toward it (a
    debug model closes ~7% of its gap in 30 steps) and calls a loss far below it a leak."""
    rare = (1 - P_SUCCESSOR) / NUM_WORDS
    likely = P_SUCCESSOR / SUCCESSORS + rare
    return -(
        SUCCESSORS * likely * math.log(likely) + (NUM_WORDS - SUCCESSORS) * rare * math.log(rare)
    )


def _corpus(words: list[str], *, num_docs: int = 2000) -> list[str]:
    """A first-order Markov chain over the words: each word has a few likely successors, so a
    model has something to learn and the loss keeps falling for hundreds of steps."""
    rng = random.Random(11)
    successors = {w: rng.sample(words, SUCCESSORS) for w in words}
    docs = []
    for _ in range(num_docs):
        word = rng.choice(words)
        out = [word]
        for _ in range(rng.randint(150, 450)):
            word = rng.choice(successors[word]) if rng.random() < P_SUCCESSOR else rng.choice(words)
            out.append(word)
        docs.append(" ".join(out))
    return docs


def ensure_assets(root: Path) -> Path:
    """Create (once, atomically) ``root/tokenizer`` and ``root/corpus``."""
    if (root / "DONE").is_file():
        return root
    from tokenizers import Tokenizer, models, pre_tokenizers  # a torchtitan dependency

    words = _words()
    build = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    (build / "tokenizer").mkdir(parents=True)
    (build / "corpus").mkdir()
    vocab = {tok: i for i, tok in enumerate([UNK, BOS, EOS, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(build / "tokenizer" / "tokenizer.json"))
    (build / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": BOS,
                "eos_token": EOS,
                "unk_token": UNK,
                "add_bos_token": True,
                "add_eos_token": True,
            }
        )
    )
    with (build / "corpus" / "data.jsonl").open("w") as fh:
        for doc in _corpus(words):
            fh.write(json.dumps({"text": doc}) + "\n")
    (build / "DONE").write_text(ASSETS_VERSION)
    try:
        build.rename(root)
    except OSError:  # another process won the race: theirs is identical
        shutil.rmtree(build, ignore_errors=True)
    return root
