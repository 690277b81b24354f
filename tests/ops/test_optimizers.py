import math
import os
import subprocess
import sys

import pytest
import torch

from lightning_zero.ops import CPUAdam, FusedAdam, FusedLamb
from lightning_zero.ops.fused_lamb import triton_available
from tests.ranks import run_distributed

STEPS = 50
SHAPES = [(7, 5), (13,), (3, 4, 2)]


# ---------------------------------------------------------------- float64 references (written from the papers/docs)
def adam_reference(p, grads, *, lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, amsgrad):
    p = p.double().clone()
    m, v, vmax = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        if not adam_w_mode:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        vmax = torch.maximum(vmax, v)
        second = vmax if amsgrad else v
        bc1 = 1 - beta1**t if bias_correction else 1.0
        bc2 = 1 - beta2**t if bias_correction else 1.0
        update = (m / bc1) / (second.sqrt() / math.sqrt(bc2) + eps)
        if adam_w_mode:
            update = update + weight_decay * p
        p = p - lr * update
    return p


def lamb_reference(p, grads, *, lr, beta1, beta2, eps, weight_decay, bias_correction, max_coeff, min_coeff, scale=1.0):
    p = p.double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    coeffs = []
    for t, g in enumerate(grads, start=1):
        g = g.double() / scale
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        update = m / (v.sqrt() + eps) + weight_decay * p
        w_norm, u_norm = p.norm().item(), update.norm().item()
        coeff = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
        coeffs.append(coeff)
        step_size = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t) if bias_correction else lr
        p = p - step_size * coeff * update
    return p, coeffs


def make_case(seed, shapes=SHAPES, steps=STEPS, weight_scales=None):
    gen = torch.Generator().manual_seed(seed)
    weight_scales = weight_scales or [1.0] * len(shapes)
    params = [torch.randn(s, generator=gen) * w for s, w in zip(shapes, weight_scales)]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    return params, grads


def run_optimizer(make_optimizer, params, grads, group_split, step_kwargs=None):
    live = [p.clone().requires_grad_() for p in params]
    groups = [
        {"params": live[:group_split], **make_optimizer["group0"]},
        {"params": live[group_split:], **make_optimizer["group1"]},
    ]
    opt = make_optimizer["cls"](groups, **make_optimizer["defaults"])
    coeff_history = []
    for step_grads in grads:
        for p, g in zip(live, step_grads):
            p.grad = g.clone()
        opt.step(**(step_kwargs or {}))
        if isinstance(opt, FusedLamb):
            coeff_history.append(opt.get_lamb_coeffs())
    return live, opt, coeff_history


ADAM_HYPER = dict(betas=(0.9, 0.99), eps=1e-8)


@pytest.mark.parametrize("cls", [FusedAdam, CPUAdam])
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_family_matches_float64_reference(cls, adam_w_mode, bias_correction):
    params, grads = make_case(seed=int(adam_w_mode) * 2 + int(bias_correction))
    mode_arg = {"adam_w_mode": adam_w_mode} if cls is FusedAdam else {"adamw_mode": adam_w_mode}
    # two groups: weight decay on in one, off in the other; amsgrad in the second
    spec = {
        "cls": cls,
        "defaults": dict(lr=1e-2, bias_correction=bias_correction, **ADAM_HYPER, **mode_arg),
        "group0": dict(weight_decay=0.1, amsgrad=False),
        "group1": dict(weight_decay=0.0, amsgrad=True, lr=3e-3),
    }
    live, opt, _ = run_optimizer(spec, params, grads, group_split=1)
    for i, (p, start) in enumerate(zip(live, params)):
        group = spec["group0"] if i < 1 else spec["group1"]
        ref = adam_reference(
            start,
            [g[i] for g in grads],
            lr=group.get("lr", 1e-2),
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            weight_decay=group["weight_decay"],
            adam_w_mode=adam_w_mode,
            bias_correction=bias_correction,
            amsgrad=group["amsgrad"],
        )
        assert not torch.allclose(ref, start.double(), atol=1e-2)  # the parameters really moved
        torch.testing.assert_close(p.detach().double(), ref, rtol=1e-5, atol=2e-6)
    if cls is FusedAdam:
        assert opt.last_implementation == ("torch-fused" if bias_correction else "foreach")


