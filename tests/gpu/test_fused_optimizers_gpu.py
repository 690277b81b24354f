"""CUDA paths of the fused optimizers: torch's fused Adam kernel behind FusedAdam, the Triton LAMB kernel, and
has_overflow on device tensors. Compared with the CPU implementations, which tests/ops/test_optimizers.py checks against
float64 references."""

import pytest
import torch

from lightning_zero.ops import FusedAdam, FusedLamb, has_overflow
from lightning_zero.ops.fused_lamb import triton_available


def _run(opt_factory, device, dtype=torch.float32, steps=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(257, 33), (1000,), (3, 5, 7), (1,)]
    scales = [1e-3, 1.0, 1e3, 1.0]
    params = [(torch.randn(s, generator=gen) * w).to(device, dtype).requires_grad_() for s, w in zip(shapes, scales)]
    grads = [[torch.randn(s, generator=gen).to(device, dtype) for s in shapes] for _ in range(steps)]
    opt = opt_factory([{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:], "weight_decay": 0.0}])
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()
    return [p.detach().float().cpu() for p in params], opt


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_cuda_matches_cpu(adam_w_mode):
    make = lambda ps: FusedAdam(ps, lr=1e-2, adam_w_mode=adam_w_mode)  # noqa: E731
    gpu, opt = _run(make, "cuda")
    cpu, _ = _run(make, "cpu")
    assert opt.last_implementation == "torch-fused"
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lamb_triton_matches_torch_path(dtype):
    triton_result, opt = _run(
        lambda ps: FusedLamb(ps, lr=1e-2, max_coeff=2.0, min_coeff=0.5, implementation="triton"), "cuda", dtype
    )
    torch_result, ref = _run(
        lambda ps: FusedLamb(ps, lr=1e-2, max_coeff=2.0, min_coeff=0.5, implementation="torch"), "cuda", dtype
    )
    assert opt.last_implementation == "triton" and ref.last_implementation == "torch"
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    for a, b in zip(triton_result, torch_result):
        torch.testing.assert_close(a, b, **tolerance)
    assert opt.get_lamb_coeffs() == pytest.approx(ref.get_lamb_coeffs(), rel=1e-4 if dtype == torch.float32 else 2e-2)


def test_has_overflow_on_cuda_tensors():
    good = [torch.ones(1000, device="cuda", dtype=torch.float16), torch.ones(3, device="cuda")]
    assert not has_overflow(good)
    assert has_overflow(good + [torch.tensor([float("nan")], device="cuda", dtype=torch.bfloat16)])
