"""Models built on the meta device: materialised by their modules' ``reset_parameters()``, recorded, replayed per unit.

[Note: meta-device models]
Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy`` (and torchtitan-style code) build under
``torch.device("meta")`` and give the weights values after sharding by calling each module's
``reset_parameters()``. :func:`init_meta_tensors` (``apply_zero`` calls it first, at every stage) does the same,
with two changes that keep ZeRO's guarantees:

* **the values are those of a non-meta build followed by the same ``reset_parameters()`` calls**, bitwise, and the
  random stream ends where those calls leave it. Running ``reset_parameters()`` on the shards cannot give that on
  CPU: a rank's slice would get the first numbers of that rank's stream instead of the numbers the full tensor
  draws at the slice's place (the CPU generator cannot skip ahead), and every rank's slice would repeat the same
  draws. So each meta parameter or buffer becomes a *deferred* tensor of the same layout (:mod:`.deferred_init`; a
  tied one stays one tensor) and the ``reset_parameters()`` calls are *recorded*: each random op saves the
  generator state and advances it by running once on scratch memory of its tensor's size. ``apply_zero`` then
  replays one FSDP unit at a time right before ``fully_shard`` (the peak is one unit plus the shards, never the
  model; afterwards a rank holds only its shards), as for a build recorded under ``exact_init``.
* **nothing is left uninitialised silently**: a module that holds meta tensors and has no callable
  ``reset_parameters`` is refused before anything runs, naming its path and class (Lightning warns and trains on
  uninitialised memory), and so is a tensor that its module's ``reset_parameters()`` did not write.

The calls run in ``module.modules()`` order, Lightning's, once per module that holds meta tensors directly. Modules
whose tensors are all real (built next to the meta part, or loaded) keep them: Lightning resets every module with
tensors once any is on the meta device, which would overwrite them. ``reset_parameters()`` sees full CPU tensors,
not shards on the compute device (the CPU generator draws, as for every ZeRO build: ``[Note: exact
initialisation]`` in :mod:`.exact_init`).

This module is framework-free: it never imports Lightning.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_zero.distributed.deferred_init import deferred_build

_KINDS = ("_parameters", "_buffers")


def direct_tensors(module: nn.Module):
    """``(kind, name, tensor)`` for each parameter (``kind`` ``"_parameters"``) and buffer (``"_buffers"``) that
    ``module`` itself holds, not its submodules; a ``None`` slot is skipped."""
    for kind in _KINDS:
        for name, tensor in getattr(module, kind).items():
            if tensor is not None:
                yield kind, name, tensor


def holds_meta_tensors(module: nn.Module) -> bool:
    """Whether a parameter or buffer of ``module`` (or of a submodule) is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _meta_owners(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (path, sub)
        for path, sub in module.named_modules()
        if any(tensor.is_meta for _, _, tensor in direct_tensors(sub))
    ]


def _shown(path: str) -> str:
    return path or "<the model itself>"


def _refuse_without_reset(owners: list[tuple[str, nn.Module]]) -> None:
    missing = [
        f"{_shown(path)} ({type(sub).__name__})"
        for path, sub in owners
        if not callable(getattr(sub, "reset_parameters", None))
    ]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ValueError(
            f"The model holds tensors on the meta device in modules without a reset_parameters() method: {shown}. "
            "A meta-device model gets its values from each module's reset_parameters() when it is set up, so "
            "these would train on uninitialised memory. Give those modules a reset_parameters() that initialises "
            "their own parameters and buffers, or build the model on real memory (ZeroStrategy builds "
            "configure_model and init_module with the model's own init; see lightning_zero.distributed.meta_init)."
        )


def init_meta_tensors(module: nn.Module, budget: Optional[int] = None) -> bool:
    """Give the meta-device parameters and buffers of ``module`` their values from ``reset_parameters()``, recorded
    (``[Note: meta-device models]``): afterwards they are deferred tensors that ``apply_zero`` (or
    :func:`~lightning_zero.distributed.deferred_init.materialize_module`) makes real. Returns whether there were
    any. Raises ``ValueError`` naming the modules without ``reset_parameters`` and the tensors it left unwritten.
    ``budget`` bounds the real values the log may keep (ops without a meta kernel; ``None``: no bound)."""
    owners = _meta_owners(module)
    if not owners:
        return False
    _refuse_without_reset(owners)
    made: dict[int, torch.Tensor] = {}  # id of a meta tensor -> its deferred replacement (tied tensors stay tied)
    kept = []  # the meta tensors, alive until the end: their ids must not be reused by other objects meanwhile
    with torch.device("cpu"), deferred_build(budget) as recorder:
        for _, sub in owners:
            for kind, name, tensor in list(direct_tensors(sub)):
                if not tensor.is_meta:
                    continue
                if id(tensor) not in made:
                    kept.append(tensor)
                    empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
                    made[id(tensor)] = (
                        nn.Parameter(empty, requires_grad=tensor.requires_grad) if kind == "_parameters" else empty
                    )
                getattr(sub, kind)[name] = made[id(tensor)]
        mark = recorder.mark()
        for _, sub in owners:
            sub.reset_parameters()
    replacements = {id(tensor) for tensor in made.values()}
    unwritten = [
        f"{path + '.' if path else ''}{name} ({type(sub).__name__})"
        for path, sub in owners
        for _, name, tensor in direct_tensors(sub)
        if id(tensor) in replacements and not recorder.written_since(mark, tensor)
    ]
    if unwritten:
        shown = ", ".join(unwritten[:6]) + (f" and {len(unwritten) - 6} more" if len(unwritten) > 6 else "")
        raise ValueError(
            f"reset_parameters() left these meta-device tensors unwritten: {shown}. They would train on "
            "uninitialised memory: initialise them in their module's reset_parameters()."
        )
    return True
