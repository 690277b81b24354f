"""Collective checks before a sharded save writes anything, and clear errors when a save fails part-way.

Hand-written because DCP has neither: it writes wherever it is pointed and reports a full disk as whatever the
failing write raised (``unexpected pos 704 vs 598``, ``basic_ios::clear``), on whichever rank hit it.

Before writing, every rank of the save:

1. writes a probe file next to the checkpoint and checks it sees every other rank's probe: ranks that do not share
   one directory (node-local disks, DeepSpeed's ``checkpoint.use_node_local_storage``) would each hold part of the
   shards and no node a loadable checkpoint, so the save is refused;
2. reports the bytes of its shards; rank 0 compares their sum with the free space of the target filesystem;
3. rank 0 checks that the path may be replaced (see ``[Note: atomic saves]`` in
   :mod:`lightning_zero.checkpoint.atomic`), prepares the partial directory and writes ``meta.pt``.

Every verdict is all-gathered over gloo (:func:`control_group`), so all ranks raise the same
:class:`CheckpointSaveError` (no rank is left waiting in a collective) before any shard is written.
"""

from __future__ import annotations

import atexit
import errno
import os
import socket
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_zero.checkpoint.atomic import (
    PARTIAL_MARKER,
    CheckpointSaveError,
    delete_leftover,
    is_complete,
    partial_dir,
    recover_interrupted_swap,
    sweep_leftovers,
    why_not_replaceable,
)
from lightning_zero.distributed.group_timeout import package_group_timeout
from lightning_zero.torch_compat import backend_serving

_CONTROL_GROUPS: Dict[Any, dist.ProcessGroup] = {}
SLACK_PER_RANK = 64 << 10  # DCP's per-file headers, .metadata, zero.json, meta.pt: small next to any model


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def control_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The group that carries the save's small CPU-side agreements over the ranks of ``group`` (the world when
    ``None``): ``group`` itself (the default group for ``None``) when gloo serves its CPU tensors, else a gloo group
    over its ranks, made once.

    [Note: the control plane rides the training group's gloo]
    The verdicts, broadcasts and the preemption flag are Python objects or CPU tensors. On the package's default
    group (``"cpu:gloo,cuda:nccl"`` on CUDA, ``"gloo"`` on CPU: ``adapters/process_group.py``) torch already carries
    them over gloo: ``all_gather_object``/``broadcast_object_list`` take the CPU device whenever a group serves
    ``cpu`` (``torch/distributed/distributed_c10d.py``, ``_get_object_coll_device``), so nothing is pickled through
    a CUDA tensor. A separate world-sized gloo group would connect a second full mesh (gloo's
    ``ProcessGroupGloo::ProcessGroupGloo`` calls ``connectFullMesh`` per context,
    ``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``): N sockets and 3 threads more per rank
    (``docs/scale.md``). Sharing is safe because every user issues its collectives from the training thread in the
    same order on every rank; preemption's flag, an ``async_op`` all-reduce still in flight while the step issues
    its own CPU collectives, is matched with its peers by the tag gloo draws per collective in issue order
    (``ProcessGroupGloo::nextTag``), not by arrival. DCP's asynchronous save, whose collectives run on another
    thread, keeps a group of its own (``checkpoint/io.py``). Only a group without a gloo CPU backend (``"nccl"``
    alone) still gets a separate gloo group.
    """
    if not _distributed():
        return None
    served = group if group is not None else dist.group.WORLD
    if backend_serving("cpu", served) == "gloo":
        return served
    return cached_gloo_group(_CONTROL_GROUPS, group)


def cached_gloo_group(cache: Dict[Any, Any], group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """A gloo group over the ranks of ``group`` (the world when ``None``), made once per world and kept in ``cache``;
    ``None`` without a process group."""
    if not _distributed():
        return None
    forget_groups_of_an_old_world(cache)
    key = id(group) if group is not None else "default"
    if key not in cache:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        cache[key] = dist.new_group(ranks=ranks, backend="gloo", timeout=package_group_timeout())
    return cache[key]


# Groups of an old world are kept referenced here, never destroyed: see forget_groups_of_an_old_world.
_ABANDONED: List[Dict[Any, Any]] = []
_RELEASED_AT_EXIT: set = set()


def forget_groups_of_an_old_world(cache: Dict[Any, Any]) -> None:
    """Empty ``cache`` when the default process group is not the one its groups were made in (destroyed and
    re-initialised, or a forked child of a process that had one): such groups are unusable.

    Groups inherited through ``fork()`` are moved aside, not released: such a gloo group blocks forever in its
    destructor (its worker threads do not exist in the child), which would hang every forked rank whose parent had
    saved in-process. Keeping a few small objects alive is the price."""
    world = dist.group.WORLD  # the default group itself (callers run only inside a process group)
    if cache.get("__world__") is not world:
        if cache.get("__pid__") not in (None, os.getpid()):
            _ABANDONED.append(dict(cache))  # inherited through fork()
        cache.clear()
        cache["__world__"] = world  # a strong reference, so its id cannot be reused by a later group
        cache["__pid__"] = os.getpid()
    if id(cache) not in _RELEASED_AT_EXIT:
        # Registered after the process group started (so after Lightning's atexit destroy_process_group, and run
        # before it: atexit is last-in first-out): the cached groups are released while c10d still knows them,
        # not destroyed at interpreter shutdown in arbitrary order, which can abort the process.
        _RELEASED_AT_EXIT.add(id(cache))
        atexit.register(cache.clear)


def all_gather(value: Any, group: Optional[dist.ProcessGroup]) -> List[Any]:
    if group is None:
        return [value]
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank (``value`` itself without a process group), over gloo
    (:func:`control_group`): on an NCCL-only group, ``broadcast_object_list`` would pickle through a CUDA tensor and
    synchronise the device. Both adapters' ``broadcast`` (checkpoint paths, resume decisions) go through here."""
    group = control_group(None)
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src, group=group)  # src: a global rank; the control group spans the world
    return box[0]


