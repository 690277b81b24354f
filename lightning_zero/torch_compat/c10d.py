"""``torch.distributed``'s default store, its flat-tensor collectives across versions, and which backend serves
which device."""

from __future__ import annotations

import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives (the old names warn that they are deprecated); torch 2.11-2.12 only
# have the old ones. Same signatures, same semantics.
#: ``all_gather_single`` (torch >= 2.13), else ``all_gather_into_tensor``.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: ``reduce_scatter_single`` (torch >= 2.13), else ``reduce_scatter_tensor``.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def default_store():
    """The key-value store of the default process group (``distributed_c10d._get_default_store``): the one store
    every rank already reaches, used for identities, watchdog heartbeats and peer checks without a collective."""
    return dist.distributed_c10d._get_default_store()


def backend_serving(device_type: str, group=None):
    """The name of the backend of ``group`` (default: the world's) that serves ``device_type`` tensors, or ``None``
    when none does: ``"nccl"`` alone serves only ``"cuda"``, ``"cpu:gloo,cuda:nccl"`` gives ``"gloo"`` for CPU
    tensors and ``"nccl"`` for CUDA ones.

    ``dist.get_backend(group)`` names a multi-backend group by its whole configuration (``"cpu:gloo,cuda:nccl"``),
    so a test ``get_backend(group) == "nccl"`` is false for the group torch starts by default on CUDA; the
    ``device:backend`` pairs of ``dist.get_backend_config`` (public; a single backend is listed with every device it
    serves, e.g. ``"cpu:gloo,cuda:gloo"``) answer the question the collectives ask: which backend will carry this
    tensor, and is there one at all."""
    pairs = dict(part.split(":", 1) for part in str(dist.get_backend_config(group)).split(","))
    return pairs.get(device_type)
