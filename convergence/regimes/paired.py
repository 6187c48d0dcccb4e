"""``paired``: bitwise-comparable fp32 runs, judged step by step at the numerical noise floor.

Control and test start from the same seed checkpoint and read the same samples in the same
order with deterministic kernels in fp32, so the curves may differ only by the rounding of
another reduction order (convergence/stats/paired_band.py). No control job besides the control;
a failure is localised by the numerics probe (both sides start from the same weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from convergence.regimes.base import ShippedRegime, TwinSource
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import Method, PairSpec

#: Train-config overrides that take a job out of the fp32 deterministic regime unless they
#: hold exactly this value (an ``overrides`` table can set them behind ``techniques``' back).
PAIRABLE_OVERRIDES: dict[str, str] = {
    "training.param_dtype": "float32",
    "training.reduce_dtype": "float32",
    "training.compile": "false",
    "training.deterministic": "true",
}


def bitwise_pairable(job: JobSpec) -> bool:
    """Deterministic fp32 (compute and reduction) and uncompiled, whatever set it."""
    overrides = job.override_dict()
    if job.resume is not None and not job.resume.techniques.bitwise_pairable:
        return False  # the phase after a resume counts too
    return job.techniques.bitwise_pairable and all(
        str(overrides[k]).lower() == v for k, v in PAIRABLE_OVERRIDES.items() if k in overrides
    )


def check_same_seed(pair: PairSpec, *, key: str) -> None:
    """The regimes that compare step by step need one seed checkpoint and one sample order."""
    if pair.control.seed != pair.test.seed:
        raise SpecError(
            f"{pair.regime} comparison needs the same seed (same seed checkpoint and data)",
            file=pair.source,
            key=f"{key}.seed",
            fix='use the same seed on both sides, or regime = "seed"',
        )


@dataclass(frozen=True)
class PairedRegime(ShippedRegime):
    """One control job and curve (ShippedRegime's): its method works in any regime, and
    the other runs given to ``convergence compare`` are not used."""

    name: str = "paired"
    method: Method = "paired"

    def claims(self, control: JobSpec, test: JobSpec, *, twins: bool) -> bool:
        """The default only when both runs are deterministic fp32 (compute and reduction),
        uncompiled and share the seed, as the README promises."""
        return control.seed == test.seed and bitwise_pairable(control) and bitwise_pairable(test)

    def check(self, pair: PairSpec, *, key: str, backend: TwinSource) -> None:
        check_same_seed(pair, key=key)


PAIRED = PairedRegime()
