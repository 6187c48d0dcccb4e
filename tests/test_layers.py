"""The library's layers, enforced: every import of ``convergence`` by ``convergence`` goes down
(or sideways within a layer), and there is no import cycle, between modules or between
packages.

Every import counts -- at the top of a module, inside a function (lazy), or under
``TYPE_CHECKING`` -- so a lazy import cannot hide a cycle. A lazy import is only for cost, and
this checks that too: what it imports must pull in a costly third-party package (torch, scipy,
matplotlib, ...) that the importing module does not already load at its top.

``convergence/report`` has its own finer layering (tests/test_report_layers.py).
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "convergence"

#: Bottom to top. A unit (a subpackage, or a module directly under convergence/) imports only
#: units of its own layer or below; ``convergence`` itself is the package's __init__ (the
#: version).
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "convergence",
        "configs",
        "process_lifetime",
        "dist_exit",
        "torch_info",
        "torchao_info",
        "phase_marks",
    ),
    ("spec",),  # parsed experiments: stdlib, configs
    ("rank",),  # what runs inside a training rank, for any trainer (both trainers use it)
    ("trainer",),  # the built-in trainer (runs under torchrun)
    ("metrics",),  # curves and their readers (JSONL, TensorBoard, golden)
    ("regimes",),  # paired / twin / seed: rules, control jobs, checks, policies
    ("launch",),  # torchrun / srun processes, pool, watchdog
    ("cache",),  # the run cache
    ("calibration",),  # floors measured on this stack (file, selection); stats reads them
    ("stats",),  # comparisons, sequential monitor, health, provenance
    ("backends",),  # how a job becomes a command (builtin, torchtitan, command)
    ("checks",),  # evidence beside the rules (anchored, resumed): described, the Runner runs it
    ("preflight",),  # the checks that need backends or devices
    ("run",),  # the spine: jobs, pairs, probe, outcomes
    ("report",),  # terminal, JSON/MD/HTML, plots
    ("options",),  # the one option table (plugin, CLI)
    ("docs",),  # the docs' generated parts (key table, option list)
    (
        "nightly",
        "worktrees",
        "bisection",
        "calibration_runs",
        "selftest",
    ),  # the nightly; commits in git; the suite's power on the user's experiment
    # worktrees; the first commit a pair fails at; the calibration's pairs, run and measured
    ("cli",),  # the `convergence` command: one module per subcommand (cli/)
)

#: Third-party packages whose import costs seconds (or is optional): the only reason for a
#: function-local import of our own modules.
COSTLY = frozenset({"torch", "scipy", "matplotlib", "numpy", "torchtitan", "tensorboard", "triton"})

FORBIDDEN = ("pytest", "_pytest", "pytest_convergence")
"""The library never imports pytest or the plugin."""


def _modules() -> dict[str, Path]:
    # The shipped train configs' package lives in the top-level train_configs/ folder
    # (pyproject.toml's package-dir mapping installs it as convergence.configs).
    out = {"convergence.configs": REPO / "train_configs" / "__init__.py"}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module an import names (``from a.b import c``: a.b.c when a module, else a.b)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@cache
def _imports(module: str) -> tuple[tuple[str, int, bool], ...]:
    """(imported name, line, at the top) for every import in ``module`` (TYPE_CHECKING blocks
    count as the top: they are no cost, but they are a dependency)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    top = {id(node) for node in tree.body}
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            top.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from a import b``: the submodule a.b where b is one, else a itself.
            subs = [
                f"{node.module}.{a.name}"
                for a in node.names
                if f"{node.module}.{a.name}" in MODULES
            ]
            names = subs if len(subs) == len(node.names) else [node.module, *subs]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.extend((name, node.lineno, id(node) in top) for name in names)
    return tuple(found)


