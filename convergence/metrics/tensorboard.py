"""TensorBoard event files, read raw at full precision.

Why not ``EventAccumulator``: it reservoir-samples each tag down to 10,000 points, so a long run
would be compared on a random subset. We read every record of every ``events.out.tfevents.*``
file (TFRecord framing parsed here, protobufs by TensorBoard's ``event_pb2``) and keep float64 where the writer stored it:

- ``simple_value`` is a float32 (old-style ``add_scalar``);
- a tensor value is DT_DOUBLE or DT_FLOAT (``add_scalar(new_style=True,
  double_precision=True)`` writes an exact float64 DT_DOUBLE tensor: the built-in trainer's way).

Layouts we meet: torchtitan writes into ``<dump>/tb/<timestamp>/`` and, when every rank saves,
into ``.../<timestamp>/rank_<N>/``. With pipeline parallelism only the last stage computes the
loss; the other stages log a placeholder of -1.0. So among ``rank_<N>`` siblings we read the one
folder that holds the real loss (see :func:`find_loss_logging_dir`); separate timestamp folders
(a resumed run) are merged in time order, a step logged twice keeping its last value.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from convergence.metrics.curve import RunMetrics
from convergence.metrics.tags import TENSORBOARD_TAGS, assemble, resolve_map, sources_for

EVENT_GLOB = "events.out.tfevents.*"
#: What torchtitan's non-last pipeline stages log as their "loss".
PLACEHOLDER_LOSS = -1.0
_RANK_DIR = re.compile(r"rank_(\d+)")

#: folder -> source tag -> [(step, value)] in file time order.
Scan = dict[Path, dict[str, list[tuple[int, float]]]]


def read_tensorboard(path: Path, tag_map: Mapping[str, str] | None = None) -> RunMetrics:
    """All metric curves under ``path`` (an event file, or a folder searched recursively).

    ``tag_map`` maps extra/other tags to our names (``{"train/loss": "loss"}``); it takes
    precedence over the default torchtitan tags for the metrics it names.
    """
    path = Path(path)
    source_map = resolve_map(TENSORBOARD_TAGS, tag_map, what="tag_map")
    loss_tags = sources_for(source_map, "loss")
    scan = _scan(_event_files(path), set(source_map))
    merged: dict[str, list[tuple[int, float]]] = {}
    for folder in _chosen_folders(scan, loss_tags):
        for tag, pairs in scan[folder].items():
            merged.setdefault(tag, []).extend(pairs)
    return assemble(source_map, merged)


def find_loss_logging_dir(root: Path, tag_map: Mapping[str, str] | None = None) -> Path | None:
    """The folder whose event files hold the real loss (not a PP placeholder), or None.

    Several candidates (a resumed run, or every last-stage rank logging the same loss): the
    most recent timestamp folder, then the lowest rank.
    """
    root = Path(root)
    if not root.exists():
        return None
    loss_tags = sources_for(resolve_map(TENSORBOARD_TAGS, tag_map, what="tag_map"), "loss")
    files = list(_iter_event_files(root))
    scan = _scan(files, set(loss_tags))
    newest = {folder: max(_file_time(f) for f in files if f.parent == folder) for folder in scan}
    candidates = [folder for folder in scan if _holds_loss(scan[folder], loss_tags)]
    if not candidates:
        return None
    return min(candidates, key=lambda folder: (-newest[folder], rank_of(folder) or 0, str(folder)))


# -- folders --------------------------------------------------------------------------------


def _chosen_folders(scan: Scan, loss_tags: list[str]) -> list[Path]:
    """Every folder, except that ``rank_<N>`` siblings contribute one: the loss holder."""
    by_parent: dict[Path, list[Path]] = {}
    chosen: list[Path] = []
    for folder in scan:
        if rank_of(folder) is None:
            chosen.append(folder)
        else:
            by_parent.setdefault(folder.parent, []).append(folder)
    for ranks in by_parent.values():
        ranks.sort(key=lambda folder: rank_of(folder) or 0)
        holders = [folder for folder in ranks if _holds_loss(scan[folder], loss_tags)]
        chosen.append(holders[0] if holders else ranks[0])
    return chosen


def _holds_loss(tags: Mapping[str, list[tuple[int, float]]], loss_tags: list[str]) -> bool:
    return any(value != PLACEHOLDER_LOSS for tag in loss_tags for _, value in tags.get(tag, []))


def rank_of(folder: Path) -> int | None:
    match = _RANK_DIR.fullmatch(folder.name)
    return int(match.group(1)) if match else None


# -- files ----------------------------------------------------------------------------------


def _event_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(
            f"TensorBoard path {path} does not exist: the job wrote no "
            f"events there; check the backend's metrics_file option"
        )
    files = list(_iter_event_files(path))
    if not files:
        raise FileNotFoundError(
            f"no {EVENT_GLOB} files under {path}: was TensorBoard logging "
            f"enabled in the job (torchtitan: metrics.enable_tensorboard)?"
        )
    return files


def _iter_event_files(root: Path) -> Iterator[Path]:
    return (p for p in root.rglob(EVENT_GLOB) if p.is_file())


def _file_time(path: Path) -> int:
    """The writer's start time from ``events.out.tfevents.<unix time>.<host>...`` (0 if odd)."""
    parts = path.name.split(".")
    return int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0


