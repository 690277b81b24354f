"""Step torch's elementwise optimizers (Adam, AdamW, SGD) on the local shards of DTensor parameters.

At stages 2-3 the optimizer holds FSDP2's sharded ``DTensor`` parameters (or their DTensor CPU masters with
``offload_optimizer``). torch's optimizers step them through DTensor's Python dispatch: every elementwise op of every
parameter (``mul_``, ``lerp_``, ``addcdiv_``, ``sqrt``, ...) is one ``PythonSubclass`` call that looks up a sharding
rule before running the same op on the local shard. On a model with many small parameters that dispatch, not the
arithmetic, is the optimizer step's cost (the profile and dispatch counts: ``docs/performance_notes_stage2.md``).
CPU-only: :mod:`lightning_zero.distributed.cpu_tuning` switches it on where the optimizer steps on the CPU, where torch
picks that per-parameter loop; on CUDA torch's ``foreach`` step over the DTensors runs as shipped.

For Adam, AdamW and SGD every state and update is elementwise, so stepping the local shards with the same torch
optimizer code gives bit-identical values: :func:`use_local_step` makes the optimizer's ``step`` hand torch's own
implementation (its ``step``, with the user's ``foreach``/``fused`` choice and hyperparameters) the local tensors
of the parameters, gradients and states, then puts the DTensor parameters and states back. Between steps nothing
changes: ``param_groups`` hold the DTensor parameters, ``state`` holds DTensor states (new states are wrapped with
the parameter's mesh, placements and global shape, as ``torch.zeros_like`` on the DTensor would have made them),
so ``state_dict()``, checkpoints, resharding and consolidation see the same format as on torch's DTensor path.

Why hand-written: torch has no switch that runs an optimizer on DTensor local shards (``local_map`` wraps a
function of tensors, not an optimizer whose state is keyed by parameter objects). Only exact ``Adam``, ``AdamW``
and ``SGD`` are switched (a subclass may add non-elementwise math, e.g. a per-tensor norm, which a shard cannot
compute); any other optimizer, a ``differentiable`` group, a gradient whose placements differ from its
parameter's, or a ``step(closure)`` keeps torch's DTensor path, never a different result.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from lightning_zero.ops.step_override import is_overridden, override_step, restore_step_override
from lightning_zero.torch_compat import dtensor_local

# The per-element states of each switched class: wrapped back into DTensors after the step. Any other state (the
# scalar ``step``) stays what torch made it (a plain tensor, as on the DTensor path).
ELEMENTWISE_STATES = {
    torch.optim.Adam: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.AdamW: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.SGD: ("momentum_buffer",),
}
_MARK = "local step"  # the step override's marker (lightning_zero.ops.step_override)


def _is_dtensor(tensor) -> bool:
    # DTensor is imported with the module: a function-level import runs the import machinery on every call, and
    # this runs for every parameter, gradient and state of every step (docs/performance.md).
    return isinstance(tensor, DTensor)


def wrap_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as the local shard of a DTensor with ``like``'s mesh, placements, global shape and stride (FSDP2's
    uneven last shard included); ``local`` itself when ``like`` is a plain tensor."""
    if not _is_dtensor(like):
        return local
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def can_step_locally(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`use_local_step` applies: an exact Adam/AdamW/SGD whose parameters are all DTensors and whose
    groups are not ``differentiable``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return (
        type(optimizer) in ELEMENTWISE_STATES
        and bool(params)
        and all(_is_dtensor(p) for p in params)
        and not any(group.get("differentiable", False) for group in optimizer.param_groups)
    )


def is_local_step(optimizer: torch.optim.Optimizer) -> bool:
    return is_overridden(optimizer, _MARK)


def use_local_step(optimizer: torch.optim.Optimizer) -> bool:
    """Make ``optimizer`` step the local shards of its DTensor parameters (see the module docstring); returns
    whether it did (False: :func:`can_step_locally` does not hold, the optimizer is left unchanged). Undo with
    :func:`restore_step`. The optimizer keeps its identity, ``param_groups``, hooks and the name of its class
    (``lightning_zero.ops.step_override``, which also keeps LR schedulers' step wrappers consistent)."""
    if is_local_step(optimizer) or not can_step_locally(optimizer):
        return False
    per_element = ELEMENTWISE_STATES[type(optimizer)]

    def step(self, base_step, closure):
        if closure is not None:
            # torch runs the closure inside step(); the gradients it makes are read after it, on the DTensor path
            return base_step(self, closure)
        swap = _swap_in(self, per_element)
        if swap is None:
            return base_step(self)
        try:
            return base_step(self)
        finally:
            _swap_out(self, swap, per_element)

    override_step(optimizer, step, marker=_MARK)
    return True


def restore_step(optimizer: torch.optim.Optimizer) -> None:
    """Undo :func:`use_local_step` (no-op when it was not applied)."""
    restore_step_override(optimizer, _MARK)


class _Swap:
    __slots__ = ("params", "state", "locals")

    def __init__(self, params, state, locals_):
        self.params, self.state, self.locals = params, state, locals_


def _swap_in(optimizer, per_element) -> Optional[_Swap]:
    """Put local tensors into ``param_groups`` and ``state``; None (nothing swapped) when a gradient is not laid
    out like its parameter, so the DTensor path decides.

    This runs for every parameter of every step, so it reads the local shards without ``to_local()``'s autograd
    node (:func:`~lightning_zero.torch_compat.dtensor_local`) and tests types inline."""
    params = [group["params"] for group in optimizer.param_groups]
    local_state: defaultdict = defaultdict(dict)
    states = optimizer.state
    locals_ = []
    for group_params in params:
        group_locals = []
        for param in group_params:
            local = dtensor_local(param).detach()  # an alias of the shard: in-place updates reach the parameter
            grad = param.grad
            if grad is not None:
                if (
                    not isinstance(grad, DTensor)
                    or grad.placements != param.placements
                    or dtensor_local(grad).shape != local.shape
                ):
                    return None
                local.grad = dtensor_local(grad)
            state = states.get(param)
            if state:
                local_state[local] = {
                    key: (dtensor_local(value) if key in per_element and isinstance(value, DTensor) else value)
                    for key, value in state.items()
                }
            group_locals.append(local)
        locals_.append(group_locals)
    for group, group_locals in zip(optimizer.param_groups, locals_):
        group["params"] = group_locals
    swap = _Swap(params, states, locals_)
    optimizer.state = local_state
    return swap


def _swap_out(optimizer, swap: _Swap, per_element) -> None:
    """Put the DTensor parameters back and carry the states over: a state that is still the local tensor of the
    DTensor it came from keeps that DTensor; a new one is wrapped like its parameter."""
    local_state = optimizer.state
    optimizer.state = swap.state
    for group, params, group_locals in zip(optimizer.param_groups, swap.params, swap.locals):
        group["params"] = params
        for param, local in zip(params, group_locals):
            local.grad = None
            new = local_state.get(local)
            if new is None:
                continue
            old = swap.state.get(param, {})
            merged = {}
            for key, value in new.items():
                previous = old.get(key)
                if key in per_element and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                    kept = isinstance(previous, DTensor) and dtensor_local(previous) is value
                    value = previous if kept else wrap_like(value, param)
                merged[key] = value
            swap.state[param].update(merged)  # the same dict object: nothing holding it goes stale
