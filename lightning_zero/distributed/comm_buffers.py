"""Reusable CPU buffers for FSDP2's all-gathers and reduce-scatters (stages 2-3 computing on CPU).

FSDP2 allocates, per unit and per step, an all-gather output, a reduce-scatter input and a reduce-scatter output
(the new sharded gradient), and lets them go once the collective is done. On CUDA the caching allocator recycles
those blocks. On CPU every one of them is a ``malloc``/``free`` of a multi-megabyte block, and glibc's dynamic mmap
threshold moves such blocks onto the heap after the first free, where the mix with long-lived allocations
fragments it: a stage-2 run's resident set climbs for several steps and settles well above what its tensors need
(``docs/stages.md``, "Communication buffers on CPU").

:class:`CommBufferPool` is the missing caching allocator for these three buffers, written here because torch has
none for CPU. It is plugged in through FSDP2's own hook (``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter``, whose ``allocate`` exists for exactly this), so the collectives themselves are still
torch's: ``all_gather_single`` (``all_gather_into_tensor`` before torch 2.13), and ``isend``/``irecv`` plus a local
sum for the reduce-scatter (see the last note).

CPU-only: :mod:`lightning_zero.distributed.cpu_tuning` installs it where the run computes on the CPU.

[Note: when a pooled buffer is free]
A buffer is handed out again only when nothing but the pool references its storage: the storage's use count is
read, not guessed from FSDP's call order. A gradient that still lives in a buffer (accumulation without
``zero_grad``), an asynchronous collective's work handle or any view keeps the buffer out of circulation, and the
pool allocates another. So reuse can never alias a live tensor; the worst case is one extra buffer per live one.

[Note: buffers too large to pool]
glibc raises its mmap threshold to the size of a freed mapped block, but never above 32 MiB (``DEFAULT_MMAP_THRESHOLD_
MAX`` on 64-bit): a larger block is always mapped on ``malloc`` and unmapped on ``free``, so it cannot fragment the
heap and leaves nothing resident once freed. Pooling such a block buys nothing against fragmentation and keeps it
resident for the whole run, at every moment of the step, not only while its collective runs: a root unit that holds
a large embedding (GPT-2 small's) would keep its all-gather and reduce-scatter buffers, each larger than the
threshold, on top of the stage-2 peak (the peaks with and without them: ``docs/performance.md``, "GPT-2 small").
So a buffer above ``POOL_MAX_BYTES`` is allocated fresh and never kept; what it costs is the page faults of touching
a fresh mapping each step, as FSDP2's own allocation does for every buffer without the pool.

[Note: reduce-scatter on gloo as pairwise exchanges]
gloo's ``reduce_scatter_tensor`` clones its whole input (a full-size ``aten::clone`` inside every call, in the
profiler) and is slower than an ``all_reduce`` of the same bytes, and an ``all_reduce`` moves twice the bytes a
reduce-scatter needs: each rank receives every other rank's copy of the whole tensor, not just of its own chunk.
Each rank instead sends every peer exactly the chunk that peer owns, one peer at a time (``isend``/``irecv``, step
``k`` to rank ``r + k`` and from rank ``r - k``), and adds what it receives into its output: ``(N-1)/N`` of the
tensor moves per rank, as in an all-to-all. At 2 ranks the peer's chunk is received straight into the output and the
rank's own chunk added to it, so no buffer beyond FSDP2's own input and output exists; at more ranks one chunk-sized
pooled buffer receives each peer's chunk in turn. An all-to-all (``all_to_all_single`` into a pooled buffer as large
as the whole input, then a sum over its rows) would cost one unit-sized buffer at the peak of every backward
(``docs/units.md``, on the default unit's memory). At 2 ranks the sum is bitwise the all-reduce's ``a + b``; at more
ranks the chunks are added own first, then ranks ``r - 1``, ``r - 2``, ..., an order that may differ from gloo's ring in
the last bit, as any two all-reduce algorithms do. Ops other than SUM/AVG (``PREMUL_SUM`` from a custom gradient divide
factor) and asynchronous calls go to ``reduce_scatter_tensor`` unchanged.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import defaultdict
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.torch_compat import all_gather_flat, fsdp_comm_bases, reduce_scatter_flat, storage_use_count

log = logging.getLogger(__name__)

# Module names of their own, so one test can count the calls the pooled all-gather makes.
_all_gather_flat = all_gather_flat
_reduce_scatter_flat = reduce_scatter_flat

POOL_MAX_BYTES = 32 * 2**20  # glibc's mmap-threshold ceiling: see [Note: buffers too large to pool]


class CommBufferPool:
    """Buffers keyed by (numel, dtype, device), each reused once nothing but the pool holds its storage.

    Every FSDP unit of one model shares a pool, so identical blocks share a handful of buffers: as many of one size
    as are alive at once (about two: the collective in flight and the prefetched one), not one per unit. Buffers
    above ``POOL_MAX_BYTES`` are handed out fresh and never kept (see [Note: buffers too large to pool]).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, list[torch.Tensor]] = defaultdict(list)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(int(s) for s in size)
        if numel * dtype.itemsize > POOL_MAX_BYTES:
            return torch.empty(tuple(int(s) for s in size), dtype=dtype, device=device)
        candidates = self._buffers[(numel, dtype, torch.device(device))]
        for buffer in candidates:
            if _only_pool_holds(buffer):
                return buffer.view(*size)
        buffer = torch.empty(numel, dtype=dtype, device=device)
        candidates.append(buffer)
        return buffer.view(*size)

    @property
    def nbytes(self) -> int:
        """Bytes the pool keeps allocated (handed out or free)."""
        return sum(b.numel() * b.element_size() for group in self._buffers.values() for b in group)

    def clear(self) -> None:
        """Let go of every buffer (those still in use stay alive through their holders)."""
        self._buffers.clear()


