"""One mechanism replaces an optimizer's step by a generated subclass (lightning_zero.ops.step_override): the
class keeps its name, hooks run once, overrides stack and undo in reverse order only, and torch LR schedulers built
before or after an override keep working during it and after it is undone (see the module's note)."""

import warnings

import pytest
import torch
from torch import nn

from lightning_zero.distributed.local_step import restore_step, use_local_step
from lightning_zero.offload.nvme_config import NvmeConfig
from lightning_zero.offload.optimizer_swapper import attach_swapper, detach_swapper
from lightning_zero.offload.param_swapper import attach_param_step, detach_param_step
from lightning_zero.ops.step_override import is_overridden, override_step, restore_step_override
from tests.ranks import run_distributed


def _optimizer(cls=torch.optim.SGD, **kwargs):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
    defaults = {"lr": 0.1, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 0.1}
    return cls(params, **{**defaults, **kwargs})


def _scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _counting(calls: list, name: str):
    def step(optimizer, base_step, closure):
        calls.append(name)
        return base_step(optimizer, closure)

    return step


def _train_step(optimizer, scheduler, value: float) -> None:
    """One optimizer step and one scheduler step, as a training loop does; any warning (the scheduler's "called
    before optimizer.step()" or "optimizer.step() has been overridden") fails."""
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        p.grad = torch.full_like(p, value)
    optimizer.__dict__.pop("_opt_called", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
        if scheduler is not None:
            assert getattr(optimizer, "_opt_called", False), "the scheduler's step wrapper did not record the step"
            scheduler.step()


def _same_as_reference(optimizer, steps: int) -> None:
    """Parameters and learning rates equal those of a never-overridden optimizer with the same schedule."""
    reference = _optimizer(type(optimizer))
    scheduler = _scheduler(reference)
    for value in range(1, steps + 1):
        _train_step(reference, scheduler, float(value))
    for got, want in zip(optimizer.param_groups, reference.param_groups):
        assert got["lr"] == want["lr"]
        for p, q in zip(got["params"], want["params"]):
            assert torch.equal(p, q)


@pytest.mark.parametrize("overridden_steps", [0, 2])
@pytest.mark.parametrize("built", ["before", "after"])
def test_a_scheduler_built_before_or_after_an_override_works_during_and_after_it(built, overridden_steps):
    optimizer = _optimizer()
    scheduler = _scheduler(optimizer) if built == "before" else None
    original_wrapper = optimizer.__dict__.get("step")
    calls = []
    override_step(optimizer, _counting(calls, "override"), marker="test")
    if built == "after":
        scheduler = _scheduler(optimizer)
    for value in range(1, overridden_steps + 1):
        _train_step(optimizer, scheduler, float(value))
    assert calls == ["override"] * overridden_steps, "the scheduler's wrapper must run the overridden step"
    assert restore_step_override(optimizer, "test")
    assert type(optimizer) is torch.optim.SGD
    wrapper = optimizer.__dict__["step"]
    if built == "before":
        assert wrapper is original_wrapper, "a scheduler built before the override gets its own wrapper back"
    else:  # what torch makes on a plain SGD: a wrapper of SGD's step
        assert wrapper._wrapped_by_lr_sched and wrapper.__wrapped__ is torch.optim.SGD.step
    for value in range(overridden_steps + 1, 5):
        _train_step(optimizer, scheduler, float(value))
    assert calls == ["override"] * overridden_steps, "after restore the base class's step runs"
    _same_as_reference(optimizer, 4)


def test_the_class_keeps_its_name_hooks_run_once_and_extra_methods_come_and_go():
    optimizer = _optimizer(torch.optim.AdamW)
    hooks = []
    optimizer.register_step_pre_hook(lambda *args: hooks.append("pre"))
    optimizer.register_step_post_hook(lambda *args: hooks.append("post"))
    calls = []
    cls = override_step(
        optimizer, _counting(calls, "inner"), marker="inner", extra={"state_dict": lambda self: "overridden"}
    )
    override_step(optimizer, _counting(calls, "outer"), marker="outer")
    for name in ("__name__", "__qualname__", "__module__"):
        assert getattr(type(optimizer), name) == getattr(torch.optim.AdamW, name)
    assert isinstance(optimizer, torch.optim.AdamW) and isinstance(optimizer, cls)
    assert optimizer.state_dict() == "overridden"
    _train_step(optimizer, None, 1.0)
    assert calls == ["outer", "inner"] and hooks == ["pre", "post"], "one step: each override once, hooks once"
    restore_step_override(optimizer, "outer")
    restore_step_override(optimizer, "inner")
    assert type(optimizer) is torch.optim.AdamW and isinstance(optimizer.state_dict(), dict)
    with pytest.raises(ValueError, match="may not replace"):
        override_step(optimizer, _counting(calls, "x"), marker="x", extra={"step": lambda self: None})


def test_stacked_overrides_undo_in_reverse_order_only_with_a_scheduler_built_between():
    optimizer = _optimizer()
    calls = []
    override_step(optimizer, _counting(calls, "inner"), marker="inner")
    scheduler = _scheduler(optimizer)  # wraps the inner class's step
    override_step(optimizer, _counting(calls, "outer"), marker="outer")
    with pytest.raises(RuntimeError, match="already applied"):
        override_step(optimizer, _counting(calls, "inner"), marker="inner")
    _train_step(optimizer, scheduler, 1.0)
    assert calls == ["outer", "inner"]
    outer_cls = type(optimizer)
    with pytest.raises(RuntimeError, match="'outer' override was applied after it.*reverse order"):
        restore_step_override(optimizer, "inner")
    assert type(optimizer) is outer_cls and is_overridden(optimizer, "inner"), "a refused undo changes nothing"
    restore_step_override(optimizer, "outer")
    _train_step(optimizer, scheduler, 2.0)
    assert calls == ["outer", "inner", "inner"]
    restore_step_override(optimizer, "inner")
    assert not restore_step_override(optimizer, "inner"), "undoing twice is a no-op"
    _train_step(optimizer, scheduler, 3.0)
    assert calls == ["outer", "inner", "inner"] and type(optimizer) is torch.optim.SGD
    _same_as_reference(optimizer, 3)


def test_a_step_replaced_on_the_instance_by_the_user_is_refused(tmp_path):
    optimizer = _optimizer()
    optimizer.step = lambda closure=None: None
    with pytest.raises(RuntimeError, match="replaced on the instance.*not by an LR scheduler"):
        override_step(optimizer, _counting([], "x"), marker="x")
    assert type(optimizer) is torch.optim.SGD
    with pytest.raises(RuntimeError, match="'NVMe optimizer-state swapping' step override cannot run through it"):
        attach_swapper(optimizer, NvmeConfig(str(tmp_path)))
    assert type(optimizer) is torch.optim.SGD and not hasattr(optimizer, "_lightning_zero_swapper")
    assert list(tmp_path.iterdir()) == [], "the refused swapper's folder is removed"


# ------------------------------------------------------------------ the three users, each with its old edge case
def test_detaching_the_state_swapper_under_a_later_scheduler_steps_the_plain_optimizer(tmp_path):
    # Before: the later scheduler's wrapper still called the swapped class's step: AttributeError on NoneType.
    optimizer = _optimizer(torch.optim.AdamW)
    attach_swapper(optimizer, NvmeConfig(str(tmp_path)))
    scheduler = _scheduler(optimizer)
    _train_step(optimizer, scheduler, 1.0)
    detach_swapper(optimizer)
    assert type(optimizer) is torch.optim.AdamW
    for value in (2.0, 3.0):
        _train_step(optimizer, scheduler, value)
    _same_as_reference(optimizer, 3)


def test_detaching_the_parameter_step_keeps_a_later_schedulers_wrapper():
    # Before: detach popped the instance step, dropping the wrapper: the scheduler warned it was overridden.
    class Swapper:
        def step(self, optimizer, base_step):
            calls.append("unit step")
            base_step(optimizer)

    calls = []
    optimizer = _optimizer()
    attach_param_step(optimizer, Swapper())
    scheduler = _scheduler(optimizer)
    detach_param_step(optimizer)
    for value in (1.0, 2.0):
        _train_step(optimizer, scheduler, value)
    assert calls == [] and type(optimizer) is torch.optim.SGD
    _same_as_reference(optimizer, 2)


def _local_step_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import lightning_zero.distributed.local_step as local_step

    mesh = init_device_mesh("cpu", (world_size,))
    swaps = []
    real_swap_in = local_step._swap_in
    local_step._swap_in = lambda *args: swaps.append(1) or real_swap_in(*args)
    for built in ("before", "after"):
        torch.manual_seed(0)
        param = nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
        optimizer = torch.optim.AdamW([param], lr=0.1)
        scheduler = _scheduler(optimizer) if built == "before" else None
        assert use_local_step(optimizer)
        scheduler = scheduler or _scheduler(optimizer)
        swaps.clear()
        _train_step(optimizer, scheduler, 1.0)
        assert swaps == [1], f"scheduler built {built}: the local step must run"
        restore_step(optimizer)
        _train_step(optimizer, scheduler, 2.0)
        # Before: a wrapper from a scheduler built after use_local_step still ran the local step after restore.
        assert swaps == [1], f"scheduler built {built}: after restore_step torch's DTensor step must run"
        torch.manual_seed(0)
        reference = nn.Parameter(torch.randn(4, 3))
        ref_optimizer = torch.optim.AdamW([reference], lr=0.1)
        ref_scheduler = _scheduler(ref_optimizer)
        for value in (1.0, 2.0):
            _train_step(ref_optimizer, ref_scheduler, value)
        assert torch.equal(param.full_tensor(), reference.detach())
        assert optimizer.param_groups[0]["lr"] == ref_optimizer.param_groups[0]["lr"]


def test_restoring_the_local_step_under_a_later_scheduler_runs_the_dtensor_step():
    run_distributed(_local_step_worker, 1)
