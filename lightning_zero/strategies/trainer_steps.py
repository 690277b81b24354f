"""The Trainer adapter's steps that depend on the Trainer's state: which step 3 a fit or an evaluation gets, the
objects a fit attaches around the LightningModule's steps, and what teardown detaches again.

:class:`~lightning_zero.strategies.trainer_strategy.ZeroStrategy` calls these from its hooks with explicit values
(the shared steps are :mod:`lightning_zero.adapters.runtime_steps`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from lightning_zero.adapters import runtime_steps
from lightning_zero.adapters.settings import ZeroSettings
from lightning_zero.distributed import runtime
from lightning_zero.distributed.apply_zero import swap_parameters
from lightning_zero.distributed.ddp import EarlyBucketRebuild
from lightning_zero.distributed.manual_backward import ManualBackward
from lightning_zero.pipeline.zero_pipeline import setup_pipeline
from lightning_zero.strategies import ds_config_fit, lifecycle
from lightning_zero.strategies.ds_config_fit import uninstall_config_optimizers
from lightning_zero.strategies.forward_redirection import forward_redirection_for
from lightning_zero.strategies.optimizer_toggle import uninstall_partition_aware_toggle


def wrap_for_trainer(
    model: nn.Module,
    lightning_module: Any,
    settings: ZeroSettings,
    meshes: runtime.Meshes,
    device: torch.device,
    precision: Any,
    trainer: Any,
) -> tuple:
    """Step 3 for the LightningModule, and what a fit attaches around its steps:
    ``(model, pipeline runner, DDP's early bucket rebuild, manual_backward's guard)``.

    Its pipeline; a module a fit already sharded (an evaluation after ``fit``) resumes swapping; FSDP2 units at
    stages 2-3 or DDP when fitting at 0-1; and an evaluation at stages 0-1 gets no DDP (nothing to reduce), every rank
    starting from rank 0's weights. Then :func:`step_hooks`."""
    zero_config, fitting = settings.zero_config, trainer.state.fn == TrainerFn.FITTING
    runner = None
    if settings.pipeline.enabled:
        runner = setup_pipeline(
            lightning_module,
            settings.pipeline,
            meshes.pipeline,
            meshes.data_parallel,
            zero_config.stage,
            device,
            precision,
            settings.activation_checkpoint_config,
            trainer.accumulate_grad_batches,
        )
    elif zero_config.stage >= 2 and isinstance(model, FSDPModule):
        swap_parameters(model, zero_config, device)
    elif zero_config.stage >= 2 or fitting:
        model = runtime_steps.wrap(model, settings, meshes, device, precision)
    else:
        runtime.replicate_for_evaluation(model, meshes.data_parallel, device)
    bucket_rebuild, manual_backward = step_hooks(
        model, lightning_module, stage=zero_config.stage, fitting=fitting, pipelined=runner is not None
    )
    return model, runner, bucket_rebuild, manual_backward


def step_hooks(
    model: nn.Module, lightning_module: Any, *, stage: int, fitting: bool, pipelined: bool
) -> tuple[Optional[EarlyBucketRebuild], Optional[ManualBackward]]:
    """What a fit attaches around the steps after step 3: DDP's early bucket rebuild under automatic optimization
    (its note in :mod:`lightning_zero.distributed.ddp`: Lightning zeroes the gradients after ``training_step``), and
    at stages 2-3 under manual optimization ``manual_backward``'s guard (:mod:`.manual_backward`)."""
    automatic = lightning_module.automatic_optimization
    ddp = isinstance(model, DistributedDataParallel)
    bucket_rebuild = EarlyBucketRebuild(model) if fitting and automatic and ddp else None
    manual = stage >= 2 and fitting and not pipelined and not automatic
    return bucket_rebuild, ManualBackward(model) if manual else None


