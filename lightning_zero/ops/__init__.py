"""Hand-written numerics that no maintained library provides in the form ZeRO needs (loss scaling, fused optimizers).

Everything here is framework-free: plain ``torch.optim.Optimizer`` subclasses and small classes usable without
Lightning. See ``docs/ops.md``.
"""

from lightning_zero.ops.cpu_adam import CPUAdam
from lightning_zero.ops.fused_adam import FusedAdam
from lightning_zero.ops.fused_lamb import FusedLamb
from lightning_zero.ops.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError, StaticLossScaler, has_overflow

__all__ = [
    "CPUAdam",
    "DynamicLossScaler",
    "FusedAdam",
    "FusedLamb",
    "LossScaleAtMinimumError",
    "StaticLossScaler",
    "has_overflow",
]
