"""Lightning adapters over :mod:`lightning_zero.distributed`."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.strategies.trainer_precision import LossScaleConfig, ZeroPrecision
from lightning_zero.strategies.trainer_strategy import ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = ["LossScaleConfig", "ZeroPrecision", "ZeroStrategy"]