def detach(lightning_module: Any, handles: list, precision: Any) -> None:
    """Teardown: remove what setup installed on the user's LightningModule (a ds_config's ``configure_optimizers``,
    the partition-aware optimizer toggle), the ``handles`` setup registered (emptied) and the ``precision`` plugin's
    fp32 values of bf16 replicas."""
    if lightning_module is not None:
        uninstall_config_optimizers(lightning_module)
        uninstall_partition_aware_toggle(lightning_module)
    for handle in handles:
        handle.remove()
    handles.clear()
    precision.fp32_values.clear()


def model_at_teardown(model: Any, lightning_module: Any, layer_sync: Any, trainer: Any) -> Any:
    """The strategy's model after teardown: the LightningModule again instead of its DDP wrapper, with Lightning's
    layer sync reverted where it can be (:func:`~lightning_zero.strategies.lifecycle.revert_layer_sync`)."""
    if isinstance(model, DistributedDataParallel):
        model = lightning_module
    if trainer is not None:
        model = lifecycle.revert_layer_sync(layer_sync, model, trainer.state.fn == TrainerFn.FITTING)
    return model


def check_fit_settings(
    trainer: Any, settings: ZeroSettings, precision: str, data_parallel: int, device: torch.device, layer_sync: Any
) -> None:
    """The Trainer's own checks before ``init_process_group`` (after the shared ones): a ds_config's precision,
    clipping, accumulation and batch arithmetic against the Trainer's flags (:mod:`.ds_config_fit`), then
    ``sync_batchnorm`` off GPU and the callbacks stages 2-3 cannot run (:mod:`.lifecycle`)."""
    if settings.ds_config is not None and trainer is not None:
        ds_config_fit.check_config_against_trainer(settings.ds_config, trainer, precision, data_parallel)
    lifecycle.check_trainer_before_process_group(trainer, device, settings.zero_config.stage, layer_sync)


def bind_ds_config_to_fit(
    settings: ZeroSettings, trainer: Any, precision: str, meshes: Optional[runtime.Meshes], is_global_zero: bool
) -> Optional[str]:
    """At setup, with a ds_config: when fitting, resolve its ``"auto"`` values against the Trainer
    (:func:`~lightning_zero.strategies.ds_config_fit.resolve_for_fit`; DeepSpeed's batch arithmetic counts the
    data-parallel replicas, under a pipeline the ``meshes``' ``"dp"``); print it on rank 0; return the precision flag
    to adopt from it (``None``: keep the Trainer's ``precision``)."""
    if settings.ds_config is None:
        return None
    if trainer.training:
        data_parallel = meshes.data_parallel.size() if meshes is not None else trainer.world_size
        ds_config_fit.resolve_for_fit(settings.ds_config, trainer, data_parallel)
    return runtime_steps.adopt_config_precision(settings, precision, print_table=is_global_zero)


def shard_optimizers(
    optimizers: list, lightning_module: Any, settings: ZeroSettings, meshes: Any, device: torch.device, precision: Any
) -> None:
    """Step 4 for each of the fit's optimizers (a ``LightningOptimizer``'s own), then forget the bf16 replicas'
    fp32 values no optimizer holds: those replicas are never stepped."""
    for index, optimizer in enumerate(optimizers):
        runtime_steps.shard_optimizer_by_settings(
            getattr(optimizer, "_optimizer", optimizer),
            lightning_module,
            settings,
            meshes,
            device=device,
            precision=precision,
            index=index,
        )
    precision.fp32_values.clear()


def forward_redirection(stage: int, device: torch.device, manual_backward: Optional[ManualBackward]):
    """How a step reaches the wrapped model: Lightning's DDP redirection at stages 0-1; at stages 2-3 the root's
    ``__call__``, with the CPU-only re-entry suspension or Lightning's own redirection
    (:func:`lightning_zero.strategies.forward_redirection.forward_redirection_for`, ``distributed/cpu_tuning.py``)."""
    if stage <= 1:
        return _DDPForwardRedirection()
    return forward_redirection_for(device, manual_backward is not None)
