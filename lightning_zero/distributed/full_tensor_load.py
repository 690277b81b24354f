"""``module.load_state_dict(full_state_dict)`` into a module sharded at stages 2-3: each rank copies its slices.

FSDP2's parameters are DTensors, and ``nn.Module.load_state_dict`` copies each entry into its parameter with
``copy_``, which refuses a plain tensor ("aten.copy_.default got mixed torch.Tensor and DTensor"). Yet a full state
dict of plain tensors is what scripts load after setup: LitGPT's fine-tuning loads the base model's weights with
``model.load_state_dict(torch.load(path))`` once the model is set up, and that works at stages 0-1 and under
Lightning's DDP.

:func:`accept_full_tensors` registers a ``load_state_dict`` pre-hook on the sharded root. Before anything is
copied, it replaces each plain tensor whose parameter is a DTensor of the same global shape by a DTensor that wraps
the slice of it this rank holds (``DTensor.from_local`` of a view, no communication, no copy of the whole): the
copy is then torch's own, between two DTensors of one layout, and casts to the parameter's dtype as usual. A
memory-mapped file's pages outside this rank's slices are never read. Every other entry (a DTensor, a tensor of
another shape, an unknown key, a buffer) is left as it is, so torch reports missing, unexpected and mismatched keys
exactly as it does for an unsharded module, with ``strict`` or without.

[Note: gathered units]
A unit that keeps its gathered parameters after a forward (every unit at stage 2 until backward) exposes plain,
unsharded tensors in place of its DTensors until FSDP2's own pre-load hook puts the shards back, which runs only
when the load reaches that unit: after this root hook has looked. So the hook first puts every unit's shards back
itself (FSDP2's ``reshard``), and the loaded values land in the shards the next forward gathers from.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.torch_compat import local_part

_MARK = "_lightning_zero_accepts_full_tensors"


def accept_full_tensors(root: nn.Module) -> None:
    """Let ``root`` (sharded in place by FSDP2) load plain full tensors with ``load_state_dict`` (module docstring).
    Idempotent: a root set up twice gets one hook."""
    if getattr(root, _MARK, False):
        return
    root.register_load_state_dict_pre_hook(_full_to_local_slices)
    setattr(root, _MARK, True)


def _reshard(root: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for sub in root.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def _full_to_local_slices(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                          *args: Any) -> None:
    """The pre-hook: ``state_dict`` is torch's own copy of the caller's dict, so replacing entries leaves theirs."""
    from torch.distributed.tensor import DTensor

    _reshard(module)  # see [Note: gathered units]
    targets = dict(module.named_parameters(remove_duplicate=False))
    targets.update(module.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, target in targets.items():
            key = prefix + name
            value = state_dict.get(key)
            if not isinstance(target, DTensor) or not isinstance(value, Tensor) or isinstance(value, DTensor):
                continue
            if tuple(value.shape) != tuple(target.shape):
                continue  # torch reports the size mismatch, naming the key
            state_dict[key] = _local_slice(value, target)


def _local_slice(value: Tensor, target: Tensor) -> Tensor:
    """``value`` (the whole tensor) as a DTensor laid out as ``target``, holding only this rank's slice of it."""
    from torch.distributed.tensor import DTensor

    _, offsets, sizes = local_part(target)
    part = value[tuple(slice(start, start + size) for start, size in zip(offsets, sizes))]
    return DTensor.from_local(part, target.device_mesh, target.placements, run_check=False,
                              shape=target.shape, stride=target.stride())
