"""Rank 0's buffers on every data-parallel rank before a forward at stages 2-3, as DDP gives them at stages 0-1.

[Note: when buffers are broadcast]
``DistributedDataParallel`` (``broadcast_buffers=True``, its default) copies the data-parallel group's rank 0 buffers
to every rank at the start of a forward (torch/nn/parallel/distributed.py: ``_pre_forward`` calls ``_sync_buffers``
when ``_check_sync_bufs_pre_fwd()``; ``_sync_buffers`` broadcasts ``modules_buffers`` from rank 0 in coalesced
buckets). It does so only when the previous forward ran with autograd on and gradients synchronised
(``require_forward_param_sync``, set in ``_post_forward``): so once per optimizer step under gradient accumulation
(before the first micro-step), before every training forward otherwise, and before the first evaluation forward
after training. FSDP2 has no such step, so without it each rank's BatchNorm statistics follow its own data and drift
apart. :class:`BufferBroadcast` follows DDP's rule on the FSDP2 root: a forward pre-hook broadcasts, a forward hook
records whether the next forward must. The gradient-sync state is told to it by
:func:`~lightning_zero.distributed.apply_zero.set_gradient_sync` (the package's only switch of FSDP2's gradient
sync), through :func:`note_gradient_sync`. A call of the root nested in the root's own forward (``self(x)`` inside a
redirected ``training_step``, :mod:`.root_reentry`) is part of the outer forward and broadcasts nothing.

One broadcast per device carries every buffer: the buffers' bytes are packed into one ``uint8`` tensor (largest
elements first, so each buffer's slice stays aligned for its dtype) and unpacked after. DTensor buffers (sharded by
the user) are left alone.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn


class BufferBroadcast:
    """Broadcasts ``module``'s buffers from rank 0 of ``group`` before a forward, on DDP's schedule (module note)."""

    def __init__(self, module: nn.Module, group, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.gradient_sync = True  # FSDP2's default; set_gradient_sync keeps it current
        self.sync_next = True  # DDP's require_forward_param_sync starts True: the first forward broadcasts
        self._depth = 0
        self.handles = [
            module.register_forward_pre_hook(self._before, prepend=True),
            module.register_forward_hook(self._after, always_call=True),
        ]

    def _before(self, module: nn.Module, args) -> None:
        if self._depth == 0 and self.sync_next:
            broadcast_buffers(module, self.group, self.device)
        self._depth += 1

    def _after(self, module: nn.Module, args, output) -> None:
        self._depth = max(0, self._depth - 1)  # always called, also when the forward (or a pre-hook) raised
        if self._depth == 0:
            self.sync_next = torch.is_grad_enabled() and self.gradient_sync


_ATTRIBUTE = "_lightning_zero_buffer_broadcast"


def install_buffer_broadcast(module: nn.Module, group, device: torch.device) -> Optional[BufferBroadcast]:
    """Broadcast ``module``'s buffers from ``group``'s rank 0 before its forwards (module note); ``None`` where there
    is nothing to broadcast (no buffers, one rank)."""
    if not _buffers(module) or dist.get_world_size(group) == 1:
        return None
    broadcaster = BufferBroadcast(module, group, device)
    setattr(module, _ATTRIBUTE, broadcaster)
    return broadcaster


def buffer_broadcast_of(module: nn.Module) -> Optional[BufferBroadcast]:
    """The :class:`BufferBroadcast` installed on ``module``, if any."""
    return getattr(module, _ATTRIBUTE, None)


def note_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Tell ``module``'s broadcaster whether the coming backward synchronises gradients (DDP's rule needs it)."""
    if (broadcaster := buffer_broadcast_of(module)) is not None:
        broadcaster.gradient_sync = enabled


def _buffers(module: nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [b for b in module.buffers() if not isinstance(b, DTensor)]


def broadcast_buffers(module: nn.Module, group, device: torch.device) -> None:
    """Give every plain buffer of ``module`` the value it has on ``group``'s rank 0, one broadcast per device. CPU
    buffers travel through ``device`` when the backend cannot send CPU tensors (NCCL)."""
    if not dist.is_initialized():
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for buffer in _buffers(module):
        by_device.setdefault(buffer.device, []).append(buffer)
    through_device = dist.get_backend(group) == "nccl"
    with torch.no_grad():
        for where, buffers in by_device.items():
            buffers.sort(key=lambda b: b.element_size(), reverse=True)  # keeps every slice aligned for its dtype
            packed = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in buffers])
            if through_device and where.type == "cpu":
                packed = packed.to(device)
            dist.broadcast(packed, group_src=0, group=group)
            offset = 0
            for buffer in buffers:
                size = buffer.numel() * buffer.element_size()
                buffer.copy_(packed[offset : offset + size].view(buffer.dtype).view(buffer.shape))
                offset += size