def test_cpu_adam_writes_low_precision_copies_and_rejects_bad_ones():
    params, grads = make_case(seed=11, steps=3)
    live = [p.clone().requires_grad_() for p in params]
    copies = [
        torch.empty(params[0].shape, dtype=torch.bfloat16),
        None,
        torch.empty(params[2].shape, dtype=torch.float16),
    ]
    opt = CPUAdam(live, lr=1e-2)
    for step_grads in grads:
        for p, g in zip(live, step_grads):
            p.grad_dtype = None  # allow a bf16 gradient on an fp32 master parameter, as an offload engine does
            p.grad = g.to(torch.bfloat16)  # low-precision gradients are upcast
        opt.step(low_precision_params=copies)
    assert torch.equal(copies[0], live[0].detach().to(torch.bfloat16))
    assert torch.equal(copies[2], live[2].detach().to(torch.float16))
    with pytest.raises(ValueError, match="shaped like"):
        opt.step(low_precision_params=[torch.empty(1, dtype=torch.bfloat16), None, None])
    with pytest.raises(ValueError, match="mirror param_groups"):
        opt.step(low_precision_params=[None])
    with pytest.raises(ValueError, match="float32 CPU"):
        CPUAdam([torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)])


def lamb_spec(implementation):
    return {
        "cls": FusedLamb,
        "defaults": dict(
            lr=2e-2, betas=(0.9, 0.99), eps=1e-6, max_coeff=2.0, min_coeff=0.5, implementation=implementation
        ),
        "group0": dict(weight_decay=0.01),
        "group1": dict(weight_decay=0.0, bias_correction=False),
    }


def check_lamb_against_reference(implementation, steps=STEPS):
    # tiny weights -> trust ratio below min_coeff; huge weights -> above max_coeff; zeros -> coefficient 1
    shapes = [(6, 4), (9,), (5, 3), (4,)]
    params, grads = make_case(seed=3, shapes=shapes, steps=steps, weight_scales=[1e-3, 1.0, 1e3, 0.0])
    spec = lamb_spec(implementation)
    live, opt, history = run_optimizer(spec, params, grads, group_split=2, step_kwargs={"scale": 4.0})
    for i, (p, start) in enumerate(zip(live, params)):
        group = spec["group0"] if i < 2 else spec["group1"]
        ref, coeffs = lamb_reference(
            start,
            [g[i] for g in grads],
            lr=2e-2,
            beta1=0.9,
            beta2=0.99,
            eps=1e-6,
            weight_decay=group["weight_decay"],
            bias_correction=group.get("bias_correction", True),
            max_coeff=2.0,
            min_coeff=0.5,
            scale=4.0,
        )
        torch.testing.assert_close(p.detach().double(), ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            torch.tensor([h[i] for h in history], dtype=torch.float64),
            torch.tensor(coeffs, dtype=torch.float64),
            rtol=1e-5,
            atol=0,
        )
    first = history[0]
    assert first[0] == pytest.approx(0.5) and first[2] == pytest.approx(2.0) and first[3] == 1.0  # clamps hit
    assert 0.5 < first[1] < 2.0
    return opt


def test_lamb_torch_path_matches_float64_reference_with_clamping():
    opt = check_lamb_against_reference("torch")
    assert opt.last_implementation == "torch"


