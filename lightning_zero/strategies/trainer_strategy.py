"""``ZeroStrategy``: the Trainer's adapter over the ZeRO runtime (:mod:`lightning_zero.distributed.runtime`).

The ZeRO steps are the runtime's plain functions; this class calls them from Lightning's hooks, in order:
``setup_environment`` starts the process group and builds the meshes, ``tensor_init_context`` records the model's
build, ``setup`` wraps the module and shards the optimizers, ``block_backward_sync`` skips gradient reduction on
accumulation micro-steps, ``teardown`` releases what the run attached. Everything else here is Lightning's
contract: precision (:mod:`.trainer_precision`), checkpoints (:mod:`.trainer_checkpoints`), a ds_config's Trainer
settings (:mod:`.ds_config_fit`), launch checks, preemption and automatic resume.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Generator, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from lightning_zero.adapters.launch_checks import (
    check_before_process_group,
    check_external_launch,
    check_launcher_world_size,
    offloads,
)
from lightning_zero.adapters.precision_policy import PrecisionFlag
from lightning_zero.adapters.process_group import barrier, start_process_group
from lightning_zero.adapters.settings import SETTING_NAMES, STRATEGY_NAMES, checkpoint_save_options, resolve_settings
from lightning_zero.checkpoint.io import wait_for_pending_saves
from lightning_zero.checkpoint.save_guards import broadcast_object
from lightning_zero.checkpoint.states import module_state_dict, optimizer_state_dict
from lightning_zero.diagnostics.hang_guard import DEFAULT_HANG_TIMEOUT, HangGuard
from lightning_zero.diagnostics.network import DEFAULT_RENDEZVOUS_TIMEOUT
from lightning_zero.diagnostics.peers import LostPeer
from lightning_zero.distributed import runtime
from lightning_zero.distributed.apply_zero import swap_parameters
from lightning_zero.distributed.ddp import EarlyBucketRebuild, explain_unused_parameters, prepare_manual_backward
from lightning_zero.distributed.manual_backward import ManualBackward
from lightning_zero.ds_config.binding import DeepSpeedConfigBinding, config_reduce_bucket_size
from lightning_zero.pipeline.zero_pipeline import setup_pipeline
from lightning_zero.strategies import auto_resume, lifecycle, trainer_checkpoints
from lightning_zero.strategies.ckpt_path_check import ValidatingLauncher, check_launch
from lightning_zero.strategies.ds_config_fit import (
    bind_at_setup,
    check_config_against_trainer,
    effective_config_of_fit,
    install_config_optimizers,
    scheduler_from_config,
    uninstall_config_optimizers,
)
from lightning_zero.strategies.forward_redirection import RootForwardRedirection, forward_redirection_for
from lightning_zero.strategies.multiprocessing_launcher import ZeroMultiProcessingLauncher
from lightning_zero.strategies.optimizer_toggle import install_partition_aware_toggle, uninstall_partition_aware_toggle
from lightning_zero.strategies.pipeline_gradients import PipelineGradients
from lightning_zero.strategies.trainer_precision import (
    ZeroPrecision,
    adapt_precision_plugin,
    guard_schedulers,
)

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ZeroStrategy(ParallelStrategy):
    """DeepSpeed's ZeRO stages 0-3 with CPU offload for Lightning, on DDP and FSDP2.

    Stage 0 is DDP; 1 is DDP with the optimizer partitioned in place; 2 and 3 are FSDP2 ``fully_shard`` with
    ``reshard_after_forward`` False and True (bytes per rank: ``docs/stages.md``, ``lightning_zero.estimate_memory``).

    Args:
        stage: ZeRO stage, 0-3 (default 2, or the config's).
        offload: ``None``, ``"cpu"`` (optimizer states and fp32 masters live and step in CPU memory; at stage 3
            the sharded parameters and gradients too, as DeepSpeed's ``zero_stage_3_offload``) or ``"nvme"``; the
            precise ``offload_optimizer``/``offload_params`` and the NVMe knobs: see ``docs/offload.md``.
        pin_memory: pin offloaded CPU tensors (default: when computing on CUDA).
        sharded_module_classes: classes or class names that become FSDP units at stages 2-3 (default: repeated blocks).
        reshard_after_forward: stage-3 override of FSDP2's ``reshard_after_forward``, for every unit: ``True``
            also reshards the root and the last unit, which the default keeps (see ``ZeroConfig``).
        process_group_backend, timeout: ``"gloo"``, ``"nccl"``, ... (default: from the accelerator); the
            process-group timeout, a positive ``timedelta`` or number of seconds.
        start_method: ``"popen"`` (re-run the script per rank, like ``DDPStrategy``), ``"spawn"``, ``"fork"``.
        async_save: write checkpoints in the background (staged to CPU first; the next save, a load and the end
            of training wait for it). Every save is atomic: a crash mid-save leaves the previous one loadable.
        communication_data_type: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: the gradients' reduce dtype.
        loss_scale, initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale:
            DeepSpeed's fp16 loss-scale knobs, same names, meanings and defaults (``loss_scale=0``: dynamic). Only
            valid with an fp16 Trainer precision (``16-mixed``/``16-true``); see ``docs/precision.md``.
        config: a DeepSpeed ``ds_config`` (dict, ``.json``/``.yaml`` path or JSON string). Its settings fill every
            argument left at ``None``; explicit arguments win. ``"auto"`` values are resolved at setup from the
            Trainer, DataLoader and LightningModule; see ``docs/ds_config.md``.
        strict: with ``config``, unknown keys and unsupported features are errors (``False``: warnings).
        pipeline_parallel_size, micro_batches, pipeline_schedule, virtual_stages: pipeline parallelism over a
            ``PipelineModule``, ZeRO on the data-parallel dimension (``docs/pipeline.md``).
        find_unused_parameters, static_graph, gradient_as_bucket_view, bucket_cap_mb: ``DDPStrategy``'s options for
            the DDP of stages 0-1 (:mod:`lightning_zero.distributed.ddp`); unlike ``DDPStrategy``,
            ``gradient_as_bucket_view`` defaults to True (one gradient buffer per rank).
        broadcast_buffers: every rank takes rank 0's buffers before a forward, on DDP's schedule, at every stage (the
            default, except under a pipeline); ``False``: each rank keeps its own (``docs/stages.md``, "Buffers").
        exclude_frozen_parameters, verbose: frozen parameters stay out of checkpoints; print the whole ds_config.
        hang_timeout: seconds (or ``timedelta``) a step, validation batch, checkpoint save/load or teardown may last
            before the job exits naming the stuck rank(s) with every rank's stacks (default 600; ``None``: off).
        auto_resume: on a restarted job (``"always"``: every fit) without ``ckpt_path``, resume from the newest
            complete checkpoint; checkpoint on preemption signals (:mod:`.auto_resume`, :mod:`.preemption`).
        hybrid_shard_size: HSDP: shard within groups of this many ranks, replicate across (opt-in).
        activation_checkpointing, cpu_checkpointing, activation_checkpointing_policy: recompute blocks' activations
            in backward, optionally keeping their inputs on CPU (``docs/activation_checkpointing.md``).
        load_full_weights: ``ckpt_path`` must be one file, which may lack optimizer states (``trainer_checkpoints.py``).
        rendezvous_timeout: seconds a multi-node start waits for every node before naming the missing ones (300).
        state_dict_type: ``"sharded"`` (a checkpoint directory) or ``"full"`` (one torch file, streamed out of the
            shards; :mod:`lightning_zero.checkpoint.full_save`), as Lightning's ``FSDPStrategy``.
        unit_bytes, param_persistence_threshold, prefetch_bytes: stages 2-3: consecutive blocks share one FSDP2
            unit up to ``unit_bytes`` parameter bytes (``0``: a unit per block); units under
            ``param_persistence_threshold`` elements stay in the root; prefetch of the next units' all-gathers up to
            ``prefetch_bytes`` (:mod:`lightning_zero.distributed.units`, ``docs/units.md``).

    ``DeepSpeedStrategy``'s other arguments (``zero_optimization``, ``offload_parameters``, ``overlap_comm``, ...,
    and ``offload_optimizer=True``) are taken with its names and types: each becomes the ds_config key it stands
    for, so it is honoured, warned about or refused as that key is (``docs/deepspeed_arguments.md``).

    As ``DeepSpeedStrategy``: without ``config`` the file ``PL_DEEPSPEED_CONFIG_PATH`` names is read, and
    :attr:`config` is the effective ds_config as a dict.

    Precision comes from the Trainer's ``precision`` flag (``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``,
    ``16-true``): fp32 master weights and optimizer states, low-precision compute, DeepSpeed's dynamic loss scaling
    for fp16 (:mod:`lightning_zero.adapters.precision_policy`).
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
        checkpoint_io: Optional[Any] = None, precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
        start_method: StartMethod = "popen", async_save: bool = False, communication_data_type: Optional[str] = None,
        loss_scale: Optional[float] = None, initial_scale_power: Optional[int] = None,
        loss_scale_window: Optional[int] = None, hysteresis: Optional[int] = None,
        consecutive_hysteresis: Optional[bool] = None, min_loss_scale: Optional[float] = None,
        config: Optional[Union[str, dict]] = None, strict: bool = True, pipeline_parallel_size: Optional[int] = None,
        micro_batches: Optional[int] = None, pipeline_schedule: Optional[str] = None,
        virtual_stages: Optional[int] = None, find_unused_parameters: Optional[bool] = None,
        static_graph: Optional[bool] = None, gradient_as_bucket_view: Optional[bool] = None,
        bucket_cap_mb: Optional[float] = None, exclude_frozen_parameters: bool = False, verbose: bool = False,
        hang_timeout: Optional[Union[float, timedelta]] = DEFAULT_HANG_TIMEOUT, auto_resume: Union[bool, str] = True,
        hybrid_shard_size: Optional[int] = None, activation_checkpointing: Any = None,
        cpu_checkpointing: Optional[bool] = None, activation_checkpointing_policy: Any = None,
        load_full_weights: bool = False, rendezvous_timeout: Union[float, timedelta] = DEFAULT_RENDEZVOUS_TIMEOUT,
        unit_bytes: Optional[int] = None, param_persistence_threshold: Optional[int] = None,
        prefetch_bytes: Optional[int] = None, state_dict_type: Literal["sharded", "full"] = "sharded",
        broadcast_buffers: Optional[bool] = None,
        # DeepSpeedStrategy's own arguments (None: the config's, else DeepSpeed's): ds_config/strategy_arguments.py
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
        # Validate everything before Lightning (or anyone) starts a process group; shared with the Fabric strategy.
        self.settings = settings = resolve_settings(
            **{name: value for name, value in locals().items() if name in SETTING_NAMES})
        self.zero_config = settings.zero_config
        self.hang_guard = HangGuard(settings.hang_timeout)
        self.lost_peer = LostPeer()  # set when a collective failed on a dead peer: teardown then skips its agreement
        self.ckpt_path_asked: Optional[str] = None  # the fit's ckpt_path before Lightning resolves it (launchers)
        self.exclude_frozen_parameters, self.verbose, self.auto_resume = (
            settings.exclude_frozen_parameters, settings.verbose, settings.auto_resume)
        self.activation_checkpoint_config, self.load_full_weights = (settings.activation_checkpoint_config,
                                                                     settings.load_full_weights)
        self.async_save = settings.async_save
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin)
        self._process_group_backend = settings.process_group_backend
        self._num_nodes = 1
        self.meshes: Optional[runtime.Meshes] = None  # once the process group exists
        self._runner = None  # the pipeline's runner (pipeline_parallel_size > 1)
        self._pipeline_grads = PipelineGradients()
        self._teardown_handles: list = []  # hooks setup added to the user's module, removed at teardown
        self._manual_backward: Optional[ManualBackward] = None
        self._forward_redirection = _DDPForwardRedirection() if self.stage <= 1 else RootForwardRedirection()

    # ------------------------------------------------------------------ properties Lightning reads
    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def ds_config(self) -> Optional[DeepSpeedConfigBinding]:
        """The DeepSpeed config binding (``None`` without ``config=`` or ``PL_DEEPSPEED_CONFIG_PATH``)."""
        return self.settings.ds_config

    @property
    def config(self) -> dict:
        """The effective DeepSpeed config as a read-only dict, as ``DeepSpeedStrategy.config``."""
        return effective_config_of_fit(self.ds_config, self.zero_config, self.settings.communication_data_type,
                                       self._precision_plugin, self._trainer())

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
    def is_distributed(self) -> bool:
        """True once the process group exists; torchmetrics and ``sync_dist`` use it to decide to reduce."""
        return _distributed_is_initialized()

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
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = self._adapt(Precision())
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = self._adapt(plugin) if plugin is not None else None

    def _adapt(self, plugin: Precision) -> Precision:
        settings = self.settings
        fp16 = str(getattr(plugin, "precision", "")).startswith("16-")
        scaling = settings.fp16_loss_scale_config if fp16 else settings.loss_scale_config
        if isinstance(plugin, ZeroPrecision):
            scaling = settings.loss_scale_config
        return adapt_precision_plugin(plugin, stage=self.stage, loss_scale_config=scaling,
                                      communication_data_type=settings.communication_data_type)

    def _bind_ds_config(self, trainer) -> None:
        """Resolve the ds_config against the Trainer, adopt its precision, print it (see ds_config_fit)."""
        # DeepSpeed's batch arithmetic counts data-parallel replicas: under a pipeline, the "dp" mesh
        replicas = self.meshes.data_parallel.size() if self.meshes is not None else self.world_size
        adopted = bind_at_setup(self.ds_config, trainer, self.precision_plugin.precision, replicas)
        if adopted is not None:
            self.precision_plugin = PrecisionFlag(adopted)  # adapted like Lightning's own choice would be
        if self.is_global_zero:
            self.ds_config.print_table(verbose=self.verbose)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # optimizer states can only be loaded into the sharded optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores them, sharded

    def connect(self, model) -> None:
        super().connect(model)
        if self.ds_config is not None and self.ds_config.translation.optimizer is not None:
            install_config_optimizers(model, self.ds_config)

    # ------------------------------------------------------------------ launch and process group
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.settings.start_method == "popen":
            check_launcher_world_size(self.cluster_environment, self.num_nodes, self.num_processes)
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = check_launch(_SubprocessScriptLauncher(
                    self.cluster_environment, self.num_processes, self.num_nodes))
            else:  # ckpt_path is still checked before the process group (see ckpt_path_check.ValidatingLauncher)
                self._launcher = ValidatingLauncher()
        else:
            self._launcher = ZeroMultiProcessingLauncher(self, start_method=self.settings.start_method)

    def setup_environment(self) -> None:
        self._check_before_process_group()  # on every rank, before init_process_group
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = start_process_group(
            self.cluster_environment, self._process_group_backend, self.root_device, timeout=self.settings.timeout,
            rendezvous_timeout=self.settings.rendezvous_timeout, num_nodes=self.num_nodes, node_rank=self.node_rank,
            global_rank=self.global_rank, world_size=self.world_size, offloads=offloads(self.zero_config))
        self.meshes = runtime.build_meshes(self.root_device.type, self.world_size,
                                           pipeline_parallel_size=self.settings.pipeline.pipeline_parallel_size,
                                           hybrid_shard_size=self.zero_config.hybrid_shard_size)
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self.meshes.world
        self.hang_guard.start(self.global_rank, self.world_size, self.node_rank)
        if self.auto_resume:
            auto_resume.install_auto_resume(self._trainer(), self.auto_resume, self.broadcast, self.ckpt_path_asked)

    def _check_before_process_group(self) -> None:
        """Everything checkable on each rank before ``init_process_group``: the launch and the settings against the
        devices (shared with Fabric), then the Trainer's own (``sync_batchnorm`` off GPU, callbacks stages 2-3 cannot
        run, the ds_config's precision, clipping, accumulation and batch arithmetic against the Trainer's flags)."""
        check_external_launch(self.cluster_environment, self.num_nodes, self.num_processes, self.settings.start_method)
        data_parallel = check_before_process_group(
            num_nodes=self.num_nodes, num_processes=self.num_processes, node_rank=self.node_rank,
            device=self.root_device, backend=self.process_group_backend, zero_config=self.zero_config,
            pipeline=self.settings.pipeline)
        trainer = self._trainer()
        if self.ds_config is not None and trainer is not None:
            check_config_against_trainer(self.ds_config, trainer, self.precision_plugin.precision, data_parallel)
        lifecycle.check_trainer_before_process_group(trainer, self.root_device, self.stage, self._layer_sync)

    def _trainer(self):
        module = self.lightning_module
        return getattr(module, "_trainer", None) if module is not None else None

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model and optimizers
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``configure_model`` and ``Trainer.init_module`` run the model's own init, recorded at stages 2-3 and
        replayed per unit by ``setup``; ``Trainer.init_module(empty_init=True)`` skips torch's layer init as Lightning
        does (not passed around ``configure_model``, which always runs the init; :func:`runtime.init_context`)."""
        with runtime.init_context(self.zero_config, pipelined=self.settings.pipeline.enabled,
                                  local_world_size=self.num_processes, empty_init=empty_init,
                                  init_dtype=self.precision_plugin.init_dtype()), \
                self.precision_plugin.tensor_init_context():
            yield

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        trainer_checkpoints.prepare_checkpoint_callbacks(self.async_save, trainer.checkpoint_callbacks)
        if self.ds_config is not None:
            self._bind_ds_config(trainer)
        self.precision_plugin.device_type = self.root_device.type
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.model = lifecycle.apply_layer_sync(self._layer_sync, self.model, fitting)  # before any wrapping
        self.precision_plugin.convert_module(self.model)
        self._wrap_model(trainer, fitting)
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _wrap_model(self, trainer, fitting: bool) -> None:
        """Step 3 of the runtime for the LightningModule: its pipeline, FSDP2 units or DDP wrapper."""
        precision, meshes = self.precision_plugin, self.meshes
        if self.settings.pipeline.enabled:
            self._runner = setup_pipeline(
                self.lightning_module, self.settings.pipeline, meshes.pipeline, meshes.data_parallel, self.stage,
                self.root_device, precision, self.activation_checkpoint_config, trainer.accumulate_grad_batches)
        elif self.stage >= 2 and isinstance(self.model, FSDPModule):
            swap_parameters(self.model, self.zero_config, self.root_device)  # evaluation after fit: resume swapping
        elif self.stage >= 2 or fitting:
            self.model = runtime.wrap_module(
                self.model, meshes.data_parallel, self.zero_config, device=self.root_device,
                ddp_options=self.settings.ddp_options, reduce_bucket_size=config_reduce_bucket_size(self.ds_config),
                activation_checkpointing=self.activation_checkpoint_config,
                **precision.wrap_module_kwargs(self.zero_config))
        else:  # evaluation at stages 0-1: no DDP, every rank starts from rank 0's weights
            runtime.replicate_for_evaluation(self.model, meshes.data_parallel, self.root_device)
        automatic = fitting and self.lightning_module.automatic_optimization  # it zeroes after training_step
        ddp = isinstance(self.model, DistributedDataParallel)
        self._bucket_rebuild = EarlyBucketRebuild(self.model) if automatic and ddp else None  # see its note
        if self.stage >= 2 and fitting and self._runner is None and not self.lightning_module.automatic_optimization:
            self._manual_backward = ManualBackward(self.model)
            self._teardown_handles.append(self._manual_backward)
        if self.stage >= 2:
            self._forward_redirection = forward_redirection_for(self.root_device, self._manual_backward is not None)

    def setup_optimizers(self, trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        binding = self.ds_config
        if binding is not None and binding.translation.optimizer is None and binding.translation.scheduler:
            self.lr_scheduler_configs = scheduler_from_config(binding.translation, trainer, self.optimizers,
                                                              self.lr_scheduler_configs)
        mesh = self.meshes.data_parallel if self.meshes is not None else None
        for index, optimizer in enumerate(self.optimizers):
            runtime.shard_optimizer_of(getattr(optimizer, "_optimizer", optimizer), self.lightning_module, mesh,
                                       self.zero_config, device=self.root_device,
                                       pipelined=self.settings.pipeline.enabled, index=index,
                                       fp32_values=self.precision_plugin.replica_fp32_values())
        self.precision_plugin.fp32_values.clear()  # those no optimizer holds: their replicas are never stepped
        install_partition_aware_toggle(self.lightning_module)  # see optimizer_toggle.py's note
        guard_schedulers(self.lr_scheduler_configs, self.precision_plugin)

    def model_to_device(self) -> None:
        assert self.model is not None
        if runtime.needs_placing(self.model, self.zero_config, self.settings.pipeline.enabled):
            self.model.to(self.root_device)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on the micro-steps of gradient accumulation."""
        assert self.model is not None
        with runtime.no_gradient_sync(self.model, self._runner):
            yield

    def backward(self, closure_loss: Tensor, optimizer, *args: Any, **kwargs: Any) -> Tensor:
        self.hang_guard.beat("backward")
        if self._runner is None:  # manual_backward runs inside training_step's forward: see manual_backward's note
            with self._manual_backward.backward(closure_loss) if self._manual_backward else nullcontext():
                closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
            return closure_loss if self._bucket_rebuild is None else self._bucket_rebuild.after_backward(closure_loss)
        # The schedule already ran backward inside training_step (see pipeline_gradients.py): restore its gradients
        # and run the hooks.
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._pipeline_grads.restore()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    def pre_backward(self, closure_loss: Tensor) -> None:
        if not self.lightning_module.automatic_optimization:
            prepare_manual_backward(self.model, closure_loss)

    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Route a step through the root module's ``__call__`` so its DDP/FSDP2 hooks run (see apply_zero's note)."""
        assert self.lightning_module is not None
        if self.model is self.lightning_module and (self.stage <= 1 or self._runner is not None):
            return getattr(self.lightning_module, method)(*args, **kwargs)
        return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.hang_guard.step("training_step")
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self.precision_plugin.train_step_context():
            if self._runner is not None:
                return self._pipeline_grads.training_step(
                    self.lightning_module, lambda: self._redirect("training_step", *args, **kwargs))
            output = self._redirect("training_step", *args, **kwargs)
        if self._manual_backward is not None:
            self._manual_backward.step_finished()
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.hang_guard.step("validation_step")
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self.hang_guard.step("test_step")
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self.hang_guard.step("predict_step")
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: Optional[str] = None) -> None:
        barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)  # over the gloo control group (checkpoint/save_guards.py)

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return module_state_dict(self.lightning_module, self.optimizers)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return optimizer_state_dict(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint does not take storage_options: it writes with "
                            "torch.distributed.checkpoint")
        with self.hang_guard.phase("save"):
            self._newest_save = trainer_checkpoints.save(
                checkpoint, self.broadcast(str(filepath)), self.lightning_module, self.optimizers,
                rank=self.global_rank, stage=self.stage, offload=self.zero_config.offload,
                exclude_frozen_parameters=self.exclude_frozen_parameters, async_save=self.async_save,
                full=self.settings.state_dict_type == "full",
                options=checkpoint_save_options(self.ds_config, self.precision_plugin.precision))

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        with self.hang_guard.phase("load"):
            module = self.lightning_module
            return trainer_checkpoints.load(
                self.broadcast(str(checkpoint_path)), module,
                trainer_checkpoints.optimizers_to_restore(self._trainer(), self.optimizers),
                load_full_weights=self.load_full_weights, exclude_frozen_parameters=self.exclude_frozen_parameters,
                precision_key=type(self.precision_plugin).__qualname__)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint already loaded the (sharded) weights in place

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # likewise for optimizer states

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            trainer_checkpoints.remove(str(filepath), newest=getattr(self, "_newest_save", None))

    def on_exception(self, exception: BaseException) -> None:
        explain_unused_parameters(exception, self.stage)
        self.lost_peer.check(exception, self.world_size)  # names the peer on the error and logs it

    # ------------------------------------------------------------------ teardown and registry
    def teardown(self) -> None:
        with self.hang_guard.teardown():  # then stops the watchdog
            # an async save must land before exit; with a lost peer each rank waits for its own saves only
            wait_for_pending_saves(barrier=_distributed_is_initialized() and not self.lost_peer.lost)
        lightning_module = self.lightning_module
        if lightning_module is not None:
            uninstall_config_optimizers(lightning_module)
            uninstall_partition_aware_toggle(lightning_module)
        for handle in self._teardown_handles:
            handle.remove()
        self._teardown_handles.clear()
        self._manual_backward, self._bucket_rebuild = None, None  # keep no wrapper alive
        self.precision_plugin.fp32_values.clear()
        if isinstance(self.model, DistributedDataParallel):
            self.model = lightning_module
        trainer = self._trainer()
        if trainer is not None:
            self.model = lifecycle.revert_layer_sync(self._layer_sync, self.model,
                                                     trainer.state.fn == TrainerFn.FITTING)
        runtime.release([lightning_module] if lightning_module is not None else [], self.optimizers)
        if lifecycle.stays_in_place(lightning_module):
            # never .cpu() a sharded module (or one on the meta device): see teardown_in_place
            lifecycle.teardown_in_place(self.cluster_environment, self.precision_plugin, self.accelerator,
                                        self.checkpoint_io)
        else:
            super().teardown()

    @property
    def checkpoint_io(self):
        return super().checkpoint_io  # Lightning's default, which only teardown reaches: saves never use it

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:  # Trainer(plugins=[MyCheckpointIO()]) sets it: refused, never silently unused
        if io is not None:  # (the constructor's checkpoint_io is refused in resolve_settings)
            raise NotImplementedError(f"ZeroStrategy does not use a CheckpointIO plugin ({type(io).__name__}): it "
                                      "writes and reads checkpoints with torch.distributed.checkpoint itself, so the "
                                      "plugin would never be called. Remove it from Trainer(plugins=...)")

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, kwargs in STRATEGY_NAMES.items():  # shared with the Fabric strategy
            if name not in strategy_registry:
                strategy_registry.register(name, cls, **kwargs)
