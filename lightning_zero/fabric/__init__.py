"""The Fabric adapter (:class:`ZeroStrategy`) and the helpers both adapters share (:mod:`.settings`).

``import lightning_zero`` registers the Trainer strategy's names (``zero``, ``zero_stage_1``, ``zero_stage_2``,
``zero_stage_2_offload``, ``zero_stage_3``, ``zero_stage_3_offload``) in Fabric's strategy registry too, so
``Fabric(strategy="zero_stage_3")`` works. For ``fabric run --strategy ...`` see :mod:`lightning_zero.fabric.__main__`.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_zero.fabric.fabric_precision import FabricZeroPrecision
from lightning_zero.fabric.fabric_strategy import ZeroStrategy

ZeroStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["FabricZeroPrecision", "ZeroStrategy"]
