"""The Python API: the ``convergence`` marker and the ``convergence_pair`` fixture.

A pair in a few lines (the marker's keyword arguments are the ``[defaults]`` of an experiment
file; relative paths are looked up next to the test file, then in the rootdir)::

    import pytest

    @pytest.mark.convergence(train_config="debug", steps=50)
    def test_fsdp_vs_tp(convergence_pair):
        convergence_pair(control={"parallelism": {"dp_shard": 2}},
                         test={"parallelism": {"dp_shard": 2, "tp": 2}})

A matrix of layouts is a parametrised test; each layout is its own test and report row::

    LAYOUTS = {
        "fsdp2-tp2": {"dp_shard": 2, "tp": 2},
        "fsdp2-pp2": {"dp_shard": 2, "pp": 2, "pp_schedule": "1F1B"},
        "fsdp2-cp2": {"dp_shard": 2, "cp": 2},
    }

    @pytest.mark.convergence(train_config="debug", steps=50)
    @pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
    def test_layouts(convergence_pair, layout):
        convergence_pair(control={"parallelism": {"dp_shard": 2}},
                         test={"parallelism": layout})

Your own parallelism is a test case: name its hook (``"package.module:function"``, imported
on every rank and applied to the model with the device mesh)::

    def test_my_tp(convergence_pair):
        outcome = convergence_pair(
            control={"parallelism": {"dp_shard": 2}},
            test={"parallelism": {"dp_shard": 2, "tp": 2}},
            hook="my_project.parallel:apply_my_tp",
            compare={"loss": "paired", "grad_norm": "paired"},
            train_config="debug", steps=50)
        assert outcome.verdict("loss").max_deviation < 1e-5   # optional extra checks

The call runs both jobs (the control from the cache when an identical one ran before), records
the outcome for the matrix and the reports, and fails the test with the rendered verdict when
the pair does not pass. Tests using the fixture get the ``convergence`` marker automatically.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import pytest

from convergence.checks import pair_keys
from convergence.preflight import make_checked_pair, validate_devices
from convergence.run.outcome import PairOutcome
from convergence.spec.errors import NotRunnableHere, SpecError
from convergence.spec.experiment import DEFAULTS_KEYS, JOB_KEYS, TEST_KEYS
from convergence.spec.pair import PairSpec
from convergence.spec.toml_io import check_keys
from pytest_convergence.collection import MARKER, modified_pair, skip_reason
from pytest_convergence.execute import check_outcome, execute_pair
from pytest_convergence.stash import get_state


def marker_defaults(node: pytest.Item) -> dict[str, Any]:
    """Keyword arguments of every ``convergence`` marker on the test; the closest wins
    (function over class over module)."""
    defaults: dict[str, Any] = {}
    for marker in reversed(list(node.iter_markers(MARKER))):
        defaults.update(marker.kwargs)
    return defaults


class PairRunner:
    """What the ``convergence_pair`` fixture returns: call it to run one pair."""

    def __init__(self, node: pytest.Item) -> None:
        self._node = node
        self._calls = 0
        self.outcomes: list[PairOutcome] = []
        """Outcomes of the pairs this test ran, in order."""

    def build(
        self,
        control: Mapping[str, Any],
        test: Mapping[str, Any],
        *,
        name: str | None = None,
        compare: Mapping[str, Any] | None = None,
        hook: str | None = None,
        **job_kw: Any,
    ) -> PairSpec:
        """The validated PairSpec the call would run (raises SpecError)."""
        source = str(self._node.path)
        defaults = {**marker_defaults(self._node), **job_kw}
        check_keys(
            defaults,
            (*DEFAULTS_KEYS, *pair_keys()),
            file=source,
            path="convergence marker/keywords",
        )
        check_keys(control, JOB_KEYS, file=source, path="control")
        check_keys(test, (*TEST_KEYS, *pair_keys()), file=source, path="test")
        test_table = dict(test)
        if hook is not None:
            test_table["hook"] = hook
        self._calls += 1
        pair_name = name or str(test.get("name") or self._node.name)
        if name is None and self._calls > 1:
            pair_name = f"{pair_name}-{self._calls}"
        pair = make_checked_pair(
            modify=functools.partial(modified_pair, self._node.config),
            name=pair_name,
            control=control,
            test=test_table,
            defaults=defaults,
            compare=compare,
            source=source,
            rootdir=self._node.config.rootpath,
        )
        state = get_state(self._node.config)
        return validate_devices(
            pair, available_devices=state.device_set(), device_mode=state.options["device"]
        )

    def __call__(
        self, control: Mapping[str, Any], test: Mapping[str, Any], **options: Any
    ) -> PairOutcome:
        """Run the pair :meth:`build` makes of the same arguments (``name``, ``compare``,
        ``hook`` and job keys as keywords); fail the test unless it passes."""
        try:
            pair = self.build(control, test, **options)
        except NotRunnableHere as exc:
            if not get_state(self._node.config).options["strict"]:
                pytest.skip(skip_reason(exc))  # too few devices, a backend not installed
            pytest.fail(f"invalid convergence pair (nothing was launched):\n{exc}", pytrace=False)
        except SpecError as exc:
            pytest.fail(f"invalid convergence pair (nothing was launched):\n{exc}", pytrace=False)
        outcome = execute_pair(self._node.config, pair, self._node.user_properties)
        self.outcomes.append(outcome)
        check_outcome(outcome, self._node.config)
        return outcome


@pytest.fixture
def convergence_pair(request: pytest.FixtureRequest) -> PairRunner:
    """Run a control/test pair from a Python test; see the module docstring."""
    return PairRunner(request.node)
