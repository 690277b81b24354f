"""The torch internals the package has to read, in one place: differences between the torch versions it supports
(``torch>=2.11``), each behind feature detection and naming the versions that differ, and DTensor's local shard.

Imports nothing of the package, so every layer (``ops/``, ``offload/``, ``distributed/``, ``checkpoint/``) may use it.
"""

from __future__ import annotations


def fsdp_param_groups(state) -> list:
    """The FSDP2 param groups of one ``fully_shard`` state (``module._get_fsdp_state()``), as a list.

    torch 2.12 turned ``FSDPState._fsdp_param_group`` (one optional group) into ``_fsdp_param_groups`` (a list, one
    group per module of a grouped ``fully_shard([a, b])``) and kept the old name as a property that raises once a
    state holds several groups; torch 2.11 has only the single attribute. Reading the list first and falling back
    to the single group gives every group on both.
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def local_tensor(tensor):
    """The rank's own part of ``tensor``: a DTensor's local shard, read directly (no autograd node and no copy, unlike
    ``DTensor.to_local()``), or a plain tensor itself. Copies and in-place updates go between local tensors, which
    may sit on different devices while the DTensors share one mesh."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def local_part(target):
    """``(local tensor, offsets, sizes)``: the part of the global tensor ``target`` this rank holds, and where it lies
    in the whole.

    For a ``DTensor`` the chunk DCP itself would read for it (``__create_chunk_list__``, any placements: FSDP2's dim-0
    shards with an uneven, possibly empty, last one; HSDP's replicated shards); a plain tensor is held whole.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(target, DTensor):
        chunks = target.__create_chunk_list__()
        if len(chunks) != 1:  # one chunk per rank for every placement FSDP2 makes; anything else is not ours
            raise NotImplementedError(f"a DTensor with {len(chunks)} local chunks ({target.placements}) cannot be "
                                      "loaded from full tensors")
        return target.to_local(), tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    return target, (0,) * target.dim(), tuple(target.shape)


def backend_serving(device_type: str, group=None):
    """The name of the backend of ``group`` (default: the world's) that serves ``device_type`` tensors, or ``None``
    when none does: ``"nccl"`` alone serves only ``"cuda"``, ``"cpu:gloo,cuda:nccl"`` gives ``"gloo"`` for CPU
    tensors and ``"nccl"`` for CUDA ones.

    ``dist.get_backend(group)`` names a multi-backend group by its whole configuration (``"cpu:gloo,cuda:nccl"``),
    so a test ``get_backend(group) == "nccl"`` is false for the group torch starts by default on CUDA; the
    ``device:backend`` pairs of ``dist.get_backend_config`` (public; a single backend is listed with every device it
    serves, e.g. ``"cpu:gloo,cuda:gloo"``) answer the question the collectives ask: which backend will carry this
    tensor, and is there one at all."""
    import torch.distributed as dist

    pairs = dict(part.split(":", 1) for part in str(dist.get_backend_config(group)).split(","))
    return pairs.get(device_type)


def ddp_buffer_sync_kwargs(enabled: bool) -> dict:
    """``DistributedDataParallel``'s keyword for broadcasting rank 0's buffers before each forward.

    torch 2.13 deprecated ``broadcast_buffers`` (a ``FutureWarning``) for ``forward_sync_buffers``, which leaves the
    broadcast at construction on whatever it is set to (``broadcast_buffers=False`` skipped that one too); torch
    2.11-2.12 have only ``broadcast_buffers``. Both start every rank from rank 0's buffers where the package calls
    DDP, because the package broadcasts the module's states itself first when ``enabled`` is False
    (:func:`lightning_zero.distributed.apply_zero.apply_zero`).
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}
