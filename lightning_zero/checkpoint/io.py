"""Sharded checkpoint save/load on ``torch.distributed.checkpoint`` (DCP), atomic and optionally asynchronous.

A lightning-zero checkpoint is a directory (``X.ckpt/``) holding

* a DCP checkpoint (``.metadata`` + ``__<rank>_<n>.distcp``) of the tensor state: ``{"state_dict": {...},
  "optimizer_states": {...}, ...}``. Every rank writes only its own shards; loading reshards to whatever DTensor
  layout or world size the receiving ``state`` has;
* ``meta.pt``: everything else of Lightning's checkpoint dict, written by rank 0 with ``torch.save`` and read back
  only with ``weights_only=True``;
* ``zero.json``: the format marker, written last. A directory without it is not a checkpoint. It records every
  other file's size and CRC-32 and is sealed with a CRC-32 of its own fields (see
  :mod:`lightning_zero.checkpoint.verify`), so that loading detects a damaged, missing or edited file.

Finding and reading such a directory, and verifying it whole: :mod:`lightning_zero.checkpoint.directory`.
Atomicity, the recovery rule after an interrupted swap, and what a save may delete: ``[Note: atomic saves]`` in
:mod:`lightning_zero.checkpoint.atomic`. The collective checks before a save (shared directory, free space,
replaceable path) and the errors of a failed one: :mod:`lightning_zero.checkpoint.save_guards`.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from lightning_zero.checkpoint import atomic
from lightning_zero.checkpoint.atomic import CheckpointSaveError, PathLike
from lightning_zero.checkpoint.directory import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INFO_FILE,
    META_FILE,
    checkpoint_directory,
    read_checkpoint_info,
)
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.matching import check_state_matches, describe_state, merge_descriptions
from lightning_zero.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_meta,
    read_dcp_metadata,
)
from lightning_zero.checkpoint.save_guards import (
    all_gather,
    cached_gloo_group,
    control_group,
    describe_failure,
    fail_collectively,
    prepare_save,
)
from lightning_zero.checkpoint.verify import check_files, check_metadata, file_records, seal

_partial_dir = atomic.partial_dir
_old_dir = atomic.old_dir
_norm = atomic.local_path


def _rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _world(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _write_info(partial: str, state: dict, world_size: int, info: Optional[dict]) -> None:
    record = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "world_size": world_size,
        "keys": sorted(str(k) for k in state),
        "model_keys": len(state.get("state_dict", {})) if isinstance(state.get("state_dict"), dict) else 0,
        "torch_version": torch.__version__,
    }
    overlap = set(record) & set(info or {}) | {"files", "seal"} & set(info or {})
    if overlap:
        raise ValueError(f"info must not override the reserved zero.json fields {sorted(overlap)}")
    record.update(info or {})
    record["files"] = file_records(partial)  # every rank's files are complete here (see the note on atomic saves)
    tmp = os.path.join(partial, INFO_FILE + ".tmp")
    with open(tmp, "w") as file:
        json.dump(seal(record), file, indent=1, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())
    os.rename(tmp, os.path.join(partial, INFO_FILE))


class PendingSave:
    """Handle of an asynchronous save. The directory appears at its path once the save is finalized.

    Rank 0 finalizes (``zero.json`` + atomic swap) as soon as the DCP write completes, in the background; if the
    write or the finalization fails it removes the partial directory. :meth:`wait` blocks until then and re-raises
    any failure as :class:`CheckpointSaveError`.
    """

    def __init__(
        self,
        future: Future,
        path: str,
        finalize,
        group: Optional[dist.ProcessGroup],
        cleanup,
        needed: Optional[int] = None,
    ) -> None:
        self.path = path
        self._future = future
        self._finalize = finalize
        self._cleanup = cleanup
        self._needed = needed
        self._group = group
        self._lock = threading.Lock()
        self._finalized = False
        self._error: Optional[BaseException] = None
        # A weak reference: the future keeps its callbacks after it completes, and a callback holding this handle
        # would make a reference cycle (handle -> future -> callback -> handle) that keeps the handle, its
        # closures and what they reference alive until the cyclic collector runs. _PENDING holds the handle
        # until it is waited for, which runs the finalization itself.
        handle = weakref.ref(self)
        future.add_done_callback(lambda _: _finalize_if_alive(handle))

    def _run_finalize(self) -> None:
        with self._lock:
            if self._finalized:
                return
            self._finalized = True
            try:
                self._future.result()
                self._finalize()
            except BaseException as err:  # kept and re-raised on the training thread by wait()
                self._error = err
                try:
                    self._cleanup()
                except Exception:
                    pass  # the save already failed; its error is the one to report
            finally:
                self._finalize = self._cleanup = None  # run once: release their closures

    def done(self) -> bool:
        return self._future.done() and self._finalized

    def wait(self, barrier: bool = True) -> None:
        """Block until the save is complete on disk. ``barrier=True`` (collective: every rank must call it) also
        guarantees every rank sees the finished directory when it returns, and that a failure on any rank raises
        on every rank."""
        try:
            self._future.result()
        except BaseException:
            pass  # recorded by _run_finalize
        self._run_finalize()
        with _PENDING_LOCK:
            if self in _PENDING:
                _PENDING.remove(self)
        if barrier:
            fail_collectively(self.path, self._error, self._needed, self._group, lambda: None, gather_group=True)
        elif self._error is not None:
            raise CheckpointSaveError(describe_failure(self.path, self._error, self._needed)) from self._error


def _finalize_if_alive(handle: "weakref.ref[PendingSave]") -> None:
    pending = handle()
    if pending is not None:
        pending._run_finalize()


_PENDING: List[PendingSave] = []
_PENDING_LOCK = threading.Lock()
_ASYNC_GROUPS: Dict[Any, dist.ProcessGroup] = {}


def _settle_pending_saves() -> List[str]:
    """Wait (locally) for every asynchronous save of this process; return the messages of those that failed."""
    with _PENDING_LOCK:
        pending = list(_PENDING)
    errors = []
    for handle in pending:
        try:
            handle.wait(barrier=False)
        except CheckpointSaveError as err:
            errors.append(str(err))
    return errors


def pending_save_paths() -> List[str]:
    """The paths of this process's asynchronous saves not yet awaited (finished or not)."""
    with _PENDING_LOCK:
        return [handle.path for handle in _PENDING]


