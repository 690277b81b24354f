"""Precision under ZeroStrategy: fp32 master weights, low-precision compute, DeepSpeed's fp16 loss scaling.

The framework-neutral half, shared by both adapters: the Trainer's
:class:`~lightning_zero.strategies.trainer_precision.ZeroPrecision` and Fabric's
:class:`~lightning_zero.fabric.fabric_precision.FabricZeroPrecision` are :class:`ZeroPrecisionPolicy` over their
framework's ``Precision`` base, and add only their framework's call signatures. Every flag keeps DeepSpeed's
memory model: the weights the optimizer steps and its states are fp32, compute
runs in the low dtype.

==============  =====================================================  ============================================
flag            stages 0-1 (DDP)                                       stages 2-3 (FSDP2)
==============  =====================================================  ============================================
``32-true``     fp32                                                   fp32
``bf16-mixed``  fp32 parameters (the masters), forward under           sharded fp32 parameters (the masters),
``16-mixed``    ``torch.autocast`` in the low dtype                    gathered as low-precision copies
                                                                       (``MixedPrecisionPolicy``) and the forward
                                                                       under ``torch.autocast``
``bf16-true``   bf16 parameters (the replicas DDP reduces, inputs      as ``*-mixed`` without autocast: every op
                cast to bf16) and fp32 masters beside the optimizer    runs in the low dtype
                (:mod:`lightning_zero.distributed.replicas`): every
                op in bf16, as at stages 2-3 and in DeepSpeed
``16-true``     as ``*-mixed`` (the loss scale comes off fp32
                gradients)
==============  =====================================================  ============================================

Bytes per parameter are those of DeepSpeed's ``2 + 2 + 12`` model spread differently: fp32 parameter (4, the master)
+ fp32 gradient (4) + Adam's two fp32 moments (8) = 16, divided by the world size at stages 2-3, plus the transient
low-precision copy that compute reads. At stage 1, which partitions only the optimizer states, that split holds
``8P + 8P/N`` per rank under ``*-mixed`` and ``16-true``; ``bf16-true`` holds DeepSpeed's ZeRO-1 split,
``4P + 12P/N`` (``estimate/model_states.py``, ``[Note: ZeroStrategy's bytes under mixed precision]``).

fp16 flags scale the loss with DeepSpeed's rules (:class:`~lightning_zero.ops.DynamicLossScaler`, or a static scale):

[Note: the fp16 step]
1. ``backward`` runs on ``loss * scale``;
2. one ``all_reduce(MAX)`` over every rank decides whether any gradient shard is inf/NaN
   (:func:`~lightning_zero.ops.has_overflow`);
3. overflow: the scaler records it, every gradient is dropped, the optimizer does not step (weights and optimizer
   states stay bit-identical) and the step-interval LR schedulers do not step either (the Trainer's
   ``guard_schedulers``);
4. otherwise gradients are divided by the scale in fp32 *before* clipping and the optimizer steps.
``loss_scale`` and ``skipped_steps`` are logged each step; the scaler's state travels in checkpoints (plain numbers,
loadable with ``weights_only=True``).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Generator, Optional, Union

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_zero.distributed.config import COMMUNICATION_DATA_TYPES
from lightning_zero.distributed.optimizer import get_sharding
from lightning_zero.distributed.replicas import replica_dtype
from lightning_zero.ops.loss_scaler import DynamicLossScaler, StaticLossScaler, has_overflow
from lightning_zero.torch_compat import foreach_mul_, local_tensor

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_LOW_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


class PrecisionFlag:
    """A stand-in for the plugin the framework would have chosen for a ``precision`` flag (a ds_config's precision,
    adopted at setup): each adapter turns it into its ``ZeroPrecisionPolicy`` plugin like the framework's own
    choice, reading only ``precision``."""

    def __init__(self, precision: str) -> None:
        self.precision = precision


@dataclass(frozen=True)
class LossScaleConfig:
    """DeepSpeed's fp16 loss-scale knobs, with DeepSpeed's names and defaults.

    Args:
        loss_scale: ``0`` for dynamic scaling, a positive number for a static scale (DeepSpeed's meaning).
        initial_scale_power: the dynamic scale starts at ``2**initial_scale_power``.
        loss_scale_window: clean steps since the last overflow before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
        consecutive_hysteresis: refill the hysteresis on every clean step.
        min_loss_scale: floor of the dynamic scale; an overflow at the floor raises ``LossScaleAtMinimumError``.
    """

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.loss_scale, bool) or not isinstance(self.loss_scale, (int, float)) or self.loss_scale < 0:
            raise ValueError(f"loss_scale must be 0 (dynamic) or a positive static scale, got {self.loss_scale!r}")
        self.make_scaler()  # the scalers validate the remaining knobs with clear messages

    def make_scaler(self) -> Union[DynamicLossScaler, StaticLossScaler]:
        if self.loss_scale > 0:
            return StaticLossScaler(self.loss_scale)
        return DynamicLossScaler(
            initial_scale_power=self.initial_scale_power,
            loss_scale_window=self.loss_scale_window,
            hysteresis=self.hysteresis,
            consecutive_hysteresis=self.consecutive_hysteresis,
            min_loss_scale=self.min_loss_scale,
        )


def parse_communication_data_type(value: Optional[str]) -> Optional[torch.dtype]:
    """``"fp32"``/``"bf16"``/``"fp16"`` (DeepSpeed's ``communication_data_type``) or ``None`` (fp32 reduction)."""
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in COMMUNICATION_DATA_TYPES:
        raise ValueError(
            f"communication_data_type must be one of {sorted(COMMUNICATION_DATA_TYPES)} or None, got {value!r}"
        )
    return COMMUNICATION_DATA_TYPES[value.lower()]


def _low_dtype(precision: str) -> Optional[torch.dtype]:
    return _LOW_DTYPES.get(precision.split("-")[0])


class ZeroPrecisionPolicy:
    """What ZeroStrategy's precision means, whichever framework drives it: the dtypes handed to the engines, the
    autocast context, and steps 2-4 of the fp16 note. A mixin: put it before the framework's ``Precision`` base, whose
    ``main_params`` it falls back to.

    Args:
        precision: one of ``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``16-true``.
        loss_scale_config: fp16 loss scaling (default: DeepSpeed's dynamic defaults); an error with bf16/fp32.
        communication_data_type: dtype of the gradient reduction (``None``: fp32).
        stage: the ZeRO stage (set by the strategy).
    """

    def __init__(
        self,
        precision: str = "32-true",
        loss_scale_config: Optional[LossScaleConfig] = None,
        communication_data_type: Optional[str] = None,
        stage: int = 2,
    ) -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(f"ZeroStrategy supports precision in {SUPPORTED_PRECISIONS}, got {precision!r}")
        self.precision = precision
        self.low_dtype = _low_dtype(precision)
        self.fp16 = self.low_dtype is torch.float16
        if loss_scale_config is not None and not self.fp16:
            raise ValueError(
                f"loss scaling applies to fp16 training only; precision={precision!r} does not use it. "
                "Drop the loss-scale arguments or use precision='16-mixed'/'16-true'."
            )
        self.loss_scale_config = loss_scale_config or (LossScaleConfig() if self.fp16 else None)
        self.scaler = self.loss_scale_config.make_scaler() if self.fp16 else None
        self.communication_data_type = communication_data_type
        self.reduce_dtype = parse_communication_data_type(communication_data_type)
        self.stage = stage
        self.device_type = "cpu"  # the strategy sets the compute device's type at setup
        self.grad_norm_clipper = None  # the strategy's global-norm clipping for pipelines (params, max_norm)
        self.last_step_skipped = False
        self.replicas_cast = False  # the module holds bf16 replicas: no autocast, inputs cast (wrap_module_kwargs)
        self.fp32_values: dict = {}  # their fp32 values, from step 3 until step 4 takes them (replica_fp32_values)

    # ------------------------------------------------------------------ what the engines are given
    def fsdp_mp_policy(self):
        """The FSDP2 ``MixedPrecisionPolicy`` for stages 2-3 (``None`` in plain fp32)."""
        if self.low_dtype is None and self.reduce_dtype in (None, torch.float32):
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.low_dtype, reduce_dtype=self.reduce_dtype or torch.float32)

    def init_dtype(self) -> Optional[torch.dtype]:
        """The default dtype the model is built under: the low dtype of a ``*-true`` flag, as Lightning's
        ``HalfPrecision.module_init_context``; the build then makes the parameters fp32 masters
        (``[Note: the build under bf16-true]`` in :mod:`lightning_zero.distributed.exact_init`)."""
        return self.low_dtype if self.precision.endswith("-true") else None

    def ddp_reduce_dtype(self, replicas: bool = False) -> Optional[torch.dtype]:
        """The gradient all-reduce dtype at stages 0-1 when it is not the parameters' (fp32 over bf16 ``replicas``)."""
        if replicas:
            return self.reduce_dtype or torch.float32
        return self.reduce_dtype if self.reduce_dtype not in (None, torch.float32) else None

    def wrap_module_kwargs(self, config) -> dict[str, Any]:
        """What step 3 (:func:`~lightning_zero.distributed.runtime.wrap_module`) takes from the precision for a run of
        ``config`` (its ``ZeroConfig``): FSDP2's policy, DDP's reduction dtype, and under ``bf16-true`` at stages 0-1
        the replicas' dtype with the dict their fp32 values go to, kept for step 4 (:meth:`replica_fp32_values`;
        :mod:`lightning_zero.distributed.replicas`)."""
        dtype = replica_dtype(
            self.precision, self.stage, config.offloads_optimizer_only and config.swaps_optimizer_states
        )
        self.replicas_cast = dtype is not None
        return dict(
            mp_policy=self.fsdp_mp_policy(),
            reduce_dtype=self.ddp_reduce_dtype(self.replicas_cast),
            replica_dtype=dtype,
            fp32_values=self.fp32_values,
        )

    def replica_fp32_values(self) -> Optional[dict]:
        """What step 4 (:func:`~lightning_zero.distributed.runtime.shard_optimizer_of`) makes masters of: the fp32
        values step 3 kept, when the module holds bf16 replicas; ``None`` otherwise."""
        return self.fp32_values if self.replicas_cast else None

    def convert_input(self, data: Any) -> Any:
        """Floating inputs in bf16 where the module holds bf16 replicas (as DeepSpeed's bf16 engine and FSDP2's
        ``param_dtype`` cast them)."""
        if not self.replicas_cast:
            base = getattr(super(), "convert_input", None)  # the framework's Precision, when mixed in
            return data if base is None else base(data)
        return apply_to_collection(data, torch.Tensor, lambda x: x.to(self.low_dtype) if x.is_floating_point() else x)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        autocast = self.low_dtype is not None and (
            self.precision.endswith("-mixed") or (self.stage <= 1 and not self.replicas_cast)
        )
        if not autocast:
            with nullcontext():
                yield
            return
        with torch.autocast(self.device_type, dtype=self.low_dtype):
            yield

    # ------------------------------------------------------------------ loss scaling
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def main_params(self, optimizer):
        sharding = get_sharding(optimizer)
        if sharding is not None:
            return sharding.all_model_params()
        return super().main_params(optimizer)

    def _skip_on_overflow(self, model, optimizer) -> bool:
        """Steps 2-4 of the fp16 note: True when the step must be skipped (gradients already dropped)."""
        params = list(self.main_params(optimizer))  # the module's parameters, not a stage-1 partition
        grads = [p.grad for p in params if p.grad is not None]
        scale = self.scaler.scale  # what backward multiplied by; update() may change it
        overflow = has_overflow(grads)
        self.scaler.update(overflow)  # raises LossScaleAtMinimumError at the floor, as DeepSpeed does
        if overflow:
            self.last_step_skipped = True
            for param in params:
                param.grad = None
        else:
            inverse = 1.0 / scale
            local = [local_tensor(g) for g in grads]
            if local:
                foreach_mul_(local, inverse)
        self._log_scaler(model)
        return overflow

    def _log_scaler(self, model) -> None:
        log = getattr(model, "log", None)
        if log is None or getattr(model, "_current_fx_name", None) is None:
            return
        log("loss_scale", float(self.scaler.scale), on_step=True, on_epoch=False, rank_zero_only=True)
        log("skipped_steps", float(self.scaler.skipped_steps), on_step=True, on_epoch=False, rank_zero_only=True)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("loss_scaler")
        if saved is not None and self.scaler is not None:
            self.scaler.load_state_dict(saved)


def loss_scale_configs(config_scaling: dict, **given) -> tuple[Optional[LossScaleConfig], Optional[LossScaleConfig]]:
    """The loss-scale configs from the strategy's explicit knobs (``given``, ``None`` = not set) and a ds_config's
    fp16 section (``config_scaling``): ``(explicit only, explicit over config)``. The second applies once the
    precision is fp16 (a config may switch fp16 on at setup); explicit knobs win over the config's."""
    given = {key: value for key, value in given.items() if value is not None}
    explicit = LossScaleConfig(**given) if given else None
    merged = {**config_scaling, **given}
    return explicit, (LossScaleConfig(**merged) if merged else None)


def check_no_second_setting(plugin, loss_scale_config, communication_data_type) -> None:
    """A ZeRO precision plugin passed by the user and the strategy's own loss-scale/``communication_data_type``
    arguments must not both set them: which one would win is not obvious, so neither is chosen silently."""
    clash = (loss_scale_config is not None and loss_scale_config != plugin.loss_scale_config) or (
        communication_data_type is not None and communication_data_type != plugin.communication_data_type
    )
    if clash:
        raise ValueError(
            f"both the {type(plugin).__name__} plugin and ZeroStrategy set loss scaling or "
            "communication_data_type: set them in one place"
        )
