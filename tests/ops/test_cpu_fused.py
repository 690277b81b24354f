"""An Adam/AdamW that left ``foreach``/``fused`` to torch steps its fp32 CPU tensors with torch's fused kernel
(lightning_zero.ops.cpu_fused): only then, only during the step, with the for-loop's values up to fp32 rounding, at
every stage and through the Trainer and Fabric."""

import contextlib

import pytest
import torch
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.distributed.optimizer import shard_optimizer
from lightning_zero.ops.cpu_fused import prefer_fused_on_cpu, steps_fused_on_cpu
from tests.lightning_models import RegressionModule, dataset, quiet_trainer
from tests.ranks import run_distributed


@contextlib.contextmanager
def counting_fused_kernels():
    """Counts the calls of torch's fused Adam/AdamW kernels (torch.optim.adam looks them up on ``torch`` per call)."""
    calls = {"n": 0}
    kernels = {name: getattr(torch, name) for name in ("_fused_adam_", "_fused_adamw_")}

    def counting(kernel):
        def counted(*args, **kwargs):
            calls["n"] += 1
            return kernel(*args, **kwargs)

        return counted

    for name, kernel in kernels.items():
        setattr(torch, name, counting(kernel))
    try:
        yield calls
    finally:
        for name, kernel in kernels.items():
            setattr(torch, name, kernel)


@pytest.fixture
def fused_calls():
    with counting_fused_kernels() as calls:
        yield calls


def _params(dtype=torch.float32, n=3):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(7, 5, dtype=dtype)) for _ in range(n)]


def _step(optimizer, steps=1, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        optimizer.step()


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_unset_kernel_on_fp32_cpu_steps_fused_with_the_for_loops_values(cls, fused_calls):
    reference = _params()
    ours = _params()
    plain = cls(reference, lr=1e-2, weight_decay=0.1, amsgrad=True)
    optimizer = cls(ours, lr=1e-2, weight_decay=0.1, amsgrad=True)
    attached = prefer_fused_on_cpu(optimizer)
    assert attached is not None and steps_fused_on_cpu(optimizer) == [0]
    _step(plain, steps=5)
    assert fused_calls["n"] == 0
    _step(optimizer, steps=5)
    assert fused_calls["n"] == 5
    for a, b in zip(reference, ours):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)  # fp32 rounding only, not bitwise
    # The flag lives only inside the step: the groups and the state dict keep the user's None.
    assert optimizer.param_groups[0]["fused"] is None
    assert optimizer.state_dict()["param_groups"][0]["fused"] is None
    attached.remove()
    _step(optimizer)
    assert fused_calls["n"] == 5


@pytest.mark.parametrize("kwargs", [dict(foreach=False), dict(foreach=True), dict(fused=False)])
def test_a_users_kernel_choice_is_kept(kwargs, fused_calls):
    optimizer = torch.optim.AdamW(_params(), lr=1e-2, **kwargs)
    prefer_fused_on_cpu(optimizer)
    assert steps_fused_on_cpu(optimizer) == []
    _step(optimizer, steps=2)
    assert fused_calls["n"] == 0
    assert {key: optimizer.param_groups[0][key] for key in kwargs} == kwargs


class _MyAdamW(torch.optim.AdamW):
    pass


class _Subclass(torch.Tensor):
    pass


