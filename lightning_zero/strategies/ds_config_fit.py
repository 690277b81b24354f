"""A ds_config inside a Trainer fit: its Trainer-level settings, and its optimizer and scheduler.

Before the process group, :func:`check_config_against_trainer` (top of ``setup_environment``) refuses the config's
precision, clipping, accumulation, ``steps_per_print`` and batch arithmetic where they contradict the Trainer's
flags, the data-parallel size or a DataLoader given to ``fit`` directly. At setup, :func:`resolve_for_fit` resolves
the config's ``"auto"`` values from the Trainer, DataLoader and LightningModule and applies those settings (the table
in :mod:`lightning_zero.ds_config.binding`). The config's optimizer and scheduler are built through the
LightningModule's ``configure_optimizers`` (:func:`install_config_optimizers`).
"""

from __future__ import annotations

import copy
import types
import warnings
from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_zero.ds_config import (
    AutoContext,
    DeepSpeedConfigError,
    DeepSpeedConfigWarning,
    DeepSpeedTranslation,
    infer_hidden_size,
    resolve_batch_sizes,
)
from lightning_zero.ds_config.auto import resolve_optimizer
from lightning_zero.ds_config.binding import DeepSpeedConfigBinding, effective_ds_config, precision_from_config
from lightning_zero.ds_config.optimizers import build_optimizer, build_scheduler, lightning_scheduler_config
from lightning_zero.ds_config.strategy_arguments import naming_arguments
from lightning_zero.ds_config.translate import AUTO

# Lightning's defaults of the Trainer settings a ds_config also sets: a Trainer value that differs was set by the user.
_TRAINER_DEFAULTS = {"accumulate_grad_batches": 1, "gradient_clip_val": None, "log_every_n_steps": 50}


def effective_config_of_fit(settings: Any, precision_plugin, trainer) -> dict:
    """``ZeroStrategy.config``: :func:`~lightning_zero.ds_config.binding.effective_ds_config` of the strategy's
    ``settings`` (``ZeroSettings``) with what the Trainer knows of the run: the precision plugin's flag, and once
    attached, accumulation and norm clipping (DeepSpeed's ``gradient_clipping`` is a norm clip: none is reported
    for value clipping)."""
    binding, zero_config, communication_data_type = (
        settings.ds_config,
        settings.zero_config,
        settings.communication_data_type,
    )
    clip = None
    if trainer is not None and trainer.gradient_clip_algorithm in (None, "norm"):
        clip = float(trainer.gradient_clip_val or 0.0)
    return effective_ds_config(
        binding,
        zero_config,
        communication_data_type=communication_data_type,
        precision=str(getattr(precision_plugin, "precision", "")) if precision_plugin is not None else "",
        accumulate_grad_batches=trainer.accumulate_grad_batches if trainer is not None else None,
        gradient_clip_val=clip,
    )


def resolve_for_fit(binding: DeepSpeedConfigBinding, trainer, data_parallel_size: int) -> DeepSpeedTranslation:
    """Resolve the config's ``"auto"`` values from the Trainer and apply/check its Trainer-level settings (fitting
    only; see the table in :mod:`lightning_zero.ds_config.binding`). ``data_parallel_size`` counts the replicas
    DeepSpeed's batch arithmetic counts (under a pipeline, the ``"dp"`` mesh)."""
    module = trainer.lightning_module
    hparams = dict(getattr(module, "hparams", {}) or {})
    explicit = explicit_trainer_values(trainer)
    accumulation = binding.raw.get("gradient_accumulation_steps")
    if isinstance(accumulation, int) and "accumulate_grad_batches" not in explicit:
        # before estimated_stepping_batches reads it: the schedule's "auto" step counts depend on it
        trainer.accumulate_grad_batches = accumulation
        explicit["accumulate_grad_batches"] = accumulation
    context = AutoContext(
        world_size=data_parallel_size,
        micro_batch_size=_train_batch_size(trainer),
        # "auto" takes the Trainer's value even at its default; a number in the config was applied above
        accumulate_grad_batches=trainer.accumulate_grad_batches
        if accumulation == "auto"
        else explicit.get("accumulate_grad_batches"),
        gradient_clip_val=explicit.get("gradient_clip_val"),
        precision=trainer.precision,
        hyperparameters=hparams,
        estimated_stepping_batches=estimated_steps(trainer),
        hidden_size=infer_hidden_size(module, hparams),
    )
    translation = binding.resolve(context)
    _apply_trainer_settings(trainer, translation, explicit)
    _point_at_replacements(trainer, translation)
    return translation


