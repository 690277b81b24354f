"""Finding and reading a lightning-zero sharded checkpoint directory: whether a path is one, which directory to
read (the ``.old`` sibling a save interrupted mid-swap leaves), its ``zero.json``, and the whole-checkpoint checks
(:func:`verify_checkpoint`) that ``load``, ``consolidate`` and ``lightning-zero verify`` run before trusting it.

The layout of the directory: :mod:`lightning_zero.checkpoint.io`, which writes it. The file records and seals the
checks compare against, and what they catch: :mod:`lightning_zero.checkpoint.verify`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Tuple

from lightning_zero.checkpoint import atomic
from lightning_zero.checkpoint.atomic import INFO_FILE, PathLike
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.safe_load import load_meta, read_dcp_metadata
from lightning_zero.checkpoint.verify import check_files, check_metadata, check_seal, unique_problems

FORMAT_NAME = "lightning-zero-sharded"
FORMAT_VERSION = 1
META_FILE = "meta.pt"


def is_sharded_checkpoint(path: PathLike) -> bool:
    """True when ``path`` is a complete lightning-zero sharded checkpoint directory."""
    path = os.fspath(path)
    return (
        os.path.isdir(path)
        and os.path.isfile(os.path.join(path, INFO_FILE))
        and os.path.isfile(os.path.join(path, ".metadata"))
    )


def resolve_checkpoint_dir(path: PathLike) -> str:
    """The directory to read for ``path``: itself, or its ``.old`` sibling left by a save interrupted mid-swap."""
    path = atomic.local_path(path)
    if is_sharded_checkpoint(path):
        return path
    if not os.path.exists(path) and is_sharded_checkpoint(atomic.old_dir(path)):
        return atomic.old_dir(path)
    if os.path.isdir(path):
        raise FileNotFoundError(
            f"{path} is a directory but not a complete lightning-zero checkpoint (missing {INFO_FILE} or .metadata)"
        )
    raise FileNotFoundError(f"no sharded checkpoint at {path}")


def checkpoint_directory(path: PathLike) -> str:
    """:func:`resolve_checkpoint_dir` for reading: something at ``path`` that is not a complete sharded checkpoint is
    a :class:`CheckpointError` naming what is missing; nothing at ``path`` stays a ``FileNotFoundError``."""
    try:
        return resolve_checkpoint_dir(path)
    except FileNotFoundError:
        path = atomic.local_path(path)
        if os.path.isdir(path):
            lacking = [name for name in (INFO_FILE, ".metadata") if not os.path.isfile(os.path.join(path, name))]
            raise CheckpointError(
                f"{os.path.join(path, lacking[0])}: file missing ({path} is a directory but not a "
                f"complete lightning-zero checkpoint)",
                os.path.join(path, lacking[0]),
            ) from None
        if os.path.exists(path):
            raise CheckpointError(
                f"{path}: a file, not a lightning-zero sharded checkpoint (a directory holding "
                f"{INFO_FILE} and .metadata)",
                path,
            ) from None
        raise


def read_checkpoint_info(path: PathLike) -> dict:
    """The ``zero.json`` of a sharded checkpoint (format version, world size, stage, top-level keys, file records,
    ...). Raises :class:`CheckpointError` when it is unreadable, of another format, or edited."""
    where = os.path.join(checkpoint_directory(path), INFO_FILE)
    try:
        with open(where) as file:
            info = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{where}: not readable JSON (truncated or corrupt: {err})", where) from err
    if not isinstance(info, dict) or info.get("format") != FORMAT_NAME:
        found = info.get("format") if isinstance(info, dict) else type(info).__name__
        raise CheckpointError(f"{where}: not a lightning-zero checkpoint record (format {found!r})", where)
    if not isinstance(info.get("version"), int) or info["version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: checkpoint format version {info.get('version')!r} is not supported by this "
            f"lightning-zero (which reads up to {FORMAT_VERSION}); upgrade lightning-zero",
            where,
        )
    check_seal(info, where)
    return info


def verify_checkpoint(path: Any, *, checksums: bool = True) -> List[CheckpointError]:
    """Every problem found in the sharded checkpoint at ``path`` (empty when it is intact), without loading it.

    Reads ``zero.json`` and checks its seal, every recorded file's size and (``checksums=True``) CRC-32, then the
    DCP ``.metadata`` (readable without running pickled code, chunks covering each tensor exactly, records inside
    the files). Used by ``lightning-zero verify``; ``load`` and ``consolidate`` run the same checks.
    """
    return verify_and_read(path, checksums=checksums)[0]


def verify_and_read(path: Any, *, checksums: bool = True) -> Tuple[List[CheckpointError], Dict[str, Any]]:
    """:func:`verify_checkpoint`, and what it read on the way: ``{"metadata": <DCP Metadata>, "meta": <meta.pt
    dict>}`` (those that were readable), so a caller that goes on to use them reads neither file again."""
    try:
        directory = checkpoint_directory(path)
        info = read_checkpoint_info(directory)
    except CheckpointError as err:
        return [err], {}
    problems = check_files(directory, info, checksums=checksums)
    bad = {problem.path for problem in problems}
    read: Dict[str, Any] = {}
    for name, reader in (("metadata", read_dcp_metadata), ("meta", load_meta)):
        try:
            read[name] = reader(directory)
        except CheckpointError as err:
            if err.path not in bad:
                problems.append(err)
            continue
        if name == "metadata":
            files = info.get("files")
            problems += [p for p in check_metadata(directory, read[name], files) if p.path not in bad]
    return unique_problems(problems), read
