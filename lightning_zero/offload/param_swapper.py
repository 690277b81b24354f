"""Stage-3 parameter swapping to NVMe (ZeRO-Infinity's ``offload_param.device: nvme``): each rank's FSDP2 local
shards live in files and are in memory around their use; at most ``max_in_cpu`` elements stay resident after it.

[Note: what is swapped, and how]
Under FSDP2's ``CPUOffloadPolicy`` each parameter's local shard is a padded CPU tensor whose storage FSDP2 reads
when it all-gathers the parameter's unit, and the optimizer steps in place. A *swap unit* is one FSDP2 unit (one
``fully_shard`` call): its shards' storages are written to ``unit<i>.bin`` and then resized to zero bytes (FSDP2
frees its own unsharded parameters the same way). Swapping in resizes them back and fills them from the file.
Storage-level swapping keeps every tensor object (the optimizer's parameters, FSDP2's views, the DTensor
wrappers) and the ``param_groups`` untouched. A swapped-out shard has no memory: code that reads it outside the
paths below crashes loudly instead of computing on stale values; call :meth:`ParamSwapper.make_resident` first
(``module.state_dict()`` and ``module.load_state_dict()`` do, through hooks).

[Note: when a unit is in memory]
- Forward/backward: each FSDP2 param group's ``unshard`` is wrapped: a unit not resident is read right before its
  all-gather (forward, the backward re-gather and FSDP2's backward prefetch alike). While the unit computes, the
  next unit in the execution order (learned during the first step) is read ahead into staging buffers.
- Optimizer step (:func:`attach_param_step`): the optimizer steps one unit at a time (the user's optimizer on that
  unit's parameters), reading it first if it is not resident; the next unit is read ahead meanwhile. Under an
  optimizer-state swapper too (``offload_optimizer="nvme"``) this runs inside each of its sub-groups.
- Release: a unit stays resident after its use while ``max_in_cpu`` allows (it is a residency budget, as in
  DeepSpeed: units that fit are not read again for the backward or the step). A unit in use is always read, even
  one larger than the budget; the excess is released at the next unit's use, and the optimizer step ends within
  the budget (:meth:`ParamSwapper.end_step`). Making room evicts a unit that no all-gather or step is using: once
  the first step has shown one step's sequence of uses (gathers, then the step's units), the unit needed again
  last among those whose release alone makes room (Belady's choice; with this cyclic order least-recently-used
  evicts the unit needed next; read counts in ``docs/offload.md``, "Parameter swapping"), before that the least
  recently used. A clean unit is dropped; only a modified one (stepped, or loaded) is written.
- ``state_dict()``/``load_state_dict()`` (checkpoint save and load): every unit is made resident and kept so until
  the next forward (it may exceed ``max_in_cpu`` only then), marked modified (a load may change it).

[Note: the bounds]
As in DeepSpeed, ``max_in_cpu`` counts the parameter elements (padded shards) *kept* in CPU memory between uses,
outside checkpoint save/load; DeepSpeed keeps that many resident for good and streams the rest through its pool of
``buffer_count`` x ``buffer_size`` swap buffers, one parameter per buffer. Here the units in use (FSDP2's
all-gathers in flight, by default the unit computing and the one it prefetches, or the unit stepping) are that
in-flight set, read into the shards' own memory, new aligned memory each time
(``lightning_zero.offload.shard_memory``), while writes and read-ahead go through aligned staging buffers of
``buffer_size`` 4-byte elements, at most ``buffer_count`` of them alive (DeepSpeed's pool); a read-ahead buffer
holding a whole shard becomes its memory. A shard larger than ``buffer_size`` (which DeepSpeed refuses) streams in
pieces, and a unit larger than ``max_in_cpu`` (``max_in_cpu: 1`` in ZeRO-Infinity's examples) stays only while in
use (until the next unit's use, or the step's end) and is read again at its next use. Framework-free: imports only
torch.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings
import weakref
from collections import deque
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_zero.offload.aio import AsyncFileIO, SwapIOError, align_up, aligned_buffer
from lightning_zero.offload.nvme_config import NvmeConfig
from lightning_zero.offload.optimizer_swapper import closure_loss, remove_folder
from lightning_zero.offload.param_units import SwapUnit, swap_units
from lightning_zero.offload.shard_memory import shard_byte_view, shard_targets
from lightning_zero.ops.step_override import is_overridden, override_step, restore_step_override
from lightning_zero.torch_compat import (
    all_gather_in_flight,
    group_is_unsharded,
    sharded_parameter,
    unwrap_param_group_methods,
    wrap_param_group_methods,
)

_ATTR = "_lightning_zero_param_swapper"
_STEP_MARKER = "NVMe parameter step"  # the step override's marker (step_override)
_END_HOOK = "_lightning_zero_param_end_step"  # on the optimizer: the handle of its end_step post-hook
_LIVE: "weakref.WeakSet[ParamSwapper]" = weakref.WeakSet()


class ParamSwapper:
    """Swaps the local shards of a stage-3 module's FSDP2 units to files (see the module notes)."""

    def __init__(self, module: nn.Module, nvme: NvmeConfig, rank: int = 0, pin_memory: bool = False) -> None:
        self.module = module
        self.nvme = nvme
        self.pin_memory = pin_memory
        self.units, self._unit_of = swap_units(module)
        if not self.units:
            raise ValueError("offload_params='nvme' needs a module sharded with FSDP2 (stage 3): none was found")
        self.chunk_bytes = align_up(nvme.buffer_size * 4)
        for unit in self.units:
            self._lay_out(unit)
        # Only now, when nothing can be refused any more but the disk, the run's folder exists.
        self.run_folder = tempfile.mkdtemp(prefix="lz-swap-", dir=nvme.nvme_path)
        self.folder = os.path.join(self.run_folder, f"rank{rank}", "params")
        self._finalizer = weakref.finalize(self, remove_folder, self.run_folder)
        os.makedirs(self.folder)
        for unit in self.units:
            unit.path = os.path.join(self.folder, unit.path)
        self.io = AsyncFileIO(nvme.aio)
        self.buffer_bytes = min(
            self.chunk_bytes, max((align_up(c[2]) for u in self.units for c in u.chunks), default=align_up(1))
        )
        self.resident_elements = sum(u.elements for u in self.units)
        self.peak_resident_elements = 0  # outside checkpoint holds, units in use included
        self.bytes_read = 0
        self.bytes_written = 0
        self.bytes_staged = 0  # bytes read through a staging buffer and copied into a shard (not read in place)
        self.bytes_adopted = 0  # bytes read ahead into a staging buffer that became the shard's memory
        self.peak_buffers = 0
        self.chunks_read_ahead = 0  # chunks that were read while the previous unit computed
        self._free: list[Tensor] = []
        self._alive = self._prefetch_buffers = self._cursor = self._clock = 0
        self._writes: deque = deque()  # (unit, buffer, future) in issue order
        self._order: list[int] = []
        self._cycle: list[int] = []  # one step's unit uses in order, once learned (see _victim)
        self._pos = 0  # the position in _cycle after the use in progress
        self._recording, self._hold_all, self.closed = True, False, False
        self._last_use: dict[int, int] = {}
        self._restore: list = []
        self.check_free_space()
        try:
            self._install()
            _LIVE.add(self)
            for unit in self.units:  # from now on the shards live on disk
                self._evict(unit)
            self._drain_writes()
        except BaseException:
            self.close()  # shards back in memory where they can be read, hooks and folder removed
            raise

    # ---------------------------------------------------------------- layout, space
    def _lay_out(self, unit: SwapUnit) -> None:
        offset = 0
        for index, size in enumerate(unit.sizes):
            for start in range(0, size, self.chunk_bytes):
                length = min(self.chunk_bytes, size - start)
                unit.chunks.append((index, start, length, offset))
                offset += align_up(length)

    def disk_bytes(self) -> int:
        """Bytes of this rank's parameter files."""
        return sum(align_up(c[2]) for u in self.units for c in u.chunks)

    def check_free_space(self) -> None:
        """Refuse to start when ``nvme_path`` cannot hold this rank's shards (times the ranks of this node)."""
        import shutil

        sharing = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        needed, free = self.disk_bytes() * sharing, shutil.disk_usage(self.folder).free
        if free < needed:
            self.close(restore=False)
            raise SwapIOError(
                28,
                f"nvme_path={self.nvme.nvme_path!r} has {free} bytes free but the swapped "
                f"parameters of {sharing} local rank(s) need about {needed} bytes on disk; free "
                "space or choose another nvme_path",
            )

    # ---------------------------------------------------------------- staging buffers
    def _acquire(self, prefetch: bool = False) -> Optional[Tensor]:
        while True:
            if self._free:
                return self._free.pop()
            if self._alive < self.nvme.buffer_count:
                self._alive += 1
                self.peak_buffers = max(self.peak_buffers, self._alive)
                return aligned_buffer(self.buffer_bytes, pin_memory=self.pin_memory)
            if prefetch:
                return None
            if self._writes:
                self._finish_write(self._writes.popleft())
                continue
            victim = next((u for u in self.units if u.prefetched), None)
            if victim is None:
                raise RuntimeError("parameter swap buffer accounting error: no staging buffer free")
            self._cancel_prefetch(victim)

    def _release(self, buf: Tensor) -> None:
        self._free.append(buf)

    def _finish_write(self, item) -> None:
        unit, buf, future = item
        try:
            future.result()
        except BaseException:
            unit.lost = True
            raise
        finally:
            unit.pending_writes -= 1
            self._release(buf)

    def _drain_writes(self, unit: Optional[SwapUnit] = None) -> None:
        while self._writes and (unit is None or unit.pending_writes):
            self._finish_write(self._writes.popleft())

    def _cancel_prefetch(self, unit: SwapUnit) -> None:
        while unit.prefetched:
            _, buf, future = unit.prefetched.pop()
            future.exception()  # let the read finish before its buffer is reused
            self._prefetch_buffers -= 1
            self._release(buf)

    # ---------------------------------------------------------------- transfers
    def _write(self, unit: SwapUnit) -> None:
        self._cancel_prefetch(unit)
        self.io.open(unit.path)  # idempotent
        views = [shard_byte_view(fp, size) for fp, size in zip(unit.members(), unit.sizes)]
        for index, start, length, offset in unit.chunks:
            buf = self._acquire()
            buf[:length].copy_(views[index][start : start + length])
            nbytes = align_up(length)
            self._writes.append((unit, buf, self.io.write(unit.path, buf[:nbytes], offset)))
            unit.pending_writes += 1
            self.bytes_written += nbytes
        unit.writes += 1
        unit.dirty = False

    def _read(self, unit: SwapUnit) -> None:
        self._drain_writes(unit)
        if unit.lost:  # never read the stale file in its place
            raise SwapIOError(
                5,
                f"the parameters of unit {unit.name!r} were lost: writing them to {unit.path!r} "
                "failed after their memory was released",
            )
        unit.reads += 1
        pending, unit.prefetched = unit.prefetched, deque()
        self._prefetch_buffers -= len(pending)
        self.chunks_read_ahead += len(pending)
        staged = {number: (buf, future) for number, buf, future in pending}
        try:
            views, adopted = shard_targets(
                unit.members(), unit.sizes, unit.in_place, unit.chunks, staged, pin_memory=self.pin_memory
            )
            self._alive -= len(adopted)  # those staging buffers left the pool: they are shard memory now
            self.bytes_adopted += sum(adopted)
            reads = []
            for number, (index, start, length, offset) in enumerate(unit.chunks):
                view = views[index]
                if view is None:  # a read-ahead buffer became this shard's memory
                    continue
                if number not in staged and unit.in_place[index]:
                    nbytes = align_up(length)  # inside the aligned memory install_shard_memory() gave the shard
                    self.bytes_read += nbytes
                    reads.append(self.io.read(unit.path, view[start : start + nbytes], offset))
                    continue
                buf, future = (
                    staged.pop(number) if number in staged else self._issue_read(unit, number, self._acquire())[1:]
                )
                future.result()
                view[start : start + length].copy_(buf[:length])
                self.bytes_staged += length
                self._release(buf)
            for future in reads:
                future.result()
        finally:
            for buf, future in staged.values():  # left only after an error: let the read end before reuse
                future.exception()
                self._release(buf)

    def _issue_read(self, unit: SwapUnit, number: int, buf: Tensor):
        nbytes = align_up(unit.chunks[number][2])
        self.bytes_read += nbytes
        return number, buf, self.io.read(unit.path, buf[:nbytes], unit.chunks[number][3])

    def _prefetch(self, unit: SwapUnit) -> None:
        """Read the first chunks of ``unit`` into free staging buffers (keeping two for the unit in use)."""
        if unit.resident or unit.dirty or unit.prefetched or unit.pending_writes:
            return
        while len(unit.prefetched) < len(unit.chunks) and self._prefetch_buffers < self.nvme.buffer_count - 2:
            buf = self._acquire(prefetch=True)
            if buf is None:
                return
            unit.prefetched.append(self._issue_read(unit, len(unit.prefetched), buf))
            self._prefetch_buffers += 1

    # ---------------------------------------------------------------- residency
    def _evictable(self, unit: SwapUnit) -> bool:
        return unit.resident and not unit.held and not self._hold_all and not unit.gathering()

    def _evict(self, unit: SwapUnit) -> None:
        if not self._evictable(unit):
            return
        if unit.dirty:
            self._write(unit)
        for storage in unit.storages():
            storage.resize_(0)
        unit.resident = False
        self.resident_elements -= unit.elements

    def _victim(self, candidates: list) -> SwapUnit:
        """The resident unit to evict: once the step's cycle of uses is known, the one needed again last
        (Belady's choice: with a cyclic order, least-recently-used would evict the unit needed next); before that,
        the least recently used."""
        cycle = self._cycle
        if not cycle:
            return min(candidates, key=lambda u: self._last_use.get(u.index, 0))

        def distance(u: SwapUnit) -> int:
            for step in range(len(cycle)):
                if cycle[(self._pos + step) % len(cycle)] == u.index:
                    return step
            return len(cycle)  # not used again in a step: the best victim

        return max(candidates, key=lambda u: (distance(u), -self._last_use.get(u.index, 0)))

    def _load(self, unit: SwapUnit) -> None:
        self._check_open()
        self._clock += 1
        self._last_use[unit.index] = self._clock
        self._trim(unit, 0 if unit.resident else unit.elements)
        if unit.resident:
            return
        self._read(unit)
        unit.resident, unit.dirty = True, False
        self.resident_elements += unit.elements
        self.peak_resident_elements = max(self.peak_resident_elements, self.resident_elements)

    def _trim(self, using: Optional[SwapUnit] = None, needed: int = 0) -> None:
        """Evict until ``needed`` more elements fit in ``max_in_cpu`` next to the resident units, or until only
        units in use (``using``, all-gathers, the step's unit) are left: those stay, over the budget if they must
        (DeepSpeed streams them through its swap buffers, outside ``max_in_cpu``)."""
        while self.resident_elements + needed > self.nvme.max_in_cpu:
            candidates = [u for u in self.units if u is not using and self._evictable(u)]
            if not candidates:
                break
            # Belady's choice among the units whose release alone makes room: evicting a small unit needed last
            # and then a large one anyway reads the small one again for nothing (a 4th read a step in
            # tests/offload/test_nvme_param_reads.py once stage 3 stopped re-gathering the root and the last unit)
            over = self.resident_elements + needed - self.nvme.max_in_cpu
            self._evict(self._victim([u for u in candidates if u.elements >= over] or candidates))

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                "this module's NVMe parameter swapper was closed (teardown): its parameters are in "
                "memory again and it no longer swaps"
            )

    # ---------------------------------------------------------------- FSDP2 hooks
    def _install(self) -> None:
        for unit in self.units:
            for group in unit.groups:
                # unshard and lazy_init only: no release after wait_for_unshard, units stay resident within max_in_cpu
                wrap_param_group_methods(
                    group,
                    {
                        "unshard": functools.partial(self._wrap_unshard, unit, group),
                        "lazy_init": functools.partial(self._wrap_lazy_init, unit),
                    },
                )
                self._restore.append(group)
        self._hooks = [
            self.module.register_state_dict_pre_hook(lambda *args: self.make_resident()),
            self.module.register_load_state_dict_pre_hook(lambda *args: self.make_resident()),
        ]

    def _wrap_unshard(self, unit: SwapUnit, group, original):
        def unshard(*args, **kwargs):
            if not all_gather_in_flight(group) and not group_is_unsharded(group):
                self._before_gather(unit)
            return original(*args, **kwargs)

        return unshard

    def _wrap_lazy_init(self, unit: SwapUnit, original):
        def lazy_init(*args, **kwargs):
            if not self.closed:
                self._load(unit)  # FSDP2 re-pads shards here once
            return original(*args, **kwargs)

        return lazy_init

    def _before_gather(self, unit: SwapUnit) -> None:
        if self.closed:
            return
        self._hold_all = False  # a new forward: checkpoint holds end, the budget applies again
        position = None
        if not self._recording and self._order:
            position = self._find(unit.index)
            if position is not None:
                self._cursor = self._pos = position + 1
        self._load(unit)
        if self._recording:
            self._order.append(unit.index)
        elif position is not None and self._cursor < len(self._order):
            self._prefetch(self.units[self._order[self._cursor]])

    def _find(self, index: int) -> Optional[int]:
        order, start = self._order, self._cursor
        for position in [*range(start, len(order)), *range(0, min(start, len(order)))]:
            if order[position] == index:
                return position
        return None

    # ---------------------------------------------------------------- the optimizer step
    def step(self, optimizer: torch.optim.Optimizer, base_step) -> None:
        """Step ``optimizer`` one unit at a time through ``base_step(optimizer)``: read, step, write back."""
        self._check_open()
        if self._order:
            self._recording = False  # the first step's forward and backward gave the execution order
        self._cursor = 0
        saved = [g["params"] for g in optimizer.param_groups]
        plan: dict[Optional[int], set] = {}
        for params in saved:
            for param in params:
                unit = self._unit_of.get(id(param))
                plan.setdefault(None if unit is None else unit.index, set()).add(id(param))
        keys = sorted(plan, key=lambda k: -1 if k is None else k)
        stepped = [k for k in keys if k is not None]
        if not self._recording:
            # one step's uses, in order: forward and backward gathers, then this step (for _victim)
            self._cycle = self._order + stepped
        try:
            for position, key in enumerate(keys):
                unit = None if key is None else self.units[key]
                if unit is not None:
                    self._pos = len(self._order) + stepped.index(key) + 1
                    self._load(unit)
                    unit.held += 1
                    following = keys[position + 1] if position + 1 < len(keys) else None
                    if following is not None:
                        self._prefetch(self.units[following])
                ids = plan[key]
                try:
                    for g, params in zip(optimizer.param_groups, saved):
                        g["params"] = [p for p in params if id(p) in ids]
                    base_step(optimizer)
                finally:
                    for g, params in zip(optimizer.param_groups, saved):
                        g["params"] = params
                    if unit is not None:
                        unit.held -= 1
                        unit.dirty = True  # stays resident (max_in_cpu), written back only when evicted
            self._drain_writes()
        finally:
            for g, params in zip(optimizer.param_groups, saved):
                g["params"] = params

    def end_step(self) -> None:
        """After the whole optimizer step (all its sub-groups): release what ``max_in_cpu`` does not keep, as no
        unit is in use until the next forward; the units kept are those that forward needs first."""
        if self.closed or self._hold_all:
            return
        self._pos = len(self._cycle)
        self._trim()
        self._drain_writes()

    # ---------------------------------------------------------------- whole-module residency, teardown
    def make_resident(self) -> None:
        """Bring every unit into memory and keep it there until the next forward (checkpoint save and load read
        and write the shards directly). The units are written back when released, as a load may change them."""
        if self.closed:
            return
        self._hold_all = False
        for unit in self.units:
            if not unit.resident:
                self._read(unit)
                unit.resident = True
                self.resident_elements += unit.elements
            unit.dirty = True
        self._hold_all = True

    def close(self, restore: bool = True) -> None:
        """Bring the shards back into memory (``restore``), unhook FSDP2 and remove this run's swap folder."""
        if self.closed:
            return
        try:
            if restore:
                self._drain_writes()
                self.make_resident()
        except OSError as error:
            warnings.warn(
                f"the parameter shards swapped under {self.folder!r} could not be read back ({error}); "
                "the module's swapped-out parameters have no memory and must not be used",
                RuntimeWarning,
                stacklevel=2,
            )
        finally:
            self.closed = True
            for group in self._restore:
                unwrap_param_group_methods(group)
            self._restore.clear()
            for handle in getattr(self, "_hooks", ()):
                handle.remove()
            for unit in self.units:
                for _, _buffer, future in unit.prefetched:
                    future.exception()
                unit.prefetched.clear()
            for _, _, future in self._writes:
                future.exception()
            self._writes.clear()
            self.io.close()
            self._free.clear()
            self._finalizer()
            if getattr(self.module, _ATTR, None) is self:
                delattr(self.module, _ATTR)


