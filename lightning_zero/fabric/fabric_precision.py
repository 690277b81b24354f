"""Precision under the Fabric ZeroStrategy: the shared
:class:`~lightning_zero.adapters.precision_policy.ZeroPrecisionPolicy` (fp32 master weights, low-precision compute,
DeepSpeed's fp16 loss scaling; the Trainer's ``ZeroPrecision`` is the same policy) behind Fabric's plugin calls.

Fabric drives precision differently from the Trainer: ``fabric.backward(loss)`` calls ``backward(tensor, module)``
without an optimizer, ``fabric.clip_gradients`` runs *before* ``optimizer.step()`` and asks the plugin to
``unscale_gradients`` first, and ``optimizer.step()`` reaches ``optimizer_step(optimizer)`` without a closure. The
fp16 step of the Trainer's note therefore runs at the first of ``unscale_gradients`` (clipping) or
``optimizer_step``: one ``all_reduce(MAX)`` decides overflow, gradients are divided by the scale (so clipping sees
true gradients) or dropped, and ``optimizer_step`` skips the step after an overflow.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_zero.adapters.precision_policy import (
    SUPPORTED_PRECISIONS,
    PrecisionFlag,
    ZeroPrecisionPolicy,
    check_no_second_setting,
)
from lightning_zero.distributed.replicas import clip_replica_grads
from lightning_zero.fabric import fabric_pipeline


class FabricZeroPrecision(ZeroPrecisionPolicy, Precision):
    """:class:`ZeroPrecisionPolicy` with Fabric's call signatures (see the module docstring).

    Args: as :class:`ZeroPrecisionPolicy`. Pass it as ``Fabric(plugins=FabricZeroPrecision("16-mixed"))`` to train fp16
    on a CPU (Fabric's connector turns ``precision="16-mixed"`` into ``bf16-mixed`` there).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unscaled: dict[int, bool] = {}  # id(optimizer) -> overflow, for the step that follows clipping
        self.lost_peer = None  # the strategy's LostPeer: a forward whose collective met a dead peer names it

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Fabric runs the module's forward inside this (``_FabricModule.forward``)."""
        with super().forward_context():
            if self.lost_peer is None:
                yield
            else:
                with self.lost_peer.naming():
                    yield

    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        return tensor  # Fabric drops what pre_backward returns: the loss is scaled in backward

    def backward(self, tensor: torch.Tensor, model, *args: Any, **kwargs: Any) -> None:
        self._unscaled.clear()  # new (scaled) gradients: an unscale recorded before them no longer holds
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
        tensor.backward(*args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        return tensor

    def convert_output(self, data: Any) -> Any:
        # As Fabric's MixedPrecision: the loss is computed outside the model in the default dtype.
        if self.low_dtype is None:
            return data
        return apply_to_collection(
            data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=torch.get_default_dtype()
        )

    def unscale_gradients(self, optimizer) -> None:
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self._unscaled[id(optimizer)] = self._skip_on_overflow(None, optimizer)

    def clip_norm(
        self, optimizer, runner: Any, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        """``fabric.clip_gradients(max_norm=...)``: the global norm over every rank, after unscaling fp16 gradients
        (as DeepSpeed before clipping). Stage-1 optimizers clip the whole module's (all-reduced) gradients, sharded
        stages their DTensor shards (``clip_grad_norm_`` reduces the norm across the mesh), a pipeline ``runner``
        every stage's (:func:`lightning_zero.fabric.fabric_pipeline.clip`), bf16 replicas in fp32."""
        self.unscale_gradients(optimizer)
        params = list(self.main_params(optimizer))
        if runner is not None:
            return fabric_pipeline.clip(runner, params, max_norm, norm_type, error_if_nonfinite)
        if self.replicas_cast:
            return clip_replica_grads(params, max_norm, norm_type, error_if_nonfinite)
        norm = torch.nn.utils.clip_grad_norm_(
            params, max_norm=max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "ZeroStrategy does not support LBFGS (its closure re-evaluation bypasses the partitioned "
                "step and the fp16 overflow check)"
            )
        self.last_step_skipped = False
        if self.scaler is not None:
            self.unscale_gradients(optimizer)
            if self._unscaled.pop(id(optimizer)):
                self.last_step_skipped = True
                return None
        return optimizer.step(**kwargs)


def adapt_fabric_precision(plugin, settings: Any, lost_peer: Any = None) -> FabricZeroPrecision:
    """Turn the plugin Fabric chose for ``precision=`` (``Precision``, ``MixedPrecision``, ``HalfPrecision``) into a
    :class:`FabricZeroPrecision` with the strategy's ``settings`` (``ZeroSettings``: stage, reduce dtype, loss
    scaling) and ``LostPeer`` (the calls that may meet a dead peer name it); any other plugin (fp64, bitsandbytes,
    Transformer Engine, FSDP's, ...) is refused."""
    stage, communication_data_type = settings.zero_config.stage, settings.communication_data_type
    loss_scale_config, fp16_loss_scale_config = settings.loss_scale_config, settings.fp16_loss_scale_config
    if isinstance(plugin, FabricZeroPrecision):
        check_no_second_setting(plugin, loss_scale_config, communication_data_type)
        plugin.stage, plugin.lost_peer = stage, lost_peer
        return plugin
    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision

    flag = getattr(plugin, "precision", None)
    known = (Precision, MixedPrecision, HalfPrecision, PrecisionFlag)
    if type(plugin) not in known or flag not in SUPPORTED_PRECISIONS:
        raise NotImplementedError(
            f"the Fabric ZeroStrategy supports precision in {SUPPORTED_PRECISIONS}; {type(plugin).__name__} "
            f"(precision={flag!r}) is not implemented (fp64, bitsandbytes and Transformer Engine have no ZeRO path "
            "here)"
        )
    if isinstance(plugin, MixedPrecision) and plugin.scaler is not None and flag != "16-mixed":
        raise ValueError("a MixedPrecision plugin with a GradScaler is only meaningful for 16-mixed")
    scaling = fp16_loss_scale_config if flag.startswith("16-") else loss_scale_config
    adapted = FabricZeroPrecision(
        flag, loss_scale_config=scaling, communication_data_type=communication_data_type, stage=stage
    )
    adapted.lost_peer = lost_peer  # the module's forward runs in its forward_context, and names a dead peer
    return adapted
