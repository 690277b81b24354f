"""``lightning_zero.fabric.ZeroStrategy``: Fabric's adapter over the ZeRO runtime (:mod:`.distributed.runtime`).

The same engines and the same arguments as the Trainer's :class:`lightning_zero.strategies.ZeroStrategy` (both
validate them with :func:`lightning_zero.adapters.settings.resolve_settings`). The ZeRO steps are the runtime's plain
functions; this class calls them from Fabric's: ``setup_environment`` starts the process group and builds the meshes,
``fabric.init_module`` records the model's build, ``fabric.setup`` (:meth:`setup_module_and_optimizers`) wraps the
module and shards the optimizers, ``fabric.no_backward_sync`` skips gradient reduction, ``teardown`` releases what
the run attached. Fabric's own contract: ``fabric.backward``, ``fabric.clip_gradients``, ``fabric.save``/
``fabric.load`` (:mod:`.fabric_checkpoints`), precision (:mod:`.fabric_precision`) and pipelines
(:mod:`.fabric_pipeline`).
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_zero.adapters.fork_safety import FabricMultiProcessingLauncher
from lightning_zero.adapters.launch_checks import (
    check_before_process_group,
    check_external_launch,
    check_launcher_world_size,
    offloads,
)
from lightning_zero.adapters.process_group import barrier, start_process_group
from lightning_zero.adapters.settings import SETTING_NAMES, STRATEGY_NAMES, checkpoint_save_options, resolve_settings
from lightning_zero.checkpoint.io import wait_for_pending_saves
from lightning_zero.checkpoint.save_guards import broadcast_object
from lightning_zero.checkpoint.states import module_state_dict
from lightning_zero.diagnostics.hang_guard import DEFAULT_HANG_TIMEOUT, HangGuard
from lightning_zero.diagnostics.network import DEFAULT_RENDEZVOUS_TIMEOUT
from lightning_zero.diagnostics.peers import LostPeer
from lightning_zero.distributed import runtime
from lightning_zero.distributed.apply_zero import refuse_parameter_gradient_hooks
from lightning_zero.distributed.ddp import average_unfrozen_gradients_after_backward
from lightning_zero.distributed.replicas import clip_replica_grads
from lightning_zero.ds_config import DeepSpeedConfigWarning
from lightning_zero.ds_config.binding import DeepSpeedConfigBinding, config_reduce_bucket_size, precision_from_config
from lightning_zero.fabric import fabric_checkpoints, fabric_pipeline
from lightning_zero.fabric.fabric_precision import FabricZeroPrecision, PrecisionFlag, adapt_fabric_precision

# ds_config settings that drive the Trainer's loop; in Fabric the user's loop does these, so they are refused.
_LOOP_SETTINGS = ("optimizer", "scheduler", "gradient_clipping", "gradient_accumulation_steps", "train_batch_size",
                  "train_micro_batch_size_per_gpu", "steps_per_print", "wall_clock_breakdown")


class ZeroStrategy(ParallelStrategy):
    """DeepSpeed's ZeRO stages 0-3 with CPU offload for Lightning Fabric, on DDP and FSDP2.

    Takes the arguments of :class:`lightning_zero.strategies.ZeroStrategy` (see its docstring for each), including
    DeepSpeedStrategy's own (``docs/deepspeed_arguments.md``), with these Fabric meanings:

    * ``fabric.setup(model, optimizer)`` shards the model and partitions the optimizers; at stages 2-3 the optimizer
      may be created before ``setup``: its parameters are replaced by the sharded ones (by name).
    * ``fabric.clip_gradients(model, optimizer, max_norm=...)`` clips the global norm over every rank's shards;
      with fp16 it first unscales (and detects overflow), as DeepSpeed does before clipping.
    * ``fabric.no_backward_sync(model, enabled=...)`` skips gradient communication on accumulation micro-steps.
    * ``fabric.save(path, state)`` writes a sharded, atomic checkpoint directory (``state_dict_type="full"``: one
      file in Fabric's own layout, which a single-device Fabric loads too); ``fabric.load(path, state)`` loads
      either, or a single-device/DDP Fabric checkpoint file, in place at any stage or world size
      (:mod:`lightning_zero.fabric.fabric_checkpoints`); a plain value under a key the checkpoint uses itself
      (``state_dict``, ``fabric_state_keys``, ...) is refused by name.
    * ``fabric.load_raw(path, model_or_optimizer)`` reads one ``torch.save`` or ``.safetensors`` file, each rank its
      slices; ``model.load_state_dict(full_state_dict)`` works after setup at every stage
      (:mod:`lightning_zero.distributed.full_tensor_load`).
    * ``fabric.init_module()`` builds the model on CPU running its own init, as the Trainer's ``configure_model``;
      ``empty_init=True`` skips torch's layer init as Lightning's DDP does (the script initialises the weights), and
      a model built on the meta device gets its values from ``reset_parameters()`` at setup (``docs/fabric.md``).
    * ``hang_timeout`` guards ``fabric.save``/``fabric.load`` and teardown (Fabric has no step hooks).
    * Precision: ``Fabric(precision=...)`` with ``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``16-true``
      (:mod:`lightning_zero.fabric.fabric_precision`); fp16 uses DeepSpeed's loss scaling with the loss-scale arguments.
    * ``async_save=True``: ``fabric.save`` writes in the background, awaited by the next save/load,
      :meth:`wait_for_checkpoints`, :meth:`teardown`, and (locally, with a warning) at exit
      (``[Note: async saves under Fabric]`` in :mod:`lightning_zero.fabric.fabric_checkpoints`).
    * ``pipeline_parallel_size > 1``: ``fabric.setup_module(pipeline_module)`` builds this rank's stages and
      :meth:`pipeline_step` runs the schedule (:mod:`lightning_zero.fabric.fabric_pipeline`); ``fabric.backward``
      is refused under a pipeline.

    Refused (no Fabric meaning yet): ``auto_resume=True`` (there are no ``ModelCheckpoint`` directories to resume
    from), and a ds_config that sets loop settings (``optimizer``, ``scheduler``, ``gradient_clipping``,
    accumulation, batch sizes, ``steps_per_print``, ``wall_clock_breakdown``): write them in the loop;
    ``load_full_weights=True`` (the state passed to ``fabric.load`` says what is loaded: leave the optimizer out to
    load the weights alone); a
    CheckpointIO plugin, given here or through ``Fabric(plugins=...)`` (saves never call it).
    """

    strategy_name = "zero"

    def __init__(
        self,
        # Literal: LightningCLI (jsonargparse) refuses stage=4 or offload="gpu" while it parses the config
        stage: Optional[Literal[0, 1, 2, 3]] = None, offload: Optional[Literal["none", "cpu", "nvme"]] = None,
        offload_optimizer: Union[str, bool, None] = None,
        offload_params: Optional[str] = None, nvme_path: Optional[str] = None,
        buffer_count: Optional[int] = None, sub_group_size: Optional[int] = None, buffer_size: Optional[int] = None,
        max_in_cpu: Optional[int] = None, aio: Optional[dict] = None, pin_memory: Optional[bool] = None,
        sharded_module_classes: Optional[Union[set, list, tuple]] = None,
        reshard_after_forward: Optional[Union[bool, int]] = None, accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None, cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None, precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen", async_save: bool = False, communication_data_type: Optional[str] = None,
        loss_scale: Optional[float] = None, initial_scale_power: Optional[int] = None,
        loss_scale_window: Optional[int] = None, hysteresis: Optional[int] = None,
        consecutive_hysteresis: Optional[bool] = None, min_loss_scale: Optional[float] = None,
        config: Optional[Union[str, dict]] = None, strict: bool = True, pipeline_parallel_size: Optional[int] = None,
        micro_batches: Optional[int] = None, pipeline_schedule: Optional[str] = None,
        virtual_stages: Optional[int] = None, find_unused_parameters: Optional[bool] = None,
        static_graph: Optional[bool] = None, gradient_as_bucket_view: Optional[bool] = None,
        bucket_cap_mb: Optional[float] = None, exclude_frozen_parameters: bool = False, verbose: bool = False,
        hang_timeout: Optional[Union[float, timedelta]] = DEFAULT_HANG_TIMEOUT, auto_resume: Union[bool, str] = False,
        activation_checkpointing: Any = None, cpu_checkpointing: Optional[bool] = None,
        activation_checkpointing_policy: Any = None, load_full_weights: bool = False,
        hybrid_shard_size: Optional[int] = None,
        rendezvous_timeout: Union[float, timedelta] = DEFAULT_RENDEZVOUS_TIMEOUT, unit_bytes: Optional[int] = None,
        param_persistence_threshold: Optional[int] = None, prefetch_bytes: Optional[int] = None,
        state_dict_type: Literal["sharded", "full"] = "sharded", broadcast_buffers: Optional[bool] = None,
        # DeepSpeedStrategy's own arguments, same names and types (None: the config's value, else DeepSpeed's
        # default); each becomes the ds_config key it stands for (ds_config/strategy_arguments.py)
        zero_optimization: Optional[bool] = None, remote_device: Optional[str] = None,
        offload_parameters: Optional[bool] = None, offload_params_device: Optional[str] = None,
        params_buffer_count: Optional[int] = None, params_buffer_size: Optional[int] = None,
        offload_optimizer_device: Optional[str] = None, optimizer_buffer_count: Optional[int] = None,
        block_size: Optional[int] = None, queue_depth: Optional[int] = None, single_submit: Optional[bool] = None,
        overlap_events: Optional[bool] = None, thread_count: Optional[int] = None,
        contiguous_gradients: Optional[bool] = None, overlap_comm: Optional[bool] = None,
        allgather_partitions: Optional[bool] = None, reduce_scatter: Optional[bool] = None,
        allgather_bucket_size: Optional[int] = None, reduce_bucket_size: Optional[int] = None,
        zero_allow_untested_optimizer: Optional[bool] = None, logging_batch_size_per_gpu: Union[str, int, None] = None,
        logging_level: Optional[int] = None, partition_activations: Optional[bool] = None,
        contiguous_memory_optimization: Optional[bool] = None, synchronize_checkpoint_boundary: Optional[bool] = None,
    ) -> None:
        settings = resolve_settings(**{name: value for name, value in locals().items() if name in SETTING_NAMES})
        if settings.auto_resume:
            raise ValueError("auto_resume=True resumes from the Trainer's ModelCheckpoint directories, which Fabric "
                             "has not: call fabric.load(path, state) yourself, and leave auto_resume=False")
        if settings.load_full_weights:
            raise NotImplementedError("load_full_weights=True is not supported with Fabric: the state given to "
                                      "fabric.load says what is loaded (fabric.load(path, {'model': model}) loads the "
                                      "weights alone, from a checkpoint directory or file); a bare state dict file "
                                      "loads with fabric.load_raw(path, model). Leave load_full_weights=False")
        _refuse_loop_settings(settings.ds_config)
        self.settings = settings
        self.zero_config = settings.zero_config
        self.hang_guard = HangGuard(settings.hang_timeout)
        # Fabric has no exception hook: the calls whose collectives may meet a dead peer name it on their error
        # (fabric.backward, optimizer.step, the forward through the precision plugin, the collectives, save/load)
        self.lost_peer = LostPeer()
        self.exclude_frozen_parameters, self.verbose = settings.exclude_frozen_parameters, settings.verbose
        self.async_save = settings.async_save
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)
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

    # ------------------------------------------------------------------ properties
    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def ds_config(self) -> Optional[DeepSpeedConfigBinding]:
        return self.settings.ds_config

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

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
        if self.meshes is None:
            raise RuntimeError("The device mesh exists only after the process group was set up")
        return self.meshes.data_parallel

    @property
    def checkpoint_io(self):
        return super().checkpoint_io  # Lightning's default, which only teardown reaches: saves never use it

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:
        # Fabric(plugins=[MyCheckpointIO()]) sets this; the constructor's checkpoint_io is refused in resolve_settings
        if io is not None:
            raise NotImplementedError(
                f"ZeroStrategy does not use a CheckpointIO plugin ({type(io).__name__}): fabric.save and fabric.load "
                "write and read sharded checkpoint directories with torch.distributed.checkpoint themselves, so the "
                "plugin would never be called. Remove it from Fabric(plugins=...)")

    @property
    def precision(self) -> FabricZeroPrecision:
        if self._precision is None:
            self._precision = self._adapt(Precision())
        return self._precision

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        self._precision = self._adapt(precision) if precision is not None else None

    def _adapt(self, plugin: Precision) -> FabricZeroPrecision:
        s = self.settings
        adapted = adapt_fabric_precision(plugin, stage=self.stage, loss_scale_config=s.loss_scale_config,
                                         fp16_loss_scale_config=s.fp16_loss_scale_config,
                                         communication_data_type=s.communication_data_type)
        adapted.lost_peer = self.lost_peer  # the module's forward runs in its forward_context
        return adapted

    # ------------------------------------------------------------------ launch and process group
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.settings.start_method == "popen":
            check_launcher_world_size(self.cluster_environment, self.num_nodes, self.num_processes)
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                           self.num_nodes)
        else:
            self._launcher = FabricMultiProcessingLauncher(self, start_method=self.settings.start_method)

    def setup_environment(self) -> None:
        device = self.root_device
        # The checks the Trainer strategy runs too, on every rank before init_process_group
        check_external_launch(self.cluster_environment, self.num_nodes, self.num_processes,
                              self.settings.start_method)
        check_before_process_group(num_nodes=self.num_nodes, num_processes=self.num_processes,
                                   node_rank=self.node_rank, device=device, backend=self.process_group_backend,
                                   zero_config=self.zero_config, pipeline=self.settings.pipeline)
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = start_process_group(
            self.cluster_environment, self._process_group_backend, device, timeout=self.settings.timeout,
            rendezvous_timeout=self.settings.rendezvous_timeout, num_nodes=self.num_nodes, node_rank=self.node_rank,
            global_rank=self.global_rank, world_size=self.world_size, offloads=offloads(self.zero_config))
        self.meshes = runtime.build_meshes(device.type, self.world_size,
                                           pipeline_parallel_size=self.settings.pipeline.pipeline_parallel_size,
                                           hybrid_shard_size=self.zero_config.hybrid_shard_size)
        self._adopt_config_precision()

    def _adopt_config_precision(self) -> None:
        """A ds_config's fp16/bf16 section applies when Fabric was left at its default precision (as the Trainer)."""
        binding = self.ds_config
        if binding is None:
            return
        adopted = precision_from_config(binding.precision, self.precision.precision)
        if adopted is not None:
            self.precision = PrecisionFlag(adopted)
        if self.is_global_zero:
            binding.print_table(verbose=self.verbose)

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model and optimizers
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``fabric.init_module()``: the model's own init runs exactly as on CPU, as the Trainer strategy's
        ``configure_model``; ``empty_init=True`` skips the init of torch's layers as Lightning's strategies do
        (:func:`lightning_zero.distributed.runtime.init_context`)."""
        return runtime.init_context(self.zero_config, pipelined=self.settings.pipeline.enabled,
                                    local_world_size=self.num_processes, empty_init=empty_init,
                                    init_dtype=self.precision.init_dtype())

    def module_to_device(self, module: nn.Module) -> None:
        if runtime.needs_placing(module, self.zero_config, self.settings.pipeline.enabled):
            module.to(self.root_device)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Optional[Any] = None) -> tuple[nn.Module, list[Optimizer], Any]:
        """Shard ``module`` (:meth:`setup_module`), point the optimizers at its sharded parameters and partition
        them (:meth:`setup_optimizer`). LR schedulers keep working: the optimizers are changed in place."""
        if self.settings.pipeline.enabled and optimizers:
            raise ValueError("with pipeline_parallel_size > 1 create the optimizer after fabric.setup_module(model): "
                             "setup builds and keeps only this rank's pipeline stages, so an optimizer made before "
                             "holds parameters the model no longer has (docs/fabric.md, Pipeline parallelism)")
        names = {id(param): name for name, param in module.named_parameters(remove_duplicate=False)}
        wrapped = self.setup_module(module)
        for optimizer in optimizers:
            _replace_parameters(optimizer, names, dict(module.named_parameters(remove_duplicate=False)))
        return wrapped, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Apply ZeRO (:func:`lightning_zero.distributed.runtime.wrap_module`): a ``DistributedDataParallel``
        wrapper at stages 0-1, FSDP2 in place at stages 2-3; under a pipeline, this rank's stages."""
        precision = self.precision
        precision.device_type = self.root_device.type
        self._modules.append(module)
        if self.settings.pipeline.enabled:
            self._runner = fabric_pipeline.setup(module, self.settings.pipeline, self.meshes, self.stage,
                                                 self.root_device, precision,
                                                 self.settings.activation_checkpoint_config, runner=self._runner)
            return module
        wrapped = runtime.wrap_module(module, self.meshes.data_parallel, self.zero_config, device=self.root_device,
                                      ddp_options=self.settings.ddp_options,
                                      reduce_bucket_size=config_reduce_bucket_size(self.ds_config),
                                      activation_checkpointing=self.settings.activation_checkpoint_config,
                                      **precision.wrap_module_kwargs(self.zero_config))
        self._wrapped.append(wrapped)
        return wrapped

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Partition (stage 1) and/or offload the optimizer in place; at stages 2-3 it must hold the sharded
        parameters (``fabric.setup(model, optimizer)`` swaps them; after ``fabric.setup_module`` build it from
        ``model.parameters()``)."""
        owners = [m for m in self._modules if _holds(m, optimizer)]
        owner = owners[0] if owners else (self._modules[-1] if self._modules else None)
        mesh = self.meshes.data_parallel if self.meshes is not None else None
        if runtime.shard_optimizer_of(optimizer, owner, mesh, self.zero_config, device=self.root_device,
                                      pipelined=self.settings.pipeline.enabled,
                                      fp32_values=self.precision.replica_fp32_values()):
            self._optimizers.append(optimizer)
        return optimizer

    # ------------------------------------------------------------------ backward, clipping, collectives
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

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """The global norm over every rank: stage-1 optimizers clip the whole module's (all-reduced) gradients,
        sharded stages their DTensor shards (``clip_grad_norm_`` reduces the norm across the mesh)."""
        self.precision.unscale_gradients(optimizer)
        params = list(self.precision.main_params(optimizer))
        if self._runner is not None:
            return fabric_pipeline.clip(self._runner, params, max_norm, norm_type, error_if_nonfinite)
        if self.precision.replicas_cast:  # bf16 replicas' gradients: the norm in fp32
            return clip_replica_grads(params, max_norm, norm_type, error_if_nonfinite)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm, norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None,
                   reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            with self.lost_peer.naming(self.world_size):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self.lost_peer.naming(self.world_size):
            barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self.lost_peer.naming(self.world_size):
            return broadcast_object(obj, src)  # over the gloo control group (checkpoint/save_guards.py)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict] = None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint does not take storage_options: it writes with "
                            "torch.distributed.checkpoint")
        with self.hang_guard.phase("save"), self.lost_peer.naming(self.world_size):
            fabric_checkpoints.save(
                self.broadcast(str(path)), state, filter, precision=self.precision, zero_config=self.zero_config,
                exclude_frozen_parameters=self.exclude_frozen_parameters, async_save=self.async_save,
                state_dict_type=self.settings.state_dict_type, rank=self.global_rank,
                **checkpoint_save_options(self.ds_config, self.precision.precision))

    def load_checkpoint(self, path, state: Optional[dict] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError("ZeroStrategy checkpoints are always read with weights_only=True (tensors and plain "
                             "values only); weights_only=False is not honoured")
        if isinstance(state, (nn.Module, Optimizer)):  # fabric.load_raw: one file's state dict, each rank its slices
            with self.hang_guard.phase("load"):
                fabric_checkpoints.load_raw(self.broadcast(str(path)), state, strict, self._modules)
            return {}
        with self.hang_guard.phase("load"):
            return fabric_checkpoints.load(self.broadcast(str(path)), state, strict, precision=self.precision,
                                           async_save=self.async_save,
                                           exclude_frozen_parameters=self.exclude_frozen_parameters)

    def wait_for_checkpoints(self) -> None:
        """Wait for the pending ``async_save`` writes (collective: every rank calls it); every rank then sees the
        committed directories, and a failure on any rank raises :class:`CheckpointSaveError` on every rank."""
        with self.hang_guard.phase("save"):
            wait_for_pending_saves(barrier=_distributed_is_initialized())

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The module's (sharded) state dict, as ``fabric.save`` writes it."""
        return module_state_dict(module.module if isinstance(module, DistributedDataParallel) else module,
                                 self._optimizers)

    def teardown(self) -> None:
        with self.hang_guard.teardown():  # an async save must land before exit; after a lost peer, this rank's only
            wait_for_pending_saves(barrier=_distributed_is_initialized() and not self.lost_peer.lost)
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


def _holds(module: nn.Module, optimizer: Optimizer) -> bool:
    owned = {id(p) for p in module.parameters()}
    return any(id(p) in owned for group in optimizer.param_groups for p in group["params"])


def _replace_parameters(optimizer: Optimizer, names: dict[int, str], sharded: dict[str, nn.Parameter]) -> None:
    """Point ``optimizer`` at the parameters ``fully_shard`` put in place of those it was built with (by name).

    FSDP2 replaces every parameter with a new DTensor parameter; an optimizer built before ``fabric.setup`` would
    otherwise step tensors no gradient reaches. Tensors that were not the module's are left for
    :func:`~lightning_zero.distributed.runtime.check_optimizer_params` to refuse."""
    if optimizer.state:
        raise RuntimeError("fabric.setup needs a fresh optimizer (no state yet): its states belong to the unsharded "
                           "parameters. Load optimizer states after setup, with fabric.load")
    for group in optimizer.param_groups:
        group["params"] = [sharded.get(names.get(id(p)), p) if id(p) in names else p for p in group["params"]]


def _refuse_loop_settings(binding: Optional[DeepSpeedConfigBinding]) -> None:
    if binding is None:
        return
    translation = binding.translation
    present = []
    for key in _LOOP_SETTINGS:
        value = getattr(translation, key, None)
        if key in binding.argument_aliases:  # logging_batch_size_per_gpu: only DeepSpeed's samples/s log used it
            warnings.warn(f"{binding.argument_aliases[key]} has no effect with Fabric: your loop sizes the batches "
                          "(DeepSpeed only used it for its samples/s log); it is ignored", DeepSpeedConfigWarning)
            continue
        if value in (None, "auto", {}, False) or (key == "gradient_clipping" and value == 0) or \
                (key == "gradient_accumulation_steps" and value == 1):
            continue
        present.append(f"{key}={value!r}")
    if present:
        raise ValueError(f"the ds_config sets {', '.join(present)}, which the Trainer applies to its loop; with "
                         "Fabric the loop is yours (create the optimizer/scheduler, call fabric.clip_gradients, "
                         "accumulate with fabric.no_backward_sync, size the DataLoader). Remove them from the config "
                         "or set them to \"auto\"")