def _point_at_replacements(trainer, translation: DeepSpeedTranslation) -> None:
    """Keys that ask for something the Trainer's own tools do: say which tool, rather than drop them."""
    if translation.wall_clock_breakdown and not any(type(c).__name__ == "ThroughputLogger" for c in trainer.callbacks):
        warnings.warn(
            "wall_clock_breakdown: true asks for per-phase step timings; add "
            "lightning_zero.callbacks.ThroughputLogger() to the Trainer's callbacks for the forward/"
            "backward/optimizer/collective breakdown",
            DeepSpeedConfigWarning,
        )


def _apply_trainer_settings(trainer, translation: DeepSpeedTranslation, explicit: dict) -> None:
    settings = translation.trainer_settings()
    if "accumulate_grad_batches" not in explicit and settings.get("accumulate_grad_batches", 1) != 1:
        trainer.accumulate_grad_batches = settings["accumulate_grad_batches"]
    clip = settings.get("gradient_clip_val")
    if "gradient_clip_val" not in explicit and clip:
        trainer.gradient_clip_val = float(clip)
        trainer.gradient_clip_algorithm = "norm"
    every = settings.get("log_every_n_steps")
    if every is not None:
        if "log_every_n_steps" in explicit and explicit["log_every_n_steps"] != every:
            raise DeepSpeedConfigError(
                f"steps_per_print={every} in the DeepSpeed config does not match the Trainer's "
                f"log_every_n_steps={explicit['log_every_n_steps']}: make them equal or drop one"
            )
        trainer.log_every_n_steps = every


def _train_batch_size(trainer) -> Optional[int]:
    trainer.fit_loop.setup_data()
    return loader_batch_size(trainer.train_dataloader)


def estimated_steps(trainer) -> Optional[float]:
    """The fit's optimizer steps (``None`` when unbounded): the total of a config schedule's ``"auto"`` steps."""
    steps = trainer.estimated_stepping_batches
    return None if steps == float("inf") else steps


def explicit_trainer_values(trainer) -> dict:
    """The Trainer settings a ds_config also sets that the user changed from Lightning's defaults."""
    return {
        name: getattr(trainer, name) for name in _TRAINER_DEFAULTS if getattr(trainer, name) != _TRAINER_DEFAULTS[name]
    }


def check_config_against_trainer(binding, trainer, precision: str, data_parallel_size: int) -> None:
    """The ds_config's Trainer-level settings against the Trainer, before the process group (module docstring),
    with the same rules (and messages) :func:`resolve_for_fit` applies at setup.

    Raises:
        DeepSpeedConfigError: precision, clipping, accumulation or ``steps_per_print`` disagree with the Trainer's
            explicit flags, or the config's batch sizes cannot add up for this data-parallel size. A key that a
            DeepSpeedStrategy argument wrote is named with the argument.
    """
    with naming_arguments(getattr(binding, "argument_aliases", {})):
        _check_config_against_trainer(binding, trainer, precision, data_parallel_size)


def _check_config_against_trainer(binding, trainer, precision: str, data_parallel_size: int) -> None:
    precision_from_config(binding.precision, precision)
    if getattr(getattr(trainer, "state", None), "fn", None) != "fit":
        return  # the rest is resolved only when fitting
    raw = binding.raw
    module = getattr(trainer, "lightning_module", None)
    if raw.get("optimizer"):
        # the optimizer's "auto" values come from the LightningModule's hyperparameters, known already
        resolve_optimizer(copy.deepcopy(raw), dict(getattr(module, "hparams", {}) or {}))
    explicit = explicit_trainer_values(trainer)
    clip, trainer_clip = raw.get("gradient_clipping"), explicit.get("gradient_clip_val")
    if isinstance(clip, (int, float)) and trainer_clip is not None and float(clip) != float(trainer_clip):
        raise DeepSpeedConfigError(
            f"gradient_clipping={clip} in the DeepSpeed config does not match the Trainer's "
            f'gradient_clip_val={trainer_clip}: remove one of them or set the config value to "auto"'
        )
    accumulation, trainer_accumulation = raw.get("gradient_accumulation_steps"), explicit.get("accumulate_grad_batches")
    if isinstance(accumulation, int) and trainer_accumulation is not None and accumulation != trainer_accumulation:
        raise DeepSpeedConfigError(
            f"gradient_accumulation_steps={accumulation} in the DeepSpeed config does not match the Trainer's "
            f'accumulate_grad_batches ({trainer_accumulation}): make them equal, or set the config value to "auto"'
        )
    every = binding.translation.steps_per_print
    if every is not None and "log_every_n_steps" in explicit and explicit["log_every_n_steps"] != every:
        raise DeepSpeedConfigError(
            f"steps_per_print={every} in the DeepSpeed config does not match the Trainer's "
            f"log_every_n_steps={explicit['log_every_n_steps']}: make them equal or drop one"
        )
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
                f'batch_size ({loader_batch}): make them equal, or set the config value to "auto"'
            )
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


