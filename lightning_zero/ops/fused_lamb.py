"""LAMB with DeepSpeed ``FusedLamb``'s arguments and math; a Triton kernel on CUDA, pure torch elsewhere.

Hand-written: neither torch nor a maintained library ships LAMB with DeepSpeed's trust-ratio clamping.

[Note: DeepSpeed LAMB math] (from ``deepspeed/ops/csrc/lamb/fused_lamb_cuda_kernel.cu``, read not copied)
For each tensor, with ``g = grad / combined_scale``:
    m = b1 m + (1-b1) g;   v = b2 v + (1-b2) g^2            (no bias correction applied to m, v themselves)
    denom = sqrt(v) + eps          (or sqrt(v + eps) with eps_inside_sqrt=True)
    u = m / denom + weight_decay * p                          (the decay is part of the update and of its norm)
    coeff = clamp(||p|| / ||u||, min_coeff, max_coeff), or 1 when ||p|| == 0 or ||u|| == 0
    step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)   (just lr with bias_correction=False)
    p = p - step_size * coeff * u
``combined_scale`` is the loss scale passed to :meth:`FusedLamb.step` (``scale``), multiplied by
``(||grad|| / scale + 1e-6) / max_grad_norm`` when that exceeds 1 and ``max_grad_norm > 0``.

[Note: norms of sharded tensors]
``||p||`` and ``||u||`` are norms of the *whole* tensor. With DTensor parameters (FSDP2 shards) each rank computes the
sums of squares of its local shard; the sums of all tensors sharing a mesh and sharding are stacked and summed with
one ``all_reduce`` per sharded mesh dimension, before any trust ratio is taken. The group gradient norm for
``max_grad_norm`` is reduced the same way.

Differences from DeepSpeed, all deliberate: the gradient norm for ``max_grad_norm`` is computed here over the whole
parameter group (DeepSpeed expects the caller to pass ``grad_norms``); ``step`` takes ``scale`` but not DeepSpeed's
``grads``/``output_params``/``grad_norms`` lists (passing them is a ``TypeError``, not silently ignored).
"""

from __future__ import annotations

import math
import os
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from lightning_zero.ops.fused_adam import validate_adam_hyperparameters
from lightning_zero.torch_compat import local_tensor

__all__ = ["FusedLamb", "reduce_shard_sums", "triton_available"]

IMPLEMENTATIONS = ("auto", "triton", "torch")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def reduce_shard_sums(sums: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """Sum rows of ``sums`` (one row of local partial sums per parameter) over the shards of DTensor parameters.

    Rows of plain tensors are left alone; rows of DTensors are all-reduced over every mesh dimension on which the
    parameter is sharded, one collective per (mesh, sharded dims) bucket and dimension."""
    buckets: dict[tuple, list[int]] = {}
    for row, p in enumerate(params):
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        # a dimension of one rank has nothing to sum (and no collective to issue: a one-GPU run's NCCL group may
        # not even serve the CPU tensors an offloaded shard gives)
        dims = tuple(d for d, placement in enumerate(p.placements) if not placement.is_replicate() and mesh.size(d) > 1)
        if dims:
            buckets.setdefault((mesh, dims), []).append(row)
    for (mesh, dims), rows in buckets.items():
        index = torch.tensor(rows, device=sums.device)
        part = sums.index_select(0, index)
        for d in dims:
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=mesh.get_group(d))
        sums.index_copy_(0, index, part)
    return sums


def _denominator(v: torch.Tensor, eps: float, eps_inside_sqrt: bool) -> torch.Tensor:
    return (v + eps).sqrt_() if eps_inside_sqrt else v.sqrt().add_(eps)