def attach_param_swapper(
    module: nn.Module, nvme: NvmeConfig, *, rank: int = 0, pin_memory: bool = False
) -> ParamSwapper:
    """Swap the FSDP2 local shards of ``module`` (sharded at stage 3 with CPU offload) to ``nvme.nvme_path``."""
    if get_param_swapper(module) is not None:
        raise RuntimeError("this module already swaps its parameters")
    swapper = ParamSwapper(module, nvme, rank=rank, pin_memory=pin_memory)
    setattr(module, _ATTR, swapper)
    return swapper


def get_param_swapper(module: nn.Module) -> Optional[ParamSwapper]:
    return getattr(module, _ATTR, None)


def detach_param_swapper(module: nn.Module, restore: bool = True) -> None:
    """Undo :func:`attach_param_swapper`: shards back in memory (``restore``), hooks removed, files removed."""
    swapper = get_param_swapper(module)
    if swapper is not None:
        swapper.close(restore=restore)


def find_param_swapper(params) -> Optional[ParamSwapper]:
    """The live swapper whose units hold any of ``params`` (the optimizer's parameters), if one does."""
    params = list(params)
    for swapper in list(_LIVE):
        if swapper.closed:
            continue
        for param in params:
            unit = swapper._unit_of.get(id(param))
            if unit is not None and any(sharded_parameter(fp) is param for fp in unit.members()):
                return swapper
    return None