def defines_configure_optimizers(module: Any) -> bool:
    """Whether the LightningModule's class overrides ``configure_optimizers`` (the base class's does nothing)."""
    from lightning.pytorch import LightningModule

    own = getattr(type(module), "configure_optimizers", None)
    return own is not None and own is not LightningModule.configure_optimizers


def _scheduler_for(translation: DeepSpeedTranslation, trainer, optimizer) -> dict:
    scheduler = build_scheduler(translation.scheduler, optimizer, total_steps=estimated_steps(trainer))
    return lightning_scheduler_config(scheduler)


def install_config_optimizers(module, binding: Optional[DeepSpeedConfigBinding]) -> None:
    """Give ``module`` a ``configure_optimizers`` that builds the config's optimizer (and scheduler).

    [Note: why an instance attribute] Lightning refuses to fit a module whose class does not override
    ``configure_optimizers`` before the strategy is set up, so the config's optimizer has to be reachable through
    that hook. It is bound on the instance (the class stays untouched) and removed again at teardown
    (:func:`uninstall_config_optimizers`). The optimizer is built when Lightning calls the hook, after setup
    resolved the config's ``"auto"`` values, over every trainable parameter as DeepSpeed does, and stepped with
    its scheduler after every optimizer step. Nothing without a ``binding`` or a config optimizer.
    """
    if binding is None or binding.translation.optimizer is None:
        return
    if defines_configure_optimizers(module):
        spec = binding.translation.optimizer
        scheduler = binding.translation.scheduler
        what = f'"optimizer" ({spec.get("type")!r})' + (
            f' and "scheduler" ({scheduler.get("type")!r})' if scheduler else ""
        )
        rank_zero_warn(
            f"both the DeepSpeed config and {type(module).__name__}.configure_optimizers define an "
            f"optimizer: the config's {what} is used and configure_optimizers is not called (its "
            "optimizers and schedulers are ignored), as DeepSpeedStrategy does. Remove one of the two to "
            "silence this warning",
            category=DeepSpeedConfigWarning,
        )

    def configure_optimizers(self):
        translation = binding.translation
        optimizer = build_optimizer(translation.optimizer, [p for p in self.parameters() if p.requires_grad])
        if translation.scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": _scheduler_for(translation, self.trainer, optimizer)}

    configure_optimizers.installed_by_lightning_zero = True  # teardown removes only this one, never the user's
    module.configure_optimizers = types.MethodType(configure_optimizers, module)


def uninstall_config_optimizers(module) -> None:
    """Remove what :func:`install_config_optimizers` bound; a ``configure_optimizers`` the user set stays."""
    bound = module.__dict__.get("configure_optimizers")
    if getattr(getattr(bound, "__func__", None), "installed_by_lightning_zero", False):
        del module.__dict__["configure_optimizers"]


def scheduler_from_config(binding: Optional[DeepSpeedConfigBinding], trainer, optimizers: list, configs: list) -> list:
    """The fit's LR scheduler configs: ``configs`` (``configure_optimizers``'), or a config ``scheduler`` over the
    LightningModule's own optimizer when the config has no ``optimizer`` (DeepSpeed accepts this pairing too)."""
    from lightning.pytorch.core.optimizer import _configure_schedulers_automatic_opt

    if binding is None or binding.translation.optimizer is not None or not binding.translation.scheduler:
        return configs
    translation = binding.translation
    if len(optimizers) != 1 or configs:
        raise DeepSpeedConfigError(
            'the DeepSpeed config has a "scheduler" section, but configure_optimizers returned '
            f"{len(optimizers)} optimizer(s) and {len(configs)} scheduler(s): a config scheduler needs exactly one "
            "optimizer and no scheduler from configure_optimizers; remove one of the two"
        )
    return _configure_schedulers_automatic_opt([_scheduler_for(translation, trainer, optimizers[0])], None)