def shard_bytes(state: Any, writes_replicas: bool = True) -> int:
    """Bytes this rank's tensors of ``state`` will occupy on disk (local shards only).

    A replicated tensor (a plain tensor at stages 0-1, a DTensor's copy on a ``Replicate`` mesh dimension) is written
    once for the whole job (DCP's planner removes the duplicates), so it is counted only where ``writes_replicas``
    (rank 0; for a DTensor, the first rank of each replicated dimension): summed over ranks, the bytes are then what
    the save writes, not the world size times the replicated part."""
    if isinstance(state, dict):
        return sum(shard_bytes(v, writes_replicas) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(shard_bytes(v, writes_replicas) for v in state)
    if isinstance(state, DTensor):
        mesh = state.device_mesh
        first = all(mesh.get_local_rank(dim) == 0 for dim, p in enumerate(state.placements) if p.is_replicate())
        local = state.to_local()
        return local.numel() * local.element_size() if first else 0
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size() if writes_replicas else 0
    return 0


def free_bytes(path: str) -> Optional[int]:
    """Free bytes for an unprivileged writer on the filesystem holding ``path`` (its nearest existing ancestor)."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _oserror_in(err: BaseException) -> Optional[OSError]:
    seen = set()
    stack = [err]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        stack += [current.__cause__, current.__context__]
        for failure in getattr(current, "failures", {}).values():  # DCP's CheckpointException: rank -> (err, tb)
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def _short(err: BaseException) -> str:
    """``Type: first line`` of ``err``, or of the first rank's failure inside a DCP ``CheckpointException``."""
    failures = getattr(err, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def describe_failure(
    path: str,
    err: BaseException,
    needed: Optional[int],
    left: Optional[str] = None,
    removed: str = "The partial directory is removed",
) -> str:
    """One message for a save that failed while writing: what failed, where, bytes needed and free; ``left``: what
    the failure left at ``path`` (:func:`what_a_failed_save_left` by default), ``removed``: what was cleaned up.

    A full disk often surfaces without an errno (``torch.save``'s zip writer: ``unexpected pos 704 vs 598``), so
    free space below what the save needs is read as "no space left" too.
    """
    oserror = _oserror_in(err)
    free = free_bytes(path)
    left = left or what_a_failed_save_left(path)
    code = oserror.errno if oserror is not None else None
    if code in (errno.ENOSPC, errno.EDQUOT) or (needed is not None and free is not None and free < needed):
        reason = f"no space left on the device or quota exceeded ({_short(oserror or err)})"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason = f"permission denied or read-only filesystem ({_short(oserror)})"
    elif oserror is not None:
        reason = f"I/O error ({_short(oserror)})"
    else:
        return f"saving the checkpoint {path} failed: {_short(err)}. {removed}; {left}"
    sizes = f"needs about {needed} bytes, " if needed is not None else ""
    return (
        f"saving the checkpoint {path} failed: {reason}; {sizes}{free} bytes free on {os.path.dirname(path)}. "
        f"{removed}; {left}"
    )


def what_a_failed_save_left(path: str, is_checkpoint: Callable[[str], bool] = is_complete) -> str:
    """The end of a failed save's message: the checkpoint that was at ``path`` before the save is intact (a failed
    save never touches it: it writes beside it and swaps only when complete), or there was none. ``is_checkpoint``
    tells a complete checkpoint at ``path`` (a one-file save passes its own test).

    Said concretely, not "if any": a user reading "disk full" must know at once whether a checkpoint to resume from
    survived, without inspecting the directory."""
    if is_checkpoint(path):
        target = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
        return f"the previous checkpoint at {path}{target} is intact"
    if os.path.lexists(path):
        return f"what was at {path} before is untouched"
    return f"there was no previous checkpoint at {path}, and none is left there"


PROBE_PREFIX = ".lightning-zero-probe-"


def _probe(parent: str, rank: int, path: str) -> tuple:
    """Write this rank's probe beside the checkpoint. Its name is fixed per checkpoint name and rank, so the probe a
    killed save left behind is overwritten and removed by the next save of that checkpoint."""
    name = os.path.join(parent, f"{PROBE_PREFIX}{os.path.basename(path)}-r{rank}")
    try:
        os.makedirs(parent, exist_ok=True)
        with open(name, "w") as file:
            file.write(str(rank))
        return name, None
    except OSError as err:
        try:  # on a full disk the file is created and its write fails: no litter
            os.remove(name)
        except OSError:
            pass
        return None, err


def _probe_failure(path: str, rank: int, err: OSError, needed: int) -> str:
    """The message for a probe that could not be written: on a full disk (the usual reason) the same as the space
    check's, since the user's question is the same (which path, how much space)."""
    parent = os.path.dirname(path)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return not_enough_space(
            path, needed, free_bytes(parent), f"rank {rank} could not write even a probe file there: {err.strerror}"
        )
    return f"rank {rank} cannot write to {parent}: {err}. Nothing was written; {what_a_failed_save_left(path)}"


def not_enough_space(path: str, needed: int, free: Optional[int], detail: str = "", left: Optional[str] = None) -> str:
    """Refusing a save for lack of space: the path, the bytes needed, free and missing, and what is left at ``path``
    (``left``, :func:`what_a_failed_save_left` by default)."""
    parent = os.path.dirname(path)
    missing = f"free at least {needed - free} more bytes" if free is not None and free < needed else "free space"
    detail = f"; {detail}" if detail else ""
    return (
        f"not enough space to save the checkpoint {path}: it needs about {needed} bytes and {parent} has {free} "
        f"bytes free ({missing} or choose another directory{detail}). Nothing was written; "
        f"{left or what_a_failed_save_left(path)}"
    )


def _remove_stale_probes(parent: str, keep: set) -> None:
    """Remove every probe in ``parent`` but this save's (``keep``, each rank's own, which it removes itself): any
    other is a killed save's, since a job's earlier saves are settled before the next one starts, and no rank can
    start its next save before this one's verdicts are gathered (a probe left under another checkpoint name or world
    size stayed before)."""
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(PROBE_PREFIX) and entry.path not in keep:
            try:
                os.remove(entry.path)
            except OSError:
                pass


def prepare_save(
    path: str,
    state: dict,
    write_meta: Callable[[str], None],
    process_group: Optional[dist.ProcessGroup],
    earlier_failures: Sequence[str] = (),
    extra_bytes: int = 0,
) -> int:
    """Run the checks of the module docstring (collective) and leave an empty ``partial`` directory with
    ``meta.pt`` written by ``write_meta``. Returns the bytes the save needs (``extra_bytes``: what it writes besides
    the shards, e.g. the 16-bit weights file). Raises :class:`CheckpointSaveError` on every rank, having written
    nothing, when a check fails or when ``earlier_failures`` (of this rank's earlier asynchronous saves) is not
    empty."""
    group = control_group(process_group)
    rank = dist.get_rank(group) if group is not None else 0
    parent = os.path.dirname(path)
    probe, error = _probe(parent, rank, path)
    reports = all_gather((socket.gethostname(), probe, shard_bytes(state, writes_replicas=rank == 0)), group)
    if rank == 0:  # here, not after the verdicts: a rank past them may already have written its next save's probe
        _remove_stale_probes(parent, keep={report[1] for report in reports})
    needed = sum(report[2] for report in reports) + SLACK_PER_RANK * len(reports) + extra_bytes
    errors: List[str] = list(earlier_failures) + ([_probe_failure(path, rank, error, needed)] if error else [])
    unseen = [r for r, (_, other, _) in enumerate(reports) if other is not None and not os.path.exists(other)]
    if unseen:
        hosts = sorted({reports[r][0] for r in unseen})
        errors.append(
            f"rank {rank} ({socket.gethostname()}) does not see the files ranks {unseen} (on {hosts}) wrote in "
            f"{parent}: the checkpoint directory is not shared by all ranks (node-local storage). A checkpoint "
            "written there would be split across machines and loadable on none. Use a filesystem every node mounts "
            "at the same path (e.g. NFS, Lustre); node-local checkpoint storage is not supported"
        )
    created = False
    if rank == 0 and not errors:
        try:
            free = free_bytes(parent)
            if free is not None and free < needed:
                raise CheckpointSaveError(not_enough_space(path, needed, free))
            recover_interrupted_swap(path)
            reason = why_not_replaceable(path)
            if reason:
                raise CheckpointSaveError(reason)
            partial = partial_dir(path)
            delete_leftover(partial)  # left by a crashed save
            os.makedirs(partial)
            created = True
            open(os.path.join(partial, PARTIAL_MARKER), "w").close()
            write_meta(partial)
        except CheckpointSaveError as err:
            errors.append(str(err))
        except Exception as err:  # a full disk while writing meta.pt surfaces as RuntimeError("unexpected pos ...")
            errors.append(describe_failure(path, err, needed))
    verdicts = all_gather(errors, group)
    if probe is not None:
        try:
            os.remove(probe)
        except OSError:
            pass
    if rank == 0:
        sweep_leftovers(parent, keep=partial_dir(path))
    failures = [message for messages in verdicts for message in messages]
    if failures:
        if created:
            delete_leftover(partial_dir(path))
        raise CheckpointSaveError("; ".join(dict.fromkeys(failures)))
    return needed


def fail_collectively(
    path: str,
    local_error: Optional[BaseException],
    needed: Optional[int],
    process_group: Optional[dist.ProcessGroup],
    cleanup: Callable[[], None],
    gather_group: bool = False,
) -> None:
    """Share each rank's failure of a save step; if any rank failed, ``cleanup`` on rank 0 and raise everywhere.

    Collective over the control group of ``process_group``, or over ``process_group`` itself (a gloo group) when
    ``gather_group``."""
    group = process_group if gather_group else control_group(process_group)
    message = None
    if local_error is not None:
        message = (
            str(local_error)
            if isinstance(local_error, CheckpointSaveError)
            else describe_failure(path, local_error, needed)
        )
    messages = [m for m in all_gather(message, group) if m]
    if messages:
        if (dist.get_rank(group) if group is not None else 0) == 0:
            cleanup()
        raise CheckpointSaveError("; ".join(dict.fromkeys(messages))) from local_error