def _scan(files: Iterable[Path], tags: set[str]) -> Scan:
    scan: Scan = {}
    for path in sorted(files, key=lambda p: (_file_time(p), str(p))):
        found = scan.setdefault(path.parent, {})
        for tag, step, value in _scalars(path, tags):
            found.setdefault(tag, []).append((step, value))
    return scan


def _scalars(path: Path, tags: set[str]) -> Iterator[tuple[str, int, float]]:
    """(tag, step, value) of every scalar of ``tags`` in one file, in file order."""
    records, _ = split_records(path.read_bytes(), path)
    for record in records:
        yield from event_scalars(record, tags)


def event_scalars(record: bytes, tags: set[str] | None = None) -> Iterator[tuple[str, int, float]]:
    """(tag, step, value) of the scalars in one event record (of ``tags``; None: all)."""
    from tensorboard.compat.proto.event_pb2 import Event

    event = Event.FromString(record)
    if not event.HasField("summary"):
        return
    for value in event.summary.value:
        if tags is not None and value.tag not in tags:
            continue
        number = _scalar(value)
        if number is not None:
            yield value.tag, int(event.step), number


def split_records(data: bytes, path: Path) -> tuple[list[bytes], int]:
    """The complete records at the start of TFRecord bytes, and how many bytes they take:
    ``u64 length | u32 crc(length) | data | u32 crc(data)`` each.

    We parse the framing ourselves (TensorBoard's pure-Python fallback reader spends most of
    its time checksumming every payload byte in Python). The length checksum is verified, so a
    corrupt or misaligned file is an error rather than garbage; the payload is checked by the
    protobuf parser. A truncated last record (the writer is mid-write) is left unconsumed: a
    reader of a finished file ignores it, a live tail (tb_tail.py) reads it once complete.
    """
    records: list[bytes] = []
    offset, size = 0, len(data)
    while offset + 12 <= size:
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[offset + 8 : offset + 12])
        if _masked_crc32c(header) != length_crc:
            raise ValueError(
                f"{path}: corrupt TensorBoard record at byte {offset} (bad length "
                f"checksum); delete or move the damaged file and re-read"
            )
        end = offset + 12 + length + 4
        if end > size:
            break
        records.append(data[offset + 12 : offset + 12 + length])
        offset = end
    return records, offset


def _scalar(value: Any) -> float | None:
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return float(value.simple_value)
    if kind != "tensor":
        return None
    tensor = value.tensor
    dtype = _TENSOR_DTYPES.get(tensor.dtype)
    if dtype is None or any(dim.size != 1 for dim in tensor.tensor_shape.dim):
        return None
    if tensor.tensor_content:
        return float(np.frombuffer(tensor.tensor_content, dtype=dtype)[0])
    field = {"<f8": tensor.double_val, "<f4": tensor.float_val}.get(dtype)
    return float(field[0]) if field else None


#: TensorFlow DataType enum -> numpy dtype (little-endian, as the writer stores it).
_TENSOR_DTYPES: dict[int, str] = {1: "<f4", 2: "<f8"}  # DT_FLOAT, DT_DOUBLE


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C (Castagnoli)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