def settle_pending_saves() -> List[str]:
    """Wait locally (no collective) for every asynchronous save of this process; return the failures' messages.

    For the end of a process, where no collective may run: every rank's background write takes part in DCP's own
    collectives (on a separate gloo group) and rank 0 commits ``zero.json`` in the background once DCP finished on
    every rank, so waiting on each rank suffices while all ranks are alive."""
    return _settle_pending_saves()


def wait_for_pending_saves(barrier: bool = True) -> None:
    """Wait for every asynchronous save this process started and raise :class:`CheckpointSaveError` if one failed.

    Collective when ``barrier=True``: every rank then sees the finished directories, and a failure on any rank raises
    on every rank. The agreement is one exchange whatever each rank still has pending (a callback may already have
    waited on rank 0 alone), so the ranks' collectives cannot fall out of step.
    """
    errors = _settle_pending_saves()
    if barrier and dist.is_available() and dist.is_initialized():
        errors = [message for messages in all_gather(errors, control_group(None)) for message in messages]
    if errors:
        raise CheckpointSaveError("; ".join(dict.fromkeys(errors)))


def _async_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    # Why a separate group: DCP's async save runs its planning collectives on a background thread. Sharing the
    # training process group with it would interleave two streams of collectives on one communicator.
    return cached_gloo_group(_ASYNC_GROUPS, group)


