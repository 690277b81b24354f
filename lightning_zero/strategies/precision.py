"""Precision plugins ZeroStrategy accepts.

Lightning picks a precision plugin from the Trainer's ``precision`` flag and hands it to the strategy; the strategy
adapts it here instead of silently running something else. Mixed and low precision (fp16 loss scaling, bf16 with
fp32 masters) belong to the precision issue and are refused with a message until they land.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.plugins.precision import Precision

from lightning_zero.distributed.optimizer import get_sharding

PRECISION_NOT_AVAILABLE = (
    "ZeroStrategy supports precision='32-true' today; {flag!r} (fp16 loss scaling, bf16 with fp32 master weights) "
    "is tracked by the mixed-precision issue and not implemented yet."
)


class ZeroPrecision(Precision):
    """fp32 training under ZeroStrategy.

    Differs from Lightning's ``Precision`` in two ways the partitioned optimizers need: clipping reads the module's
    parameters of each optimizer (a stage-1 optimizer holds only its own partition, an offloaded one CPU masters),
    and the closure runs before ``optimizer.step()`` so the offload pre-step hook sees finished gradients.
    """

    precision = "32-true"

    def main_params(self, optimizer):
        sharding = get_sharding(optimizer)
        if sharding is not None:
            return sharding.all_model_params()
        return super().main_params(optimizer)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("ZeroStrategy runs the closure once before the optimizer step, which LBFGS (which "
                            "re-evaluates the closure) cannot use")
        closure_result = self._wrap_closure(model, optimizer, closure)
        skipped_backward = closure_result is None
        automatic = getattr(model, "automatic_optimization", True)
        if not automatic or not skipped_backward:
            return optimizer.step(**kwargs)
        return closure_result

    def fsdp_mp_policy(self):
        """The FSDP2 ``MixedPrecisionPolicy`` for stages 2-3 (none in fp32)."""
        return None


def adapt_precision_plugin(plugin: Precision) -> Precision:
    if isinstance(plugin, ZeroPrecision):
        return plugin
    if type(plugin) is Precision:  # Lightning's choice for precision="32-true"
        return ZeroPrecision()
    flag = getattr(plugin, "precision", type(plugin).__name__)
    raise NotImplementedError(PRECISION_NOT_AVAILABLE.format(flag=flag))