def test_what_keeps_torchs_choice():
    # not fp32: the kernel's one rounding would not be the for-loop's result up to rounding
    assert steps_fused_on_cpu(torch.optim.AdamW(_params(torch.bfloat16), lr=1e-2)) == []
    # a subclass may add math of its own: no hooks at all
    assert prefer_fused_on_cpu(_MyAdamW(_params(), lr=1e-2)) is None
    # differentiable and capturable groups; a group with one bf16 tensor; other optimizers
    assert steps_fused_on_cpu(torch.optim.AdamW(_params(), lr=1e-2, differentiable=True)) == []
    assert steps_fused_on_cpu(torch.optim.Adam(_params(), lr=1e-2, capturable=True)) == []
    mixed = torch.optim.AdamW([{"params": _params()}, {"params": _params() + _params(torch.bfloat16, 1)}], lr=1e-2)
    assert steps_fused_on_cpu(mixed) == [0]
    assert prefer_fused_on_cpu(torch.optim.SGD(_params(), lr=1e-2)) is None
    # a tensor subclass (other than a DTensor, whose local shard is plain) may not dispatch the kernel alike
    subclassed = [nn.Parameter(p.detach().as_subclass(_Subclass)) for p in _params()]
    assert steps_fused_on_cpu(torch.optim.AdamW(subclassed, lr=1e-2)) == []
    # a gradient of another dtype keeps the group on torch's choice for that step
    optimizer = torch.optim.AdamW(_params(), lr=1e-2)
    prefer_fused_on_cpu(optimizer)
    for p in optimizer.param_groups[0]["params"]:
        if hasattr(p, "grad_dtype"):  # torch >= 2.13 refuses a gradient of another dtype unless told
            p.grad_dtype = None
        p.grad = torch.ones(p.shape, dtype=torch.bfloat16)
    assert steps_fused_on_cpu(optimizer) == []


def test_a_step_that_raised_never_shows_its_flag(fused_calls):
    optimizer = torch.optim.AdamW(_params(), lr=1e-2)
    attached = prefer_fused_on_cpu(optimizer)

    def fail(*_):
        raise RuntimeError("boom")

    failing = optimizer.register_step_pre_hook(fail)  # after ours: the flag is set when it raises
    with pytest.raises(RuntimeError, match="boom"):
        _step(optimizer)
    assert optimizer.param_groups[0]["fused"] is True  # until the next step or remove()
    # a checkpoint taken now (an on-exception save) shows the user's setting, not ours
    assert optimizer.state_dict()["param_groups"][0]["fused"] is None
    failing.remove()
    _step(optimizer)
    assert optimizer.param_groups[0]["fused"] is None and fused_calls["n"] == 1
    with pytest.raises(RuntimeError, match="boom"):
        failing = optimizer.register_step_pre_hook(fail)
        _step(optimizer)
    failing.remove()
    attached.remove()  # detaching puts the flag back too
    assert optimizer.param_groups[0]["fused"] is None


def test_layouts_the_kernel_would_misread_keep_torchs_choice(fused_calls):
    # The fused kernel walks a parameter and its states as flat memory; the for-loop follows strides.
    base = torch.randn(8, 6)
    strided = nn.Parameter(base[:, ::2])  # a view: stepping it flat would write the columns between
    optimizer = torch.optim.Adam([strided], lr=0.1)
    prefer_fused_on_cpu(optimizer)
    untouched = base[:, 1::2].clone()
    strided.grad = torch.ones(8, 3)
    optimizer.step()
    assert fused_calls["n"] == 0 and torch.equal(base[:, 1::2], untouched)
    # a transposed parameter with a contiguous gradient, and contiguous states beside a transposed parameter
    transposed = nn.Parameter(torch.randn(6, 4).t())
    optimizer = torch.optim.AdamW([transposed], lr=0.1)
    transposed.grad = torch.randn(4, 6)
    assert steps_fused_on_cpu(optimizer) == []
    # states loaded in another layout (load_state_dict keeps the saved tensors' strides): checked after every load
    dense = nn.Parameter(torch.randn(4, 6))
    optimizer = torch.optim.AdamW([dense], lr=0.1)
    prefer_fused_on_cpu(optimizer)
    for _ in range(3):
        dense.grad = torch.randn(4, 6)
        optimizer.step()
    assert fused_calls["n"] == 3
    saved = optimizer.state_dict()
    saved["state"][0]["exp_avg"] = saved["state"][0]["exp_avg"].t().contiguous().t()  # same values, column-major
    optimizer.load_state_dict(saved)
    assert not optimizer.state[dense]["exp_avg"].is_contiguous()
    dense.grad = torch.randn(4, 6)
    optimizer.step()
    assert fused_calls["n"] == 3 and steps_fused_on_cpu(optimizer) == []