def _only_pool_holds(buffer: torch.Tensor) -> bool:
    # The pool's tensor holds one reference to the storage and the temporary Python storage object a second one;
    # any view, gradient or in-flight collective adds more.
    return storage_use_count(buffer) <= 2


@functools.cache
def _comm_classes():
    AllGather, ReduceScatter = fsdp_comm_bases()

    class PooledAlloc:
        def __init__(self, pool: CommBufferPool):
            self.pool = pool

        def allocate(self, size, *, dtype, device):
            return self.pool.allocate(size, dtype=dtype, device=device)

    class PooledAllGather(PooledAlloc, AllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return _all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op)

    class PooledReduceScatter(PooledAlloc, ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if async_op or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                return _reduce_scatter_flat(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            # See [Note: reduce-scatter on gloo as pairwise exchanges].
            _pairwise_reduce_scatter(output_tensor, input_tensor, group, self.pool)
            if op == dist.ReduceOp.AVG:
                output_tensor.div_(dist.get_world_size(group))
            return None

    return PooledAllGather, PooledReduceScatter


def _pairwise_reduce_scatter(output: torch.Tensor, input_tensor: torch.Tensor, group, pool: CommBufferPool) -> None:
    """Sum rank ``j``'s chunk ``r`` of ``input_tensor`` over all ``j`` into rank ``r``'s ``output``, exchanging one
    chunk with one peer at a time (see [Note: reduce-scatter on gloo as pairwise exchanges])."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks, out = input_tensor.view(world_size, -1), output.view(-1)
    if world_size == 1:
        out.copy_(chunks[0])
    elif world_size == 2:  # the peer's chunk lands in the output itself: no buffer of our own
        peer = 1 - rank
        _exchange(chunks[peer], out, peer, peer, group)
        out.add_(chunks[rank])
    else:
        received = pool.allocate(out.shape, dtype=out.dtype, device=out.device)
        out.copy_(chunks[rank])
        for step in range(1, world_size):
            send_to, receive_from = (rank + step) % world_size, (rank - step) % world_size
            _exchange(chunks[send_to], received, send_to, receive_from, group)
            out.add_(received)


def _exchange(send: torch.Tensor, receive: torch.Tensor, send_to: int, receive_from: int, group) -> None:
    """Send ``send`` to one rank of ``group`` while receiving ``receive`` from another (group-local ranks)."""
    works = [dist.isend(send, group=group, group_dst=send_to), dist.irecv(receive, group=group, group_src=receive_from)]
    for work in works:
        work.wait()


def install_comm_buffer_pool(module: nn.Module, pool: Optional[CommBufferPool] = None) -> Optional[CommBufferPool]:
    """Route the communication buffers of every FSDP2 unit in ``module`` through one :class:`CommBufferPool`.

    Meant for CPU compute only: on CUDA the caching allocator already recycles these blocks and knows about streams,
    which this pool does not. Returns the pool (also reachable as :func:`comm_buffer_pool`), or ``None`` on a torch
    whose FSDP2 has no custom-collective hook, where FSDP2's own allocation stays in place.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("install_comm_buffer_pool needs a module sharded with fully_shard (ZeRO stage 2 or 3)")
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        log.debug("this torch's FSDP2 has no set_custom_all_gather/reduce_scatter: CPU buffers are not pooled")
        return None
    pool = pool or CommBufferPool()
    all_gather_cls, reduce_scatter_cls = _comm_classes()
    all_gather, reduce_scatter = all_gather_cls(pool), reduce_scatter_cls(pool)
    for unit in units:
        unit.set_custom_all_gather(all_gather)
        unit.set_custom_reduce_scatter(reduce_scatter)
    module._lightning_zero_comm_buffer_pool = pool
    return pool


def comm_buffer_pool(module: nn.Module) -> Optional[CommBufferPool]:
    """The pool :func:`install_comm_buffer_pool` put on ``module``, or ``None`` (CUDA, stages 0-1, old torch)."""
    return getattr(module, "_lightning_zero_comm_buffer_pool", None)
