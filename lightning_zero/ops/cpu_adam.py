"""Adam/AdamW for offloaded optimizer states: fp32 master weights, m and v in CPU memory, plus the low-precision
parameter copy the device needs, written in the same step.

[Note: why torch's fused CPU kernel and not a compiled extension]
DeepSpeed ships ``DeepSpeedCPUAdam``, a C++/AVX extension that updates p, m, v and writes an fp16/bf16 copy of p per
element. We ship no compiled extension: torch's fused CPU Adam kernel (``torch.optim.adam.adam(fused=True)``,
vectorised and threaded) followed by ``low_precision.copy_(p)`` runs at about the bandwidth floor, and a
``torch.compile``d elementwise function writing p, m, v and the copy in one loop would add a compilation in every
process. So the copy is a second (cheap: 4 bytes read, 2 written per element, against 28 for the Adam update) pass
after the fused kernel over all parameters, not a chunk-by-chunk interleaving of the two (the per-call overhead of the
functional API outweighs the cache reuse). The measurements (``benchmarks/bench_optimizers.py``, ratios to the
bandwidth floor) are in ``docs/ops.md``, "Why no compiled extension" and "Benchmark".

Math and arguments are DeepSpeed's ``DeepSpeedCPUAdam`` (``adamw_mode``, ``bias_correction``), identical to
:class:`lightning_zero.ops.FusedAdam`.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch
from torch.optim.adam import adam as torch_adam

from lightning_zero.ops.fused_adam import adam_foreach, validate_adam_hyperparameters
from lightning_zero.torch_compat import foreach_add_, local_tensor

__all__ = ["CPUAdam"]

LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over fp32 CPU master parameters (plain tensors or DTensor shards living on CPU).

    Args:
        params: fp32 parameters or parameter-group dicts; they must be in CPU memory when ``step`` runs (the module's
            device parameters are accepted at construction: optimizer offload replaces them by CPU masters).
        lr, betas, eps, weight_decay, amsgrad: as in Adam.
        bias_correction: DeepSpeed's switch (``False`` runs torch ``_foreach`` ops instead of the fused kernel).
        adamw_mode: ``True`` decoupled weight decay (AdamW), ``False`` L2 penalty added to the gradient.

    Gradients may be fp32 or low precision (they are upcast). ``step(low_precision_params=...)`` also writes the
    updated parameters into the given bf16/fp16 CPU tensors (e.g. pinned buffers then copied to the device).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
    ) -> None:
        validate_adam_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            bias_correction=bool(bias_correction),
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=bool(amsgrad),
            adamw_mode=bool(adamw_mode),
        )
        super().__init__(params, defaults)
        # The device is checked at step(), not here: with offload_optimizer the optimizer is built over the module's
        # device parameters (configure_optimizers) and ZeroStrategy then swaps in CPU fp32 masters.
        for group in self.param_groups:
            for p in group["params"]:
                local = local_tensor(p)
                if local.dtype != torch.float32:
                    raise ValueError(
                        "CPUAdam keeps fp32 master weights in CPU memory: every parameter must be a float32 CPU "
                        f"tensor, got dtype={local.dtype} on {local.device}"
                    )

    def _low_precision_groups(self, low_precision_params) -> list[Sequence[Optional[torch.Tensor]]]:
        if low_precision_params is None:
            return [[None] * len(g["params"]) for g in self.param_groups]
        groups = list(low_precision_params)
        if len(self.param_groups) == 1 and (not groups or not isinstance(groups[0], (list, tuple))):
            groups = [groups]
        if len(groups) != len(self.param_groups) or any(
            len(lp) != len(g["params"]) for lp, g in zip(groups, self.param_groups)
        ):
            raise ValueError(
                "low_precision_params must mirror param_groups: one list per group, one tensor (or "
                "None) per parameter; a flat list is accepted when there is a single group"
            )
        return groups

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, low_precision_params: Optional[Sequence] = None):
        """One Adam step; then, for every given ``low_precision_params`` entry, ``copy = p.to(copy.dtype)``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, lows in zip(self.param_groups, self._low_precision_groups(low_precision_params)):
            params, grads, ms, vs, vmaxes, steps, copies = [], [], [], [], [], [], []
            for p, low in zip(group["params"], lows):
                if p.grad is None:
                    continue
                local = local_tensor(p)
                if local.device.type != "cpu":
                    raise ValueError(
                        f"CPUAdam steps in CPU memory, but a parameter is on {local.device}: offload the optimizer "
                        "(ZeroStrategy(offload_optimizer='cpu'), which gives it CPU fp32 masters) or use FusedAdam"
                    )
                state = self.state[p] or _initial_state(self.state[p], p, group["amsgrad"])
                grad = local_tensor(p.grad)
                params.append(local)
                grads.append(grad if grad.dtype == torch.float32 else grad.float())
                ms.append(local_tensor(state["exp_avg"]))
                vs.append(local_tensor(state["exp_avg_sq"]))
                if group["amsgrad"]:
                    vmaxes.append(local_tensor(state["max_exp_avg_sq"]))
                steps.append(state["step"])
                if low is not None:
                    copies.append((_checked_low_precision_copy(low, local), local))
            if not params:
                continue
            beta1, beta2 = group["betas"]
            if group["bias_correction"]:
                torch_adam(
                    params,
                    grads,
                    ms,
                    vs,
                    vmaxes,
                    steps,
                    fused=True,
                    foreach=False,
                    decoupled_weight_decay=group["adamw_mode"],
                    amsgrad=group["amsgrad"],
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
            else:
                foreach_add_(steps, 1)
                adam_foreach(
                    params,
                    grads,
                    ms,
                    vs,
                    vmaxes,
                    steps,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    adam_w_mode=group["adamw_mode"],
                    bias_correction=False,
                    amsgrad=group["amsgrad"],
                )
            for low, local in copies:
                low.copy_(local)
        return loss


def _initial_state(state: dict, param: torch.Tensor, amsgrad: bool) -> dict:
    """Adam's zero states for ``param``, written into (and returned as) its empty ``state``."""
    state["step"] = torch.zeros((), dtype=torch.float32)
    state["exp_avg"] = torch.zeros_like(param)
    state["exp_avg_sq"] = torch.zeros_like(param)
    if amsgrad:
        state["max_exp_avg_sq"] = torch.zeros_like(param)
    return state


def _checked_low_precision_copy(low: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The local tensor of a low-precision copy the step refreshes: a bf16/fp16 CPU tensor shaped like ``local``."""
    low = local_tensor(low)
    if low.shape != local.shape or low.device.type != "cpu" or low.dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(
            f"a low-precision copy must be a bf16/fp16 CPU tensor shaped like its parameter "
            f"{tuple(local.shape)}, got {low.dtype} {tuple(low.shape)} on {low.device}"
        )
    return low
