"""The documentation's generated parts: the experiment key table (from the spec) and the option
list (from the option table), so that what the docs promise is what the code accepts.

The site's reference page of the keys (docs/reference/experiment-keys.md) is written by
``python scripts/docs_reference.py`` from :func:`key_table`, and tests/test_docs_site.py fails
when it drifts from the code; a key added to the spec without a line here fails too:
:func:`key_table` refuses to render while a key is undocumented. Any other page may embed a
generated part between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` markers, rewritten in
place by ``python -m convergence.docs FILE``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from convergence.backends.registry import SHIPPED as SHIPPED_BACKENDS
from convergence.checks import all_checks, pair_keys
from convergence.options import OPTIONS, Option
from convergence.regimes import REGISTRY
from convergence.spec.experiment import (
    EXPERIMENT_KEYS,
    JOB_KEYS,
    LAYOUT_KEYS,
    PAIR_KEYS,
    PROBE_MODES,
    RULE_KEYS,
    TECHNIQUE_KEYS,
    TIERS,
)
from convergence.spec.pair import METHODS, METRICS
from convergence.spec.pp_schedules import (
    AT_LEAST_ONE_MICROBATCH_PER_STAGE,
    SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
)
from convergence.spec.resume import RESUME_KEYS


def _names(values: Sequence[str] | frozenset[str], quote: str = "`") -> str:
    ordered = [v for v in SCHEDULES if v in values] if isinstance(values, frozenset) else values
    return ", ".join(f"{quote}{v}{quote}" for v in ordered)


def _code(values: Sequence[str]) -> str:
    return ", ".join(f'`"{v}"`' for v in values)


#: (where, keys, meaning): one row of the key table. Keys are the spec's names.
KeyRow = tuple[str, tuple[str, ...], str]


def key_rows() -> list[KeyRow]:
    """The rows, their values read from the spec (schedules, methods, regimes, tiers...)."""
    return [
        (
            "`[experiment]`",
            ("description", "tier"),
            "optional: a line that describes the file; the tier of every pair in it unless a "
            "pair sets its own",
        ),
        (
            "any job (`[defaults]`, `[control]`, `[[test]]`, `[[sweep]]`)",
            ("train_config",),
            "a shipped config by short name (`debug`, `gpt2_small`; `convergence configs` lists "
            "them) or a TOML path (looked up next to the experiment file, then in each parent "
            "folder up to the rootdir); optional for `torchtitan` (its config is "
            "`backend_options.module` + `config`)",
        ),
        (
            "",
            ("name",),
            "the test's name (the pytest item `file.toml::name`); the control's "
            "defaults to its layout (`fsdp2`)",
        ),
        (
            "",
            ("steps", "seed"),
            "optimizer steps; seed of the weights (seed checkpoint) and the data order",
        ),
        (
            "",
            ("parallelism",),
            f"{_names(LAYOUT_KEYS)}. `pp_schedule`: {_names(SCHEDULES)} (torch's names; "
            f"{_names(ZERO_BUBBLE_SCHEDULES)} defer the weight gradients and run only without "
            f"data or context parallelism in the built-in trainer; {_names(V_SCHEDULES)} hold "
            f"exactly 2 stages per rank). `pp_microbatches`: at least the number of stages for "
            f"{_names(AT_LEAST_ONE_MICROBATCH_PER_STAGE)} (checked at collection)",
        ),
        (
            "",
            ("techniques",),
            f"{_names(TECHNIQUE_KEYS)}. `param_dtype`/`reduce_dtype` are FSDP2's mixed "
            f"precision (need `dp_shard*cp > 1`); `activation_checkpoint`: none, full or "
            f"selective; `float8` (none, tensorwise, rowwise), `float8_all_gather`, `mxfp8`: "
            f"torchao's low-precision linears, judged by the margin regime (docs/precision.md)",
        ),
        (
            "",
            ("local_batch_size",),
            "samples per DP rank per microstep (default: the train config's)",
        ),
        (
            "",
            ("hook", "hook_mode"),
            'your parallelism: `"package.module:function"`; `after` (default: after the '
            "built-in parallelisation) or `replace_tp` (in place of the built-in TP plan)",
        ),
        (
            "",
            ("overrides",),
            'any trainer setting, `{ "optimizer.lr" = 1e-3 }`, or a command-line option string '
            'as torchtitan takes it, `"--training.seq_len=256 --compile.enable"` (split like a '
            "shell would, never run through one)",
        ),
        (
            "",
            ("backend", "backend_options"),
            f"{_names(tuple(SHIPPED_BACKENDS))} (default `builtin`). `command`: "
            f"`backend_options.command` is an "
            f'argv list (`["python", "train.py", "--out", "{{dump_dir}}"]`) or one string '
            f"split like a shell, never run through one; `keys.<metric>` maps your trainer's "
            f"metric names to ours",
        ),
        (
            "test / defaults",
            ("compare",),
            f'per metric ({_names(METRICS)}): {_code(METHODS)}, `"off"` or a table '
            f'`{{ method = "allclose", rtol = 1e-3 }}` (keys: {_names(RULE_KEYS)}). A metric '
            f"named here that a run does not log is an error; a default one is reported as "
            f'"not compared"',
        ),
        (
            "",
            ("regime",),
            f"{_names(REGISTRY.names())}: `paired` (same seed checkpoint and data, compared step by step "
            f"at the fp32 noise floor), `twin` (same seed checkpoint and data, not bitwise "
            f"reproducible: the envelope is measured on a twin of the control that differs only "
            f"by legitimate rounding) or `seed` (K control replicates with other seeds form a "
            f"band); default: paired when both sides are deterministic fp32, twin when they "
            f"share the seed otherwise (bf16, compile, nondeterministic kernels; built-in "
            f"trainer and torchtitan, whose backends derive the twin), seed when the seeds "
            f"differ or the backend derives no twin (command)",
        ),
        (
            "",
            ("replicates", "early_stop", "golden", "tier"),
            f"seed-band size (default 3); stop a hopeless test early (default true); compare "
            f"against a golden curve file instead of a control run; {_names(TIERS)}",
        ),
        (
            "",
            ("probe", "probe_on_failure"),
            f"the numerics probe (built-in or torchtitan jobs on both sides): {_code(PROBE_MODES)} "
            f"(default `on_failure`: a failed paired or twin pair is probed); `probe_on_failure "
            f'= false` is `probe = "off"`',
        ),
        # The checks' own pair keys, documented by their check (convergence/checks/).
        *(("", (key,), doc) for check in all_checks() for key, doc in check.keys.items()),
        (
            "test",
            ("resume",),
            f"a table ({_names(RESUME_KEYS)}): train `at_step` steps, write a training "
            f"checkpoint, resume on `parallelism` (a whole layout; default: the side's) with "
            f"`techniques` merged into the side's and `local_batch_size` (keep the tokens per "
            f"step) to the end; one curve against the uninterrupted control. Built-in trainer "
            f"and torchtitan (its own DCP checkpoint; the DP degree stays the same)",
        ),
    ]


#: Where a table of the spec is documented, and which keys it must cover.
COVERED: Mapping[str, tuple[str, ...]] = {
    "[experiment]": EXPERIMENT_KEYS,
    "job": JOB_KEYS,
    "pair": (*PAIR_KEYS, *pair_keys()),
    "parallelism": LAYOUT_KEYS,
    "techniques": TECHNIQUE_KEYS,
    "compare": RULE_KEYS,
    "methods": METHODS,
    "regimes": REGISTRY.names(),
    "pp_schedule": SCHEDULES,
    "resume": RESUME_KEYS,
}


def undocumented(rows: Sequence[KeyRow]) -> list[str]:
    """Spec keys and values that no row names (each must appear in backquotes)."""
    text = " ".join(" ".join(f"`{k}`" for k in keys) + " " + meaning for _, keys, meaning in rows)
    return [
        f"{table}.{key}"
        for table, keys in COVERED.items()
        for key in keys
        if f"`{key}`" not in text and f'`"{key}"`' not in text
    ]


def key_table() -> str:
    rows = key_rows()
    missing = undocumented(rows)
    if missing:
        raise ValueError(
            f"the key table: undocumented spec keys {', '.join(missing)}; "
            f"add them to convergence/docs.py key_rows()"
        )
    lines = ["| where | key | meaning |", "|---|---|---|"]
    lines += [
        f"| {where} | {', '.join(f'`{k}`' for k in keys)} | {meaning} |"
        for where, keys, meaning in rows
    ]
    return "\n".join(lines)


def _metavar(opt: Option) -> str:
    if opt.kind == "bool":
        return ""
    if opt.kind == "choice":
        return " " + "|".join(opt.choices)
    if opt.kind == "path":
        return " DIR"
    if opt.name.endswith("limit"):
        return " S"
    return " N" if opt.kind in ("int", "float") and opt.name != "alpha" else " A"


def option_list() -> str:
    """One line per option of the shared table: flag, value, help (pytest's wording)."""
    return "\n".join(f"- `--convergence-{opt.name}{_metavar(opt)}`: {opt.help}" for opt in OPTIONS)


PARTS: Mapping[str, Callable[[], str]] = {"keys": key_table, "options": option_list}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {name}:begin -->\n)(.*?)(<!-- {name}:end -->)", re.DOTALL)


def render(text: str) -> str:
    """``text`` with every generated part it marks rewritten; a page that marks none is an
    error (nothing to generate there)."""
    found = False
    for name, make in PARTS.items():
        match = _block(name).search(text)
        if match is None:
            continue
        found = True
        text = text[: match.start(2)] + make() + "\n" + text[match.end(2) :]
    if not found:
        names = ", ".join(f"<!-- {name}:begin -->" for name in PARTS)
        raise ValueError(f"no generated part to rewrite: the page marks none of {names}")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(
            "usage: python -m convergence.docs FILE (the site's reference pages: "
            "python scripts/docs_reference.py)",
            file=sys.stderr,
        )
        return 2
    path = Path(args[0])
    old = path.read_text(encoding="utf-8")
    new = render(old)
    if new != old:
        path.write_text(new, encoding="utf-8")
        print(f"{path}: generated parts rewritten")
    else:
        print(f"{path}: up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