def test_lamb_max_grad_norm_clips_like_deepspeed():
    params, grads = make_case(seed=8, shapes=[(10,), (3, 3)], steps=4)
    live = [p.clone().requires_grad_() for p in params]
    opt = FusedLamb(live, lr=1e-2, max_grad_norm=0.5, implementation="torch")
    for step_grads in grads:
        for p, g in zip(live, step_grads):
            p.grad = g.clone()
        opt.step(scale=2.0)
        # DeepSpeed: combined_scale = scale * clip when clip = (||g|| / scale + 1e-6) / max_grad_norm > 1
        norm = math.sqrt(sum(g.double().square().sum().item() for g in step_grads))
        clip = (norm / 2.0 + 1e-6) / 0.5
        assert clip > 1
    for i, start in enumerate(params):
        norm_scales = []
        for step_grads in grads:
            norm = math.sqrt(sum(g.double().square().sum().item() for g in step_grads))
            norm_scales.append(2.0 * max((norm / 2.0 + 1e-6) / 0.5, 1.0))
        p = start.double().clone()
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        for t, (step_grads, combined) in enumerate(zip(grads, norm_scales), start=1):
            g = step_grads[i].double() / combined
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            u = m / (v.sqrt() + 1e-8)
            coeff = min(max(p.norm().item() / u.norm().item(), 0.01), 10.0)
            p = p - 1e-2 * math.sqrt(1 - 0.999**t) / (1 - 0.9**t) * coeff * u
        torch.testing.assert_close(live[i].detach().double(), p, rtol=1e-5, atol=1e-6)


def test_invalid_arguments_are_rejected():
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="amsgrad"):
        FusedLamb(p, amsgrad=True)
    with pytest.raises(ValueError, match="min_coeff"):
        FusedLamb(p, min_coeff=2.0, max_coeff=1.0)
    with pytest.raises(ValueError, match="implementation"):
        FusedLamb(p, implementation="cuda")
    with pytest.raises(ValueError, match="betas"):
        FusedAdam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        CPUAdam(p, lr=-1.0)


def _triton_interpret_check():
    """Run in a subprocess with TRITON_INTERPRET=1 (the interpreter is chosen when the kernel is defined)."""
    opt = check_lamb_against_reference("triton", steps=8)
    assert opt.last_implementation == "triton"


@pytest.mark.skipif(
    not triton_available(),
    reason="triton is not installed: the LAMB Triton kernel cannot be interpreted on CPU (pip install triton)",
)
def test_lamb_triton_kernel_under_interpreter_matches_reference():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    script = "from tests.ops.test_optimizers import _triton_interpret_check as f; f()"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- DTensor shards on 2 gloo ranks
def _dtensor_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    shapes = [(5, 3), (7,), (1, 4)]  # uneven shards, and an empty shard on rank 1
    params, grads = make_case(seed=21, shapes=shapes, steps=6, weight_scales=[1e-3, 1.0, 1e3])
    makers = {
        "adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
        "cpu_adam": lambda ps: CPUAdam(ps, lr=1e-2, weight_decay=0.1, adamw_mode=False),
        "lamb": lambda ps: FusedLamb(
            ps, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, max_coeff=2.0, min_coeff=0.5, implementation="torch"
        ),
    }
    for name, make in makers.items():
        plain = [p.clone().requires_grad_() for p in params]
        sharded = [distribute_tensor(p.clone(), mesh, [Shard(0)]).requires_grad_() for p in params]
        opt_plain, opt_sharded = make(plain), make(sharded)
        for step_grads in grads:
            for p, q, g in zip(plain, sharded, step_grads):
                p.grad = g.clone()
                q.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            opt_plain.step()
            opt_sharded.step()
        for p, q in zip(plain, sharded):
            torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=1e-6, atol=1e-7, msg=name)
        if name == "lamb":
            # the trust ratios used global norms (a local norm would give different clamps/ratios)
            assert opt_plain.get_lamb_coeffs() == pytest.approx(opt_sharded.get_lamb_coeffs(), rel=1e-6)
        if name == "adam":
            assert isinstance(opt_sharded.state[sharded[0]]["exp_avg"], DTensor)


def test_optimizers_on_dtensor_shards_match_unsharded():
    run_distributed(_dtensor_worker, 2)
