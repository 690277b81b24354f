"""DeepSpeed's learning-rate schedules as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.

Hand-written because no maintained library ships these exact curves: torch has warm-up/cosine pieces, but not
DeepSpeed's log warm-up, its clamps and its one-cycle stair steps. Parameter names, defaults and formulas follow
DeepSpeed's ``deepspeed/runtime/lr_schedules.py`` so a ``"scheduler"`` section of a ds_config means the same thing.

[Note: step alignment. DeepSpeed sets the LR for iteration ``t = -1`` at construction and its engine calls
``scheduler.step()`` after every optimizer step, so optimizer step ``k`` (0-based) runs with ``f(k - 1)``, where
``f`` is the documented formula of ``last_batch_iteration``. A torch ``LRScheduler`` steps once in its constructor
and Lightning steps it after every optimizer step (``interval="step"``), so optimizer step ``k`` runs with
``get_lr()`` at ``last_epoch == k``. We therefore evaluate ``f(last_epoch - 1)``: every optimizer step sees the
same LR as under DeepSpeed. :attr:`last_batch_iteration` exposes DeepSpeed's counter.]
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"
WARMUP_TYPES = (WARMUP_LOG, WARMUP_LINEAR)

FloatOrList = Union[float, Sequence[float]]


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list:
    """Broadcast a scalar to every parameter group, or check a per-group list has one entry per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has {len(optimizer.param_groups)} "
                "parameter groups: give one value per group, or a single number"
            )
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _warmup_fraction(t: int, warmup_steps: int, warmup_type: str) -> float:
    """DeepSpeed's warm-up progress in [0, 1) for ``0 <= t < warmup_steps``."""
    if warmup_type == WARMUP_LOG:
        return math.log(t + 1) / math.log(warmup_steps)
    return t / warmup_steps


