"""What ``ZeroStrategy`` does around training that is not ZeRO itself: the DDP settings manual optimization needs,
``toggle_optimizer`` over partitioned optimizers, Lightning's layer sync (``sync_batchnorm``), callbacks it refuses,
and a teardown that leaves sharded modules where they are."""

from __future__ import annotations

from typing import Any

import torch


def ddp_kwargs(module) -> dict[str, Any]:
    """``DistributedDataParallel`` arguments for stages 0-1.

    With manual optimization a step usually back-propagates through part of the model only (a GAN's discriminator
    loss never reaches the generator, ``toggle_optimizer`` freezes the other optimizer's parameters). DDP then
    waits forever for those gradients and fails on the next step ("Expected to have finished reduction"), so
    unused parameters are found per backward, as Lightning's ``ddp_find_unused_parameters_true`` does.
    """
    return {} if module.automatic_optimization else {"find_unused_parameters": True}


def _model_params(optimizer) -> list:
    """Every module parameter ``optimizer`` updates, also the ones a stage-1 rank does not step itself."""
    from lightning_zero.distributed.optimizer import get_sharding

    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
    sharding = get_sharding(optimizer)
    if sharding is not None:
        return sharding.all_model_params()
    return [param for group in optimizer.param_groups for param in group["params"]]


class _WholeModelToggle:
    """``toggle_optimizer``/``untoggle_optimizer`` over the module's parameters, not the optimizers' param groups.

    [Note: toggle_optimizer at stage 1]
    Lightning's versions freeze the parameters they find in ``optimizer.param_groups``. At stage 1 those hold only
    the parameters this rank steps (or their CPU masters with offload; see ``distributed.optimizer``'s note), so the
    other ranks' parameters stayed trainable: they collected gradients from the other optimizer's loss, DDP
    averaged those into the owner's gradient, and the owner stepped on the sum (a silently different GAN). These
    versions bind on the instance (the class stays untouched), use each optimizer's full parameter list, and are
    removed at teardown, as the ds_config's ``configure_optimizers`` is.
    """

    def __init__(self, module, optimizers: list) -> None:
        import types

        self.module = module
        self.optimizers = optimizers
        module.toggle_optimizer = types.MethodType(self._toggle, module)
        module.untoggle_optimizer = types.MethodType(self._untoggle, module)

    def _toggle(self, module, optimizer) -> None:
        saved: dict = {}
        for other in self.optimizers:
            for param in _model_params(other):
                saved.setdefault(param, param.requires_grad)
                param.requires_grad = False
        for param in _model_params(optimizer):
            param.requires_grad = saved[param]
        module._param_requires_grad_state = saved

    def _untoggle(self, module, optimizer) -> None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        saved = module._param_requires_grad_state
        for other in self.optimizers:
            if other is not optimizer:
                for param in _model_params(other):
                    if param in saved:
                        param.requires_grad = saved[param]
        module._param_requires_grad_state = {}

    def remove(self) -> None:
        for name in ("toggle_optimizer", "untoggle_optimizer"):
            self.module.__dict__.pop(name, None)


def whole_model_toggle(module, optimizers: list) -> list:
    """At stage 1 (partitioned param groups) bind toggle/untoggle that see every parameter; returns handles."""
    from lightning_zero.distributed.optimizer import get_sharding

    def partitioned(optimizer) -> bool:
        sharding = get_sharding(getattr(optimizer, "_optimizer", optimizer))
        return sharding is not None and (bool(sharding.masters) or any(owner != -1 for owners in sharding.owners
                                                                        for owner in owners))

    if module.automatic_optimization or not any(partitioned(optimizer) for optimizer in optimizers):
        return []
    return [_WholeModelToggle(module, optimizers)]


def holds_sharded_parameters(module) -> bool:
    """Whether ``module`` has FSDP2 (DTensor) parameters: stages 2-3, or a sharded pipeline stage."""
    from torch.distributed.tensor import DTensor

    return module is not None and any(isinstance(param, DTensor) for param in module.parameters())


