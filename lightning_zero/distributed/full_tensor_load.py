"""``module.load_state_dict(full_state_dict)`` into a module sharded at stages 2-3: each rank copies its slices.

FSDP2's parameters are DTensors, and ``nn.Module.load_state_dict`` copies each entry into its parameter with
``copy_``, which refuses a plain tensor ("aten.copy_.default got mixed torch.Tensor and DTensor"). Yet a full state
dict is what fine-tuning scripts load after setup, and it loads at stages 0-1 and under Lightning's DDP. LitGPT's
``litgpt.utils.load_checkpoint(fabric, model, path)`` (litgpt/utils.py) takes, for any strategy other than
Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy``, the branch ``state_dict = lazy_load(path)``
(``lightning.fabric.utilities.load._lazy_load``) then ``model.load_state_dict(state_dict, strict=strict)``.

:func:`accept_full_tensors` registers a ``load_state_dict`` pre-hook on each module of the sharded root that holds
tensors (see its note). Before anything is copied, it replaces each full value whose parameter is a DTensor of the
same global shape by a DTensor that wraps the slice of it this rank holds (``DTensor.from_local``, no
communication): the copy is then torch's own, between two DTensors of one layout, and casts to the parameter's
dtype as usual. The full values it reads slices of:

* a plain tensor (``torch.load``; with ``mmap=True, weights_only=True`` a memory-mapped one): the slice is a view,
  so a memory-mapped file's pages outside this rank's slices are never read;
* any other tensor-like object (one torch accepts through ``__torch_function__``), such as the values of
  Lightning's ``_lazy_load`` (``_NotYetLoadedTensor``): torch materialises it, one entry at a time, and the hook keeps
  a copy of this rank's slice only. Lightning's lazy loader reads a tensor's whole record from the file, so the
  transient peak is the largest single tensor, as under DDP, where ``copy_`` materialises each entry the same way;
* a safetensors slice (``safe_open(path, "pt").get_slice(name)``, any object with ``get_shape()`` and indexing by
  a tuple of slices): a dict ``{name: f.get_slice(name) for name in f.keys()}``, with ``f`` kept open during the
  load, is read through the slices, each rank reading only its own from the file. torch itself accepts no slice
  object, so the hook also materialises one whose entry is not sharded (a buffer, any parameter at stages 0-1,
  where :func:`accept_full_tensors` is registered on the user's module too), and hands torch a meta tensor of the
  slice's shape where the shapes differ, so that torch reports the size mismatch by key as for a tensor.

Every other entry (a DTensor, a tensor-like of another shape, an unknown key) is left as it is, so torch reports
missing, unexpected and mismatched keys exactly as it does for an unsharded module, with ``strict`` or without.

[Note: gathered units]
A unit that keeps its gathered parameters after a forward (every unit at stage 2 until backward) exposes plain,
unsharded tensors in place of its DTensors until FSDP2's own pre-load hook puts the shards back, which FSDP2
registers lazily (at the first forward), so after this hook on the same module. So the hook first puts the shards
of the unit the module is in back itself (FSDP2's ``reshard``, a no-op when they are back), and the loaded values
land in the shards the next forward gathers from.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_zero.torch_compat import local_part

_MARK = "_lightning_zero_accepts_full_tensors"

Reader = Callable[[tuple], Tensor]  # the part of a full value at an index (a tuple of slices), as a tensor


def accept_full_tensors(root: nn.Module) -> None:
    """Let ``root`` (sharded in place by FSDP2, or the module DDP wraps at stages 0-1) load full values of the kinds
    the module docstring lists with ``load_state_dict``. Idempotent: a root set up twice gets its hooks once.

    [Note: one hook per module that holds tensors]
    Each module holding parameters or buffers of its own gets the pre-hook, for those only, rather than the root
    for all of them: a module may rename entries in its own ``_load_from_state_dict`` before its children load
    (LitGPT's LoRA ``GPT`` and ``CausalSelfAttention`` map a base checkpoint's ``qkv.weight`` to ``qkv.linear.weight``,
    litgpt/lora.py), and a hook that runs as the holder starts its load sees the entries under their final names. It
    also serves ``load_state_dict`` called on a submodule."""
    if getattr(root, _MARK, False):
        return
    for holder, unit in _holders(root):
        holder.register_load_state_dict_pre_hook(functools.partial(_full_to_local_slices, unit))
    setattr(root, _MARK, True)


def _holders(root: nn.Module) -> list[tuple[nn.Module, Optional[nn.Module]]]:
    """Every module under ``root`` that holds parameters or buffers itself, with the innermost FSDP2 unit it is in
    (``None`` outside any, as at stages 0-1)."""
    from torch.distributed.fsdp import FSDPModule

    found, seen = [], set()

    def visit(module: nn.Module, unit: Optional[nn.Module]) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        unit = module if isinstance(module, FSDPModule) else unit
        if (
            next(module.parameters(recurse=False), None) is not None
            or next(module.buffers(recurse=False), None) is not None
        ):
            found.append((module, unit))
        for child in module.children():
            visit(child, unit)

    visit(root, None)
    return found


def _full_to_local_slices(
    unit: Optional[nn.Module], module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: Any
) -> None:
    """The pre-hook of ``module``: ``state_dict`` is torch's own copy of the caller's dict, so replacing entries
    leaves theirs."""
    from torch.distributed.tensor import DTensor

    if unit is not None:
        unit.reshard()  # see [Note: gathered units]
    targets = dict(module.named_parameters(recurse=False))
    targets.update(module.named_buffers(recurse=False))
    with torch.no_grad():
        for name, target in targets.items():
            key = prefix + name
            value = state_dict.get(key)
            source = None if value is None or isinstance(value, DTensor) else _full_source(value)
            if source is None:
                continue  # not a full value: torch reports what it is
            shape, read = source
            if isinstance(target, DTensor) and shape == tuple(target.shape):
                state_dict[key] = _local_slice(read, target)
            elif _is_safetensors_slice(value):
                state_dict[key] = _for_torch(value, shape, tuple(target.shape))
            # otherwise a tensor or tensor-like torch copies itself (or reports the size mismatch, naming the key)


def _is_safetensors_slice(value: object) -> bool:
    return (
        callable(getattr(value, "get_shape", None))
        and hasattr(value, "__getitem__")
        and not torch.overrides.is_tensor_like(value)
    )


def _full_source(value: object) -> Optional[tuple[tuple[int, ...], Reader]]:
    """``value``'s global shape and a reader of its parts, or ``None`` for a value that is none of the full values
    the module docstring lists."""
    if isinstance(value, Tensor):
        return tuple(value.shape), lambda index: value[index]
    if _is_safetensors_slice(value):
        return tuple(value.get_shape()), lambda index: value[index]  # reads only the part from the file
    if torch.overrides.is_tensor_like(value) and hasattr(value, "shape"):
        # torch.detach goes through the object's __torch_function__, which materialises it; the clone lets the
        # whole tensor go as soon as this entry is done
        return tuple(value.shape), lambda index: torch.detach(value)[index].clone()
    return None


def _for_torch(piece: Any, shape: tuple[int, ...], expected: tuple[int, ...]) -> Tensor:
    """A safetensors slice for an entry the hook does not shard: materialised when torch will copy it whole, a meta
    tensor of its shape when torch will only report the size mismatch (a one-element slice is materialised, since
    torch turns a ``[1]``-shaped value for a 0-dim parameter into a scalar before comparing)."""
    if shape == expected or len(shape) == 1 and shape[0] == 1:
        return piece[...]
    return torch.empty(shape, device="meta")


def _local_slice(read: Reader, target: Tensor) -> Tensor:
    """The full value ``read`` gives parts of, as a DTensor laid out as ``target``, holding only this rank's slice."""
    from torch.distributed.tensor import DTensor

    _, offsets, sizes = local_part(target)
    part = read(tuple(slice(start, start + size) for start, size in zip(offsets, sizes)))
    return DTensor.from_local(
        part, target.device_mesh, target.placements, run_check=False, shape=target.shape, stride=target.stride()
    )
