"""Build the optimizer and LR scheduler named in a ds_config's ``"optimizer"`` / ``"scheduler"`` sections.

Used when the LightningModule defines no ``configure_optimizers``. Names and parameters follow DeepSpeed:

* ``Adam``/``AdamW`` (case-insensitive). DeepSpeed's ``adam_w_mode`` defaults to ``true``, so ``"Adam"`` means
  **decoupled weight decay (AdamW)** unless ``"adam_w_mode": false``; ``"AdamW"`` is always decoupled.
  ``"torch_adam": true`` selects ``torch.optim.Adam``/``AdamW`` (``foreach`` passed through); otherwise
  :class:`lightning_zero.ops.fused_adam.FusedAdam`, our counterpart of DeepSpeed's FusedAdam/DeepSpeedCPUAdam.
* ``Lamb``: :class:`lightning_zero.ops.fused_lamb.FusedLamb` (DeepSpeed's FusedLamb arguments).
* any other ``torch.optim`` class name (``SGD``, ``Adagrad``, ``RMSprop``...), matched case-insensitively.
* schedulers: the five of :mod:`lightning_zero.ops.lr_schedules`, or any ``torch.optim.lr_scheduler`` class name.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Mapping, Optional

import torch

from lightning_zero.ds_config.loading import DeepSpeedConfigError
from lightning_zero.ops.lr_schedules import DEEPSPEED_SCHEDULERS

# DeepSpeed optimizers that have no counterpart here, and why.
_UNSUPPORTED_OPTIMIZERS = {
    "onebitadam": "1-bit Adam needs DeepSpeed's compressed communication backend",
    "zerooneadam": "0/1 Adam needs DeepSpeed's compressed communication backend",
    "onebitlamb": "1-bit LAMB needs DeepSpeed's compressed communication backend",
    "lion": "DeepSpeed's Lion (FusedLion/DeepSpeedCPULion) has no torch.optim counterpart",
    "muadam": "MuAdam comes from the external 'mup' package",
    "muadamw": "MuAdamW comes from the external 'mup' package",
    "musgd": "MuSGD comes from the external 'mup' package",
    "muon": "DeepSpeed's Muon splits parameters into Muon and auxiliary-Adam halves; torch.optim.Muon does not",
}
_TOTAL_STEP_SCHEDULERS = ("WarmupDecayLR", "WarmupCosineLR")


def _split_spec(spec: Mapping[str, Any], section: str) -> tuple[str, dict]:
    if not isinstance(spec, Mapping) or not isinstance(spec.get("type"), str):
        raise DeepSpeedConfigError(f'{section} spec must look like {{"type": "...", "params": {{...}}}}, got {spec!r}')
    params = dict(spec.get("params") or {})
    for key, value in params.items():
        if value == "auto" or (isinstance(value, list) and "auto" in value):
            raise DeepSpeedConfigError(
                f'{section}.params.{key} is still "auto": resolve it first with lightning_zero.ds_config.resolve_auto'
            )
    return spec["type"], params


def _lazy_op(module: str, name: str) -> type:
    try:
        imported = __import__(f"lightning_zero.ops.{module}", fromlist=[name])
        return getattr(imported, name)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"lightning_zero.ops.{module}.{name} is needed for this optimizer but could not be imported ({error})"
        ) from error


def _torch_optimizer_class(name: str) -> Optional[type]:
    for attribute in dir(torch.optim):
        candidate = getattr(torch.optim, attribute)
        if (
            attribute.lower() == name.lower()
            and inspect.isclass(candidate)
            and issubclass(candidate, torch.optim.Optimizer)
        ):
            return candidate
    return None


def _instantiate(cls: type, params: Iterable, kwargs: dict, label: str) -> torch.optim.Optimizer:
    try:
        return cls(params, **kwargs)
    except TypeError as error:
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")]
        raise DeepSpeedConfigError(f"optimizer {label}: {error}; {cls.__name__} accepts {accepted}") from error


def build_optimizer(spec: Mapping[str, Any], params: Iterable) -> torch.optim.Optimizer:
    """Instantiate the optimizer of a ds_config ``"optimizer"`` section.

    Args:
        spec: ``{"type": name, "params": {...}}`` with every ``"auto"`` already resolved.
        params: parameters or parameter-group dicts, as for any ``torch.optim`` optimizer.

    Raises:
        DeepSpeedConfigError: unknown or unsupported name, unresolved ``"auto"``, or parameters the class rejects.
        ImportError: the lightning-zero op implementing the optimizer is missing.
    """
    name, kwargs = _split_spec(spec, "optimizer")
    key = name.lower()
    if "max_grad_norm" in kwargs:
        raise DeepSpeedConfigError(
            "optimizer.params.max_grad_norm is not an optimizer parameter: use the top-level "
            '"gradient_clipping" (Trainer gradient_clip_val)'
        )
    if key in ("adam", "adamw"):
        adam_w_mode = kwargs.pop("adam_w_mode", True)
        decoupled = key == "adamw" or bool(adam_w_mode)  # DeepSpeed: "AdamW" is decoupled whatever adam_w_mode says
        fp32_states = kwargs.pop("fp32_optimizer_states", None)
        if fp32_states is False:
            raise DeepSpeedConfigError(
                "optimizer.params.fp32_optimizer_states=false is not supported: optimizer "
                "states are always kept in fp32"
            )
        if kwargs.pop("torch_adam", False):
            cls = torch.optim.AdamW if decoupled else torch.optim.Adam
            return _instantiate(cls, params, kwargs, name)
        fused_adam = _lazy_op("fused_adam", "FusedAdam")
        return _instantiate(fused_adam, params, {**kwargs, "adam_w_mode": decoupled}, name)
    if key == "lamb":
        return _instantiate(_lazy_op("fused_lamb", "FusedLamb"), params, kwargs, name)
    if key in _UNSUPPORTED_OPTIMIZERS:
        raise DeepSpeedConfigError(
            f"optimizer {name!r} is not supported: {_UNSUPPORTED_OPTIMIZERS[key]}. Use Adam, "
            "AdamW, Lamb or a torch.optim optimizer, or define configure_optimizers"
        )
    cls = _torch_optimizer_class(name)
    if cls is None:
        raise DeepSpeedConfigError(
            f"optimizer {name!r} is neither a DeepSpeed optimizer we support (Adam, AdamW, "
            "Lamb) nor a torch.optim class"
        )
    return _instantiate(cls, params, kwargs, name)


def build_scheduler(
    spec: Mapping[str, Any], optimizer: torch.optim.Optimizer, total_steps: Optional[int] = None
) -> torch.optim.lr_scheduler.LRScheduler:
    """Instantiate the LR scheduler of a ds_config ``"scheduler"`` section; step it after every optimizer step
    (Lightning: ``{"scheduler": s, "interval": "step"}``, see :func:`lightning_scheduler_config`).

    Args:
        spec: ``{"type": name, "params": {...}}``; name is one of DeepSpeed's schedulers (exact spelling, as in
            DeepSpeed) or a ``torch.optim.lr_scheduler`` class.
        optimizer: the optimizer to schedule.
        total_steps: used as ``total_num_steps`` for WarmupDecayLR/WarmupCosineLR when the config omits it
            (e.g. ``trainer.estimated_stepping_batches``).
    """
    name, kwargs = _split_spec(spec, "scheduler")
    if name in DEEPSPEED_SCHEDULERS:
        cls = DEEPSPEED_SCHEDULERS[name]
        if name in _TOTAL_STEP_SCHEDULERS and "total_num_steps" not in kwargs:
            if total_steps is None:
                raise DeepSpeedConfigError(
                    f"scheduler {name} needs total_num_steps: set it in scheduler.params or "
                    "pass total_steps (trainer.estimated_stepping_batches)"
                )
            kwargs["total_num_steps"] = int(total_steps)
    else:
        cls = getattr(torch.optim.lr_scheduler, name, None)
        if not (inspect.isclass(cls) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
            raise DeepSpeedConfigError(
                f"scheduler {name!r} is neither a DeepSpeed scheduler "
                f"({', '.join(DEEPSPEED_SCHEDULERS)}) nor a torch.optim.lr_scheduler class"
            )
    try:
        return cls(optimizer, **kwargs)
    except TypeError as error:
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "optimizer")]
        raise DeepSpeedConfigError(f"scheduler {name}: {error}; it accepts {accepted}") from error


def lightning_scheduler_config(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict:
    """The Lightning ``lr_scheduler`` dict that steps like DeepSpeed's engine: after every optimizer step."""
    return {"scheduler": scheduler, "interval": "step", "frequency": 1}
