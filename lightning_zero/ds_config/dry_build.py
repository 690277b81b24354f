"""Early checks of a ds_config: what can fail is made to fail before any process group starts.

* :func:`dry_build` (constructor): the config's optimizer and scheduler are instantiated once over a one-element
  dummy parameter, with placeholders for the ``"auto"`` values, so an unknown type or a parameter the class rejects
  is reported at ``ZeroStrategy(...)`` instead of at ``configure_optimizers`` after the launch.
* :func:`check_config_against_trainer` (top of ``setup_environment``): the config's precision, clipping,
  accumulation, ``steps_per_print`` and batch arithmetic against the Trainer's flags, the data-parallel size and a
  DataLoader given to ``fit`` directly, with the same rules (and messages) :meth:`DeepSpeedConfigBinding.resolve`
  applies at setup.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from lightning_zero.ds_config import DeepSpeedConfigError, DeepSpeedTranslation, resolve_batch_sizes
from lightning_zero.ds_config.auto import _resolve_optimizer
from lightning_zero.ds_config.translate import AUTO

# Stand-ins for "auto" values during the dry build: valid for every optimizer/scheduler we build, and never used.
_OPTIMIZER_PLACEHOLDERS = {"lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8, "betas": [0.9, 0.999]}
_SCHEDULER_PLACEHOLDERS = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "cycle_max_lr": 1e-3,
                           "warmup_num_steps": 1, "total_num_steps": 10**9}
_TRAINER_DEFAULTS = {"accumulate_grad_batches": 1, "gradient_clip_val": None, "log_every_n_steps": 50}


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
    from lightning_zero.ds_config.optimizers import build_optimizer, build_scheduler

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
            optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)],
                                        lr=1e-3)
        target = optimizer
        _build("scheduler", spec, lambda: build_scheduler(spec, target, total_steps=10**9))


def _build(section: str, spec: dict, build) -> Any:
    try:
        return build()
    except DeepSpeedConfigError:
        raise
    except (ValueError, TypeError) as error:  # the class's own argument checks (a negative lr, a bad warmup...)
        raise DeepSpeedConfigError(f"{section} {spec['type']!r} rejects its params {spec['params']}: {error}") \
            from error
    except ImportError:
        return None  # the op is missing on this machine: build_optimizer reports it where it is needed


def explicit_trainer_values(trainer) -> dict:
    """The Trainer settings a ds_config also sets that the user changed from Lightning's defaults."""
    return {name: getattr(trainer, name) for name in _TRAINER_DEFAULTS
            if getattr(trainer, name) != _TRAINER_DEFAULTS[name]}


def check_config_against_trainer(binding, trainer, precision: str, data_parallel_size: int) -> None:
    """The ds_config's Trainer-level settings against the Trainer, before the process group (module docstring).

    Raises:
        DeepSpeedConfigError: precision, clipping, accumulation or ``steps_per_print`` disagree with the Trainer's
            explicit flags, or the config's batch sizes cannot add up for this data-parallel size.
    """
    from lightning_zero.ds_config.binding import precision_from_config

    precision_from_config(binding.precision, precision)
    if getattr(getattr(trainer, "state", None), "fn", None) != "fit":
        return  # the rest is resolved only when fitting
    raw = binding.raw
    module = getattr(trainer, "lightning_module", None)
    if raw.get("optimizer"):
        # the optimizer's "auto" values come from the LightningModule's hyperparameters, known already
        _resolve_optimizer(copy.deepcopy(raw), dict(getattr(module, "hparams", {}) or {}))
    explicit = explicit_trainer_values(trainer)
    clip, trainer_clip = raw.get("gradient_clipping"), explicit.get("gradient_clip_val")
    if isinstance(clip, (int, float)) and trainer_clip is not None and float(clip) != float(trainer_clip):
        raise DeepSpeedConfigError(
            f"gradient_clipping={clip} in the DeepSpeed config does not match the Trainer's "
            f'gradient_clip_val={trainer_clip}: remove one of them or set the config value to "auto"')
    accumulation, trainer_accumulation = raw.get("gradient_accumulation_steps"), explicit.get(
        "accumulate_grad_batches")
    if isinstance(accumulation, int) and trainer_accumulation is not None and accumulation != trainer_accumulation:
        raise DeepSpeedConfigError(
            f"gradient_accumulation_steps={accumulation} in the DeepSpeed config does not match the Trainer's "
            f'accumulate_grad_batches ({trainer_accumulation}): make them equal, or set the config value to "auto"')
    every = binding.translation.steps_per_print
    if every is not None and "log_every_n_steps" in explicit and explicit["log_every_n_steps"] != every:
        raise DeepSpeedConfigError(
            f"steps_per_print={every} in the DeepSpeed config does not match the Trainer's "
            f"log_every_n_steps={explicit['log_every_n_steps']}: make them equal or drop one")
    if accumulation == AUTO:
        accumulation = trainer.accumulate_grad_batches
    elif not isinstance(accumulation, int):
        accumulation = trainer_accumulation
    train, micro = raw.get("train_batch_size"), raw.get("train_micro_batch_size_per_gpu")
    train = train if isinstance(train, int) and not isinstance(train, bool) else None
    micro = micro if isinstance(micro, int) and not isinstance(micro, bool) else None
    loader_batch = _direct_loader_batch_size(trainer)
    if loader_batch is not None:
        if micro is not None and micro != loader_batch:
            raise DeepSpeedConfigError(
                f"train_micro_batch_size_per_gpu={micro} in the DeepSpeed config does not match the DataLoader's "
                f'batch_size ({loader_batch}): make them equal, or set the config value to "auto"')
        micro = loader_batch
    if train is not None:
        # A failure with only these numbers means no DataLoader batch size can make them add up at setup either.
        resolve_batch_sizes(train, micro, accumulation, data_parallel_size)


def _direct_loader_batch_size(trainer) -> Any:
    """The batch size of a DataLoader passed to ``fit(train_dataloaders=...)`` itself, or ``None``.

    Such a loader exists before the process group; one returned by a ``train_dataloader`` hook does not (Lightning
    calls the hook after the ``setup`` hooks), so that case is checked at setup instead.
    """
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is None or getattr(source, "instance", None) is None or source.is_module():
        return None
    size = loader_batch_size(source.instance)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def loader_batch_size(loader: Any) -> Any:
    """The batch size of a DataLoader (the first one of a dict or list of them): its ``batch_size``, else its batch
    sampler's; ``None`` when neither says."""
    if isinstance(loader, dict):
        loader = next(iter(loader.values()), None)
    elif isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size
