"""Stage 1's parameter broadcast: after each rank steps the partition it owns, every parameter travels from its
owner to the other ranks in flat buckets per (owner, dtype), planned once (the note in
:func:`broadcast_from_owners`). Split from :mod:`.optimizer`, which calls it after the local step."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

# ``sharding`` below is an :class:`~lightning_zero.distributed.optimizer.OptimizerSharding` (typed ``Any``: that
# module imports this one).
BROADCAST_BUCKET_BYTES = 64 * 1024 * 1024


def broadcast_from_owners(sharding: Any, bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Send each parameter from the rank that stepped it to every other rank, in flat buckets per (owner, dtype).

    [Note: stage 1's buckets are planned once and the parameters live in them]
    Which parameters go in which bucket is fixed when the optimizer is sharded (owners, dtypes, sizes), so the plan
    is made once and kept (:class:`BroadcastPlan`). Making it re-points each parameter's storage at
    its slice of its bucket's flat buffer (as ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` does):
    the owner's step then writes the bucket itself and the broadcast delivers it in place, so a step runs one
    broadcast per bucket and no copy (the cost of packing into a separate buffer and unpacking after:
    ``docs/performance.md``, "Stage 1's parameters live in their broadcast buckets"). Before the broadcasts a step
    checks that every parameter still lives in its slice; one whose storage was replaced since (``param.data = ...``, a
    ``module.to(...)``) would otherwise silently stop receiving its owner's values, so the plan is then made again from
    the parameters' current values.

    The plan is made when the optimizer is sharded (:func:`plan_broadcast`), not at the first step: re-pointing
    frees each parameter's old storage, and glibc keeps freed chunks inside its heap rather than handing them back,
    so memory freed at the first step (gradients and optimizer states alive) stays charged at that peak, while
    memory freed before them is reused by them, and stage 1 trains more blocks of the capacity ladder's GPT under
    the same memory cap (the blocks each way: ``docs/performance.md``, "The ladder again after the changes").
    """
    plan = plan_broadcast(sharding, bucket_bytes)
    if plan is not None:
        plan.run(sharding.group)


def plan_broadcast(sharding: Any, bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> Optional["BroadcastPlan"]:
    """Stage 1's broadcast plan, made (the parameters linked into their buckets) when there is none yet, when it
    was made for another bucket size, or when a parameter moved out of its bucket; ``None`` without a second rank.
    No collective: every rank makes the same plan from owners, dtypes and sizes."""
    if not dist.is_initialized() or dist.get_world_size(sharding.group) == 1:
        return None
    plan = sharding.broadcast_plan
    if plan is None or plan.bucket_bytes != bucket_bytes or not plan.linked():
        # the old plan's buffers go first: each is freed once its last parameter moved to a new bucket
        sharding.broadcast_plan = plan = None
        plan = sharding.broadcast_plan = BroadcastPlan(sharding, bucket_bytes)
    return plan


class BroadcastPlan:
    """The buckets of :func:`broadcast_from_owners`: per bucket its source rank, its flat buffer and the parameters
    whose storages are slices of it."""

    def __init__(self, sharding: Any, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        buckets = _buckets(sharding, bucket_bytes)
        self.buckets = [(src, _link_into_flat(params)) for src, params in buckets]
        self.params = [p for _, params in buckets for p in params]
        self.pointers = self._pointers()

    def _pointers(self) -> list[int]:
        return [p.data_ptr() for p in self.params]

    def linked(self) -> bool:
        """Every parameter still lives in its bucket (one ``data_ptr`` per parameter: no tensor is made)."""
        return self._pointers() == self.pointers

    def run(self, group) -> None:
        for src, flat in self.buckets:
            dist.broadcast(flat, src=src, group=group)


def _buckets(sharding: Any, bucket_bytes: int) -> list[tuple[int, list[Tensor]]]:
    """``(source rank, parameters)`` per bucket: each owner's parameters per dtype and device type, in the user's
    order, cut after ``bucket_bytes``; the same list on every rank (it depends only on owners, dtypes and sizes)."""
    per_owner: dict[tuple[int, str, str], list[Tensor]] = {}
    for params, owners in zip(sharding.model_params, sharding.owners):
        for param, owner in zip(params, owners):
            if owner >= 0:
                per_owner.setdefault((owner, str(param.dtype), param.device.type), []).append(param)
    buckets: list[tuple[int, list[Tensor]]] = []
    for (owner, _, _), params in sorted(per_owner.items(), key=lambda kv: kv[0]):
        src = dist.get_global_rank(sharding.group, owner) if sharding.group is not None else owner
        bucket: list[Tensor] = []
        size = 0
        for param in params:
            bucket.append(param)
            size += param.numel() * param.element_size()
            if size >= bucket_bytes:
                buckets.append((src, bucket))
                bucket, size = [], 0
        if bucket:
            buckets.append((src, bucket))
    return buckets


def _link_into_flat(params: list[Tensor]) -> Tensor:
    """One flat buffer holding ``params``' current values, each parameter's storage re-pointed at its slice (with
    the parameter's own dense strides, so a ``channels_last`` weight stays one). The parameters' old storages are
    freed as they are re-pointed, so making a bucket holds at most one bucket's worth of extra memory."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    with torch.no_grad():
        for param in params:
            strides = torch.empty_like(param, device="meta").stride()
            view = flat.as_strided(param.shape, strides, offset)
            view.copy_(param.detach())
            param.data = view
            offset += param.numel()
    return flat