class _DeepSpeedSchedule(LRScheduler):
    """Base: subclasses give the LR of DeepSpeed iteration ``t`` (``-1`` = value set at construction)."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        if last_batch_iteration != -1:
            raise ValueError(
                "last_batch_iteration other than -1 is not supported: to resume, build the scheduler "
                "and call load_state_dict() with the saved state"
            )
        super().__init__(optimizer, last_epoch=-1)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's iteration counter (``-1`` before the first ``step()``)."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:
        return self.lrs_at(self.last_epoch - 1)

    def _get_closed_form_lr(self) -> list[float]:
        return self.lrs_at(self.last_epoch - 1)

    def lrs_at(self, iteration: int) -> list[float]:
        """The learning rate of every parameter group at DeepSpeed iteration ``iteration``."""
        raise NotImplementedError


class WarmupLR(_DeepSpeedSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then stay at the maximum.

    ``lr(t) = min + (max - min) * g(t)`` with ``g(t) = log(t + 1) / log(W)`` ("log") or ``t / W`` ("linear") for
    ``t < W`` and ``1`` afterwards, where ``W = max(2, warmup_num_steps)``.

    Args:
        warmup_min_lr: start LR (or one per parameter group). DeepSpeed default ``0.0``.
        warmup_max_lr: final LR; ``None`` (default) uses each group's current ``lr``.
        warmup_num_steps: warm-up length. Default ``1000``.
        warmup_type: ``"log"`` (default) or ``"linear"``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: FloatOrList = 0.0,
        warmup_max_lr: FloatOrList | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        _positive_int(warmup_num_steps, "warmup_num_steps")
        if warmup_type not in WARMUP_TYPES:
            # DeepSpeed logs and falls back to "log"; a typo should not silently change the curve.
            raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)  # log(1) = 0 would divide by zero
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linear decay to 0 at ``total_num_steps``.

    After warm-up ``g(t) = max(0, (T - t) / max(1, T - W))`` with ``T = total_num_steps``.

    Args:
        total_num_steps: total optimizer steps (required).
        warmup_min_lr: default ``0.0``. warmup_max_lr: default ``0.001`` (DeepSpeed's, unlike WarmupLR's).
        warmup_num_steps: default ``1000``. warmup_type: ``"log"`` (default) or ``"linear"``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: FloatOrList = 0.0,
        warmup_max_lr: FloatOrList = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        if total_num_steps < warmup_num_steps:
            warnings.warn(
                f"total_num_steps ({total_num_steps}) is less than warmup_num_steps ({warmup_num_steps}): "
                "the LR never reaches warmup_max_lr",
                UserWarning,
                stacklevel=2,
            )
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_DeepSpeedSchedule):
    """Scale each group's LR by a ratio warming up from ``warmup_min_ratio`` to 1, then cosine-decaying to
    ``cos_min_ratio`` at ``total_num_steps``.

    Warm-up: ``r(t) = m + (1 - m) * g(t)`` (``g`` as in :class:`WarmupLR`). Then with
    ``p = min(1, (t - W + 1) / max(1, T - W))``: ``r(t) = max(0, c + (1 - c) * (1 + cos(pi * p)) / 2)``.
    The LR is ``r(t)`` times the group's LR at construction. At construction (``t = -1``) DeepSpeed sets the LR
    to 0, and so do we.

    Args:
        total_num_steps: total optimizer steps (required).
        warmup_min_ratio: default ``0.0``. warmup_num_steps: default ``1000``.
        cos_min_ratio: default ``0.0001``. warmup_type: ``"log"`` (default) or ``"linear"``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        _positive_int(warmup_num_steps, "warmup_num_steps")
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        if warmup_type not in WARMUP_TYPES:
            raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
        if total_num_steps < warmup_num_steps:
            warnings.warn(
                f"total_num_steps ({total_num_steps}) is less than warmup_num_steps ({warmup_num_steps})",
                UserWarning,
                stacklevel=2,
            )
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio_at(self, t: int) -> float:
        """The multiplier of the original LR at DeepSpeed iteration ``t``."""
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            progress = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * progress
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def lrs_at(self, iteration: int) -> list[float]:
        ratio = self.ratio_at(iteration)
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_DeepSpeedSchedule):
    """DeepSpeed's 1-cycle policy: LR rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps, falls back over ``cycle_second_step_size``, then decays; momentum (Adam's
    ``beta1``) moves the opposite way.

    In the cycle (``t < S1 + S2``) with ``x = 1 + (t + 1) / (S1 + S2) - floor(1 + (t + 1) / (S1 + S2))`` the scale is
    ``x / r`` while ``x <= r = S1 / (S1 + S2)`` and ``(x - 1) / (r - 1)`` after, optionally quantised into stair
    steps; ``lr = min + (max - min) * scale`` and ``mom = max_mom - (max_mom - min_mom) * scale``. After the cycle,
    with ``i = (t - S1 - S2 + 1) / decay_step_size``: ``lr = cycle_min_lr / (1 + decay_lr_rate * i)`` and
    ``mom = cycle_max_mom * (1 + decay_mom_rate * i)`` (no decay while ``decay_step_size`` or the rate is 0).

    Momentum cycling needs ``betas`` in the optimizer's defaults (Adam-like); otherwise it is disabled with a
    warning, as in DeepSpeed. Unlike DeepSpeed, which also forces ``beta2`` to 0.99, each group keeps its ``beta2``.

    Args:
        cycle_min_lr, cycle_max_lr: required (numbers or one per group).
        decay_lr_rate: ``0.0``. cycle_first_step_size: ``2000``. cycle_second_step_size: ``None`` (= first).
        cycle_first_stair_count: ``0``. cycle_second_stair_count: ``None`` (= first). decay_step_size: ``0``.
        cycle_momentum: ``True``. cycle_min_mom: ``0.8``. cycle_max_mom: ``0.9``. decay_mom_rate: ``0.0``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: FloatOrList,
        cycle_max_lr: FloatOrList,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: FloatOrList = 0.8,
        cycle_max_mom: FloatOrList = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (
            float(cycle_second_step_size) if cycle_second_step_size is not None else self.first_step_size
        )
        if self.first_step_size <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size!r}")
        if self.second_step_size < 0:
            raise ValueError(f"cycle_second_step_size must be >= 0, got {cycle_second_step_size!r}")
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_mom_rate = float(decay_mom_rate)
        no_decay_steps = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay_steps or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = no_decay_steps or math.isclose(self.decay_mom_rate, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            warnings.warn(
                f"OneCycle: cycle_momentum is disabled because {type(optimizer).__name__} has no 'betas' "
                "(DeepSpeed does the same); pass cycle_momentum=false to silence this",
                UserWarning,
                stacklevel=2,
            )
            self.cycle_momentum = False
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self, t: int) -> float:
        iteration = t + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            position = iteration % self.total_size
            if position <= self.first_step_size:
                stair = position * stairs / self.first_step_size
            else:
                stair = (self.total_size - position) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (iteration - self.total_size + 1) / self.decay_step_size
        return [low / factor for low in self.min_lrs]

    def momenta_at(self, iteration: int) -> list[float]:
        """``beta1`` of every group at DeepSpeed iteration ``iteration``."""
        if iteration < 0:
            return list(self.min_moms)
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (iteration - self.total_size + 1) / self.decay_step_size
        return [high * factor for high in self.max_moms]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, momentum in zip(self.optimizer.param_groups, self.momenta_at(self.last_epoch - 1)):
                group["betas"] = (momentum, group["betas"][1])


class LRRangeTest(_DeepSpeedSchedule):
    """LR range test: grow the LR from ``lr_range_test_min_lr`` to find a good maximum.

    ``lr(t) = min_lr * (1 + step_rate * i)`` with ``i = (t + 1) / step_size``, floored when ``staircase``.

    Args:
        lr_range_test_min_lr: ``1e-3`` (or one per group). lr_range_test_step_size: ``2000``.
        lr_range_test_step_rate: ``1.0``. lr_range_test_staircase: ``False``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: FloatOrList = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1 + self.step_rate * interval) for low in self.min_lrs]


DEEPSPEED_SCHEDULERS = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
