"""Adam/AdamW with DeepSpeed ``FusedAdam``'s arguments, running on torch's fused multi-tensor kernels.

[Note: why no kernel of our own]
DeepSpeed's ``FusedAdam`` is a multi-tensor CUDA kernel (apex ``multi_tensor_adam``): one launch updates p, m and v
of many tensors in a single read/write pass. torch ships the same design as ``torch._fused_adam_`` /
``torch._fused_adamw_`` (used by ``torch.optim.Adam(fused=True)``) on CUDA and, since 2.4, a vectorised, threaded CPU
kernel. Those are the best available implementations, so ``FusedAdam`` calls them through the public functional API
``torch.optim.adam.adam(..., fused=True)``; the only thing hand-written here is the adapter (DeepSpeed's argument names
and ``bias_correction=False``, which torch does not offer) and the DTensor handling.

Math (identical to DeepSpeed ``adam_w_mode`` 1/0, and to torch AdamW/Adam):
    g' = g + wd * p               (only when adam_w_mode=False: L2 penalty added to the gradient)
    m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'^2
    p = p - lr * ( (m/bc1) / (sqrt(v)/sqrt(bc2) + eps)  +  wd * p [adam_w_mode=True only] )
with bc1 = 1-b1^t, bc2 = 1-b2^t, or both 1 when ``bias_correction=False``.

DTensor (FSDP2 shards): the update is elementwise, so each rank updates its local shard; states are created with
``zeros_like(param)`` and are therefore DTensors with the parameter's placements (what
``torch.distributed.checkpoint`` expects), and are updated in place through ``to_local()`` views.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch
from torch.optim.adam import adam as torch_adam

from lightning_zero.torch_compat import (
    foreach_add,
    foreach_add_,
    foreach_addcmul_,
    foreach_lerp_,
    foreach_maximum_,
    foreach_mul_,
    fused_kernel_devices,
    local_tensor,
)

__all__ = ["FusedAdam", "validate_adam_hyperparameters"]

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def validate_adam_hyperparameters(lr, betas, eps, weight_decay) -> None:
    """Raise ``ValueError`` naming the bad argument (shared by the Adam-family optimizers of this package)."""
    if not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"lr must be a number >= 0, got {lr!r}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")


def step_counts(steps: list[torch.Tensor]) -> list[float]:
    """The step-count tensors as Python numbers, read with one device-to-host copy per device: a ``float(step)``
    per tensor would stall the host on the device once per parameter."""
    by_device: dict[torch.device, list[int]] = {}
    for i, step in enumerate(steps):
        by_device.setdefault(step.device, []).append(i)
    counts = [0.0] * len(steps)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([steps[i] for i in indices]).tolist()):
            counts[i] = value
    return counts


def adam_foreach(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    steps,
    *,
    beta1,
    beta2,
    lr,
    eps,
    weight_decay,
    adam_w_mode,
    bias_correction,
    amsgrad,
) -> None:
    """Adam on lists of plain tensors with ``torch._foreach_*`` ops; used where torch's kernels cannot be
    (``bias_correction=False``, or devices/dtypes without a fused kernel). ``steps`` are already incremented."""
    if not params:
        return
    if weight_decay and not adam_w_mode:
        grads = foreach_add(grads, params, alpha=weight_decay)
    foreach_lerp_(exp_avgs, grads, 1 - beta1)
    foreach_mul_(exp_avg_sqs, beta2)
    foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    second = exp_avg_sqs
    if amsgrad:
        foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        second = max_exp_avg_sqs
    if weight_decay and adam_w_mode:
        foreach_mul_(params, 1 - lr * weight_decay)
    if bias_correction:
        corrections = [(1 - beta1**t, 1 - beta2**t) for t in step_counts(steps)]
    else:
        corrections = [(1.0, 1.0)] * len(params)
    for p, m, v, (bc1, bc2) in zip(params, exp_avgs, second, corrections):
        denom = v.sqrt().div_(math.sqrt(bc2)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bc1)


class FusedAdam(torch.optim.Optimizer):
    """DeepSpeed-compatible Adam/AdamW (``deepspeed.ops.adam.FusedAdam`` arguments and math).

    Args:
        params: parameters or parameter-group dicts (plain tensors or DTensors).
        lr, betas, eps, weight_decay: as in Adam.
        bias_correction: divide the moments by ``1 - beta**t`` (DeepSpeed's switch; torch always corrects, so
            ``False`` runs the hand-written foreach path).
        adam_w_mode: ``True`` decoupled weight decay (AdamW), ``False`` L2 penalty added to the gradient (Adam).
        amsgrad: keep the running maximum of ``v`` (DeepSpeed's FusedAdam rejects it; torch's kernels support it).

    The kernel used is torch's fused one when every tensor of a (device, dtype) bucket is on a device torch has a fused
    kernel for (CUDA, CPU, ...) and bias correction is on; otherwise torch ``_foreach`` ops. ``last_implementation``
    says which ran.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
    ) -> None:
        validate_adam_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            bias_correction=bool(bias_correction),
            betas=tuple(betas),
            eps=eps,
            adam_w_mode=bool(adam_w_mode),
            weight_decay=weight_decay,
            amsgrad=bool(amsgrad),
        )
        super().__init__(params, defaults)
        self.last_implementation: Optional[str] = None

    def _init_state(self, p: torch.Tensor, amsgrad: bool, device: torch.device) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != device:
            # Optimizer.load_state_dict leaves "step" on the CPU; the fused kernels want it next to the params.
            state["step"] = state["step"].to(device)
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One Adam step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fused_devices = set(fused_kernel_devices())
        used = set()
        for group in self.param_groups:
            lists = {"params": [], "grads": [], "m": [], "v": [], "vmax": [], "steps": []}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients")
                local_p = local_tensor(p)
                state = self._init_state(p, group["amsgrad"], local_p.device)
                grad = local_tensor(p.grad)
                if grad.dtype != local_p.dtype:
                    grad = grad.to(local_p.dtype)
                lists["params"].append(local_p)
                lists["grads"].append(grad)
                lists["m"].append(local_tensor(state["exp_avg"]))
                lists["v"].append(local_tensor(state["exp_avg_sq"]))
                if group["amsgrad"]:
                    lists["vmax"].append(local_tensor(state["max_exp_avg_sq"]))
                lists["steps"].append(state["step"])
            if not lists["params"]:
                continue
            beta1, beta2 = group["betas"]
            fusable = group["bias_correction"] and all(
                t.device.type in fused_devices and t.dtype in _FUSED_DTYPES for t in lists["params"]
            )
            if fusable:
                torch_adam(
                    lists["params"],
                    lists["grads"],
                    lists["m"],
                    lists["v"],
                    lists["vmax"],
                    lists["steps"],
                    fused=True,
                    foreach=False,
                    decoupled_weight_decay=group["adam_w_mode"],
                    amsgrad=group["amsgrad"],
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
                used.add("torch-fused")
            else:
                foreach_add_(lists["steps"], 1)
                adam_foreach(
                    lists["params"],
                    lists["grads"],
                    lists["m"],
                    lists["v"],
                    lists["vmax"],
                    lists["steps"],
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    adam_w_mode=group["adam_w_mode"],
                    bias_correction=group["bias_correction"],
                    amsgrad=group["amsgrad"],
                )
                used.add("foreach")
        self.last_implementation = "+".join(sorted(used)) or None
        return loss
