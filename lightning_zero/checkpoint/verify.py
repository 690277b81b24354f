"""Self-verifying sharded checkpoints: file records in ``zero.json`` and the checks ``load``, ``consolidate`` and
``lightning-zero verify`` run before trusting a byte of the checkpoint. These are the pieces; the whole-checkpoint
check that runs them in order, :func:`lightning_zero.checkpoint.directory.verify_checkpoint`, lives with the code
that finds and reads the directory (this module imports nothing of the package above its errors).

At save time :func:`file_records` records every file's size and CRC-32 in ``zero.json`` (written last), and
:func:`seal` adds a CRC-32 of ``zero.json``'s own fields, so an edited ``zero.json`` is detected too.

[Note: what the checks catch]
* a missing, truncated, extended or edited file: its size (always) or checksum (``checksums=True``) differs from
  the record, and the error names the file;
* a ``.metadata`` that is not DCP metadata, or whose records point past the end of a file or at a file the
  checkpoint does not hold;
* a ``.metadata`` whose tensor sizes were edited (even with a recomputed checksum): :func:`check_metadata` checks
  that the stored chunks of every tensor lie inside it and cover it exactly once, so consolidation never hands out
  uninitialised memory.

Checksums use ``zlib.crc32`` (standard library; its speed: ``docs/reliability.md``, "Cost"): it detects damage, not
tampering by someone who recomputes it, which no unkeyed checksum could. Hand-written because DCP records no checksums
and no maintained library verifies a DCP directory.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from typing import Any, Dict, Iterable, List, Optional

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from lightning_zero.checkpoint.atomic import INFO_FILE
from lightning_zero.checkpoint.errors import CheckpointError

METADATA_FILE = ".metadata"
_BLOCK = 1 << 20  # read in 1 MiB blocks: bounded memory whatever the file size


def crc32_of(path: str) -> int:
    """CRC-32 of the file at ``path``, read in blocks."""
    crc = 0
    with open(path, "rb") as file:
        while True:
            block = file.read(_BLOCK)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def file_records(directory: str) -> Dict[str, Dict[str, int]]:
    """``{name: {"size": bytes, "crc32": checksum}}`` of every regular file in ``directory`` but ``zero.json``."""
    records = {}
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if name.startswith(INFO_FILE) or not os.path.isfile(full) or os.path.islink(full):
            continue  # zero.json (and its .tmp) is sealed separately
        records[name] = {"size": os.path.getsize(full), "crc32": crc32_of(full)}
    return records


def _seal_of(record: Dict[str, Any]) -> int:
    fields = {key: value for key, value in record.items() if key != "seal"}
    return zlib.crc32(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


def seal(record: Dict[str, Any]) -> Dict[str, Any]:
    """``record`` with a ``seal``: the CRC-32 of its other fields, so that an edit of ``zero.json`` is detected."""
    return {**record, "seal": _seal_of(record)}


def check_seal(record: Dict[str, Any], path: str) -> None:
    """Raise :class:`CheckpointError` when ``zero.json`` was edited after it was written (a record without a seal,
    from a checkpoint written before seals existed, is accepted)."""
    if "seal" in record and record["seal"] != _seal_of(record):
        raise CheckpointError(
            f"{path}: zero.json was edited after the checkpoint was written (its fields no longer "
            "match the checksum recorded with them)",
            path,
        )


def check_files(
    directory: str, info: Dict[str, Any], *, checksums: bool, share: tuple = (0, 1)
) -> List[CheckpointError]:
    """The recorded files of the checkpoint that are missing or whose size (and, with ``checksums``, CRC-32) differs.

    ``share=(rank, world)`` checks only the files ``rank`` is responsible for (every ``world``-th), so that the ranks
    of a load split the reading; sizes are checked for every file on every rank (a ``stat`` each).
    """
    records = info.get("files")
    if records is None:
        return []  # a checkpoint written before file records: nothing to compare with
    if not isinstance(records, dict):
        return [CheckpointError(f"{os.path.join(directory, INFO_FILE)}: 'files' is not a mapping", directory)]
    problems = []
    rank, world = share
    for position, (name, record) in enumerate(sorted(records.items())):
        full = os.path.join(directory, name)
        if os.path.basename(name) != name or not isinstance(record, dict):
            problems.append(CheckpointError(f"{full}: malformed file record in zero.json", full))
        elif not os.path.isfile(full):
            problems.append(CheckpointError(f"{full}: file missing (the checkpoint was written with it)", full))
        elif os.path.getsize(full) != record.get("size"):
            problems.append(
                CheckpointError(
                    f"{full}: size is {os.path.getsize(full)} bytes, the checkpoint was written with "
                    f"{record.get('size')} (truncated or modified)",
                    full,
                )
            )
        elif checksums and position % world == rank and crc32_of(full) != record.get("crc32"):
            problems.append(
                CheckpointError(
                    f"{full}: contents changed since the checkpoint was written (CRC-32 mismatch: the file is corrupt)",
                    full,
                )
            )
    return problems


def _overlapping(chunks: List[tuple]) -> Optional[tuple]:
    """A pair of chunks (offsets, sizes) that overlap, or ``None``. Sweeps along dim 0: chunks are compared only
    with those whose dim-0 range is still open, which for the usual row-sharded layouts is one or two."""
    if not chunks or not chunks[0][0]:
        return chunks[:2] if len(chunks) > 1 else None  # 0-d tensors: any two chunks overlap
    active: List[tuple] = []
    for chunk in sorted(chunks, key=lambda c: c[0][0]):
        if not math.prod(chunk[1]):
            continue
        active = [other for other in active if other[0][0] + other[1][0] > chunk[0][0]]
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(chunk[0], chunk[1], other[0], other[1])):
                return other, chunk
        active.append(chunk)
    return None


def check_metadata(
    directory: str, metadata: Metadata, recorded: Optional[Iterable[str]] = None
) -> List[CheckpointError]:
    """Structural checks of DCP ``metadata`` against the files of ``directory``: every chunk lies inside its tensor,
    the chunks cover the tensor exactly once, and every storage record lies inside a file the checkpoint holds."""
    where = os.path.join(directory, METADATA_FILE)
    problems: List[CheckpointError] = []
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                problems.append(CheckpointError(f"{where}: no stored data for {fqn!r}", where))
        elif isinstance(item, TensorStorageMetadata):
            problems.extend(_tensor_chunk_problems(where, fqn, item, storage))
        else:
            problems.append(CheckpointError(f"{where}: {fqn!r} has unknown metadata {type(item).__name__}", where))
    problems.extend(_storage_record_problems(directory, where, storage, recorded))
    return unique_problems(problems)


def _tensor_chunk_problems(where: str, fqn: str, item: TensorStorageMetadata, storage: dict) -> List[CheckpointError]:
    """The first problem of one tensor's chunks: one outside the tensor, one without stored data, or chunks that do
    not cover the tensor exactly once."""
    size = tuple(item.size)
    chunks, covered = [], 0
    for chunk in item.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, size))
        ):
            message = (
                f"{where}: tensor {fqn!r} of size {list(size)} has a stored chunk at offsets {list(offsets)} of "
                f"size {list(sizes)} that lies outside it (edited or corrupt metadata)"
            )
            return [CheckpointError(message, where)]
        if MetadataIndex(fqn, offsets) not in storage:
            message = f"{where}: tensor {fqn!r} has no stored data for its chunk at offsets {list(offsets)}"
            return [CheckpointError(message, where)]
        chunks.append((offsets, sizes))
        covered += math.prod(sizes)
    overlap = _overlapping(chunks)
    if overlap is None and covered == math.prod(size):
        return []
    detail = (
        f"chunks at offsets {list(overlap[0][0])} and {list(overlap[1][0])} overlap"
        if overlap is not None
        else f"its stored chunks hold {covered} of its {math.prod(size)} elements"
    )
    message = (
        f"{where}: tensor {fqn!r} of size {list(size)} is not covered exactly by its stored chunks: {detail} (edited "
        "or corrupt metadata)"
    )
    return [CheckpointError(message, where)]


def _storage_record_problems(
    directory: str, where: str, storage: dict, recorded: Optional[Iterable[str]]
) -> List[CheckpointError]:
    """Records stored in a file the checkpoint was not written with, and files missing or shorter than the records
    ``.metadata`` places in them."""
    problems: List[CheckpointError] = []
    recorded = set(recorded) if recorded is not None else None
    ends: Dict[str, tuple] = {}  # file -> (end of its last record, the fqn stored there)
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if (
            not isinstance(name, str)
            or os.path.basename(name) != name
            or name.startswith(INFO_FILE)
            or (recorded is not None and name not in recorded)
        ):
            message = (
                f"{where}: the record of {index.fqn!r} is in {name!r}, which is not a data file this checkpoint was "
                "written with (edited metadata)"
            )
            problems.append(CheckpointError(message, where))
            continue
        end = info.offset + info.length
        if info.offset < 0 or info.length < 0:
            end = math.inf
        if end > ends.get(name, (-1, ""))[0]:
            ends[name] = (end, index.fqn)
    for name, (end, fqn) in sorted(ends.items()):
        full = os.path.join(directory, name)
        if not os.path.isfile(full):
            problems.append(CheckpointError(f"{full}: file missing (.metadata stores {fqn!r} in it)", full))
        elif end > os.path.getsize(full):
            message = (
                f"{full}: {os.path.getsize(full)} bytes, but .metadata stores {fqn!r} up to byte {end} (truncated "
                "file or edited metadata)"
            )
            problems.append(CheckpointError(message, full))
    return problems


def unique_problems(problems: List[CheckpointError]) -> List[CheckpointError]:
    """``problems`` without repeated messages (the first of each kept, in order)."""
    seen, kept = set(), []
    for problem in problems:
        if str(problem) not in seen:
            seen.add(str(problem))
            kept.append(problem)
    return kept