class FusedLamb(torch.optim.Optimizer):
    """DeepSpeed-compatible LAMB (``deepspeed.ops.lamb.FusedLamb`` arguments; see the module notes for the math).

    Args:
        params: parameters or parameter-group dicts (plain tensors or DTensors).
        lr, betas, eps, weight_decay, bias_correction, eps_inside_sqrt: as in DeepSpeed.
        max_grad_norm: clip the group's gradient norm to this value when > 0.
        max_coeff, min_coeff: clamp of the per-tensor trust ratio ``||p|| / ||u||``.
        amsgrad: not supported by LAMB (DeepSpeed also rejects it): ``True`` raises.
        implementation: ``"auto"`` (Triton for CUDA tensors when triton imports, torch otherwise), ``"triton"``
            (always; CPU tensors then need ``TRITON_INTERPRET=1``) or ``"torch"``.

    After each step ``get_lamb_coeffs()`` returns the trust ratios used, one per updated tensor, in order.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        implementation: str = "auto",
    ) -> None:
        validate_adam_hyperparameters(lr, betas, eps, weight_decay)
        if amsgrad:
            raise ValueError("FusedLamb does not support amsgrad (neither does DeepSpeed's FusedLamb)")
        if not max_grad_norm >= 0.0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 disables clipping), got {max_grad_norm!r}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got min_coeff={min_coeff}, max_coeff={max_coeff}")
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        if implementation == "triton" and not triton_available():
            raise ImportError("implementation='triton' needs the `triton` package; install it or use 'torch'/'auto'")
        self.implementation = implementation
        defaults = dict(
            lr=lr,
            bias_correction=bool(bias_correction),
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=bool(eps_inside_sqrt),
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.lamb_coeffs: list[torch.Tensor] = []
        self.last_implementation: Optional[str] = None

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step (DeepSpeed's method name); syncs with the device."""
        return [float(c) for c in self.lamb_coeffs]

    def _use_triton(self, tensors: list[torch.Tensor]) -> bool:
        if self.implementation == "torch":
            return False
        on_cuda = all(t.is_cuda for t in tensors)
        contiguous = all(t.is_contiguous() for t in tensors)
        if self.implementation == "triton":
            if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError(
                    "implementation='triton' on CPU tensors needs TRITON_INTERPRET=1 (Triton's "
                    "interpreter); use implementation='torch' for CPU training"
                )
            if not contiguous:
                raise RuntimeError("implementation='triton' needs contiguous parameters and states")
            return True
        return on_cuda and contiguous and triton_available()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, scale: float = 1.0):
        """One LAMB step. ``scale``: the loss scale the gradients still carry (they are divided by it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        used = set()
        for group in self.param_groups:
            params, locals_, grads, ms, vs = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedLamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params.append(p)
                locals_.append(local_tensor(p))
                grads.append(local_tensor(p.grad))
                ms.append(local_tensor(state["exp_avg"]))
                vs.append(local_tensor(state["exp_avg_sq"]))
            if not params:
                continue
            used.add(self._step_group(group, params, locals_, grads, ms, vs, scale))
        self.last_implementation = "+".join(sorted(used)) or None
        return loss

    def _step_group(self, group, params, locals_, grads, ms, vs, scale) -> str:
        beta1, beta2 = group["betas"]
        eps, decay, inside = group["eps"], group["weight_decay"], group["eps_inside_sqrt"]
        device = locals_[0].device
        combined_scale = float(scale)
        if group["max_grad_norm"] > 0:
            grad_sq = torch.stack([g.float().square().sum() for g in grads]).unsqueeze(1)
            grad_norm = reduce_shard_sums(grad_sq, params).sum().sqrt().item()
            clip = (grad_norm / scale + 1e-6) / group["max_grad_norm"]
            if clip > 1:
                combined_scale = clip * scale
        # per tensor: a parameter whose gradient was None on some steps has a smaller step count
        step_sizes = []
        for p in params:
            step = self.state[p]["step"]
            bias = math.sqrt(1 - beta2**step) / (1 - beta1**step) if group["bias_correction"] else 1.0
            step_sizes.append(group["lr"] * bias)

        sums = torch.zeros(len(params), 2, dtype=torch.float32, device=device)
        use_triton = self._use_triton(locals_ + grads + ms + vs)
        if use_triton:
            from lightning_zero.ops import _lamb_triton

            for row, (p, g, m, v) in enumerate(zip(locals_, grads, ms, vs)):
                if p.numel():
                    _lamb_triton.lamb_moments(
                        p,
                        g,
                        m,
                        v,
                        sums[row],
                        grad_scale=combined_scale,
                        beta1=beta1,
                        beta2=beta2,
                        eps=eps,
                        decay=decay,
                        eps_inside_sqrt=inside,
                    )
        else:
            for row, (p, g, m, v) in enumerate(zip(locals_, grads, ms, vs)):
                g = g.to(m.dtype) / combined_scale
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / _denominator(v, eps, inside)).add_(p, alpha=decay)
                sums[row, 0] = p.float().square().sum()
                sums[row, 1] = update.float().square().sum()
        norms = reduce_shard_sums(sums, params).sqrt()
        w_norm, u_norm = norms[:, 0], norms[:, 1]
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        coeffs = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        self.lamb_coeffs.extend(coeffs.unbind(0))
        for row, (p, m, v, step_size) in enumerate(zip(locals_, ms, vs, step_sizes)):
            if not p.numel():
                continue
            if use_triton:
                _lamb_triton.lamb_apply(
                    p, m, v, coeffs[row : row + 1], step_size=step_size, eps=eps, decay=decay, eps_inside_sqrt=inside
                )
            else:
                update = (m / _denominator(v, eps, inside)).add_(p, alpha=decay)
                p.add_(update.mul_(coeffs[row].to(update.dtype)), alpha=-step_size)
        return "triton" if use_triton else "torch"
