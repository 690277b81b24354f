"""DeepSpeed LR schedules and the optimizer/scheduler factory.

Each LR curve is compared, optimizer step by optimizer step, with an independent per-step implementation of the
formulas documented in DeepSpeed's docstrings; DeepSpeed runs optimizer step ``k`` with ``f(k - 1)`` (``f(-1)`` is
the value set at construction), which is what the reference functions below encode.
"""

from __future__ import annotations

import inspect
import math
import os

import pytest
import torch

from lightning_zero.ds_config import DeepSpeedConfigError
from lightning_zero.ds_config.optimizers import build_optimizer, build_scheduler, lightning_scheduler_config
from lightning_zero.ops.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

STEPS = 400


def _optimizer(lr=0.01, groups=1, cls=torch.optim.Adam):
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)]
    return cls(params, lr=lr)


def _observed(optimizer, scheduler, steps=STEPS, key="lr"):
    """The value each optimizer step runs with, stepping like DeepSpeed's engine and Lightning (interval='step')."""
    values = []
    for _ in range(steps):
        group = optimizer.param_groups[0]
        values.append(group[key] if key == "lr" else group["betas"][0])
        optimizer.step()
        scheduler.step()
    return values


def _reference_curve(formula, steps=STEPS):
    return [formula(k - 1) for k in range(steps)]


def _assert_curve(observed, expected):
    assert len(observed) == len(expected)
    for k, (got, want) in enumerate(zip(observed, expected)):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), f"optimizer step {k}: {got} != {want}"


def _warmup(t, W, kind):
    W = max(2, W)
    if kind == "log":
        return math.log(t + 1) / math.log(W)
    return t / W


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_curve(kind):
    lo, hi, W = 1e-4, 3e-3, 50

    def ref(t):
        if t < 0:
            return lo
        return lo + (hi - lo) * (_warmup(t, W, kind) if t < W else 1.0)

    opt = _optimizer()
    sched = WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=W, warmup_type=kind)
    _assert_curve(_observed(opt, sched), _reference_curve(ref))
    assert opt.param_groups[0]["lr"] == pytest.approx(hi)


def test_warmup_lr_max_defaults_to_optimizer_lr_and_per_group_values():
    opt = _optimizer(lr=0.05, groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_num_steps=10, warmup_type="linear")
    _observed(opt, sched, steps=20)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.05])
    with pytest.raises(ValueError, match="2 parameter groups"):
        WarmupLR(_optimizer(groups=2), warmup_min_lr=[0.0, 0.1, 0.2])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_curve(kind):
    lo, hi, W, T = 1e-5, 2e-3, 40, 300

    def ref(t):
        if t < 0:
            return lo
        gamma = _warmup(t, W, kind) if t < W else max(0.0, (T - t) / max(1.0, T - W))
        return lo + (hi - lo) * gamma

    opt = _optimizer()
    sched = WarmupDecayLR(
        opt, total_num_steps=T, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=W, warmup_type=kind
    )
    _assert_curve(_observed(opt, sched), _reference_curve(ref))  # runs past T: stays at warmup_min_lr


@pytest.mark.parametrize("kind, min_ratio", [("log", 0.0), ("linear", 0.2)])
def test_warmup_cosine_lr_curve(kind, min_ratio):
    base, W, T, cos_min = 0.02, 30, 250, 0.05

    def ref(t):
        if t < 0:
            return 0.0  # DeepSpeed sets the LR to 0 at construction
        if t < W:
            return base * (min_ratio + (1 - min_ratio) * _warmup(t, W, kind))
        progress = min(1.0, (t - W + 1) / max(1, T - W))
        return base * max(0.0, cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress)))

    opt = _optimizer(lr=base)
    sched = WarmupCosineLR(
        opt, total_num_steps=T, warmup_min_ratio=min_ratio, warmup_num_steps=W, cos_min_ratio=cos_min, warmup_type=kind
    )
    _assert_curve(_observed(opt, sched), _reference_curve(ref))


