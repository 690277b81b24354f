"""Optimizer-state swapping to NVMe: the optimizer steps its parameters in sub-groups whose states stream from
and to files, so host memory holds only a few sub-groups' states at a time.

[Note: the swapped step]
:func:`attach_swapper` gives the optimizer a subclass whose ``step`` (still wrapped by torch's hook machinery, so
the stage-1 partition/offload hooks run once around the whole step) does, for sub-groups ``0..n-1``::

    read(i+1) from disk  ||  step(i) on CPU  ||  write(i-1) to disk

Stepping sub-group ``i`` narrows every ``param_groups[g]["params"]`` to the sub-group's parameters and calls the
optimizer's own (unhooked) ``step``: the update math is the user's optimizer, per element identical to one step over
all parameters. State tensors with one value per parameter element (Adam's ``exp_avg``/``exp_avg_sq``, ...) are
swapped; scalars (``step``) stay in memory. At most ``buffer_count`` aligned sub-group buffers are alive at once.

[Note: what a swapped-out state looks like]
Between steps ``optimizer.state[p][key]`` is a :class:`SwappedOut` marker (not a tensor: any computation on it fails
loudly), which records how to rebuild the tensor (shape, dtype, and for FSDP2 DTensor states the mesh and
placements). Readers of the states must call :meth:`OptimizerStateSwapper.make_resident` first (checkpoint save and
load do, and ``optimizer.state_dict()`` does); the next step writes them back out.

[Note: swapped fp32 masters]
Where the optimizer steps separate fp32 *masters* of the module's parameters (optimizer-only offload: plain tensors
at stage 1, DTensors over the FSDP2 shards at stages 2-3), ``masters=`` maps each master to the module parameter it
stands for, and the masters are swapped too, in the same sub-group files (each master before its states). Between
steps a swapped-out master's local tensor is an empty ``(0,)`` tensor (its ``.data``, a DTensor's local tensor's
``.data``; the object, the DTensor wrapper with its mesh and global shape, its identity in ``param_groups``/``state``
and ``requires_grad`` stay), so any computation on it fails
loudly on the shape instead of reading stale values. For each sub-group the swapped step then also does what the
stage-1 hooks do for resident masters: copy the module's gradients into fresh fp32 ``master.grad`` tensors (one
sub-group's worth, dropped after the step) and copy the stepped masters back into the module's parameters. Masters
are written to disk sub-group by sub-group at attach time, so they are never all resident at once.
With ``offload_params`` (stage 3) the FSDP2 sharded parameter *is* the master, read by every all-gather between
steps: it can only be swapped by parameter swapping (``offload_params="nvme"``), not here.

[Note: files]
Each swapper creates its own fresh folder ``nvme_path/lz-swap-<unique>/rank<k>/`` and never reads anything it did
not write in this process, so leftovers of a crashed run cannot be mistaken for state. :meth:`close` (teardown,
exception) and a finalizer at interpreter exit remove the folder.

Framework-free: imports only torch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.offload.aio import AsyncFileIO, SwapIOError, align_up, aligned_buffer
from lightning_zero.offload.nvme_config import NvmeConfig
from lightning_zero.ops.step_override import override_step, restore_step_override
from lightning_zero.torch_compat import local_tensor

_ATTR = "_lightning_zero_swapper"
_MARKER = "NVMe optimizer-state swapping"  # the step override's marker (step_override)
MASTER = "__master__"  # the key of a master's entry in a sub-group layout (not an optimizer state key)
# An Adam-like optimizer keeps two fp32 values per parameter element (exp_avg, exp_avg_sq).
ESTIMATED_STATE_BYTES_PER_ELEMENT = 8


@dataclass(frozen=True)
class SwappedOut:
    """Placeholder for a state tensor that lives on disk (see the module's second note)."""

    shape: torch.Size
    dtype: torch.dtype
    local_shape: torch.Size
    mesh: Any = None
    placements: Any = None
    stride: Any = None

    def __repr__(self) -> str:
        return f"SwappedOut(shape={tuple(self.shape)}, dtype={self.dtype}: on NVMe, call make_resident first)"


@dataclass
class _Entry:
    param: Tensor
    key: str
    marker: SwappedOut
    offset: int
    nbytes: int


def _marker(value: Tensor) -> SwappedOut:
    local = local_tensor(value)
    if local is value:
        return SwappedOut(value.shape, value.dtype, value.shape)
    return SwappedOut(value.shape, value.dtype, local.shape, value.device_mesh, tuple(value.placements), value.stride())


def _rebuild(marker: SwappedOut, local: Tensor) -> Tensor:
    local = local.view(marker.local_shape)
    if marker.mesh is None:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, marker.mesh, marker.placements, run_check=False, shape=marker.shape, stride=marker.stride
    )


