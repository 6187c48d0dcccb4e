"""What a warm fork server imports for torchtitan's jobs (``Capabilities.warm_imports``).

Why: torchtitan's trainer, config parser and models cost each rank ~3.5 CPU s of imports beyond
the server's own stack (launch/forkserver.py WARM_MODULES) -- half of a short debug job on two
CPU cores, paid by every rank of every torchtitan job. Imported once here, the forked ranks
find them in ``sys.modules``.

Only on a CPU build of torch: torchtitan chooses its device *at import*
(``torchtitan.tools.utils.device_type``), and a rank makes that choice before importing it
(launch.py: ``patches.pick_cpu_device`` where the job runs on CPU). On a CPU build every job
runs on CPU, so the server can choose for them; on a CUDA build a job's device depends on its
own ``CUDA_VISIBLE_DEVICES``, which the server does not have, and nothing is imported here (the
ranks import torchtitan themselves, as through torchrun). The other shims (launch.install) stay
the rank's: each is applied once, by the rank.
"""

from __future__ import annotations

import importlib

import torch

from convergence.backends.torchtitan import patches

#: What a torchtitan rank imports after its shims (launch.main, then torchtitan's own
#: ConfigManager and the shipped experiments' model modules).
MODULES = (
    "convergence.backends.torchtitan.launch",
    "convergence.backends.torchtitan.trainer_class",
    "torchtitan.config",
    "torchtitan.models.llama3",
    "torchtitan.models.deepseek_v3",
)


def cpu_only_build() -> bool:
    """A torch built without CUDA or ROCm: every job of this machine runs on CPU."""
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


if cpu_only_build():
    if patches.unsupported_releases() is None:  # else the ranks refuse, with the reason
        patches.pick_cpu_device()
        for _name in MODULES:
            importlib.import_module(_name)
