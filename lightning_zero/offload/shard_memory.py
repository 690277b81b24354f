"""The memory of FSDP2's sharded parameters under NVMe parameter swapping: read from disk in place.

[Note: in-place reads]
``O_DIRECT`` needs ``ALIGNMENT``-aligned memory. torch's CPU allocator aligns to 64 bytes, so a shard storage resized
back to its size is no ``O_DIRECT`` target: a read into it would have to go through an aligned staging buffer and a copy
into the shard (one memcpy of every byte read, a read of the model and more per step). Instead a swapped-in shard gets
new aligned memory (:func:`~lightning_zero.offload.aio.aligned_buffer`) that the file is read into, and FSDP2's two
tensors on a shard's memory are re-pointed to it, as FSDP2's own ``FSDPParam.reset_sharded_param`` replaces them:
``FSDPParam._sharded_param_data`` (the padded flat shard its all-gather reads) and the sharded DTensor parameter's
``_local_tensor`` (the narrow view of it that the optimizer steps). Every object the optimizer, the module and the
checkpoint code hold (the DTensor parameter, its ``grad``, the states keyed by it) stays the same. A staging buffer that
read a whole shard ahead, of exactly the shard's aligned size, becomes the shard's memory instead of being copied.
Eviction frees the shard's storage (``resize_(0)``): reading a swapped-out shard fails loudly.

Where FSDP2's layout is not the one expected (a storage offset or a storage larger than the padded shard, a tensor
subclass, an attribute missing in another torch version), :func:`can_read_in_place` says so and the swapper keeps
the staging copy for that shard. Framework-free: imports only torch.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_zero.offload.aio import align_up, aligned_buffer
from lightning_zero.torch_compat import (
    dtensor_local,
    padded_shard_size,
    set_dtensor_local,
    set_sharded_param_data,
    shard_placement,
    sharded_param_data,
    sharded_parameter,
)


def can_read_in_place(fsdp_param) -> bool:
    """Whether the shard of ``fsdp_param`` (an ``FSDPParam``) can be re-pointed to new memory (see the note)."""
    data = sharded_param_data(fsdp_param)
    param = getattr(fsdp_param, "sharded_param", None)
    local = dtensor_local(param) if isinstance(param, DTensor) else None
    padded = getattr(fsdp_param, "padded_sharded_param_size", None)
    placement = getattr(fsdp_param, "fsdp_placement", None)
    if type(data) is not torch.Tensor or type(local) is not torch.Tensor or padded is None or placement is None:
        return False
    storage = data.untyped_storage()
    return (
        data.device.type == "cpu"
        and data.dim() == 1
        and data.is_contiguous()
        and data.storage_offset() == 0
        and storage.nbytes() == data.numel() * data.element_size()
        and torch.Size(padded).numel() == data.numel()
        and local.is_contiguous()
        and local.untyped_storage().data_ptr() == storage.data_ptr()
        and local.storage_offset() == 0
        and local.dtype == data.dtype
    )


def shard_byte_view(fsdp_param, nbytes: int) -> Tensor:
    """The ``nbytes`` bytes of the padded shard of ``fsdp_param`` as a ``uint8`` tensor (memory, not a copy)."""
    data = sharded_param_data(fsdp_param)
    storage = data.untyped_storage()
    start = data.storage_offset() * data.element_size()
    return torch.empty(0, dtype=torch.uint8, device=data.device).set_(storage, start, (nbytes,))


def install_shard_memory(fsdp_param, memory: Tensor, nbytes: int) -> None:
    """Make ``memory`` (``uint8``, at least ``nbytes``, aligned) the memory of ``fsdp_param``'s shard (see the
    note); its current contents are not copied."""
    data = sharded_param_data(fsdp_param)
    local = dtensor_local(sharded_parameter(fsdp_param))
    flat = memory[:nbytes].view(data.dtype)
    dim = shard_placement(fsdp_param).dim
    set_sharded_param_data(fsdp_param, flat)
    set_dtensor_local(
        sharded_parameter(fsdp_param), flat.view(padded_shard_size(fsdp_param)).narrow(dim, 0, local.size(dim))
    )


def shard_targets(fsdp_params, sizes, in_place, chunks, staged: dict, *, pin_memory: bool = False):
    """Give each shard of a unit being read memory to read into; returns ``(views, adopted)``.

    ``views[i]``: the ``uint8`` bytes the chunks of shard ``i`` land in: new aligned memory installed in FSDP2's
    tensors (``in_place[i]``, see the note), or the shard's own storage resized back to ``sizes[i]`` (the staging
    copy); ``None`` where the shard's only chunk was read ahead (``staged``: chunk number -> (buffer, future)) into
    a staging buffer of exactly its aligned size, which then became the shard's memory: it is removed from
    ``staged`` and its size appended to ``adopted`` (the caller's pool no longer owns it)."""
    views, adopted = [], []
    for index, (fsdp_param, size) in enumerate(zip(fsdp_params, sizes)):
        if not in_place[index]:
            sharded_param_data(fsdp_param).untyped_storage().resize_(size)
            views.append(shard_byte_view(fsdp_param, size))
            continue
        numbers = [number for number, chunk in enumerate(chunks) if chunk[0] == index]
        whole = numbers[0] if len(numbers) == 1 else None
        if whole in staged and staged[whole][0].numel() == align_up(size):
            buf, future = staged.pop(whole)
            future.result()
            install_shard_memory(fsdp_param, buf, size)
            adopted.append(size)
            views.append(None)
        else:
            memory = aligned_buffer(size, pin_memory=pin_memory)
            install_shard_memory(fsdp_param, memory, size)
            views.append(memory)
    return views, adopted
