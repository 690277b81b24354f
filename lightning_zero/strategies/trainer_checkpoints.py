"""The Trainer's checkpoints under ZeroStrategy: Lightning's checkpoint dict in and out of the sharded format
(:mod:`lightning_zero.checkpoint.states`) or one full file (``state_dict_type="full"``,
:mod:`lightning_zero.checkpoint.full_save`), loads from one full file or a DeepSpeed ZeRO checkpoint directory
(:mod:`lightning_zero.checkpoint.load_full`), top-k removal, and the callback settings whose checkpoints could not
be resumed from.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from lightning.fabric import __version__ as lightning_version
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_zero.adapters.settings import checkpoint_save_options
from lightning_zero.checkpoint.deepspeed_reader import is_deepspeed_checkpoint
from lightning_zero.checkpoint.deepspeed_resume import LOSS_SCALER_KEY
from lightning_zero.checkpoint.directory import checkpoint_directory
from lightning_zero.checkpoint.full_save import remove_full_file, save_full_file
from lightning_zero.checkpoint.io import remove_sharded_checkpoint, repoint_links, wait_for_pending_saves
from lightning_zero.checkpoint.load_full import is_full_checkpoint, load_full_checkpoint
from lightning_zero.checkpoint.safe_load import load_meta
from lightning_zero.checkpoint.states import load_states, save_states
from lightning_zero.strategies import last_link


def prepare_checkpoint_callbacks(async_save: bool, checkpoint_callbacks: list) -> None:
    """At setup: refuse callback settings whose checkpoints could not be resumed from after a crash, and make
    ``save_last="link"`` re-point ``last.ckpt`` atomically (``[Note: re-pointing last.ckpt]`` in
    :mod:`lightning_zero.strategies.last_link`)."""
    check_checkpoint_callbacks(async_save, checkpoint_callbacks)
    last_link.install_atomic_links(checkpoint_callbacks)


def check_checkpoint_callbacks(async_save: bool, checkpoint_callbacks: list) -> None:
    """Refuse callback settings whose checkpoints could not be resumed from after a crash.

    ``ModelCheckpoint(save_last="link")`` points ``last.ckpt`` at a checkpoint right after asking the strategy to save
    it. With ``async_save=True`` that checkpoint is still being written, so a crash before it completes leaves
    ``last.ckpt`` a dangling link and ``fit(ckpt_path="last")`` would start from step 0.
    """
    if not async_save:
        return
    for callback in checkpoint_callbacks:
        if getattr(callback, "save_last", None) == "link":
            raise ValueError(
                'ModelCheckpoint(save_last="link") cannot be combined with ZeroStrategy(async_save=True): the link '
                "would point at a checkpoint still being written, and a crash before it completes leaves no "
                'resumable "last" checkpoint. Use save_last=True, or async_save=False'
            )


def optimizers_to_restore(trainer: Any, optimizers: list) -> list:
    """The optimizers a checkpoint's states go into: the strategy's when fitting. ``validate``/``test``/``predict``
    after a ``fit`` still have the fit's optimizers attached, but restore weights only (as Lightning does), so a
    weights-only checkpoint is not refused there and the optimizers are left untouched."""
    if trainer is not None and trainer.state.fn != "fit":
        return []
    return [getattr(o, "_optimizer", o) for o in optimizers]


def load(
    filepath: str,
    module: torch.nn.Module,
    optimizers: list,
    *,
    load_full_weights: bool,
    exclude_frozen_parameters: bool,
    precision_key: str,
) -> dict[str, Any]:
    """Load a checkpoint into the LightningModule ``module`` and ``optimizers`` (:func:`optimizers_to_restore`);
    return the rest of it for Lightning, with ``state_dict`` holding the loaded (sharded) weights: Lightning hands
    this dict to every ``on_load_checkpoint`` hook (callbacks such as ``WeightAveraging`` read the weights from it),
    as it does the full checkpoint under DDP.

    A sharded directory is loaded in place (:func:`~lightning_zero.checkpoint.states.load_states`); a single file (a
    DDP ``.ckpt``, a consolidated file, ``.safetensors``) by
    :func:`~lightning_zero.checkpoint.load_full.load_full_checkpoint`, each rank reading its slices only, and so is a
    DeepSpeed ZeRO checkpoint directory (``DeepSpeedStrategy``'s), whose fp16 loss-scaler state goes to the
    precision plugin, stored under ``precision_key`` (its class's ``__qualname__``, where Lightning looks).
    ``LightningModule.strict_loading = False`` accepts missing and unexpected keys (never shape mismatches). With
    optimizers (resuming a fit), their number and types must match the checkpoint's. Errors are
    :class:`~lightning_zero.checkpoint.errors.CheckpointError` naming the file or the keys.
    """
    wait_for_pending_saves(barrier=False)
    if is_full_checkpoint(filepath, load_full_weights):
        return load_full(
            filepath,
            module,
            optimizers,
            load_full_weights=load_full_weights,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
    if is_deepspeed_checkpoint(filepath):
        return load_deepspeed(
            filepath,
            module,
            optimizers,
            exclude_frozen_parameters=exclude_frozen_parameters,
            precision_key=precision_key,
        )
    directory = checkpoint_directory(filepath)
    meta = load_meta(directory)  # weights_only; raises a clear error if not a checkpoint
    meta["state_dict"] = load_states(directory, meta, module, optimizers, strict=module.strict_loading)
    return meta


def load_full(
    path: str, module: torch.nn.Module, optimizers: list, *, load_full_weights: bool, exclude_frozen_parameters: bool
) -> dict[str, Any]:
    """A single file, as ``DDPStrategy`` would hand it to Lightning; with ``load_full_weights=True`` and no optimizer
    states in it, the optimizers and LR schedulers start fresh from its weights (DeepSpeed's flag)."""
    rest, fresh = load_full_checkpoint(
        path,
        module,
        optimizers,
        strict=module.strict_loading,
        exclude_frozen_parameters=exclude_frozen_parameters,
        load_full_weights=load_full_weights,
    )
    if fresh:
        rank_zero_warn(
            f"{path} holds no optimizer states: with load_full_weights=True the optimizers and LR "
            "schedulers start fresh from its weights (as DeepSpeed's load_full_weights)"
        )
        rest["lr_schedulers"] = []  # none to restore: Lightning would otherwise refuse the missing key
    rest.setdefault("pytorch-lightning_version", lightning_version)  # a weights-only file has none to migrate
    return rest


def load_deepspeed(
    path: str, module: torch.nn.Module, optimizers: list, *, exclude_frozen_parameters: bool, precision_key: str
) -> dict[str, Any]:
    """A DeepSpeed ZeRO checkpoint directory: as a full file, its client state for Lightning. One that
    ``DeepSpeedEngine.save_checkpoint`` wrote outside Lightning holds no loops or LR schedulers: those start fresh
    (Lightning would otherwise refuse it as a weights-only checkpoint), with a warning."""
    rest = load_full(
        path, module, optimizers, load_full_weights=False, exclude_frozen_parameters=exclude_frozen_parameters
    )
    if (scaler := rest.pop(LOSS_SCALER_KEY, None)) is not None:
        rest.setdefault(precision_key, {})["loss_scaler"] = scaler
    if optimizers and "lr_schedulers" not in rest:
        rank_zero_warn(
            f"{path} holds no Lightning training state (saved by DeepSpeedEngine.save_checkpoint, not by "
            "DeepSpeedStrategy): the weights and optimizer states are restored; loops, epoch, global step "
            "and LR schedulers start fresh"
        )
        rest["lr_schedulers"] = []
    return rest


def save(
    checkpoint: dict[str, Any],
    path: str,
    module: torch.nn.Module,
    optimizers: list,
    settings: Any,
    rank: int,
    precision: str,
) -> str:
    """Save Lightning's ``checkpoint`` at ``path`` (collective): a sharded directory, or with the ``settings``'
    ``state_dict_type="full"`` one file streamed out of the shards. ``settings``: the strategy's ``ZeroSettings``,
    whose ds_config adds its save options at this ``precision`` flag (:func:`checkpoint_save_options`). Returns
    ``path``."""
    options = checkpoint_save_options(settings.ds_config, precision)

    def save_sharded(state: dict, directory: str) -> None:
        save_states(
            state,
            directory,
            module=module,
            optimizers=optimizers,
            stage=settings.zero_config.stage,
            offload=settings.zero_config.offload,
            exclude_frozen_parameters=settings.exclude_frozen_parameters,
            async_save=settings.async_save,
            **options,
        )

    if settings.state_dict_type == "full":
        save_full_file(
            checkpoint, path, save_sharded, rank=rank, with_optimizer=bool(checkpoint.get("optimizer_states"))
        )
    else:
        save_sharded(checkpoint, path)
    return path


def remove(path: str, newest: Optional[str]) -> None:
    """Top-k removal of the checkpoint at ``path`` (rank 0). A link beside it that points to it (``last.ckpt`` under
    ``save_last="link"``) is first re-pointed to ``newest``, the checkpoint saved last, so a kill during the deletion
    never leaves it dangling; Lightning then links it to the same checkpoint."""
    repoint_links(path, newest)
    (remove_full_file if os.path.isfile(path) else remove_sharded_checkpoint)(path)