def _stageable(value: Any) -> Any:
    """``value`` (nested dicts/lists of the state) as DCP's async stager can copy it.

    The stager deep-copies each DTensor, and ``Tensor.__deepcopy__`` clones a wrapper subclass only when the
    wrapper's own ``data_ptr()`` is 0; otherwise it copies the wrapper's storage, which holds no memory ("Attempted
    to call copy_() on an invalid python storage"). A DTensor's wrapper takes the storage offset of the local tensor
    it is made from, and under NVMe parameter swapping a shard's memory is an aligned slice of a larger allocation
    (:func:`lightning_zero.offload.aio.aligned_buffer`), so ``module.state_dict()``'s detached DTensors have a
    non-zero ``data_ptr()``. Those are rebuilt here around a copy of their local shard (offset 0), the real
    swapped-in data; the copy is made now, on the caller's thread, as the stager's own copies are."""
    if isinstance(value, DTensor) and value.data_ptr() != 0:
        return DTensor.from_local(
            value.to_local().clone(),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, dict):
        return {key: _stageable(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_stageable(item) for item in value)
    return value


def save_planner() -> DefaultSavePlanner:
    """DCP's default planner, except that a tensor every rank holds whole is written by the group's rank 0.

    [Note: whose copy of a replicated tensor a checkpoint holds]
    Buffers (BatchNorm's running statistics) and every other tensor that is not sharded are plain tensors on every
    rank at every stage, and DCP writes one copy of them. Its default planner gives that copy to the rank with the
    least planned bytes so far (torch/distributed/checkpoint/_dedup_save_plans.py, ``dedup_save_plans`` with
    ``save_to_lowest_rank=False``, called from ``DefaultSavePlanner._dedup_save_plans``): at stages 2-3, where each
    rank's shards weigh the same, that is often rank 1, whose buffers differ from rank 0's when the ranks do not
    broadcast them. DDP's and DeepSpeed's checkpoints hold rank 0's (Lightning saves on global rank 0; DeepSpeed's
    engine, ``save_checkpoint``, writes the module states from data-parallel rank 0 only), so here the copy is
    always rank 0's: ``dedup_save_to_lowest_rank=True`` picks the lowest rank holding each item
    (``save_to_lowest_rank=True``). Rank 0 then writes every replicated tensor: at stages 2-3 those are the buffers
    and the few tensors FSDP2 does not shard, small beside the shards. ``save_guards.shard_bytes`` counts the same
    rank for the free-space check."""
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def save_sharded_checkpoint(
    path: PathLike,
    state: Dict[str, Any],
    metadata: Dict[str, Any],
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    async_save: bool = False,
    info: Optional[Dict[str, Any]] = None,
    extra_files: Optional[Callable[[str], Any]] = None,
    extra_bytes: int = 0,
) -> Optional[PendingSave]:
    """Save ``state`` (tensors/DTensors, nested dicts) with DCP and ``metadata`` as ``meta.pt``, atomically.

    Collective: every rank of ``process_group`` (default: the world) calls it with its local shards. Works without a
    process group too (single process). ``info`` adds JSON-serialisable fields to ``zero.json`` (e.g. ``stage``).
    ``extra_files`` is called on rank 0 with the partial directory once every rank's shards and ``.metadata`` are in
    it, before ``zero.json``: the files it writes there are part of the checkpoint (recorded and verified, swapped
    into place atomically, deleted with it), and a failure fails the save like any other write. ``extra_bytes``:
    their size, for the free-space check.

    Returns ``None`` for a synchronous save (the checkpoint is complete on every rank on return) or a
    :class:`PendingSave` when ``async_save=True``: the state is staged to CPU before returning, so training may
    modify parameters right away; call :func:`wait_for_pending_saves` before exit. A new save first waits for
    earlier pending ones.
    """
    if not isinstance(state, dict) or not isinstance(metadata, dict):
        raise TypeError("state and metadata must be dicts")
    clash = set(state) & set(metadata)
    if clash:
        raise ValueError(f"keys {sorted(clash)} are in both the tensor state and the metadata; each key goes in one")
    earlier_failures = _settle_pending_saves()  # reported through prepare_save's verdict, on every rank
    path = _norm(path)
    partial = _partial_dir(path)
    rank, world = _rank(process_group), _world(process_group)
    json.dumps(info or {})  # fail on every rank before writing anything if info is not JSON
    needed = prepare_save(
        path,
        state,
        lambda directory: torch.save(metadata, os.path.join(directory, META_FILE)),
        process_group,
        earlier_failures,
        extra_bytes,
    )
    writer = FileSystemWriter(partial)
    # What zero.json records of the state (its keys, the count of model keys), without its tensors: finalize outlives
    # the call with async_save, and must not keep the state alive.
    outline = {key: dict.fromkeys(value) if isinstance(value, dict) else None for key, value in state.items()}

    def finalize() -> None:
        if rank == 0:
            atomic.fault_point("after_metadata")
            if extra_files is not None:
                extra_files(partial)
            _write_info(partial, outline, world, info)
            atomic.fault_point("after_info")
            atomic.swap_into_place(partial, path)

    def cleanup() -> None:
        if rank == 0:
            atomic.recover_interrupted_swap(path)
            atomic.delete_leftover(partial)

    atomic.fault_point("before_shards")
    if async_save:
        group = _async_group(process_group)
        result = dcp.async_save(_stageable(state), storage_writer=writer, planner=save_planner(), process_group=group)
        future = getattr(result, "upload_completion", result)
        handle = PendingSave(future, path, finalize, group, cleanup, needed)
        with _PENDING_LOCK:
            _PENDING.append(handle)
        return handle
    error: Optional[BaseException] = None
    try:
        dcp.save(state, storage_writer=writer, planner=save_planner(), process_group=process_group)
        finalize()
    except (Exception, CheckpointException) as err:  # shared below so every rank raises (DCP's is a BaseException)
        error = err
    fail_collectively(path, error, needed, process_group, cleanup)
    return None


def load_sharded_checkpoint(
    path: PathLike,
    state: Dict[str, Any],
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
    checksums: bool = True,
) -> Dict[str, Any]:
    """Fill the tensors of ``state`` in place from the checkpoint at ``path`` and return its ``meta.pt`` dict.

    Collective over ``process_group``. ``state`` has the receiving layout (DTensors of any mesh, plain tensors, any
    world size); DCP reads the overlapping chunks, which is how a checkpoint saved by 4 ranks at stage 3 resumes on
    1 rank at stage 0. Non-tensor leaves of ``state`` are replaced with the stored values (read with
    ``weights_only=True``). The checks before any data is read: :func:`load_sharded_states`.
    """
    wait_for_pending_saves(barrier=False)
    directory = checkpoint_directory(path)
    load_sharded_states(directory, state, process_group=process_group, strict=strict, checksums=checksums)
    return load_meta(directory)


def load_sharded_states(
    directory: str,
    state: Dict[str, Any],
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
    checksums: bool = True,
    info: Optional[dict] = None,
    metadata: Optional[Any] = None,
) -> None:
    """:func:`load_sharded_checkpoint` without ``meta.pt``, for a caller that read it already; ``info``
    (:func:`read_checkpoint_info`) and ``metadata`` (``safe_load.read_dcp_metadata``) likewise, so each file is read
    once per load (DCP's own reader is handed the same ``metadata``: :class:`SafeFileSystemReader`).

    Before reading any data the checkpoint is verified: ``zero.json``'s seal, every file's size, ``.metadata``'s
    structure and (``checksums=True``, the default) every file's CRC-32, the ranks splitting the files between them.
    Keys of ``state`` missing from the checkpoint, and keys the checkpoint holds under a top-level key of ``state``
    that ``state`` lacks, are errors unless ``strict=False`` (missing keys then keep their values); a shape mismatch
    always is. Every failure is a :class:`CheckpointError` naming the file or keys, raised on every rank.
    """
    problems: List[CheckpointError] = []
    try:
        info = read_checkpoint_info(directory) if info is None else info
        problems = check_files(
            directory, info, checksums=checksums, share=(_rank(process_group), _world(process_group))
        )
        if not problems:
            if metadata is None:
                metadata = read_dcp_metadata(directory)  # refuses a tampered .metadata without running its pickle
            problems = check_metadata(directory, metadata, info.get("files"))
    except CheckpointError as err:
        problems = [err]
    _raise_on_every_rank(problems, process_group)
    description = describe_state(state, metadata)
    if _world(process_group) > 1:
        description = merge_descriptions(all_gather(description, control_group(process_group)))
    check_state_matches(description, metadata, strict=strict, where=directory)
    try:
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(directory, metadata=metadata),
            planner=SafeLoadPlanner(allow_partial_load=not strict),
            process_group=process_group,
        )
    except CheckpointException as wrapped:
        error = _translate(wrapped, directory)
        first = next(iter(wrapped.failures.values()), (None, None))[0]
        # chained to the first rank's own exception (its traceback), never to DCP's BaseException wrapper
        raise error from (first if isinstance(first, Exception) and first is not error else None)


