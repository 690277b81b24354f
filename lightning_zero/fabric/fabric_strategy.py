"""``lightning_zero.fabric.ZeroStrategy``: Fabric's adapter over the ZeRO runtime (:mod:`.distributed.runtime`): the
Trainer strategy's arguments (:mod:`lightning_zero.adapters.arguments`) and steps
(:mod:`lightning_zero.adapters.runtime_steps`), called from Fabric's; Fabric's own contract lives in
:mod:`.fabric_checkpoints`, :mod:`.fabric_precision`, :mod:`.fabric_pipeline` and :mod:`.fabric_settings`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_zero.adapters import runtime_steps
from lightning_zero.adapters.arguments import StrategyArguments, lightning_parameter
from lightning_zero.adapters.fork_safety import FabricMultiProcessingLauncher
from lightning_zero.adapters.launch_checks import check_launcher_world_size
from lightning_zero.adapters.precision_policy import PrecisionFlag
from lightning_zero.adapters.process_group import barrier
from lightning_zero.adapters.settings import STRATEGY_NAMES, resolve_settings
from lightning_zero.checkpoint.io import wait_for_pending_saves
from lightning_zero.checkpoint.save_guards import broadcast_object
from lightning_zero.checkpoint.states import module_state_dict
from lightning_zero.diagnostics.hang_guard import HangGuard
from lightning_zero.diagnostics.peers import LostPeer
from lightning_zero.distributed import runtime
from lightning_zero.distributed.apply_zero import refuse_parameter_gradient_hooks
from lightning_zero.distributed.ddp import average_unfrozen_gradients_after_backward
from lightning_zero.fabric import fabric_checkpoints, fabric_pipeline
from lightning_zero.fabric.fabric_precision import FabricZeroPrecision, adapt_fabric_precision
from lightning_zero.fabric.fabric_settings import refuse_trainer_settings

# auto_resume is the Trainer's (refused when on): off by default here
FABRIC_ARGUMENTS = StrategyArguments(
    lightning_parameter("precision", Optional[Precision]), defaults={"auto_resume": False}
)


class ZeroStrategy(ParallelStrategy):
    """DeepSpeed's ZeRO stages 0-3 with CPU and NVMe offload for Lightning Fabric, on DDP and FSDP2.

    Takes the arguments of :class:`lightning_zero.strategies.ZeroStrategy` (declared in
    :class:`lightning_zero.adapters.settings.ZeroArguments`, documented there), with these Fabric meanings:

    * ``fabric.setup(model, optimizer)`` shards the model and partitions the optimizers; at stages 2-3 the optimizer
      may be created before ``setup``: its parameters are replaced by the sharded ones (by name).
    * ``fabric.clip_gradients(model, optimizer, max_norm=...)`` clips the global norm over every rank's shards;
      with fp16 it first unscales (and detects overflow), as DeepSpeed does before clipping.
    * ``fabric.no_backward_sync(model, enabled=...)`` skips gradient communication on accumulation micro-steps.
    * ``fabric.save(path, state)`` writes a sharded, atomic checkpoint directory (``state_dict_type="full"``: one
      file); ``fabric.load(path, state)`` loads either, or a single-device/DDP Fabric file, in place at any stage or
      world size (:mod:`lightning_zero.fabric.fabric_checkpoints`).
    * ``fabric.load_raw(path, model_or_optimizer)`` reads one ``torch.save`` or ``.safetensors`` file, each rank its
      slices; ``model.load_state_dict(full_state_dict)`` works after setup at every stage
      (:mod:`lightning_zero.distributed.full_tensor_load`).
    * ``fabric.init_module()`` builds the model on CPU running its own init; ``empty_init=True`` and meta-device
      models: ``docs/fabric.md``.
    * ``hang_timeout`` guards ``fabric.save``/``fabric.load`` and teardown (Fabric has no step hooks).
    * Precision: ``Fabric(precision=...)`` with ``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``16-true``
      (:mod:`lightning_zero.fabric.fabric_precision`); fp16 uses DeepSpeed's loss scaling with the loss-scale arguments.
    * ``async_save=True``: ``fabric.save`` writes in the background, awaited by the next save/load,
      :meth:`wait_for_checkpoints`, :meth:`teardown`, and (locally, with a warning) at exit
      (``[Note: async saves under Fabric]`` in :mod:`lightning_zero.fabric.fabric_checkpoints`).
    * ``pipeline_parallel_size > 1``: ``fabric.setup_module(pipeline_module)`` builds this rank's stages and
      :meth:`pipeline_step` runs the schedule (:mod:`lightning_zero.fabric.fabric_pipeline`); ``fabric.backward``
      is refused under a pipeline.

    Refused (no Fabric meaning yet, :mod:`lightning_zero.fabric.fabric_settings`): ``auto_resume=True``, a ds_config
    that sets loop settings (optimizer, scheduler, clipping, accumulation, batch sizes, ...), ``load_full_weights=True``
    and a CheckpointIO plugin, given here or through ``Fabric(plugins=...)`` (saves never call it).
    """

    strategy_name = "zero"

    @FABRIC_ARGUMENTS.declare
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        lightning, arguments = FABRIC_ARGUMENTS.bind(args, kwargs)
        self.settings = settings = resolve_settings(**arguments)
        refuse_trainer_settings(settings)
        self.zero_config = settings.zero_config
        self.hang_guard = HangGuard(settings.hang_timeout)
        # Fabric has no exception hook: the calls whose collectives may meet a dead peer name it on their error
        # (fabric.backward, optimizer.step, the forward through the precision plugin, the collectives, save/load)
        self.lost_peer = LostPeer()
        self.exclude_frozen_parameters, self.verbose = settings.exclude_frozen_parameters, settings.verbose
        self.async_save = settings.async_save
        super().__init__(**lightning)
        self._process_group_backend = settings.process_group_backend
        self._num_nodes = 1
        self.meshes: Optional[runtime.Meshes] = None  # once the process group exists
        self._runner = None  # the pipelined module's runner (see lightning_zero.fabric.fabric_pipeline)
        # a bound method, not a lambda: start_method="spawn" pickles the strategy into every rank
        self._backward_sync_control = _ZeroBackwardSyncControl(self._pipeline_runner)
        self._modules: list[nn.Module] = []  # the user's modules set up so far (unwrapped)
        self._wrapped: list[nn.Module] = []  # what setup_module returned for them (DDP wrappers at stages 0-1)
        self._optimizers: list[Optimizer] = []  # their partitioned optimizers (teardown stops NVMe swapping)
        self._gradient_hooks_checked = False  # hooks added to the shards after setup: checked at the first step

    def _pipeline_runner(self) -> Any:
        return self._runner

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def ds_config(self):
        return self.settings.ds_config

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes  # Fabric's connector sets _num_nodes of a strategy that has num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return runtime.sampler_kwargs(self.meshes, self.num_nodes * self.num_processes, self.global_rank)

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def device_mesh(self):
        return runtime_steps.data_parallel_mesh_of(self.meshes)

    @property
    def checkpoint_io(self):
        return super().checkpoint_io  # Lightning's default, which only teardown reaches: saves never use it

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:  # Fabric(plugins=[MyCheckpointIO()]) sets it
        runtime_steps.refuse_checkpoint_io(io, "Fabric(plugins=...)")

    @property
    def precision(self) -> FabricZeroPrecision:
        if self._precision is None:
            self._precision = adapt_fabric_precision(Precision(), self.settings, self.lost_peer)
        return self._precision

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        adapted = adapt_fabric_precision(precision, self.settings, self.lost_peer) if precision is not None else None
        self._precision = adapted

    def _configure_launcher(self) -> None:
        start_method = self.settings.start_method
        if start_method != "popen":
            self._launcher = FabricMultiProcessingLauncher(self, start_method=start_method)
            return
        check_launcher_world_size(self.cluster_environment, self.num_nodes, self.num_processes)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        settings, environment, device = self.settings, self.cluster_environment, self.root_device
        runtime_steps.check_launch_settings(
            settings, environment, self.num_nodes, self.num_processes, device, self.process_group_backend
        )
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        self._process_group_backend, self.meshes = runtime_steps.start(
            settings, environment, self._process_group_backend, device, self.num_nodes
        )
        adopted = runtime_steps.adopt_config_precision(
            settings, self.precision.precision, print_table=self.is_global_zero
        )
        if adopted is not None:  # a ds_config's fp16/bf16 section, with Fabric left at its default precision
            self.precision = PrecisionFlag(adopted)

    def _set_world_ranks(self) -> None:  # Fabric's connector calls it before the launch too
        runtime_steps.set_world_ranks(self.cluster_environment, self.num_nodes, self.num_processes)

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``fabric.init_module()``: the model's own init, as the Trainer's ``configure_model``; ``empty_init=True``
        skips torch's layer init (:func:`lightning_zero.distributed.runtime.init_context`)."""
        init_dtype = self.precision.init_dtype()
        return runtime_steps.module_init_context(self.settings, self.num_processes, empty_init, init_dtype)

    def module_to_device(self, module: nn.Module) -> None:
        if runtime.needs_placing(module, self.zero_config, self.settings.pipeline.enabled):
            module.to(self.root_device)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """Shard ``module`` (:meth:`setup_module`), point the optimizers at its sharded parameters
        (:func:`~lightning_zero.distributed.runtime.point_at_shards`, by the names they had) and partition them
        (:meth:`setup_optimizer`). LR schedulers keep working: the optimizers are changed in place."""
        if self.settings.pipeline.enabled and optimizers:
            fabric_pipeline.refuse_optimizers_before_setup()
        names = {id(param): name for name, param in module.named_parameters(remove_duplicate=False)}
        wrapped = self.setup_module(module)
        for optimizer in optimizers:
            runtime.point_at_shards(optimizer, module, names)
        return wrapped, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Apply ZeRO (:func:`lightning_zero.distributed.runtime.wrap_module`): a ``DistributedDataParallel``
        wrapper at stages 0-1, FSDP2 in place at stages 2-3; under a pipeline, this rank's stages."""
        self.precision.device_type = self.root_device.type
        self._modules.append(module)
        if self.settings.pipeline.enabled:
            self._runner = fabric_pipeline.setup(
                module, self.settings, self.meshes, self.root_device, self.precision, runner=self._runner
            )
            return module
        wrapped = runtime_steps.wrap(module, self.settings, self.meshes, self.root_device, self.precision)
        self._wrapped.append(wrapped)
        return wrapped

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Partition (stage 1) and/or offload the optimizer in place; at stages 2-3 it must hold the sharded
        parameters (``fabric.setup(model, optimizer)`` swaps them; after ``fabric.setup_module`` build it from
        ``model.parameters()``)."""
        owner = runtime_steps.owner_of(optimizer, self._modules)
        if runtime_steps.shard_optimizer_by_settings(
            optimizer, owner, self.settings, self.meshes, self.root_device, self.precision
        ):
            self._optimizers.append(optimizer)
        return optimizer

    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if self._runner is not None:
            fabric_pipeline.refuse_backward()
        with self.lost_peer.naming(self.world_size):
            super().backward(tensor, module, *args, **kwargs)
            for wrapped in self._wrapped:  # before clipping sees them: see [Note: parameters DDP does not reduce]
                average_unfrozen_gradients_after_backward(wrapped)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if not self._gradient_hooks_checked:
            for module in self._modules:
                refuse_parameter_gradient_hooks(module, sharded_only=True)
            self._gradient_hooks_checked = True
        with self.lost_peer.naming(self.world_size):
            return super().optimizer_step(optimizer, **kwargs)

    def pipeline_step(self, model: nn.Module, inputs: Any, targets: Any, grad_scale: float = 1.0) -> Tensor:
        """Run the pipeline schedule on one batch: forward and backward of every micro-batch, gradients of
        ``grad_scale`` x the batch's mean loss accumulated into ``.grad`` (reduced over ``dp`` unless inside
        ``fabric.no_backward_sync``). Returns this data-parallel replica's mean loss on every rank; then
        ``fabric.clip_gradients`` and ``optimizer.step()`` as usual. See
        :mod:`lightning_zero.fabric.fabric_pipeline`."""
        return fabric_pipeline.step(self._runner, model, inputs, targets, grad_scale)

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """The global norm over every rank (:meth:`FabricZeroPrecision.clip_norm`)."""
        return self.precision.clip_norm(optimizer, self._runner, max_norm, norm_type, error_if_nonfinite)

    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Tensor:
        if not isinstance(tensor, Tensor):
            return tensor
        with self.lost_peer.naming(self.world_size):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self.lost_peer.naming(self.world_size):
            barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self.lost_peer.naming(self.world_size):
            return broadcast_object(obj, src)  # over the gloo control group (checkpoint/save_guards.py)

    def save_checkpoint(
        self, path, state: dict[str, Any], storage_options: Optional[Any] = None, filter: Optional[dict] = None
    ) -> None:
        runtime_steps.refuse_storage_options(storage_options)
        with self.hang_guard.phase("save"), self.lost_peer.naming(self.world_size):
            path = self.broadcast(str(path))
            fabric_checkpoints.save_with_settings(path, state, filter, self.settings, self.precision, self.global_rank)

    def load_checkpoint(
        self, path, state: Optional[dict] = None, strict: bool = True, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(
                "ZeroStrategy checkpoints are always read with weights_only=True (tensors and plain "
                "values only); weights_only=False is not honoured"
            )
        with self.hang_guard.phase("load"):
            if isinstance(state, (nn.Module, Optimizer)):  # fabric.load_raw: one file, each rank its slices
                fabric_checkpoints.load_raw(self.broadcast(str(path)), state, strict, self._modules)
                return {}
            flags = dict(async_save=self.async_save, exclude_frozen_parameters=self.exclude_frozen_parameters)
            return fabric_checkpoints.load(self.broadcast(str(path)), state, strict, precision=self.precision, **flags)

    def wait_for_checkpoints(self) -> None:
        """Wait for the pending ``async_save`` writes (collective: every rank calls it); every rank then sees the
        committed directories, and a failure on any rank raises :class:`CheckpointSaveError` on every rank."""
        with self.hang_guard.phase("save"):
            wait_for_pending_saves(barrier=_distributed_is_initialized())

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The module's (sharded) state dict, as ``fabric.save`` writes it."""
        unwrapped = module.module if isinstance(module, DistributedDataParallel) else module
        return module_state_dict(unwrapped, self._optimizers)

    def teardown(self) -> None:
        runtime_steps.finish_saves(self.hang_guard, self.lost_peer)
        runtime.release(self._modules, self._optimizers)
        self._modules.clear()
        self._wrapped.clear()
        self._optimizers.clear()
        self.precision.fp32_values.clear()
        self._runner = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """The Trainer strategy's names (``zero``, ``zero_stage_1`` ... ``zero_stage_3_offload``) in Fabric's
        registry."""
        for name, kwargs in STRATEGY_NAMES.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, **kwargs)


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    def __init__(self, runner: Callable[[], Any]) -> None:
        self._runner = runner  # the strategy's pipeline runner, when it has one

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """No gradient communication in the backward passes inside (gradient accumulation micro-steps)."""
        if not enabled:
            return nullcontext()
        return runtime.no_gradient_sync(module, self._runner())
