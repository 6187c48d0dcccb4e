"""pytest-xdist glue: the controller hands its session folder to the workers (each worker
writes every outcome there as JSON) and derives ``-n auto`` from the devices.

Sharing devices and control runs across workers is safe by construction in the library: the
device pool and the run cache are file-locked (``convergence.launch.pool``,
``convergence.cache``), so a control shared by several pairs runs once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from convergence.launch.devices import session_devices
from convergence.launch.placement import gpu_count
from convergence.preflight import load_checked
from convergence.spec.errors import SpecError
from pytest_convergence.collection import is_experiment_file
from pytest_convergence.options import read_options
from pytest_convergence.stash import get_state

SHARE_KEY = "convergence_share_dir"
DEFAULT_WORLD_SIZE = 2
MAX_SCANNED_FILES = 200


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def is_distributing(config: pytest.Config) -> bool:
    """This process is an xdist controller that will run tests in workers."""
    return (
        not is_worker(config)
        and config.pluginmanager.hasplugin("xdist")
        and getattr(config.option, "dist", "no") != "no"
    )


def worker_share_dir(config: pytest.Config) -> Path | None:
    workerinput: dict[str, Any] = getattr(config, "workerinput", {})
    value = workerinput.get(SHARE_KEY)
    return Path(value) if value else None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    share_dir = get_state(node.config).share_dir
    if share_dir is not None:
        node.workerinput[SHARE_KEY] = str(share_dir)


def _experiment_files(config: pytest.Config) -> list[Path]:
    found: list[Path] = []
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        candidates = (
            [path] if path.is_file() else (sorted(path.rglob("*.toml")) if path.is_dir() else [])
        )
        for candidate in candidates:
            if any(part.startswith(".") for part in candidate.parts):
                continue
            if is_experiment_file(config, candidate):
                found.append(candidate)
            if len(found) >= MAX_SCANNED_FILES:
                return found
    return found


def _largest_world_size(config: pytest.Config, files: list[Path]) -> int:

    largest = 0
    for path in files:
        try:
            experiment = load_checked(path, rootdir=config.rootpath)
        except Exception:  # noqa: BLE001 - only sizing workers here; collection reports it
            continue
        for pair in experiment.pairs:
            largest = max(largest, pair.control.world_size, pair.test.world_size)
    return largest or DEFAULT_WORLD_SIZE


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: devices (GPUs, or CPU slots) // the largest job's world size. Returns
    None (xdist's own default) when the session has no convergence tests in sight."""
    files = _experiment_files(config)
    if not files and "convergence" not in (config.option.markexpr or ""):
        return None
    options = read_options(config)
    try:
        device_set = session_devices(options["launcher"], options["devices"])
    except SpecError:
        return None  # slurm outside an allocation: collection reports it
    largest = _largest_world_size(config, files)
    devices = len(device_set.devices)
    if device_set.kind == "gpu" and device_set.per_node is None:
        # GPUs offered as shared slots (convergence.launch.pool): a job that fits one GPU per
        # rank takes whole GPUs, so count GPUs; only jobs larger than the GPUs share slots.
        gpus = gpu_count(device_set)
        devices = gpus if largest <= gpus else devices
    return max(1, devices // largest)