def _raise_on_every_rank(problems: List[CheckpointError], group: Optional[dist.ProcessGroup]) -> None:
    """Raise the first problem any rank found, on every rank (each rank checksums only its share of the files,
    and a rank that raised alone would leave the others waiting in DCP's collectives)."""
    found = [str(problem) for problem in problems]
    if _world(group) > 1:
        # Python objects go over the gloo control group: on NCCL, all_gather_object on the training group would
        # pickle through CUDA tensors and synchronise the device (save_guards.control_group).
        gathered = all_gather(found, control_group(group))
        found = list(dict.fromkeys(message for messages in gathered for message in messages))  # sizes: every rank
    if not found:
        return
    mine = {str(problem): problem for problem in problems}
    first = mine.get(found[0]) or CheckpointError(found[0])
    if len(found) > 1:
        raise CheckpointError(
            f"{first} (and {len(found) - 1} more problems; `lightning-zero verify` lists them)", first.path
        ) from first
    raise first


def _translate(wrapped: CheckpointException, directory: str) -> CheckpointError:
    """DCP's ``CheckpointException`` (a ``BaseException`` holding every failed rank's exception) as one
    :class:`CheckpointError`. A failure that is already a :class:`CheckpointError` (a refused pickle, a damaged
    record) is kept as it is."""
    failures = list(wrapped.failures.items())
    for _rank_id, (failure, _trace) in failures:
        if isinstance(failure, CheckpointError):
            return failure
    summary = "; ".join(
        f"rank {rank_id}: {type(failure).__name__}: {(str(failure).strip() or ' ').splitlines()[0]}"
        for rank_id, (failure, _trace) in failures[:3]
    )
    return CheckpointError(f"{directory}: loading failed on {len(failures)} rank(s): {summary}", directory)


