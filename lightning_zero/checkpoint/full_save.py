"""``state_dict_type="full"``: a checkpoint saved as one torch file, as Lightning's FSDP strategy offers.

The file is what ``torch.save`` of the unsharded run's Lightning checkpoint would be (weights, and the optimizer
states in ``Optimizer.state_dict()`` form when the checkpoint has them), so ``torch.load(path, weights_only=True)``,
``LightningModule.load_from_checkpoint`` and any strategy's ``ckpt_path`` read it, at any stage and world size.
The Fabric strategy lays the same content out as Fabric's own one-file checkpoints
(:func:`lightning_zero.fabric.fabric_checkpoints.as_fabric_file`).

How it is written, and why so: every rank saves its shards into a hidden staging directory beside the file (the
ordinary atomic sharded save), then rank 0 streams the file out of the staging directory tensor by tensor
(:func:`~lightning_zero.checkpoint.consolidate.consolidate_checkpoint`, which writes ``path.partial`` and renames it
into place) and deletes the staging directory. No rank ever holds the whole model: gathering to rank 0 would need
the full model in its memory, which is the reason a ZeRO run shards it. The cost is the staging directory's disk
space and the time rank 0 spends reading it back; the other ranks wait at the end of the save.

A file at ``path`` is replaced, and deleted by top-k rotation, only when it is one of these files (it carries
:data:`FULL_FILE_MARKER`); any other file is refused, as a sharded save refuses a directory that is not its own.
"""

from __future__ import annotations

import os
import zipfile
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_zero.checkpoint.atomic import CheckpointSaveError
from lightning_zero.checkpoint.consolidate import consolidate_checkpoint
from lightning_zero.checkpoint.io import remove_sharded_checkpoint
from lightning_zero.checkpoint.save_guards import (
    SLACK_PER_RANK,
    all_gather,
    broadcast_object,
    control_group,
    describe_failure,
    free_bytes,
    not_enough_space,
    shard_bytes,
    what_a_failed_save_left,
)

#: The key a full file carries so that a later save may replace it and rotation may delete it.
FULL_FILE_MARKER = "lightning_zero_full_checkpoint"
STATE_DICT_TYPES = ("sharded", "full")