@cache
def _typing_only(module: str) -> frozenset[int]:
    """The lines of ``module``'s imports under ``TYPE_CHECKING``: a dependency, but no cost."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    return frozenset(
        n.lineno
        for node in tree.body
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    )


def _graph(*, top_only: bool = False) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        deps = {
            _resolve(name)
            for name, _, at_top in _imports(module)
            if name.startswith("convergence") and (at_top or not top_only)
        }
        # A package's __init__ is imported with each of its submodules: an edge from a module
        # to its own package (or a package to its submodule) is no dependency between units.
        graph[module] = {d for d in deps if d and d != module and not module.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for dep in edges:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(graph.get(dep, ())))))
                    break
                if dep in on_stack:
                    low[node] = min(low[node], index[dep])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_every_unit_has_a_layer() -> None:
    layered = [unit for layer in LAYERS for unit in layer]
    assert len(layered) == len(set(layered))
    units = {_unit(m) for m in MODULES}
    assert units - set(layered) == set(), "give each new package a layer in LAYERS"
    assert set(layered) - units == set(), "LAYERS names a package that is gone"


def test_imports_go_down_the_layers() -> None:
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    upward = []
    for module, deps in _graph().items():
        for dep in deps:
            if level[_unit(dep)] > level[_unit(module)]:
                upward.append(f"{module} ({_unit(module)}) imports {dep} ({_unit(dep)})")
    assert upward == [], "imports that climb a layer:\n" + "\n".join(sorted(upward))


def test_no_cycle_between_modules() -> None:
    assert _cycles(_graph()) == []


def test_no_cycle_between_packages() -> None:
    units: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        units.setdefault(_unit(module), set()).update(
            _unit(d) for d in deps if _unit(d) != _unit(module)
        )
    assert _cycles(units) == []


def test_the_library_never_imports_pytest_or_the_plugin() -> None:
    found = [
        f"{m}:{line} {name}"
        for m in MODULES
        for name, line, _ in _imports(m)
        if name.split(".")[0] in FORBIDDEN
    ]
    assert found == []


def _third_party_at_top(module: str, seen: set[str] | None = None) -> set[str]:
    """Third-party top-level packages loaded by importing ``module`` (its top-level imports,
    followed through our own modules and their packages' __init__)."""
    seen = set() if seen is None else seen
    if module in seen:
        return set()
    seen.add(module)
    found: set[str] = set()
    parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
    for parent in parents:
        found |= _third_party_at_top(parent, seen)
    for name, line, at_top in _imports(module):
        if not at_top or line in _typing_only(module):
            continue  # imported when run, or only by the type checker: no cost at import
        if name.startswith("convergence"):
            target = _resolve(name)
            if target:
                found |= _third_party_at_top(target, seen)
        elif name.split(".")[0] not in sys.stdlib_module_names and name != "__future__":
            found.add(name.split(".")[0])
    return found


def test_lazy_imports_are_for_cost() -> None:
    """A function-local import of our own module must save a costly package that the
    importing module does not load anyway; else it belongs at the top."""
    pointless = []
    for module in MODULES:
        loaded = _third_party_at_top(module)
        for name, line, at_top in _imports(module):
            if at_top or not name.startswith("convergence"):
                continue
            target = _resolve(name)
            saved = (_third_party_at_top(target) - loaded) & COSTLY if target else set()
            if not saved:
                pointless.append(f"{module}:{line} {name}")
    assert pointless == [], (
        "lazy imports that save no costly package (move them to the "
        "top):\n" + "\n".join(sorted(set(pointless)))
    )


#: ``convergence/run`` in levels, bottom to top: a run module imports run modules of its own
#: level or below ("level", not "tier": a tier is the quick/ci/nightly selection). The job level (jobs.py: cache, pool, launcher, seed checkpoint, job keys,
#: cached runs) knows nothing of pairs; the probe and a resuming side use it alone; the pair
#: level (runner.py: controls, monitoring, verdicts, golden, localisation) sits on top.
RUN_LEVELS: tuple[tuple[str, ...], ...] = (
    # what reports read; the one judge and the one status; jobs at once (together: no job
    # or pair of its own)
    ("outcome", "probe_compare", "judge", "settle", "together"),
    ("jobs",),  # the job level
    ("probe", "resume"),  # users of the job level alone
    ("runner", "attribution"),  # the pair level (attribution runs pairs through run_pair)
    ("session",),  # one Runner per session
)

#: Modules that run jobs but no pairs: they must not reach the pair level, not even through
#: another module.
JOB_LEVEL_USERS = (
    "convergence.run.probe",
    "convergence.run.resume",
    "convergence.cli.ab",
)
PAIR_LEVEL = ("convergence.run.runner", "convergence.run.session")


def test_run_modules_go_down_its_levels() -> None:
    level = {f"convergence.run.{m}": i for i, level in enumerate(RUN_LEVELS) for m in level}
    inside = {m for m in MODULES if m.startswith("convergence.run.")}
    assert inside == set(level), "give each module of convergence/run a level in RUN_LEVELS"
    upward = [
        f"{module} imports {dep}"
        for module in inside
        for dep in _graph()[module]
        if dep in level and level[dep] > level[module]
    ]
    assert upward == [], "run/ imports that climb a level:\n" + "\n".join(sorted(upward))


def test_job_level_users_never_reach_the_pair_level() -> None:
    graph = _graph()
    for start in JOB_LEVEL_USERS:
        seen, todo = {start}, [start]
        while todo:
            for dep in graph[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        assert seen.isdisjoint(PAIR_LEVEL), f"{start} reaches {sorted(seen & set(PAIR_LEVEL))}"


#: The torchtitan backend's modules, which run in its collection checks and on its ranks.
TORCHTITAN = "convergence.backends.torchtitan"


def test_the_torchtitan_backend_imports_nothing_of_the_builtin_trainer() -> None:
    """What both trainers use lives in convergence/rank/ (sample hash, norms, the probe's
    recorder, the hook API, the rounding draw, the meshes): torchtitan's launcher reaches into
    no internal of the built-in trainer, lazily or for typing either."""
    found = [
        f"{m}:{line} {name}"
        for m in MODULES
        if m == TORCHTITAN or m.startswith(TORCHTITAN + ".")
        for name, line, _ in _imports(m)
        if name == "convergence.trainer" or name.startswith("convergence.trainer.")
    ]
    assert found == [], "move what both trainers use to convergence/rank/:\n" + "\n".join(found)


#: Rank-side modules the pytest process imports (the backends' collection checks locate a
#: hook with rank/hooks.py, the run cache hashes it; the plugin reads the rounding draw): the
#: pytest process never imports torch (convergence/torch_info.py), so neither may they at
#: their top.
COLLECTION_SIDE_RANK = ("convergence.rank.hooks", "convergence.rank.rounding_draw")


def test_rank_modules_the_collection_imports_load_no_costly_package() -> None:
    costly = {m: _third_party_at_top(m) & COSTLY for m in COLLECTION_SIDE_RANK}
    assert costly == {m: set() for m in COLLECTION_SIDE_RANK}


#: What a trainer's rank imports that the run cache's code hash leaves out, and why: the key
#: holds what these produce, not their code.
NOT_HASHED = {
    "spec": "parsed experiments: the key holds the job's identity and its train config text",
    "configs": "the shipped train configs: the key holds the config's text",
    "torch_info": "torch's version: in the key as the stack (cache/stack.py)",
    "torchao_info": "torchao's version: in the key where a job converts (config_text)",
    "phase_marks": "timestamps of a job's phases: no part of its result",
    "process_lifetime": "parent-death signals: no part of its result",
}

#: The entry points of the trainers' ranks.
RANK_ENTRIES = (
    "convergence.trainer.train",
    "convergence.backends.torchtitan.launch",
    "convergence.backends.torchtitan.trainer_class",
)


def test_the_run_cache_hashes_the_code_the_trainers_run() -> None:
    """A package the trainers import on their ranks decides what a run computes: the run
    cache's code hash (cache/key.py RESULT_PACKAGES) covers it, or NOT_HASHED says why not. A
    new rank-side package (rank/, when it moved out of trainer/) cannot fall out of the key."""
    from convergence.cache.key import RESULT_PACKAGES

    graph = _graph()
    seen, todo = set(RANK_ENTRIES), list(RANK_ENTRIES)
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    units = {_unit(m) for m in seen} - {"convergence"}
    assert units - set(RESULT_PACKAGES) - set(NOT_HASHED) == set()
    assert set(NOT_HASHED) <= units, "NOT_HASHED names a package the ranks no longer import"
