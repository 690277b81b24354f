"""``bf16-true`` at stages 0-1: bf16 replicas of the parameters, fp32 values only beside the optimizer.

[Note: where the fp32 values live under bf16-true at stages 0-1]
DDP replicates every parameter on every rank. Keeping the replicas in fp32 and computing under autocast (what
``*-mixed`` means) holds ``4 + 4`` bytes per parameter on every rank for the parameter and its gradient, and at stage
1, which partitions only the optimizer states, that is ``8P + 8P/N`` per rank. DeepSpeed's bf16 engine keeps the
replicas and their gradients in bf16 (``2 + 2``) and fp32 values only where the optimizer steps them: all of them at
stage 0, the owned partition at stage 1 (``4P + 12P/N``). ``bf16-true`` here does the same, so its numerics are those
of stages 2-3 under ``bf16-true`` (every op in bf16 over fp32 masters) and of DeepSpeed's ``bf16.enabled``:

1. step 3 (:func:`keep_fp32_values`), before DDP builds its buckets: each floating parameter is cast in place (the
   same ``Parameter`` object, so an optimizer built before still holds it) and the fp32 value of each trainable one
   is returned;
2. step 4 (:func:`~lightning_zero.distributed.optimizer.shard_optimizer`, ``fp32_values=``): the values of the
   parameters this rank steps become the optimizer's masters, on the compute device (or copied to CPU with the
   optimizer offloaded); the others are dropped, which is where stage 1 saves its memory;
3. each step DDP all-reduces the bf16 gradients in fp32 (the precision of stages 2-3's reduce-scatter), the
   pre-step hook upcasts the owned ones into the masters' gradients and drops the bf16 ones, the optimizer steps the
   masters, and the post-step hook rounds them back into the replicas (stage 1: then broadcasts them from their
   owners, in bf16);
4. checkpoints save the masters, not the replicas (:func:`lightning_zero.checkpoint.states.module_state_dict`): a
   checkpoint written here holds fp32 weights and loads at any stage, precision and world size.

Frozen parameters are cast and keep no fp32 value (nothing steps them; Lightning's own ``bf16-true`` holds the whole
model in bf16 too). ``bf16-true`` with the optimizer's states and masters swapped to NVMe keeps fp32 parameters
(:func:`replica_dtype`). ``16-true`` keeps autocast over fp32 parameters at stages 0-1: its loss scale must come off
fp32 gradients (a tiny fp16 gradient divided by the scale in fp16 flushes to zero, which DeepSpeed avoids the same
way, by unscaling its fp32 master gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def replica_dtype(precision: str, stage: int, swapped_masters: bool = False) -> torch.dtype | None:
    """The dtype stages 0-1 cast the replicas to: bf16 under ``bf16-true``; ``None`` otherwise (fp32 parameters).

    Also ``None`` with the masters swapped to NVMe (``offload_optimizer="nvme"``): the swapper writes its first
    masters from the parameters and a checkpoint then saves the parameters (the masters are on disk between steps),
    so bf16 replicas there would start and save bf16-rounded weights; that run keeps fp32 parameters under
    autocast."""
    return torch.bfloat16 if precision == "bf16-true" and stage <= 1 and not swapped_masters else None


@torch.no_grad()
def keep_fp32_values(module: nn.Module, dtype: torch.dtype) -> dict[int, Tensor]:
    """Cast ``module``'s floating parameters to ``dtype`` in place; returns ``{id(parameter): its fp32 value}`` for
    the trainable ones (step 1 of the note), for :func:`~lightning_zero.distributed.optimizer.shard_optimizer`."""
    values: dict[int, Tensor] = {}
    for param in module.parameters():
        if not param.is_floating_point() or param.dtype == dtype:
            continue
        if param.requires_grad:
            values[id(param)] = param.data.float()  # the tensor itself when fp32: no copy
        param.data = param.data.to(dtype)
    return values


def clip_replica_grads(params, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the bf16 replicas' (already reduced) gradients, with the norm taken in
    fp32: torch's would round each tensor's norm and the total to bf16 (how far off: ``docs/precision.md``), where
    DeepSpeed's bf16 engine takes it from fp32 gradients. The gradients are then scaled by torch's own
    ``clip_grads_with_norm_``. Returns the fp32 total norm."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(p.grad, norm_type, dtype=torch.float32) for p in params]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite, so they cannot be "
            "clipped. Set error_if_nonfinite=False to clip anyway."
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
