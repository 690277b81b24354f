"""DTensor's local shard, read and replaced without the autograd node and the copy of the public API.

``DTensor.to_local()`` is differentiable (it adds a node and, for some placements, a redistribution), and there is
no public setter for the local tensor. The optimizer step, the loss scaler and the NVMe swapper touch every shard of
every step, so they go through ``DTensor._local_tensor``; a rename breaks each of them at its first step.
"""

from __future__ import annotations


def local_tensor(tensor):
    """The rank's own part of ``tensor``: a DTensor's local shard, read directly (no autograd node and no copy, unlike
    ``DTensor.to_local()``), or a plain tensor itself. Copies and in-place updates go between local tensors, which
    may sit on different devices while the DTensors share one mesh."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def dtensor_local(dtensor):
    """The local shard of ``dtensor``, known to be a DTensor (``_local_tensor``): the per-step hot path, one
    attribute read where :func:`local_tensor` first asks whether there is one."""
    return dtensor._local_tensor


def set_dtensor_local(dtensor, local) -> None:
    """Make ``local`` the local shard of ``dtensor`` (same shape, dtype and device as before: the DTensor's spec is
    left as it is)."""
    dtensor._local_tensor = local


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
            raise NotImplementedError(
                f"a DTensor with {len(chunks)} local chunks ({target.placements}) cannot be loaded from full tensors"
            )
        return target.to_local(), tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    return target, (0,) * target.dim(), tuple(target.shape)