def teardown_in_place(strategy) -> None:
    """Lightning's ``ParallelStrategy.teardown`` minus moving the module and optimizer states to CPU.

    Lightning's base teardown calls ``lightning_module.cpu()``. On sharded (DTensor) parameters that swaps every
    parameter: inside ``torch.inference_mode()`` (Lightning's evaluation loops) it raises ("Cannot set
    version_counter for inference tensor"), and on CUDA it would move the shards off the device so a later
    ``fit``/``validate``/``test`` with the same module, which keeps the sharded module as it is, would compute on
    CPU. Lightning's own FSDP2 strategy (``ModelParallelStrategy``) leaves the module in place the same way.
    """
    assert strategy.cluster_environment is not None and strategy.accelerator is not None
    strategy.cluster_environment.teardown()
    strategy.precision_plugin.teardown()
    strategy.accelerator.teardown()
    strategy.checkpoint_io.teardown()


_SYNC_BATCHNORM_DEVICES = ("cuda", "xpu", "hpu")


def check_before_process_group(strategy) -> None:
    """Refuse, before any process group starts, what this strategy would otherwise run wrongly or crash on.

    - ``Trainer(sync_batchnorm=True)`` off GPU: torch's ``SyncBatchNorm`` raises inside its forward on CPU input
      once a process group exists, so the first training batch would fail deep inside torch.
    - ``StochasticWeightAveraging`` at stages 2-3: it deep-copies the module and averages its parameters into the
      copy, mixing plain tensors with FSDP2's sharded DTensors ("mixed torch.Tensor and DTensor").
    """
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
    from lightning.pytorch.trainer.states import TrainerFn

    module = strategy.lightning_module
    trainer = getattr(module, "_trainer", None) if module is not None else None
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:  # both only act while fitting
        return
    device = strategy.root_device
    if isinstance(strategy._layer_sync, TorchSyncBatchNorm) and \
            device.type not in (*_SYNC_BATCHNORM_DEVICES, torch._C._get_privateuse1_backend_name()):
        raise ValueError(
            f"Trainer(sync_batchnorm=True) turns BatchNorm layers into torch.nn.SyncBatchNorm, which torch runs only "
            f"on {'/'.join(_SYNC_BATCHNORM_DEVICES)} devices, but this run computes on {device.type!r}. Train on a "
            "GPU, or remove sync_batchnorm=True (each rank then normalises with its own batch statistics).")
    if strategy.stage >= 2:
        for callback in trainer.callbacks:
            if isinstance(callback, StochasticWeightAveraging):
                raise ValueError(
                    f"The StochasticWeightAveraging callback is not supported with ZeroStrategy(stage="
                    f"{strategy.stage}): it averages copies of the parameters, which stages 2-3 shard across ranks. "
                    "Remove the callback, or use stage 0 or 1.")


def apply_layer_sync(strategy, fitting: bool) -> None:
    """Apply Lightning's layer sync (``Trainer(sync_batchnorm=True)``) before the module is wrapped, as DDP does.

    Only when fitting; a module that is already sharded (evaluation after ``fit``) keeps the layers it trained with.
    """
    from torch.distributed.fsdp import FSDPModule

    if fitting and strategy._layer_sync is not None and not isinstance(strategy.model, FSDPModule):
        strategy.model = strategy._layer_sync.apply(strategy.model)


def revert_layer_sync(strategy, fitting: bool) -> None:
    """Undo :func:`apply_layer_sync` at teardown, at stages 0-1 only.

    At stages 2-3 the synchronised layers' parameters are FSDP2 shards bound to those very layer objects; swapping
    the layers back would detach the shards from FSDP2, so the module keeps them (in ``eval()`` a ``SyncBatchNorm``
    normalises exactly like a ``BatchNorm``, with its running statistics).
    """
    if fitting and strategy._layer_sync is not None and not holds_sharded_parameters(strategy.lightning_module):
        strategy.model = strategy._layer_sync.revert(strategy.model)