def test_a_step_override_keeps_the_built_class_visible():
    from lightning_zero.ops.step_override import override_step, restore_step_override

    optimizer = torch.optim.AdamW(_params(), lr=1e-2)
    override_step(optimizer, lambda opt, base_step, closure: base_step(opt), marker="test")
    try:
        assert steps_fused_on_cpu(optimizer) == [0] and prefer_fused_on_cpu(optimizer) is not None
    finally:
        restore_step_override(optimizer, "test")


def _two_steps(rank, world_size, stage, offload, **adam_kwargs):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero.distributed.apply_zero import apply_zero

    config = ZeroConfig(stage=stage, offload_optimizer=offload)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    module = apply_zero(net, init_device_mesh("cpu", (world_size,)), config)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, **adam_kwargs)
    sharding = shard_optimizer(optimizer, config)
    torch.manual_seed(rank)
    for _ in range(2):
        module(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    weights = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in module.named_parameters()
    }
    return optimizer, sharding, weights


def _stage_worker(rank, world_size, stage, offload):
    with counting_fused_kernels() as calls:
        optimizer, sharding, weights = _two_steps(rank, world_size, stage, offload)
        assert calls["n"] == 2, "each of the two steps runs the fused kernel once"
        assert optimizer.param_groups[0]["fused"] is None
        sharding.remove()
        for held in optimizer.param_groups[0]["params"]:
            held.grad = torch.ones_like(held)
        optimizer.step()
        assert calls["n"] == 2, "released: torch's own choice again"
        _, _, for_loop = _two_steps(rank, world_size, stage, offload, foreach=False)
        assert calls["n"] == 2, "foreach=False is the user's choice: the for-loop"
    for name, value in for_loop.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} at stage {stage}")


@pytest.mark.parametrize(
    "stage,offload", [(0, None), (1, None), (2, None), (3, None), (1, "cpu"), (2, "cpu"), (3, "cpu")]
)
def test_every_stage_steps_fused_on_cpu_until_released(stage, offload):
    run_distributed(_stage_worker, 2, stage, offload)


class _OneGroupModule(RegressionModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _trainer_worker(rank, world_size, stage):
    with counting_fused_kernels() as calls:
        trainer = quiet_trainer(ZeroStrategy(stage=stage), world_size, max_steps=3)
        trainer.fit(_OneGroupModule(), torch.utils.data.DataLoader(dataset(), batch_size=4))
    assert calls["n"] == 3, f"stage {stage}: the user's AdamW ran the fused kernel {calls['n']} times in 3 steps"
    assert trainer.optimizers[0].param_groups[0]["fused"] is None


@pytest.mark.parametrize("stage", [0, 2])
def test_trainer_steps_the_users_adamw_fused(stage):
    run_distributed(_trainer_worker, 2, stage)


def _fabric_worker(rank, world_size, stage):
    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
    from tests.distributed.test_zero_parity import STEPS
    from tests.fabric.test_fabric_parity import fabric_train, make_fabric

    with counting_fused_kernels() as calls:
        _, optimizer = fabric_train(make_fabric(FabricZeroStrategy(stage=stage)), rank, world_size)
    groups = len(optimizer.param_groups)
    assert calls["n"] == STEPS * groups, f"stage {stage}: {calls['n']} fused calls in {STEPS} steps of {groups} groups"
    assert all(group["fused"] is None for group in optimizer.param_groups)


@pytest.mark.parametrize("stage", [0, 2])
def test_fabric_steps_the_users_adamw_fused(stage):
    run_distributed(_fabric_worker, 2, stage)
