"""Triton kernels for :class:`lightning_zero.ops.FusedLamb` (hand-written: torch has no LAMB kernel).

Two passes per tensor, like DeepSpeed's ``fused_lamb_cuda_kernel.cu`` (part1 / part3):
  1. ``lamb_moments``: update m and v in place and write, per program, the partial sums of ``p**2`` and ``u**2`` where
     ``u = m / denom + decay * p`` is the un-scaled update. Partials (not atomics) keep the result deterministic.
  2. ``lamb_apply``: recompute ``u`` from the stored m, v (cheaper in memory than keeping it) and write
     ``p -= step_size * coeff * u`` with the tensor's trust ratio ``coeff`` read from device memory (no host sync).
Arithmetic is in fp32 whatever the storage dtype. Runs on CPU tensors under ``TRITON_INTERPRET=1`` (used by the tests).

[Note: 64-bit element offsets] ``tl.program_id`` is a 32-bit integer, so ``pid * BLOCK_SIZE`` wraps past 2**31 - 1
and a tensor of 2**31 elements or more would be read and written at wrapped (negative) offsets. The program id is
widened to int64 before the multiplication, so every offset derived from it is 64-bit.

[Note: the launching device] Triton launches on the *current* CUDA device, not on the device of the pointers it is
given, so each launch runs under ``torch.cuda.device(p.device)``: a tensor on ``cuda:1`` while ``cuda:0`` is current
would otherwise be launched on the wrong device.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _lamb_moments_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    partial_ptr,
    n,
    grad_scale,
    beta1,
    beta2,
    eps,
    decay,
    EPS_INSIDE_SQRT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32) / grad_scale
    m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)
    if EPS_INSIDE_SQRT:
        denom = tl.sqrt(v + eps)
    else:
        denom = tl.sqrt(v) + eps
    update = tl.where(mask, m / denom + decay * p, 0.0)
    tl.store(partial_ptr + 2 * pid, tl.sum(p * p, axis=0))
    tl.store(partial_ptr + 2 * pid + 1, tl.sum(update * update, axis=0))


@triton.jit
def _lamb_apply_kernel(
    p_ptr, m_ptr, v_ptr, coeff_ptr, n, step_size, eps, decay, EPS_INSIDE_SQRT: tl.constexpr, BLOCK_SIZE: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    coeff = tl.load(coeff_ptr)
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if EPS_INSIDE_SQRT:
        denom = tl.sqrt(v + eps)
    else:
        denom = tl.sqrt(v) + eps
    p = p - step_size * coeff * (m / denom + decay * p)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)


def launch_device(device: torch.device):
    """The context a launch on ``device`` runs in: that CUDA device made current (see the module notes)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def lamb_moments(p, g, m, v, sums_out, *, grad_scale, beta1, beta2, eps, decay, eps_inside_sqrt) -> None:
    """Update m, v of one contiguous tensor and write ``[sum p^2, sum u^2]`` (fp32) into ``sums_out`` (shape [2])."""
    n = p.numel()
    blocks = triton.cdiv(n, BLOCK)
    with launch_device(p.device):
        partials = torch.empty(blocks, 2, dtype=torch.float32, device=p.device)
        _lamb_moments_kernel[(blocks,)](
            p,
            g,
            m,
            v,
            partials,
            n,
            float(grad_scale),
            beta1,
            beta2,
            eps,
            decay,
            EPS_INSIDE_SQRT=eps_inside_sqrt,
            BLOCK_SIZE=BLOCK,
        )
        torch.sum(partials, dim=0, out=sums_out)


def lamb_apply(p, m, v, coeff, *, step_size, eps, decay, eps_inside_sqrt) -> None:
    """``p -= step_size * coeff * u`` for one contiguous tensor; ``coeff`` is a one-element fp32 device tensor."""
    n = p.numel()
    with launch_device(p.device):
        _lamb_apply_kernel[(triton.cdiv(n, BLOCK),)](
            p, m, v, coeff, n, step_size, eps, decay, EPS_INSIDE_SQRT=eps_inside_sqrt, BLOCK_SIZE=BLOCK
        )
