"""The LAMB Triton kernels (``lightning_zero/ops/_lamb_triton.py``) on CPU, through Triton's interpreter.

The interpreter is chosen when a kernel is defined, so the numerical checks run in a subprocess started with
``TRITON_INTERPRET=1``. Only fp32 storage is checked there: the interpreter converts fp32 to bf16 by truncating the
mantissa where a GPU rounds to nearest, so a bf16 case would compare the interpreter's rounding, not the kernel's
(the bf16 kernel is checked on a GPU by ``tests/gpu``).
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from lightning_zero.ops.fused_lamb import triton_available
from tests.ops.test_optimizers import lamb_reference

needs_triton = pytest.mark.skipif(
    not triton_available(),
    reason="triton is not installed: the LAMB Triton kernel cannot be interpreted on CPU (pip install triton)",
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCK = 1024
# one block less one, exactly one, one more, several blocks and a remainder, and a 2-D tensor over three blocks
BOUNDARY_SHAPES = [(BLOCK - 1,), (BLOCK,), (BLOCK + 1,), (3 * BLOCK + 17,), (33, 70)]


def run_interpreted(function_name: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    script = f"from tests.ops.test_lamb_triton import {function_name} as f; f()"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _boundary_shapes_check():
    """In the subprocess: FusedLamb(implementation="triton") against the float64 reference, shape by shape."""
    from lightning_zero.ops import FusedLamb

    assert os.environ.get("TRITON_INTERPRET") == "1"
    gen = torch.Generator().manual_seed(5)
    steps = 3
    for eps_inside_sqrt in (False, True):
        for shape in BOUNDARY_SHAPES:
            start = torch.randn(shape, generator=gen)
            grads = [torch.randn(shape, generator=gen) for _ in range(steps)]
            param = start.clone().requires_grad_()
            opt = FusedLamb(
                [param],
                lr=1e-2,
                betas=(0.9, 0.99),
                eps=1e-6,
                weight_decay=0.01,
                eps_inside_sqrt=eps_inside_sqrt,
                max_coeff=10.0,
                min_coeff=0.01,
                implementation="triton",
            )
            coeffs = []
            for g in grads:
                param.grad = g.clone()
                opt.step()
                coeffs.append(opt.get_lamb_coeffs()[0])
            assert opt.last_implementation == "triton"
            ref, ref_coeffs = _reference(start, grads, eps_inside_sqrt)
            where = f"shape {shape}, eps_inside_sqrt={eps_inside_sqrt}"
            torch.testing.assert_close(param.detach().double(), ref, rtol=1e-6, atol=1e-6, msg=where)
            assert coeffs == pytest.approx(ref_coeffs, rel=1e-6), where
            assert not torch.allclose(ref, start.double(), atol=1e-4), where  # the parameter really moved


def _reference(start, grads, eps_inside_sqrt):
    if not eps_inside_sqrt:
        return lamb_reference(
            start,
            grads,
            lr=1e-2,
            beta1=0.9,
            beta2=0.99,
            eps=1e-6,
            weight_decay=0.01,
            bias_correction=True,
            max_coeff=10.0,
            min_coeff=0.01,
        )
    p = start.double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    coeffs = []
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        update = m / (v + 1e-6).sqrt() + 0.01 * p
        coeff = min(max(p.norm().item() / update.norm().item(), 0.01), 10.0)
        coeffs.append(coeff)
        p = p - 1e-2 * math.sqrt(1 - 0.99**t) / (1 - 0.9**t) * coeff * update
    return p, coeffs


@needs_triton
def test_kernels_match_float64_reference_across_block_boundaries():
    run_interpreted("_boundary_shapes_check")


def _far_program_check():
    """In the subprocess: run one program whose id is 2**22, as in a tensor of more than 2**32 elements.

    ``2**22 * BLOCK == 2**32``: in 32-bit arithmetic the program's offsets wrap to exactly 0..BLOCK-1, so it would
    read and write the first block of a small tensor. With 64-bit offsets they lie past the tensor's end, every lane
    is masked off, and the tensors are left as they were. (Allocating 2**31 elements is not possible here; the
    interpreter's program id is moved instead.)"""
    import numpy as np
    from triton.runtime import interpreter

    from lightning_zero.ops import _lamb_triton

    far = 2**22
    builder = interpreter.interpreter_builder
    builder.create_get_program_id = lambda axis: interpreter.TensorHandle(
        np.array([far], dtype=np.int32), interpreter.tl.int32
    )
    p, g, m, v = (torch.full((BLOCK,), value) for value in (1.0, 2.0, 3.0, 4.0))
    partials = torch.zeros(far + 1, 2)  # the program writes its partial sums at row ``far``
    _lamb_triton._lamb_moments_kernel[(1,)](
        p, g, m, v, partials, BLOCK, 1.0, 0.9, 0.99, 1e-6, 0.0, EPS_INSIDE_SQRT=False, BLOCK_SIZE=BLOCK
    )
    assert torch.equal(m, torch.full((BLOCK,), 3.0)), "the far program wrote m inside the tensor"
    assert torch.equal(v, torch.full((BLOCK,), 4.0)), "the far program wrote v inside the tensor"
    assert torch.equal(partials[far], torch.zeros(2)), "the far program summed elements inside the tensor"
    coeff = torch.ones(1)
    _lamb_triton._lamb_apply_kernel[(1,)](
        p, m, v, coeff, BLOCK, 0.5, 1e-6, 0.0, EPS_INSIDE_SQRT=False, BLOCK_SIZE=BLOCK
    )
    assert torch.equal(p, torch.full((BLOCK,), 1.0)), "the far program wrote p inside the tensor"


@needs_triton
def test_offsets_are_64_bit_past_two_to_the_32_elements():
    run_interpreted("_far_program_check")


class _CudaDeviceRecorder:
    """Stands in for ``torch.cuda.device``: records which device each entered context made current."""

    events: list = []
    current: list = []

    def __init__(self, device):
        self.device = torch.device(device)

    def __enter__(self):
        self.events.append(("enter", self.device))
        self.current.append(self.device)

    def __exit__(self, *exc):
        self.current.pop()
        self.events.append(("exit", self.device))


class _FakeKernel:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records the device current at the launch."""

    def __init__(self, name, events):
        self.name, self.events = name, events

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            current = _CudaDeviceRecorder.current[-1] if _CudaDeviceRecorder.current else None
            self.events.append(("launch", self.name, current))

        return launch


def _record_launches(monkeypatch):
    from lightning_zero.ops import _lamb_triton

    events = []
    monkeypatch.setattr(_CudaDeviceRecorder, "events", events)
    monkeypatch.setattr(_CudaDeviceRecorder, "current", [])
    monkeypatch.setattr(torch.cuda, "device", _CudaDeviceRecorder)
    monkeypatch.setattr(_lamb_triton, "_lamb_moments_kernel", _FakeKernel("moments", events))
    monkeypatch.setattr(_lamb_triton, "_lamb_apply_kernel", _FakeKernel("apply", events))
    return _lamb_triton, events


def _launch_both(lamb_triton, make):
    p, g, m, v = (make(3000) for _ in range(4))
    sums, coeff = make(2), make(1)
    shared = dict(eps=1e-6, decay=0.0, eps_inside_sqrt=False)
    lamb_triton.lamb_moments(p, g, m, v, sums, grad_scale=1.0, beta1=0.9, beta2=0.99, **shared)
    lamb_triton.lamb_apply(p, m, v, coeff, step_size=1e-2, **shared)


@needs_triton
def test_each_launch_runs_with_the_tensors_cuda_device_current(monkeypatch):
    """A tensor on cuda:1 launches with cuda:1 current (Triton launches on the current device). The tensors are
    fake CUDA tensors (``FakeTensorMode``): the wrappers' own code runs, the kernels and the CUDA context are fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lamb_triton, events = _record_launches(monkeypatch)
    with FakeTensorMode():
        _launch_both(lamb_triton, lambda n: torch.zeros(n, device="cuda:1"))
    cuda1 = torch.device("cuda", 1)
    assert events == [
        ("enter", cuda1),
        ("launch", "moments", cuda1),
        ("exit", cuda1),
        ("enter", cuda1),
        ("launch", "apply", cuda1),
        ("exit", cuda1),
    ]


@needs_triton
def test_cpu_launches_enter_no_cuda_device(monkeypatch):
    lamb_triton, events = _record_launches(monkeypatch)
    _launch_both(lamb_triton, lambda n: torch.zeros(n))
    assert events == [("launch", "moments", None), ("launch", "apply", None)]


def test_the_test_extra_pins_the_triton_that_torch_requires():
    """Unpinned, CI would test whatever triton is newest (torch's CPU wheel declares none); a CUDA wheel of torch
    declares the one version it was built with, and the pin must be that one."""
    from importlib.metadata import requires

    import tomllib
    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        test_extra = [Requirement(r) for r in tomllib.load(f)["project"]["optional-dependencies"]["test"]]
    (ours,) = [r for r in test_extra if r.name == "triton"]
    assert [s.operator for s in ours.specifier] == ["=="], f"triton is not pinned in the test extra: {ours}"
    torch_wants = [Requirement(r) for r in requires("torch") or [] if Requirement(r).name == "triton"]
    for wanted in torch_wants:  # none on a CPU wheel
        assert ours.specifier == wanted.specifier, f"the test extra pins {ours}, torch requires {wanted}"


@needs_triton
def test_triton_on_cpu_tensors_without_the_interpreter_is_refused(monkeypatch):
    from lightning_zero.ops import FusedLamb

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        FusedLamb([param], implementation="triton").step()
    torch.testing.assert_close(param.detach(), torch.ones(3))  # refused before anything was written