def remove_sharded_checkpoint(path: PathLike) -> None:
    """Delete a checkpoint (and leftovers of interrupted saves). Not collective: call it on one rank.

    A symlink (``save_last="link"``) to a checkpoint is removed, not its target. Refuses
    (:class:`CheckpointSaveError`) to delete anything at ``path`` that is not a lightning-zero checkpoint.
    """
    path = _norm(path)
    with _PENDING_LOCK:
        pending = [handle for handle in _PENDING if handle.path == path]
    for handle in pending:
        handle.wait(barrier=False)
    if os.path.islink(path) and (not os.path.exists(path) or atomic.is_complete(path)):
        os.remove(path)  # the link only (a dangling one included); its target is not ours to delete
    elif os.path.lexists(path):
        reason = atomic.why_not_replaceable(path)
        if reason:
            raise CheckpointSaveError(reason.replace("replace", "delete"))
        atomic.delete_checkpoint_directory(path)
    for leftover in (_partial_dir(path), _old_dir(path)):
        atomic.delete_leftover(leftover)


def repoint_links(path: PathLike, new_target: Optional[PathLike]) -> None:
    """Before ``path`` is deleted: each symlink in its directory that points to it is re-pointed to ``new_target``
    (a complete checkpoint; relative, as Lightning links), atomically (a new link renamed over the old one). Without
    this a kill between the deletion and Lightning's re-link left ``last.ckpt`` dangling, and a restart with
    ``ckpt_path="last"`` started from step 0. Nothing happens when ``new_target`` is ``None`` or not complete."""
    if new_target is None:
        return
    path, new_target = _norm(path), _norm(new_target)
    if path == new_target or not (atomic.is_complete(new_target) or os.path.isfile(new_target)):
        return
    parent = os.path.dirname(path)
    for entry in os.scandir(parent):
        if entry.is_symlink() and os.path.realpath(entry.path) == os.path.realpath(path):
            atomic.replace_link(new_target, entry.path)
