"""The ds_config's optimizer and scheduler inside a Trainer fit: the Trainer-only half of
:mod:`lightning_zero.ds_config.binding` (it binds a LightningModule hook and builds Lightning's scheduler
configs)."""

from __future__ import annotations

from typing import Any

from lightning_zero.ds_config import DeepSpeedConfigError, DeepSpeedConfigWarning, DeepSpeedTranslation
from lightning_zero.ds_config.binding import DeepSpeedConfigBinding, _estimated_steps


def defines_configure_optimizers(module: Any) -> bool:
    """Whether the LightningModule's class overrides ``configure_optimizers`` (the base class's does nothing)."""
    from lightning.pytorch import LightningModule

    own = getattr(type(module), "configure_optimizers", None)
    return own is not None and own is not LightningModule.configure_optimizers


def _scheduler_for(translation: DeepSpeedTranslation, trainer, optimizer) -> dict:
    from lightning_zero.ds_config.optimizers import build_scheduler, lightning_scheduler_config

    scheduler = build_scheduler(translation.scheduler, optimizer, total_steps=_estimated_steps(trainer))
    return lightning_scheduler_config(scheduler)


def install_config_optimizers(module, binding: DeepSpeedConfigBinding) -> None:
    """Give ``module`` a ``configure_optimizers`` that builds the config's optimizer (and scheduler).

    [Note: why an instance attribute] Lightning refuses to fit a module whose class does not override
    ``configure_optimizers`` before the strategy is set up, so the config's optimizer has to be reachable through
    that hook. It is bound on the instance (the class stays untouched) and removed again at teardown
    (:func:`uninstall_config_optimizers`). The optimizer is built when Lightning calls the hook, after setup
    resolved the config's ``"auto"`` values, over every trainable parameter as DeepSpeed does, and stepped with
    its scheduler after every optimizer step.
    """
    import types

    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    from lightning_zero.ds_config.optimizers import build_optimizer

    if defines_configure_optimizers(module):
        spec = binding.translation.optimizer
        scheduler = binding.translation.scheduler
        what = f'"optimizer" ({spec.get("type")!r})' + (f' and "scheduler" ({scheduler.get("type")!r})'
                                                        if scheduler else "")
        rank_zero_warn(f"both the DeepSpeed config and {type(module).__name__}.configure_optimizers define an "
                       f"optimizer: the config's {what} is used and configure_optimizers is not called (its "
                       "optimizers and schedulers are ignored), as DeepSpeedStrategy does. Remove one of the two to "
                       "silence this warning", category=DeepSpeedConfigWarning)

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


def scheduler_from_config(translation: DeepSpeedTranslation, trainer, optimizers: list, configs: list) -> list:
    """A config ``scheduler`` over the LightningModule's own optimizer (DeepSpeed accepts this pairing too)."""
    from lightning.pytorch.core.optimizer import _configure_schedulers_automatic_opt

    if len(optimizers) != 1 or configs:
        raise DeepSpeedConfigError(
            'the DeepSpeed config has a "scheduler" section, but configure_optimizers returned '
            f"{len(optimizers)} optimizer(s) and {len(configs)} scheduler(s): a config scheduler needs exactly one "
            "optimizer and no scheduler from configure_optimizers; remove one of the two")
    return _configure_schedulers_automatic_opt([_scheduler_for(translation, trainer, optimizers[0])], None)