def _one_cycle_reference(lo, hi, s1, s2, decay_steps, decay_rate, stairs1=0, stairs2=None):
    stairs2 = stairs1 if stairs2 is None else stairs2
    total = s1 + s2

    def scale(t):
        i = t + 1
        x = (i % total) / total  # position inside the current cycle, in [0, 1)
        if x <= s1 / total:
            value, stairs = x * total / s1, stairs1
        else:
            value, stairs = (total - x * total) / s2, stairs2
        if stairs > 0:
            pos = i % total
            value = math.floor((pos if pos <= s1 else total - pos) * stairs / (s1 if pos <= s1 else s2)) / stairs
        return value

    def lr(t):
        if t < 0:
            return lo
        if t < total:
            return lo + (hi - lo) * scale(t)
        if decay_steps == 0 or decay_rate == 0:
            return lo
        return lo / (1 + decay_rate * (t - total + 1) / decay_steps)

    return lr, scale


def test_one_cycle_lr_and_momentum_curves():
    lo, hi, s1, s2, decay_steps, rate = 1e-4, 1e-2, 60, 90, 20, 0.5
    mom_lo, mom_hi, mom_rate = 0.85, 0.95, 0.01
    lr_ref, scale = _one_cycle_reference(lo, hi, s1, s2, decay_steps, rate)

    def mom_ref(t):
        if t < 0:
            return mom_lo
        if t < s1 + s2:
            return mom_hi - (mom_hi - mom_lo) * scale(t)
        return mom_hi * (1 + mom_rate * (t - s1 - s2 + 1) / decay_steps)

    opt = _optimizer()
    sched = OneCycle(
        opt,
        cycle_min_lr=lo,
        cycle_max_lr=hi,
        cycle_first_step_size=s1,
        cycle_second_step_size=s2,
        decay_step_size=decay_steps,
        decay_lr_rate=rate,
        cycle_min_mom=mom_lo,
        cycle_max_mom=mom_hi,
        decay_mom_rate=mom_rate,
    )
    lrs, moms = [], []
    for _ in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"][0])
        assert opt.param_groups[0]["betas"][1] == 0.999  # beta2 is kept (DeepSpeed would force 0.99)
        opt.step()
        sched.step()
    _assert_curve(lrs, _reference_curve(lr_ref))
    _assert_curve(moms, _reference_curve(mom_ref))


def test_one_cycle_stairs_and_sgd_disables_momentum():
    lr_ref, _ = _one_cycle_reference(1e-3, 1e-1, 40, 40, 0, 0.0, stairs1=4, stairs2=2)
    opt = _optimizer(cls=torch.optim.SGD)
    with pytest.warns(UserWarning, match="cycle_momentum is disabled"):
        sched = OneCycle(
            opt,
            cycle_min_lr=1e-3,
            cycle_max_lr=1e-1,
            cycle_first_step_size=40,
            cycle_first_stair_count=4,
            cycle_second_stair_count=2,
        )
    _assert_curve(_observed(opt, sched, steps=200), _reference_curve(lr_ref, steps=200))


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_curve(staircase):
    lo, size, rate = 1e-5, 25, 3.0

    def ref(t):
        interval = (t + 1) / size
        return lo * (1 + rate * (math.floor(interval) if staircase else interval))

    opt = _optimizer()
    sched = LRRangeTest(
        opt,
        lr_range_test_min_lr=lo,
        lr_range_test_step_size=size,
        lr_range_test_step_rate=rate,
        lr_range_test_staircase=staircase,
    )
    _assert_curve(_observed(opt, sched), _reference_curve(ref))


