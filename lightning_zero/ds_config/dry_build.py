"""The ds_config's optimizer and scheduler built once at construction, so what can fail fails before any process group.

:func:`dry_build` instantiates them over a one-element dummy parameter, with placeholders for the ``"auto"`` values,
so an unknown type or a parameter the class rejects is reported at ``ZeroStrategy(...)`` instead of at
``configure_optimizers`` after the launch. (The config's Trainer-level settings are checked against the Trainer
before the process group by :func:`lightning_zero.strategies.ds_config_fit.check_config_against_trainer`.)
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero.ds_config.loading import DeepSpeedConfigError
from lightning_zero.ds_config.optimizers import build_optimizer, build_scheduler
from lightning_zero.ds_config.translate import AUTO, DeepSpeedTranslation

# Stand-ins for "auto" values during the dry build: valid for every optimizer/scheduler we build, and never used.
_OPTIMIZER_PLACEHOLDERS = {"lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8, "betas": [0.9, 0.999]}
_SCHEDULER_PLACEHOLDERS = {
    "warmup_min_lr": 0.0,
    "warmup_max_lr": 1e-3,
    "cycle_max_lr": 1e-3,
    "warmup_num_steps": 1,
    "total_num_steps": 10**9,
}


def _without_auto(spec: dict, placeholders: dict) -> dict:
    params = {}
    for key, value in (spec.get("params") or {}).items():
        if value == AUTO or (isinstance(value, list) and AUTO in value):
            value = placeholders.get(key, value)  # an "auto" we cannot resolve is reported by resolve_auto
        params[key] = value
    return {"type": spec["type"], "params": params}


def dry_build(translation: DeepSpeedTranslation) -> None:
    """Instantiate the config's optimizer and scheduler once on a dummy parameter (see the module docstring).

    Raises:
        DeepSpeedConfigError: unknown optimizer/scheduler type, or parameters the class rejects (named).
    """
    optimizer_spec, scheduler_spec = translation.optimizer, translation.scheduler
    if optimizer_spec is None and scheduler_spec is None:
        return
    dummy = [torch.nn.Parameter(torch.zeros(1))]
    optimizer = None
    if optimizer_spec is not None:
        spec = _without_auto(optimizer_spec, _OPTIMIZER_PLACEHOLDERS)
        if any(v == AUTO for v in spec["params"].values()):
            return  # an "auto" without a placeholder: resolve_auto names it at setup
        optimizer = _build("optimizer", spec, lambda: build_optimizer(spec, dummy))
    if scheduler_spec is not None:
        spec = _without_auto(scheduler_spec, _SCHEDULER_PLACEHOLDERS)
        if any(v == AUTO for v in spec["params"].values()):
            return
        if optimizer is None:
            # over the module's own optimizer, per-group lists are legal: give the stand-in that many groups
            groups = max([len(v) for v in spec["params"].values() if isinstance(v, (list, tuple))] + [1])
            optimizer = torch.optim.SGD(
                [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=1e-3
            )
        target = optimizer
        _build("scheduler", spec, lambda: build_scheduler(spec, target, total_steps=10**9))


def _build(section: str, spec: dict, build) -> Any:
    try:
        return build()
    except DeepSpeedConfigError:
        raise
    except (ValueError, TypeError) as error:  # the class's own argument checks (a negative lr, a bad warmup...)
        raise DeepSpeedConfigError(
            f"{section} {spec['type']!r} rejects its params {spec['params']}: {error}"
        ) from error
    except ImportError:
        return None  # the op is missing on this machine: build_optimizer reports it where it is needed
