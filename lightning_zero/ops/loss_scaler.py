"""fp16 loss scaling with DeepSpeed's rules, and a one-collective overflow check.

Hand-written because no maintained library provides DeepSpeed's trajectory: ``torch.amp.GradScaler`` grows the scale
after ``growth_interval`` *consecutive* clean steps and has no hysteresis, so a run that switches from DeepSpeed would
see a different scale (and different skipped steps) from the first overflow on.

The rules, as implemented by DeepSpeed's ``deepspeed/runtime/fp16/loss_scaler.py`` ``DynamicLossScaler.update_scale``
(read, not copied; names map ``hysteresis`` -> ``delayed_shift``, ``loss_scale_window`` -> ``scale_window``,
``min_loss_scale`` -> ``min_scale``, ``2**initial_scale_power`` -> ``init_scale``):

[Note: DynamicLossScaler trajectory]
State: ``cur_scale``, ``cur_iter`` (number of updates done, starts at 0), ``last_overflow_iter`` (starts at -1),
``cur_hysteresis`` (starts at ``hysteresis``).

On ``update(overflow=True)``:
  * if ``hysteresis == 1`` or ``cur_hysteresis == 1`` the scale is halved, floored at ``min_loss_scale`` -- unless the
    scale already equals ``min_loss_scale``, which raises :class:`LossScaleAtMinimumError` (state left unchanged);
  * otherwise ``cur_hysteresis`` is decremented and the scale is kept;
  * ``last_overflow_iter = cur_iter``. ``cur_hysteresis`` is *not* refilled by a halving.
On ``update(overflow=False)``:
  * with ``consecutive_hysteresis`` ``cur_hysteresis`` is refilled to ``hysteresis`` on every clean step;
  * ``stable = cur_iter - last_overflow_iter - 1``; when ``stable > 0`` and ``stable % loss_scale_window == 0`` the
    scale doubles and (without ``consecutive_hysteresis``) ``cur_hysteresis`` is refilled.
Then ``cur_iter += 1`` in both cases.

So the first doubling happens on the update whose ``cur_iter`` is ``last_overflow_iter + 1 + loss_scale_window``: at
the very start (``last_overflow_iter = -1``) that is the ``loss_scale_window + 1``-th clean update, and after an
overflow at iteration ``k`` it is the ``loss_scale_window + 1``-th update after it (all clean), and then every
``loss_scale_window`` clean updates.

About the error at the minimum scale: DeepSpeed's ``DynamicLossScaler`` takes ``raise_error_at_min_scale=True`` and
the ZeRO engines build it through ``CreateLossScaler`` without ever overriding it, so a DeepSpeed ZeRO fp16 run always
raises when it must halve a scale that is already at ``min_loss_scale``. We do the same by default and keep the switch
under the same name; with ``raise_error_at_min_scale=False`` the scale stays at the floor and the step is skipped.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from lightning_zero.torch_compat import backend_serving, foreach_norm, local_tensor

__all__ = ["DynamicLossScaler", "LossScaleAtMinimumError", "StaticLossScaler", "has_overflow"]


class LossScaleAtMinimumError(RuntimeError):
    """An overflow happened while the dynamic loss scale was already at ``min_loss_scale``."""


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


class StaticLossScaler:
    """A fixed loss scale (DeepSpeed's ``"loss_scale": <value> > 0``); overflowing steps are still skipped and counted.

    Args:
        scale: the factor the loss is multiplied by before ``backward``. ``1.0`` means no scaling (bf16/fp32).
    """

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self._scale = _check_positive_number("scale", scale)
        self.cur_iter = 0
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self._scale

    loss_scale = scale  # DeepSpeed's name for the same value

    def update(self, overflow: bool) -> None:
        """Record one optimizer step attempt; ``overflow=True`` means it was skipped. The scale never changes."""
        if overflow:
            self.skipped_steps += 1
        self.cur_iter += 1

    update_scale = update  # DeepSpeed's name

    def state_dict(self) -> dict:
        """JSON-serialisable state: the scale and the counters."""
        return {
            "kind": "static",
            "cur_scale": self._scale,
            "cur_iter": self.cur_iter,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters. The scale given to the constructor wins; a different saved scale is an error."""
        if state.get("kind") != "static":
            raise ValueError(f"cannot load a {state.get('kind')!r} loss-scaler state into a StaticLossScaler")
        if float(state["cur_scale"]) != self._scale:
            raise ValueError(
                f"checkpoint was saved with static loss scale {state['cur_scale']} but this run uses {self._scale}; "
                "a static scale is part of the configuration, pass the same loss_scale to resume"
            )
        self.cur_iter = int(state["cur_iter"])
        self.skipped_steps = int(state["skipped_steps"])


class DynamicLossScaler:
    """DeepSpeed's dynamic fp16 loss scaler (``"loss_scale": 0``), step-for-step identical to
    ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``. See the module note for the rules.

    Args:
        initial_scale_power: the scale starts at ``2**initial_scale_power``.
        loss_scale_window: clean updates since the last overflow before the scale doubles.
        hysteresis: overflows tolerated (``hysteresis - 1`` of them keep the scale) before halving.
        consecutive_hysteresis: refill the hysteresis on every clean update instead of only when the scale doubles.
        min_loss_scale: floor of the scale.
        raise_error_at_min_scale: raise :class:`LossScaleAtMinimumError` when an overflow asks to halve a scale that
            is already at ``min_loss_scale`` (DeepSpeed's default and the only behaviour of its ZeRO engines).
    """

    dynamic = True
    scale_factor = 2.0

    def __init__(
        self,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        self.initial_scale_power = _check_int("initial_scale_power", initial_scale_power, 0)
        self.loss_scale_window = _check_int("loss_scale_window", loss_scale_window, 1)
        # hysteresis=0 would make DeepSpeed decrement forever and never halve: reject it instead.
        self.hysteresis = _check_int("hysteresis", hysteresis, 1)
        if not isinstance(consecutive_hysteresis, bool):
            raise TypeError(f"consecutive_hysteresis must be a bool, got {consecutive_hysteresis!r}")
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_loss_scale = _check_positive_number("min_loss_scale", min_loss_scale)
        if not isinstance(raise_error_at_min_scale, bool):
            raise TypeError(f"raise_error_at_min_scale must be a bool, got {raise_error_at_min_scale!r}")
        self.raise_error_at_min_scale = raise_error_at_min_scale
        initial = float(2**initial_scale_power)
        if initial < self.min_loss_scale:
            raise ValueError(
                f"the initial scale 2**initial_scale_power = {initial} is below min_loss_scale = {min_loss_scale}; "
                "raise initial_scale_power or lower min_loss_scale"
            )
        self.cur_scale = initial
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = hysteresis
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self.cur_scale

    @property
    def loss_scale(self) -> float:
        """DeepSpeed's name for :attr:`scale`."""
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step attempt. ``overflow=True`` means gradients were non-finite and the step was
        skipped. Raises :class:`LossScaleAtMinimumError` (before changing any state) when the scale must halve but
        is already at ``min_loss_scale`` and ``raise_error_at_min_scale`` is set."""
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_loss_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16 gradients overflowed (inf/NaN) at step attempt {self.cur_iter} while the dynamic loss "
                        f"scale is already at its minimum min_loss_scale={self.min_loss_scale:g}: the model produces "
                        "non-finite gradients even unscaled. Lower the learning rate, check the data for inf/NaN, "
                        "use bf16, or lower min_loss_scale."
                    )
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_loss_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
            self.skipped_steps += 1
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable_interval = self.cur_iter - self.last_overflow_iter - 1
            if stable_interval > 0 and stable_interval % self.loss_scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    update_scale = update  # DeepSpeed's name

    def state_dict(self) -> dict:
        """JSON-serialisable state (plain ints, floats, bools): the trajectory state, the counters, and the
        configuration it was produced with (informational)."""
        return {
            "kind": "dynamic",
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "skipped_steps": self.skipped_steps,
            "config": {
                "initial_scale_power": self.initial_scale_power,
                "loss_scale_window": self.loss_scale_window,
                "hysteresis": self.hysteresis,
                "consecutive_hysteresis": self.consecutive_hysteresis,
                "min_loss_scale": self.min_loss_scale,
                "raise_error_at_min_scale": self.raise_error_at_min_scale,
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the trajectory state. The configuration given to the constructor wins (so a resumed run may change
        ``loss_scale_window`` etc.), as with DeepSpeed's engine config; ``cur_hysteresis`` is capped at the new
        ``hysteresis`` and the scale floored at the new ``min_loss_scale``."""
        if state.get("kind") != "dynamic":
            raise ValueError(f"cannot load a {state.get('kind')!r} loss-scaler state into a DynamicLossScaler")
        self.cur_scale = max(float(state["cur_scale"]), self.min_loss_scale)
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = min(int(state["cur_hysteresis"]), self.hysteresis)
        self.skipped_steps = int(state["skipped_steps"])


def has_overflow(tensors: Iterable[Optional[torch.Tensor]], group: Optional[dist.ProcessGroup] = None) -> bool:
    """True when any element of any given tensor (gradients, possibly DTensor shards; ``None`` entries are ignored) is
    inf or NaN on *any* rank of ``group`` (default: the world when a process group is initialised).

    One max-norm per device/dtype bucket (``torch._foreach_norm`` with ``ord=inf`` propagates inf and NaN and never
    overflows, unlike the ``sum`` DeepSpeed uses) and exactly one ``all_reduce(MAX)`` of a single flag. Every rank of
    ``group`` must call it, even with no tensors (e.g. an empty shard)."""
    local = [local_tensor(t) for t in tensors if t is not None]
    local = [t for t in local if t.numel() > 0]
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if local:
        device = local[0].device
    elif distributed and backend_serving("cpu", group) is None:  # NCCL alone: the flag must be a CUDA tensor
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    flag = torch.zeros((), dtype=torch.float32, device=device)
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for t in local:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    for bucket in buckets.values():
        norms = torch.stack(foreach_norm(bucket, float("inf"))).float()
        bad = (~torch.isfinite(norms)).any().float()
        flag = torch.maximum(flag, bad.to(device))
    if distributed:
        from lightning_zero.diagnostics.timing import collective_timer

        with collective_timer().record("overflow_check"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)