def check_state_dict_type(value: str, *, async_save: bool) -> str:
    """``"sharded"`` (a directory, the default) or ``"full"`` (one file); ``"full"`` is written synchronously, so
    ``async_save=True`` with it is refused by name."""
    if value not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type must be 'sharded' or 'full' (as Lightning's FSDPStrategy), got {value!r}")
    if value == "full" and async_save:
        raise ValueError(
            "state_dict_type='full' writes one file through rank 0 after the shards are saved, so it is "
            "not asynchronous: drop async_save=True or use state_dict_type='sharded'"
        )
    return value


def staging_directory(path: str) -> str:
    """The hidden directory beside ``path`` the shards are saved into first."""
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.lz-staging")


def is_full_file(path: str) -> bool:
    """True if ``path`` is a file written by :func:`save_full_file` (read with ``weights_only=True``, memory-mapped:
    the marker is found without reading the tensors)."""
    if not os.path.isfile(path) or not zipfile.is_zipfile(path):
        return False
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # a torch file we cannot read safely is not one of ours
        return False
    return isinstance(checkpoint, dict) and checkpoint.get(FULL_FILE_MARKER) is True


def why_not_replaceable_file(path: str) -> Optional[str]:
    """``None`` when a full save may write (or rotation delete) ``path``; otherwise why not."""
    if not os.path.lexists(path) or is_full_file(path):
        return None
    kind = "directory" if os.path.isdir(path) else "file"
    return (
        f"{path} is an existing {kind} that is not a lightning-zero full checkpoint file; refusing to replace it. "
        "Choose another path or move it away"
    )


def save_full_file(
    checkpoint: dict,
    path: str,
    save_sharded: Callable[[dict, str], None],
    *,
    rank: int,
    with_optimizer: bool,
    layout: Optional[Callable[[dict], dict]] = None,
) -> None:
    """Save ``checkpoint`` as one file at ``path`` (collective: every rank calls it). ``save_sharded(checkpoint,
    directory)`` is the strategy's ordinary sharded save; ``with_optimizer`` puts the optimizer states in the file
    (the checkpoint holds them); ``layout`` rearranges the Lightning checkpoint dict before it is written (Fabric's
    own layout). Raises :class:`CheckpointSaveError` on every rank if any step fails; a previous file at ``path``
    stays intact then.

    [Note: a failed full save names the user's file]
    The shards are written to the hidden staging directory by the ordinary sharded save, whose errors name that
    directory. A user asked for ``path``: every error here names ``path``, its directory's free space, and what is
    left at ``path`` (a previous file of ours is never touched before the new one is complete). The space check counts
    the staged shards and the file together, since both exist until the staging directory is deleted."""
    path = os.path.abspath(os.fspath(path))
    staging = staging_directory(path)
    problem = broadcast_object(why_not_replaceable_file(path) if rank == 0 else None)
    if problem:
        raise CheckpointSaveError(problem)
    file_bytes = _check_space(checkpoint, path, rank)
    try:
        save_sharded({**checkpoint, FULL_FILE_MARKER: True}, staging)
    except CheckpointSaveError as err:
        raise CheckpointSaveError(_staging_failure(path, staging, str(err))) from err
    error = None
    if rank == 0:
        try:
            consolidate_checkpoint(staging, output=path, with_optimizer=with_optimizer, layout=layout)
        except Exception as err:  # said on every rank below
            error = describe_failure(
                path,
                err,
                file_bytes,
                left=what_is_left(path),
                removed="The partial file and the staged shards are removed",
            )
        finally:
            remove_sharded_checkpoint(staging)
    error = broadcast_object(error)
    if error:
        raise CheckpointSaveError(error)


def what_is_left(path: str) -> str:
    """What a failed full save left at ``path``: a previous full file of ours intact, something else untouched, or
    nothing."""
    return what_a_failed_save_left(path, is_checkpoint=is_full_file)


def _check_space(checkpoint: dict, path: str, rank: int) -> int:
    """Refuse the save on every rank, naming ``path``, when its directory cannot hold the staged shards and the file
    at once (collective). Returns the bytes of the file (about those of the shards)."""
    group = control_group(None)
    shards = sum(all_gather(shard_bytes(checkpoint, writes_replicas=rank == 0), group))
    ranks = dist.get_world_size(group) if group is not None else 1
    needed = 2 * shards + SLACK_PER_RANK * ranks
    problem = None
    if rank == 0:
        free = free_bytes(os.path.dirname(path))
        if free is not None and free < needed:
            problem = not_enough_space(
                path,
                needed,
                free,
                "the shards are staged beside the file, then written into it",
                left=what_is_left(path),
            )
    problem = broadcast_object(problem)
    if problem:
        raise CheckpointSaveError(problem)
    return shards


def _staging_failure(path: str, staging: str, message: str) -> str:
    """The sharded save's error, which names the staging directory, said of ``path`` (the free space it names is
    that of ``path``'s directory: the staging directory is beside the file)."""
    message = message.replace(staging, f"{path} (its staged shards)")
    for tail in (". Nothing was written; ", ". The partial directory is removed; "):
        message = message.split(tail)[0] if tail in message else message
    return f"{message}. The staged shards are removed and nothing was written to the file; {what_is_left(path)}"


def remove_full_file(path: str) -> None:
    """Delete a full checkpoint file (top-k rotation); anything else at ``path`` is refused. Not collective."""
    problem = why_not_replaceable_file(path)
    if problem:
        raise CheckpointSaveError(problem.replace("replace", "delete"))
    if os.path.lexists(path):
        os.remove(path)