def resident_parameters(module: nn.Module) -> None:
    """Make the swapped parameters of ``module`` readable until its next forward (no-op without swapping)."""
    swapper = get_param_swapper(module)
    if swapper is not None:
        swapper.make_resident()


# ---------------------------------------------------------------- the optimizer side
def attach_param_step(optimizer: torch.optim.Optimizer, swapper: ParamSwapper) -> None:
    """Make ``optimizer.step`` step one swapped unit at a time (see the module notes). Attach it before an
    optimizer-state swapper, which then calls this step for each of its sub-groups; undo with
    :func:`detach_param_step` after detaching that one."""
    if is_overridden(optimizer, _STEP_MARKER):
        raise RuntimeError("this optimizer already steps swapped parameters")

    def step(self, base_step, closure):
        loss = closure_loss(closure)
        swapper.step(self, base_step)
        return loss

    override_step(optimizer, step, marker=_STEP_MARKER)
    # A post-hook runs once after the whole step; this step runs once per sub-group under optimizer-state swapping.
    setattr(optimizer, _END_HOOK, optimizer.register_step_post_hook(lambda *args: swapper.end_step()))


def detach_param_step(optimizer: torch.optim.Optimizer) -> None:
    """Undo :func:`attach_param_step` (the original class back, LR schedulers' step wrappers kept consistent)."""
    restore_step_override(optimizer, _STEP_MARKER)  # a no-op when it was not attached
    handle = optimizer.__dict__.pop(_END_HOOK, None)
    if handle is not None:
        handle.remove()
