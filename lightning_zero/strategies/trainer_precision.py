"""The Trainer's precision plugin under ZeroStrategy: :class:`ZeroPrecision` is the shared
:class:`~lightning_zero.adapters.precision_policy.ZeroPrecisionPolicy` (what each flag means per stage, the fp16 step:
see that module) behind Lightning's Trainer ``Precision`` hooks.

Lightning picks a precision plugin from the Trainer's ``precision`` flag and hands it to the strategy; the strategy
turns it into a :class:`ZeroPrecision` here (:func:`adapt_precision_plugin`) instead of silently running something
else. Trainer-only here: the loss scaled in ``pre_backward``, clipping through the partitioned optimizers, the
closure run before ``optimizer.step()``, and LR schedulers that skip with a skipped fp16 step
(:func:`guard_schedulers`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.plugins.precision import Precision

from lightning_zero.adapters.precision_policy import (  # noqa: F401  (LossScaleConfig: the package's public name)
    SUPPORTED_PRECISIONS,
    LossScaleConfig,
    ZeroPrecisionPolicy,
    check_no_second_setting,
)
from lightning_zero.distributed.apply_zero import refuse_parameter_gradient_hooks
from lightning_zero.distributed.ddp import average_unfrozen_gradients
from lightning_zero.distributed.replicas import clip_replica_grads


class ZeroPrecision(ZeroPrecisionPolicy, Precision):
    """The precision plugin ZeroStrategy runs with; see the module docstring for what each flag means per stage.

    Args:
        precision: one of ``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``16-true``.
        loss_scale_config: fp16 loss scaling (default: DeepSpeed's dynamic defaults); an error with bf16/fp32.
        communication_data_type: dtype of the gradient reduction (``None``: fp32).
        stage: the ZeRO stage (set by the strategy).

    Also differs from Lightning's ``Precision`` in ways the partitioned optimizers need: clipping reads the module's
    parameters of each optimizer (a stage-1 optimizer holds only its own partition, an offloaded one CPU masters),
    and the closure runs before ``optimizer.step()`` so the offload pre-step hook sees finished gradients.
    """

    # ------------------------------------------------------------------ Trainer hooks
    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
        return super().pre_backward(tensor, module)

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        if self.grad_norm_clipper is not None:  # a pipeline's: the norm over every stage
            self.grad_norm_clipper(self.main_params(optimizer), clip_val)
        elif self.replicas_cast:  # bf16 replicas' gradients: the norm in fp32
            clip_replica_grads(self.main_params(optimizer), clip_val)
        else:
            super().clip_grad_by_norm(optimizer, clip_val)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "ZeroStrategy runs the closure once before the optimizer step, which LBFGS (which "
                "re-evaluates the closure) cannot use"
            )
        self.last_step_skipped = False
        closure_result = closure()
        automatic = getattr(model, "automatic_optimization", True)
        if automatic and closure_result is None:
            return None  # training_step returned None: Lightning skips backward and the step
        if self.stage <= 1:  # recorded for DDP only: see [Note: parameters DDP does not reduce]
            average_unfrozen_gradients(model)
        if self.scaler is not None and self._skip_on_overflow(model, optimizer):
            return closure_result
        if not getattr(self, "_gradient_hooks_checked", False):  # once: hooks added after setup (on_fit_start)
            refuse_parameter_gradient_hooks(model, sharded_only=True)
            self._gradient_hooks_checked = True
        self._after_closure(model, optimizer)
        return optimizer.step(**kwargs)


def guard_schedulers(scheduler_configs, precision: ZeroPrecision) -> None:
    """Make the step-interval LR schedulers skip the ``step()`` that follows a skipped fp16 optimizer step.

    DeepSpeed steps its scheduler only when the optimizer stepped; Lightning steps schedulers after every optimizer
    step. The scheduler's class is swapped for a subclass whose ``step`` asks the precision plugin first: an instance
    attribute would land in ``scheduler.state_dict()`` (it returns ``__dict__``) and from there in the checkpoint.
    """
    if precision.scaler is None:
        return
    for config in scheduler_configs:
        scheduler = config.scheduler
        if config.interval != "step" or getattr(type(scheduler), "_lightning_zero_guarded", False):
            continue
        base = type(scheduler)

        def step(self, *args: Any, _base=base, **kwargs: Any) -> Any:
            if precision.last_step_skipped:
                return None
            return _base.step(self, *args, **kwargs)

        scheduler.__class__ = type(
            base.__name__, (base,), {"step": step, "_lightning_zero_guarded": True, "__module__": base.__module__}
        )


def adapt_precision_plugin(plugin: Precision, settings: Any) -> Precision:
    """Turn the plugin Lightning chose for the Trainer's ``precision`` into a :class:`ZeroPrecision`, with the
    strategy's ``settings`` (``ZeroSettings``): its stage, reduce dtype and loss scaling (an fp16 flag's takes the
    ds_config's ``fp16`` section under the explicit knobs; a ``ZeroPrecision`` given by the user, the knobs only)."""
    stage, communication_data_type = settings.zero_config.stage, settings.communication_data_type
    loss_scale_config = settings.loss_scale_config
    if isinstance(plugin, ZeroPrecision):
        check_no_second_setting(plugin, loss_scale_config, communication_data_type)
        plugin.stage = stage
        return plugin
    if str(getattr(plugin, "precision", "")).startswith("16-"):
        loss_scale_config = settings.fp16_loss_scale_config
    flag = str(getattr(plugin, "precision", ""))
    if flag not in SUPPORTED_PRECISIONS:
        raise NotImplementedError(
            f"ZeroStrategy supports precision in {SUPPORTED_PRECISIONS}; {flag or type(plugin).__name__!r} is not "
            "implemented (fp64 and Transformer Engine have no ZeRO path here)."
        )
    return ZeroPrecision(
        flag, loss_scale_config=loss_scale_config, communication_data_type=communication_data_type, stage=stage
    )
