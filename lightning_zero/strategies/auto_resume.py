"""Automatic resume of a restarted ``trainer.fit`` (the Trainer-only half of :mod:`lightning_zero.adapters.restarts`,
whose ``[Note: automatic resume]`` explains it): it reads the Trainer's ``ModelCheckpoint`` callbacks and wraps its
checkpoint connector, so it lives with the Trainer adapter."""

from __future__ import annotations

import logging
from typing import Optional

from lightning_zero.adapters.restarts import newest_complete_checkpoint, restart_count

log = logging.getLogger(__name__)


def _checkpoint_directories(trainer) -> list[str]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return [str(cb.dirpath) for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]


def _choose_resume_path(trainer, broadcast) -> Optional[str]:
    count = restart_count()
    why = f"this job is restart {count}" if count else "auto_resume='always'"
    path = newest_complete_checkpoint(_checkpoint_directories(trainer)) if trainer.is_global_zero else None
    path = broadcast(path)
    if trainer.is_global_zero:
        if path is not None:
            log.warning(f"lightning-zero auto_resume: {why}; resuming from the newest complete "
                        f"checkpoint {path} (pass ckpt_path to choose, or ZeroStrategy(auto_resume=False))")
        else:
            log.warning(f"lightning-zero auto_resume: {why} but no complete checkpoint is in "
                        f"{_checkpoint_directories(trainer) or 'any ModelCheckpoint dirpath'}; training starts from "
                        f"step 0")
    return path


def install_auto_resume(strategy) -> None:
    """On a restarted fit without ``ckpt_path`` (or every fit with ``auto_resume="always"``), make the Trainer resume
    from the newest complete checkpoint; on every fit, turn preemption signals into a checkpoint at the next step
    boundary (:mod:`.preemption`)."""
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_zero.strategies import preemption

    preemption.install(strategy)
    module = strategy.lightning_module
    trainer = getattr(module, "_trainer", None) if module is not None else None
    asked = restart_count() > 0 or strategy.auto_resume == "always"
    if trainer is None or not asked or trainer.state.fn != TrainerFn.FITTING:
        return
    connector = trainer._checkpoint_connector
    original = connector.resume_start

    def resume_start(checkpoint_path=None, weights_only=None):
        del connector.resume_start  # one call only: back to the class's method
        if checkpoint_path is None:
            checkpoint_path = _choose_resume_path(trainer, strategy.broadcast)
        return original(checkpoint_path, weights_only=weights_only)

    connector.resume_start = resume_start