def _master_marker(param: Tensor) -> SwappedOut:
    """How to rebuild the fp32 master of module parameter ``param`` (a DTensor's local shard, at stages 2-3)."""
    marker = _marker(param.detach())
    return SwappedOut(marker.shape, torch.float32, marker.local_shape, marker.mesh, marker.placements, marker.stride)


def get_swapper(optimizer) -> Optional["OptimizerStateSwapper"]:
    return getattr(optimizer, _ATTR, None)


def remove_folder(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class OptimizerStateSwapper:
    """Swaps one optimizer's per-element states to files under ``nvme.nvme_path`` (see the module notes)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        nvme: NvmeConfig,
        rank: int = 0,
        pin_memory: bool = False,
        masters: Optional[dict[int, Tensor]] = None,
    ) -> None:
        self.optimizer = optimizer
        # id(master) -> the module parameter it stands for (see the note on swapped fp32 masters)
        self.companions: dict[int, Tensor] = dict(masters or {})
        # a master has its module parameter's shape (and for FSDP2's DTensor parameters its mesh and placements)
        self._master_markers = {key: _master_marker(p) for key, p in self.companions.items()}
        self._masters_out: set[int] = set()
        self.nvme = nvme
        self.pin_memory = pin_memory
        self.run_folder = tempfile.mkdtemp(prefix="lz-swap-", dir=nvme.nvme_path)
        self.folder = os.path.join(self.run_folder, f"rank{rank}")
        os.makedirs(self.folder)
        self._finalizer = weakref.finalize(self, remove_folder, self.run_folder)
        self.io = AsyncFileIO(nvme.aio)
        self.subgroups = self._split([p for g in optimizer.param_groups for p in g["params"]])
        self.layouts: dict[int, list[_Entry]] = {}
        self._free: list[Tensor] = []
        self.buffers_alive = 0
        self.peak_buffers = 0
        self.peak_buffer_bytes = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.closed = False

    def _split(self, params: list[Tensor]) -> list[list[Tensor]]:
        groups: list[list[Tensor]] = []
        current: list[Tensor] = []
        size = 0
        for param in params:
            n = self._numel(param)
            if current and size + n > self.nvme.sub_group_size:
                groups.append(current)
                current, size = [], 0
            current.append(param)
            size += n
        if current:
            groups.append(current)
        return groups

    def _numel(self, param: Tensor) -> int:
        """Elements this rank steps for ``param`` (a swapped-out master's own tensor is empty)."""
        marker = self._master_markers.get(id(param))
        return torch.Size(marker.local_shape).numel() if marker is not None else local_tensor(param).numel()

    def path(self, index: int) -> str:
        return os.path.join(self.folder, f"subgroup{index}.bin")

    def estimated_bytes(self) -> int:
        """Disk bytes for an Adam-like optimizer over this rank's parameters (checked against free space)."""
        return sum(
            align_up(ESTIMATED_STATE_BYTES_PER_ELEMENT * self._numel(p))
            + (align_up(4 * self._numel(p)) if id(p) in self.companions else 0)
            for group in self.subgroups
            for p in group
        )

    def check_free_space(self, needed: Optional[int] = None) -> None:
        """Refuse to start when ``nvme_path`` cannot hold this rank's states (times the ranks of this node, which
        usually share the disk: ``LOCAL_WORLD_SIZE`` as torchrun sets it, else 1)."""
        needed = self.estimated_bytes() if needed is None else needed
        sharing = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        free = shutil.disk_usage(self.folder).free
        if free < needed * sharing:
            who = "this rank's" if sharing == 1 else f"the {sharing} local ranks'"
            raise SwapIOError(
                28,
                f"nvme_path={self.nvme.nvme_path!r} has {free} bytes free but {who} optimizer "
                f"states need about {needed * sharing} bytes on disk; free space or choose another "
                "nvme_path",
            )

    # ---------------------------------------------------------------- buffers
    def _acquire(self, nbytes: int, writes: deque) -> Tensor:
        while True:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
            if self._free:  # free but too small: replace it rather than keep both
                self._free.pop()
                self.buffers_alive -= 1
            if self.buffers_alive < self.nvme.buffer_count:
                self.buffers_alive += 1
                self.peak_buffers = max(self.peak_buffers, self.buffers_alive)
                buf = aligned_buffer(nbytes, pin_memory=self.pin_memory)
                self.peak_buffer_bytes = max(self.peak_buffer_bytes, buf.numel())
                return buf
            if not writes:
                raise RuntimeError("swap buffer accounting error: no buffer free and no write in flight")
            self._finish_write(writes.popleft())

    def _release(self, buf: Optional[Tensor]) -> None:
        if buf is not None:
            self._free.append(buf)

    # ---------------------------------------------------------------- layouts and transfers
    def _layout(self, index: int) -> list[_Entry]:
        entries, offset = [], 0
        for param in self.subgroups[index]:
            master = self._master_markers.get(id(param))
            if master is not None:
                nbytes = torch.Size(master.local_shape).numel() * 4
                entries.append(_Entry(param, MASTER, master, offset, nbytes))
                offset = align_up(offset + nbytes)
            state = self.optimizer.state.get(param)
            if not state:
                continue
            numel = self._numel(param)
            for key, value in state.items():
                if key == "step" or not isinstance(value, (Tensor, SwappedOut)):
                    continue
                marker = value if isinstance(value, SwappedOut) else _marker(value)
                local_numel = torch.Size(marker.local_shape).numel()
                if local_numel != numel or local_numel == 0:
                    continue
                nbytes = local_numel * marker.dtype.itemsize
                entries.append(_Entry(param, key, marker, offset, nbytes))
                offset = align_up(offset + nbytes)
        return entries

    def _state(self, entry: _Entry):
        """The entry's current value, or ``None`` when its state was dropped (never creates an empty state)."""
        if entry.key is MASTER:
            return entry.marker if id(entry.param) in self._masters_out else entry.param
        state = self.optimizer.state.get(entry.param)
        return None if state is None else state.get(entry.key)

    def _set(self, entry: _Entry, value) -> None:
        """Make ``value`` (a tensor, or the entry's marker: swapped out) the entry's current value."""
        if entry.key is not MASTER:
            self.optimizer.state[entry.param][entry.key] = value
        elif isinstance(value, SwappedOut):
            # see the note on swapped fp32 masters; a DTensor master keeps its wrapper, its local tensor empties
            local_tensor(entry.param).data = torch.empty(0, dtype=value.dtype)
            self._masters_out.add(id(entry.param))
        else:
            local_tensor(entry.param).data = local_tensor(value)
            self._masters_out.discard(id(entry.param))

    def _view(self, buf: Tensor, entry: _Entry) -> Tensor:
        return buf[entry.offset : entry.offset + entry.nbytes].view(entry.marker.dtype)

    def _start_read(self, index: int, writes: deque):
        entries = self.layouts.get(index)
        # .get: a state may have been dropped since the write (a resume drops those its checkpoint lacks)
        if not entries or not any(isinstance(self._state(e), SwappedOut) for e in entries):
            return None
        nbytes = align_up(entries[-1].offset + entries[-1].nbytes)
        buf = self._acquire(nbytes, writes)
        future = self.io.read(self.path(index), buf[:nbytes])
        self.bytes_read += nbytes
        return buf, future

    def _attach(self, index: int, buf: Tensor, future, copy: bool) -> None:
        future.result()
        for entry in self.layouts[index]:
            if isinstance(self._state(entry), SwappedOut):
                local = self._view(buf, entry)
                self._set(entry, _rebuild(entry.marker, local.clone() if copy else local))

    def _start_write(self, index: int, buf: Optional[Tensor], writes: deque) -> None:
        entries = self._layout(index)
        if not entries:
            self._release(buf)
            return
        nbytes = align_up(entries[-1].offset + entries[-1].nbytes)
        previous = [(id(e.param), e.key, e.offset) for e in self.layouts.get(index, ())]
        moved = previous != [(id(e.param), e.key, e.offset) for e in entries]  # ids: tensors compare elementwise
        # [Note: a changed layout never reuses its buffer] When a parameter got its first state since the last
        # write, later entries move; packing them inside the buffer they are read from would overwrite states not
        # yet moved. So a changed (or grown) layout is packed into another buffer, and the old one released after.
        old = None
        if buf is None or buf.numel() < nbytes or moved:
            old, buf = buf, self._acquire(nbytes, writes)
        for entry in entries:
            value = self._state(entry)
            slot = self._view(buf, entry)
            local = local_tensor(value).reshape(-1)
            if local.data_ptr() != slot.data_ptr():
                slot.copy_(local)
        self._release(old)
        path = self.path(index)
        if index not in self.layouts:
            self.io.open(path)
        self.layouts[index] = entries
        future = self.io.write(path, buf[:nbytes])
        self.bytes_written += nbytes
        writes.append((index, buf, future))

    def _finish_write(self, item) -> None:
        index, buf, future = item
        future.result()
        for entry in self.layouts[index]:
            self._set(entry, entry.marker)
        self._release(buf)

    # ---------------------------------------------------------------- the step
    def step(self, base_step) -> None:
        """Step every sub-group through ``base_step(optimizer)`` with the read/step/write pipeline."""
        if self.closed:
            raise RuntimeError(
                "this optimizer's NVMe swapper was closed (teardown): its states are in memory again "
                "and it can no longer step with swapping"
            )
        if not self.layouts:
            self.check_free_space()
        optimizer = self.optimizer
        saved = [g["params"] for g in optimizer.param_groups]
        members = [set(map(id, params)) for params in saved]
        writes: deque = deque()
        reads: dict[int, Any] = {}
        try:
            for index, group in enumerate(self.subgroups):
                for ahead in (index, index + 1):
                    if ahead < len(self.subgroups) and ahead not in reads:
                        reads[ahead] = self._start_read(ahead, writes)
                pending = reads.pop(index)
                buf = None
                if pending is not None:
                    buf, future = pending
                    self._attach(index, buf, future, copy=False)
                ids = set(map(id, group))
                for g, params, member in zip(optimizer.param_groups, saved, members):
                    g["params"] = [p for p in params if id(p) in ids] if member & ids else []
                self._master_gradients(group)
                base_step(optimizer)
                for g, params in zip(optimizer.param_groups, saved):
                    g["params"] = params
                self._masters_to_module(group)
                self._start_write(index, buf, writes)
            while writes:
                self._finish_write(writes.popleft())
        finally:
            for g, params in zip(optimizer.param_groups, saved):
                g["params"] = params
            for pending in reads.values():
                if pending is not None:
                    pending[1].exception()  # let it finish before its buffer can go away
            for item in writes:
                item[2].exception()

    def _master_gradients(self, group: list[Tensor]) -> None:
        """The module's gradients as fp32 ``master.grad`` for this sub-group's masters (the stage-1 pre-step copy)."""
        for master in group:
            param = self.companions.get(id(master))
            if param is not None:
                grad = param.grad
                master.grad = (
                    None
                    if grad is None
                    else _rebuild(
                        self._master_markers[id(master)],
                        local_tensor(grad).detach().to("cpu", torch.float32, copy=True),
                    )
                )

    def _masters_to_module(self, group: list[Tensor]) -> None:
        """Stepped masters back into the module's parameters (the stage-1 post-step copy); gradients dropped."""
        for master in group:
            param = self.companions.get(id(master))
            if param is not None:
                # the local tensors' own detach: a DTensor's would go through DTensor's Python dispatch
                local_tensor(param).detach().copy_(local_tensor(master))
                master.grad = None

    def write_initial_masters(self) -> None:
        """Fill the masters from their module parameters and write them out, one sub-group at a time."""
        writes: deque = deque()
        for index, group in enumerate(self.subgroups):
            for master in group:
                param = self.companions.get(id(master))
                if param is not None:
                    self._set(
                        _Entry(master, MASTER, self._master_markers[id(master)], 0, 0),
                        local_tensor(param.detach()).to("cpu", torch.float32, copy=True),
                    )
            self._start_write(index, None, writes)
        while writes:
            self._finish_write(writes.popleft())

    def make_resident(self) -> None:
        """Read every swapped-out state back into ordinary memory (checkpoint save/load, teardown)."""
        writes: deque = deque()
        indices = sorted(self.layouts)
        pending = {}
        for position, index in enumerate(indices):
            for ahead in indices[position : position + 2]:  # read the next sub-group while copying this one
                if ahead not in pending:
                    pending[ahead] = self._start_read(ahead, writes)
            current = pending.pop(index)
            if current is not None:
                self._attach(index, current[0], current[1], copy=True)
                self._release(current[0])

    def swap_out(self) -> None:
        """Write every resident state to disk and drop it from memory."""
        writes: deque = deque()
        for index in range(len(self.subgroups)):
            self._start_write(index, None, writes)
        while writes:
            self._finish_write(writes.popleft())

    def close(self, restore: bool = True) -> None:
        """Bring the states back into memory (``restore``), then remove this run's swap folder."""
        if self.closed:
            return
        try:
            if restore:
                self.make_resident()
        except OSError as error:
            # Typically after a failed write (disk full): the original error already surfaced; say what is lost.
            warnings.warn(
                f"the optimizer states swapped under {self.folder!r} could not be read back ({error}); "
                "the optimizer is left with SwappedOut markers for them",
                RuntimeWarning,
                stacklevel=2,
            )
        finally:
            self.closed = True
            self.io.close()
            self._free.clear()
            self._finalizer()


def closure_loss(closure):
    """Run an optimizer ``closure`` as ``torch.optim.Optimizer.step`` does (grad mode on) and return its loss."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def attach_swapper(
    optimizer: torch.optim.Optimizer,
    nvme: NvmeConfig,
    *,
    rank: int = 0,
    pin_memory: bool = False,
    masters: Optional[dict[int, Tensor]] = None,
) -> OptimizerStateSwapper:
    """Make ``optimizer`` swap its states to ``nvme.nvme_path`` (see the module notes); undo with
    :func:`detach_swapper`. The optimizer keeps its identity, ``param_groups`` and hooks; its class becomes a
    subclass whose ``step`` and ``state_dict`` go through the swapper.

    ``masters`` (``id(master) -> module parameter``) names the optimizer's parameters that are fp32 masters of
    module parameters: they are swapped too, and their values are taken from the module parameters now (see the
    note on swapped fp32 masters); their own tensors may be empty placeholders."""
    if get_swapper(optimizer) is not None:
        raise RuntimeError("this optimizer already swaps its states")
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if masters and not set(masters) <= held:
        raise ValueError("masters must map parameters the optimizer holds (by id) to module parameters")
    swapper = OptimizerStateSwapper(optimizer, nvme, rank=rank, pin_memory=pin_memory, masters=masters)
    swapper.check_free_space()
    if swapper.companions:
        try:
            swapper.write_initial_masters()
        except BaseException:
            swapper.close(restore=False)
            raise
    base_cls = type(optimizer)

    def step(self, base_step, closure):
        loss = closure_loss(closure)
        with torch.no_grad():
            get_swapper(self).step(base_step)
        return loss

    def state_dict(self):
        get_swapper(self).make_resident()
        return base_cls.state_dict(self)

    try:
        override_step(optimizer, step, marker=_MARKER, extra={"state_dict": state_dict})
    except BaseException:
        swapper.close()  # masters already written are read back; the folder is removed
        raise
    setattr(optimizer, _ATTR, swapper)
    return swapper


def detach_swapper(optimizer: torch.optim.Optimizer, restore: bool = True) -> None:
    """Undo :func:`attach_swapper`: states back in memory (``restore``), files removed, original class back."""
    swapper = get_swapper(optimizer)
    if swapper is None:
        return
    restore_step_override(optimizer, _MARKER)  # first: refused, changing nothing, under a later override
    try:
        swapper.close(restore=restore)
    finally:
        delattr(optimizer, _ATTR)


def resident_states(optimizer) -> None:
    """Make the states of ``optimizer`` readable if it swaps (no-op otherwise)."""
    swapper = get_swapper(getattr(optimizer, "_optimizer", optimizer))
    if swapper is not None:
        swapper.make_resident()