def test_deepspeed_defaults():
    expected = {
        WarmupLR: {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
        WarmupDecayLR: {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"},
        WarmupCosineLR: {
            "warmup_min_ratio": 0.0,
            "warmup_num_steps": 1000,
            "cos_min_ratio": 0.0001,
            "warmup_type": "log",
        },
        OneCycle: {
            "decay_lr_rate": 0.0,
            "cycle_first_step_size": 2000,
            "cycle_second_step_size": None,
            "cycle_first_stair_count": 0,
            "cycle_second_stair_count": None,
            "decay_step_size": 0,
            "cycle_momentum": True,
            "cycle_min_mom": 0.8,
            "cycle_max_mom": 0.9,
            "decay_mom_rate": 0.0,
        },
        LRRangeTest: {
            "lr_range_test_min_lr": 1e-3,
            "lr_range_test_step_size": 2000,
            "lr_range_test_step_rate": 1.0,
            "lr_range_test_staircase": False,
        },
    }
    for cls, defaults in expected.items():
        signature = inspect.signature(cls.__init__).parameters
        assert {name: signature[name].default for name in defaults} == defaults, cls.__name__
    # Default curves: WarmupLR with every default reaches the optimizer's lr after 1000 steps.
    opt = _optimizer(lr=0.3)
    sched = WarmupLR(opt)
    _observed(opt, sched, steps=1001)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.3)


def test_scheduler_validation_and_state_dict_resume():
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(_optimizer(), warmup_type="cosine")
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        WarmupLR(_optimizer(), warmup_num_steps=0)
    with pytest.raises(ValueError, match="load_state_dict"):
        WarmupLR(_optimizer(), last_batch_iteration=10)
    with pytest.warns(UserWarning, match="less than warmup_num_steps"):
        WarmupDecayLR(_optimizer(), total_num_steps=10, warmup_num_steps=100)
    opt = _optimizer()
    sched = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=10)
    _observed(opt, sched, steps=37)
    opt2 = _optimizer()
    resumed = WarmupDecayLR(opt2, total_num_steps=100, warmup_num_steps=10)
    resumed.load_state_dict(sched.state_dict())
    assert resumed.last_batch_iteration == sched.last_batch_iteration == 36
    opt.step(), sched.step(), opt2.step(), resumed.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_matches_deepspeed_when_installed():
    """Cross-check against DeepSpeed's own classes (skipped where deepspeed is not installed)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    cases = [
        ("WarmupLR", dict(warmup_num_steps=30, warmup_type="log")),
        ("WarmupDecayLR", dict(total_num_steps=120, warmup_num_steps=20, warmup_type="linear")),
        ("WarmupCosineLR", dict(total_num_steps=120, warmup_num_steps=20, warmup_min_ratio=0.1)),
        (
            "OneCycle",
            dict(
                cycle_min_lr=1e-4,
                cycle_max_lr=1e-2,
                cycle_first_step_size=30,
                decay_step_size=5,
                decay_lr_rate=0.2,
                cycle_first_stair_count=3,
            ),
        ),
        ("LRRangeTest", dict(lr_range_test_step_size=7, lr_range_test_staircase=True)),
    ]
    import lightning_zero.ops.lr_schedules as ours

    for name, kwargs in cases:
        opt_ds, opt_ours = _optimizer(), _optimizer()
        theirs = _observed(opt_ds, getattr(lr_schedules, name)(opt_ds, **kwargs), steps=200)
        _assert_curve(_observed(opt_ours, getattr(ours, name)(opt_ours, **kwargs), steps=200), theirs)


# --------------------------------------------------------------------------------- optimizer/scheduler factory


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3))]


def test_adam_means_decoupled_weight_decay_unless_adam_w_mode_false():
    from lightning_zero.ops.fused_adam import FusedAdam

    hyper = {"lr": 0.1, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.5}
    adam = build_optimizer({"type": "Adam", "params": hyper}, _params())
    assert isinstance(adam, FusedAdam) and adam.defaults["adam_w_mode"] is True
    assert adam.defaults["lr"] == 0.1 and tuple(adam.defaults["betas"]) == (0.8, 0.99)
    assert adam.defaults["eps"] == 1e-6 and adam.defaults["weight_decay"] == 0.5
    assert (
        build_optimizer({"type": "adam", "params": {"adam_w_mode": False}}, _params()).defaults["adam_w_mode"] is False
    )
    # "AdamW" is decoupled even when adam_w_mode says otherwise (DeepSpeed's rule).
    assert build_optimizer({"type": "AdamW", "params": {"adam_w_mode": False}}, _params()).defaults["adam_w_mode"]

    # Numerically: DeepSpeed's "Adam" == torch AdamW; with adam_w_mode=false == torch Adam (L2).
    def one_step(optimizer_spec=None, torch_cls=None):
        params = _params()
        opt = (
            build_optimizer(optimizer_spec, params)
            if optimizer_spec
            else torch_cls(params, **{**hyper, "betas": tuple(hyper["betas"])})
        )
        params[0].grad = torch.ones_like(params[0])
        opt.step()
        return params[0].detach().clone()

    torch.testing.assert_close(one_step({"type": "Adam", "params": hyper}), one_step(torch_cls=torch.optim.AdamW))
    torch.testing.assert_close(
        one_step({"type": "Adam", "params": {**hyper, "adam_w_mode": False}}), one_step(torch_cls=torch.optim.Adam)
    )


def test_torch_adam_lamb_sgd_and_any_torch_optim_name():
    opt = build_optimizer({"type": "Adam", "params": {"torch_adam": True, "lr": 0.2}}, _params())
    assert type(opt) is torch.optim.AdamW and opt.defaults["lr"] == 0.2
    opt = build_optimizer({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}, _params())
    assert type(opt) is torch.optim.Adam
    from lightning_zero.ops.fused_lamb import FusedLamb

    lamb = build_optimizer({"type": "Lamb", "params": {"lr": 0.01, "max_coeff": 5.0, "weight_decay": 0.1}}, _params())
    assert isinstance(lamb, FusedLamb) and lamb.defaults["max_coeff"] == 5.0 and lamb.defaults["lr"] == 0.01
    sgd = build_optimizer({"type": "SGD", "params": {"lr": 0.3, "momentum": 0.9, "nesterov": True}}, _params())
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"]
    assert type(build_optimizer({"type": "rmsprop", "params": {"lr": 0.1}}, _params())) is torch.optim.RMSprop
    assert type(build_optimizer({"type": "Adagrad"}, _params())) is torch.optim.Adagrad


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"type": "OneBitAdam", "params": {}}, "compressed communication"),
        ({"type": "Lion"}, "no torch.optim counterpart"),
        ({"type": "Sophia"}, "neither a DeepSpeed optimizer"),
        ({"type": "Adam", "params": {"lr": "auto"}}, 'still "auto"'),
        ({"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}, "SGD accepts"),
        ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, "gradient_clipping"),
        ({"type": "Adam", "params": {"fp32_optimizer_states": False}}, "always kept in fp32"),
    ],
)
def test_optimizer_errors(spec, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        build_optimizer(spec, _params())


def test_build_scheduler_from_config_spec():
    opt = build_optimizer({"type": "AdamW", "params": {"lr": 1e-3}}, _params())
    sched = build_scheduler({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10}}, opt, total_steps=77)
    assert isinstance(sched, WarmupCosineLR) and sched.total_num_steps == 77
    assert lightning_scheduler_config(sched) == {"scheduler": sched, "interval": "step", "frequency": 1}
    sched = build_scheduler(
        {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 5}}, opt, total_steps=77
    )
    assert sched.total_num_steps == 50  # the config wins over the estimate
    step_lr = build_scheduler({"type": "StepLR", "params": {"step_size": 3, "gamma": 0.5}}, opt)
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR) and step_lr.gamma == 0.5
    with pytest.raises(DeepSpeedConfigError, match="needs total_num_steps"):
        build_scheduler({"type": "WarmupDecayLR"}, opt)
    with pytest.raises(DeepSpeedConfigError, match="neither a DeepSpeed scheduler"):
        build_scheduler({"type": "WarmupLinear"}, opt)
    with pytest.raises(DeepSpeedConfigError, match="it accepts"):
        build_scheduler({"type": "WarmupLR", "params": {"warmup_steps": 3}}, opt)


def test_defines_configure_optimizers_tells_an_override_from_the_base_hook():
    import lightning.pytorch as pl

    from lightning_zero.strategies.ds_config_fit import defines_configure_optimizers

    class WithOptimizers(pl.LightningModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class WithoutOptimizers(pl.LightningModule):
        pass

    assert defines_configure_optimizers(WithOptimizers()) and not defines_configure_optimizers(WithoutOptimizers())
