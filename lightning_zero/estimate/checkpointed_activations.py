"""Measure the activation bytes of a model whose blocks run under activation checkpointing.

``saved_activation_bytes`` counts what autograd saves through the saved-tensor hooks active around the forward. A
non-reentrant ``torch.utils.checkpoint`` (``apply_activation_checkpointing``) changes two things:

- the tensors a checkpointed block saves go through checkpoint's own, innermost hooks, which drop them; backward
  rebuilds them, one block at a time. That rebuilt block is part of the backward peak and no outer hook sees it;
- the block's inputs are what checkpoint keeps. Without ``cpu_checkpointing`` it saves them through the outer
  hooks (so they are counted there); with it, ``save_on_cpu`` is the innermost hook around that save and keeps a
  CPU copy of each, which no outer hook sees either.

``checkpointed_activation_bytes`` therefore measures the peak of live saved tensors as: what the outer hook sees
during forward, plus the inputs of every checkpointed block counted where checkpoint receives them (a forward
pre-hook on the block; each storage once, so an input the outer hook also saw is not counted twice), plus the
largest set of tensors one checkpointed block saves when its forward runs without checkpoint (what backward
rebuilds). No library reports these three; on CPU there is no allocator peak to ask, hence this module.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional

import torch
from torch import nn

from lightning_zero.distributed.activation_checkpointing import is_checkpointed
from lightning_zero.estimate.activations import SavedBytes, saved_activation_bytes


def checkpointed_blocks(module: nn.Module) -> list[nn.Module]:
    """The submodules whose ``forward`` ``apply_activation_checkpointing`` replaced."""
    return [m for m in module.modules() if is_checkpointed(m)]


@contextlib.contextmanager
def checkpointed_activation_bytes(module: nn.Module) -> Iterator[SavedBytes]:
    """Count the bytes saved for backward during a forward of ``module`` (see ``saved_activation_bytes``), including
    the inputs its checkpointed blocks keep (on CPU under ``cpu_checkpointing``: counted under ``"cpu"``)."""
    blocks = checkpointed_blocks(module)
    with saved_activation_bytes() as result:
        result.block_inputs = {}
        offload = {id(b): b.__dict__["forward"].cpu_checkpointing for b in blocks}

        def count_inputs(block: nn.Module, args: tuple, kwargs: dict) -> None:
            if not torch.is_grad_enabled():  # the checkpointed forward saves nothing then
                return
            result.block_inputs[id(block)] = [(t.shape, t.dtype, t.device) for t in args if isinstance(t, torch.Tensor)]
            for tensor in (*args, *kwargs.values()):
                if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                    continue
                # save_on_cpu keeps a CPU copy of each positional input; keyword tensors stay where they are
                device = "cpu" if offload[id(block)] and any(tensor is a for a in args) else tensor.device.type
                result.add(tensor, device)

        handles = [b.register_forward_pre_hook(count_inputs, with_kwargs=True) for b in blocks]
        try:
            yield result
        finally:
            for handle in handles:
                handle.remove()


def recomputed_block_bytes(
    module: nn.Module, counted: SavedBytes, forward_context: Optional[Callable[[], ContextManager]] = None
) -> int:
    """The most bytes one checkpointed block saves in a forward without checkpointing: what backward rebuilds for
    that block and keeps until the block's gradient is computed (0 when no block is checkpointed).

    ``counted``: the result of a ``checkpointed_activation_bytes`` forward, which recorded each block's positional
    inputs (shape, dtype, device); the block runs on fresh tensors of those (the inputs themselves are not counted
    here: ``checkpointed_activation_bytes`` counted them). Under FSDP2 the block's parameters are gathered for the
    call (``unshard``/``reshard``), since calling the original ``forward`` bypasses its hooks; so call this outside a
    training step, on every rank.
    """
    largest = 0
    parents = {id(child): parent for parent in module.modules() for child in parent.children()}
    for block in checkpointed_blocks(module):
        specs = counted.block_inputs.get(id(block))
        if specs is None:  # not run in that forward
            continue
        unit = _owning_unit(block, parents)
        if unit is not None:
            unit.unshard()
        try:
            args = [
                torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
                if dtype.is_floating_point
                else torch.zeros(shape, dtype=dtype, device=device)
                for shape, dtype, device in specs
            ]
            with torch.enable_grad(), (forward_context or contextlib.nullcontext)():
                with saved_activation_bytes(exclude=args) as saved:
                    out = block.__dict__["forward"].forward(*args)  # the original forward: no checkpoint
            del out
        finally:
            if unit is not None:
                unit.reshard()
        largest = max(largest, saved.total)
    return largest


def _owning_unit(block: nn.Module, parents: dict[int, nn.Module]):
    """The FSDP2 unit whose parameters ``block`` uses: the block itself, or the nearest enclosing unit (a block
    grouped into the root, as a stage-2 model smaller than one unit is; ``parents``: ``{id(child): parent}``);
    ``None`` when nothing is sharded."""
    from torch.distributed.fsdp import FSDPModule

    current: Optional[nn.Module] = block
    while current is not None and not isinstance(current, FSDPModule):
        current = parents.get(id(current))
    return current
