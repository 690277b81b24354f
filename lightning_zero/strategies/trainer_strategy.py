"""``ZeroStrategy``: the Lightning adapter over :mod:`lightning_zero.distributed`.

All parallelism lives in plain functions (:func:`~lightning_zero.distributed.apply_zero.apply_zero`,
:func:`~lightning_zero.distributed.optimizer.shard_optimizer`); this class only maps Lightning's hooks onto them:
process-group set-up, wrapping the LightningModule, partitioning the optimizers, gradient-accumulation sync,
clipping, and checkpoints.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Generator, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_zero.checkpoint.io import wait_for_pending_saves
from lightning_zero.checkpoint.save_guards import broadcast_object
from lightning_zero.diagnostics.hang_guard import DEFAULT_HANG_TIMEOUT, HangGuard
from lightning_zero.distributed import hybrid
from lightning_zero.diagnostics.network import DEFAULT_RENDEZVOUS_TIMEOUT
from lightning_zero.distributed.comm_buffers import comm_buffer_pool
from lightning_zero.distributed.exact_init import InitConfig, broadcast_module_states, exact_init
from lightning_zero.distributed.manual_backward import ManualBackward
from lightning_zero.distributed.optimizer import get_sharding, shard_optimizer
from lightning_zero.distributed.optimizer_check import check_optimizer_params
from lightning_zero.distributed.process_group_exit import destroy_process_group_at_exit
from lightning_zero.distributed.apply_zero import apply_zero, reshard_gathered, swap_parameters
from lightning_zero.offload.param_swapper import detach_param_swapper
from lightning_zero.adapters.settings import SETTING_NAMES, STRATEGY_NAMES, resolve_settings
from lightning_zero.checkpoint import states as checkpointing
from lightning_zero.distributed import runtime as gradient_sync
from lightning_zero.adapters import launch_checks as validation
from lightning_zero.distributed.ddp import ddp_kwargs_for, explain_unused_parameters
from lightning_zero.ds_config.binding import DeepSpeedConfigBinding, effective_ds_config, precision_from_config
from lightning_zero.pipeline.zero_pipeline import PipelineGradients, pipeline_mesh
from lightning_zero.pipeline.zero_pipeline import setup_for_strategy as setup_pipeline_for_strategy
from lightning_zero.adapters.precision_policy import low_precision_allreduce_hook
from lightning_zero.strategies import auto_resume, lifecycle
from lightning_zero.strategies.launcher import ZeroMultiProcessingLauncher
from lightning_zero.strategies.ds_config_fit import (
    install_config_optimizers,
    scheduler_from_config,
    uninstall_config_optimizers,
)
from lightning_zero.strategies.trainer_precision import PrecisionFlag, ZeroPrecision, adapt_precision_plugin, guard_schedulers
from lightning_zero.strategies.forward_redirection import RootForwardRedirection
from lightning_zero.strategies.optimizer_toggle import install_partition_aware_toggle, uninstall_partition_aware_toggle

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ZeroStrategy(ParallelStrategy):
    """DeepSpeed's ZeRO stages 0-3 with CPU offload for Lightning, on DDP and FSDP2.

    ==========  ==========================================================  ======================================
    ``stage``   engine                                                      model-state bytes per rank at rest
    ==========  ==========================================================  ======================================
    0           DDP                                                         ``P (bp + bg + K)``
    1           DDP + the optimizer partitioned in place (each rank steps   ``P (bp + bg) + P K / N``
                1/N of the parameters, then broadcasts them)
    2           FSDP2 ``fully_shard(reshard_after_forward=False)``          ``P (bp + bg + K) / N``, plus ``P bp``
                                                                            gathered from forward to backward
    3           FSDP2 ``fully_shard(reshard_after_forward=True)``           ``P (bp + bg + K) / N``, plus one or two
                                                                            gathered units
    ==========  ==========================================================  ======================================

    ``P`` parameters, ``N`` ranks, ``bp``/``bg`` bytes per parameter/gradient, ``K`` optimizer-state bytes per
    parameter (8 for fp32 Adam). ``docs/stages.md`` derives these; :func:`lightning_zero.model_state_memory`
    measures them and :func:`lightning_zero.estimate_model_states_memory` predicts them.

    Args:
        stage: ZeRO stage, 0-3 (default 2, or the config's).
        offload: ``None``, ``"cpu"`` (optimizer states and fp32 masters live and step in CPU memory; at stage 3
            the sharded parameters and gradients too, as DeepSpeed's ``zero_stage_3_offload``) or ``"nvme"``; the
            precise ``offload_optimizer``/``offload_params`` and the NVMe knobs: see ``docs/offload.md``.
        pin_memory: pin offloaded CPU tensors (default: when computing on CUDA).
        sharded_module_classes: classes or class names that become FSDP units at stages 2-3; by default
            repeated blocks are detected (:func:`lightning_zero.distributed.apply_zero.find_repeated_blocks`).
        reshard_after_forward: stage-3 override of FSDP2's ``reshard_after_forward``, for every unit: ``True``
            also reshards the root and the last unit, which the default keeps (see ``ZeroConfig``).
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; by default chosen from the accelerator.
        timeout: process-group timeout: a positive ``timedelta`` or number of seconds.
        start_method: ``"popen"`` (re-run the script per rank, like ``DDPStrategy``), ``"spawn"``, ``"fork"``.
        async_save: write checkpoints in the background (DCP async save; the state is staged to CPU first, so
            training continues at once). The next save, a load and the end of training wait for it. Every save is
            atomic either way: a crash mid-save leaves the previous checkpoint at that path loadable.
        communication_data_type: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the dtype gradients are reduced in
            (DeepSpeed's key of the same name). Default ``None``: fp32.
        loss_scale, initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale:
            DeepSpeed's fp16 loss-scale knobs, same names, meanings and defaults (``loss_scale=0``: dynamic). Only
            valid with an fp16 Trainer precision (``16-mixed``/``16-true``); see ``docs/precision.md``.
        config: a DeepSpeed ``ds_config`` (dict, ``.json``/``.yaml`` path or JSON string). Its settings fill every
            argument left at ``None``; explicit arguments win. ``"auto"`` values are resolved at setup from the
            Trainer, DataLoader and LightningModule; see ``docs/ds_config.md``.
        strict: with ``config``, unknown keys and unsupported features are errors (``False``: warnings).
        pipeline_parallel_size, micro_batches, pipeline_schedule, virtual_stages: pipeline parallelism over a
            ``PipelineModule`` held by the LightningModule, with the ZeRO stage on the data-parallel dimension
            (:mod:`lightning_zero.pipeline.zero_pipeline`, ``docs/pipeline.md``).
        find_unused_parameters, static_graph, gradient_as_bucket_view, bucket_cap_mb: ``DDPStrategy``'s options for
            the DDP of stages 0-1 (:mod:`lightning_zero.distributed.ddp`); unlike ``DDPStrategy``,
            ``gradient_as_bucket_view`` defaults to True (one gradient buffer per rank).
        exclude_frozen_parameters, verbose: frozen parameters stay out of checkpoints; print the whole ds_config.
        hang_timeout: seconds (or ``timedelta``) a step, validation batch, checkpoint save/load or teardown may last
            before the job exits naming the stuck rank(s) with every rank's stacks (default 600; ``None``: off).
        auto_resume: on a restarted job (torchrun/SLURM; ``"always"``: on every fit) without ``ckpt_path``, resume from
            the newest complete ``ModelCheckpoint`` checkpoint; checkpoint on preemption signals (:mod:`.auto_resume`, :mod:`.preemption`).
        hybrid_shard_size: HSDP: shard within groups of this many ranks, replicate across (:mod:`.hybrid`, opt-in).
        activation_checkpointing, cpu_checkpointing, activation_checkpointing_policy: recompute blocks' activations
            in backward, optionally keeping their inputs on CPU (``docs/activation_checkpointing.md``).
        load_full_weights: ``ckpt_path`` must be one file, which may lack optimizer states (``full_loading.py``).
        rendezvous_timeout: seconds a multi-node start waits for every node before naming the missing ones (300).
        unit_bytes, param_persistence_threshold, prefetch_bytes: stages 2-3: consecutive blocks share one FSDP2
            unit up to ``unit_bytes`` parameter bytes (``0``: a unit per block); units under
            ``param_persistence_threshold`` elements stay in the root; prefetch of the next units' all-gathers up to
            ``prefetch_bytes`` (:mod:`lightning_zero.distributed.units`, ``docs/units.md``).

    As ``DeepSpeedStrategy``: without ``config`` the file ``PL_DEEPSPEED_CONFIG_PATH`` names is read, and
    :attr:`config` is the effective ds_config as a dict.

    Precision comes from the Trainer's ``precision`` flag (``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``,
    ``16-true``): fp32 master weights and optimizer states, low-precision compute, DeepSpeed's dynamic loss scaling
    for fp16 (:mod:`lightning_zero.adapters.precision_policy`).
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: Optional[int] = None,
        offload: Optional[str] = None,
        offload_optimizer: Optional[str] = None, offload_params: Optional[str] = None, nvme_path: Optional[str] = None,
        buffer_count: Optional[int] = None, sub_group_size: Optional[int] = None, buffer_size: Optional[int] = None,
        max_in_cpu: Optional[int] = None, aio: Optional[dict] = None,
        pin_memory: Optional[bool] = None,
        sharded_module_classes: Optional[Union[set, list, tuple]] = None,
        reshard_after_forward: Optional[Union[bool, int]] = None,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: StartMethod = "popen",
        async_save: bool = False,
        communication_data_type: Optional[str] = None,
        loss_scale: Optional[float] = None,
        initial_scale_power: Optional[int] = None,
        loss_scale_window: Optional[int] = None,
        hysteresis: Optional[int] = None,
        consecutive_hysteresis: Optional[bool] = None,
        min_loss_scale: Optional[float] = None,
        config: Optional[Union[str, dict]] = None,
        strict: bool = True,
        pipeline_parallel_size: Optional[int] = None,
        micro_batches: Optional[int] = None,
        pipeline_schedule: Optional[str] = None,
        virtual_stages: Optional[int] = None,
        find_unused_parameters: Optional[bool] = None,
        static_graph: Optional[bool] = None,
        gradient_as_bucket_view: Optional[bool] = None,
        bucket_cap_mb: Optional[float] = None,
        exclude_frozen_parameters: bool = False,
        verbose: bool = False,
        hang_timeout: Optional[Union[float, timedelta]] = DEFAULT_HANG_TIMEOUT,
        auto_resume: Union[bool, str] = True,
        hybrid_shard_size: Optional[int] = None,
        activation_checkpointing: Any = None,
        cpu_checkpointing: Optional[bool] = None,
        activation_checkpointing_policy: Any = None,
        load_full_weights: bool = False,
        rendezvous_timeout: Union[float, timedelta] = DEFAULT_RENDEZVOUS_TIMEOUT,
        unit_bytes: Optional[int] = None,
        param_persistence_threshold: Optional[int] = None,
        prefetch_bytes: Optional[int] = None,
    ) -> None:
        # Validate everything before Lightning (or anyone) starts a process group; shared with the Fabric strategy.
        settings = resolve_settings(**{name: value for name, value in locals().items() if name in SETTING_NAMES})
        self._ds_config, self.zero_config, self._pipeline = settings.ds_config, settings.zero_config, settings.pipeline
        self.hang_guard = HangGuard(settings.hang_timeout)
        self._loss_scale_config, self._fp16_loss_scale_config = (settings.loss_scale_config,
                                                                 settings.fp16_loss_scale_config)
        self._communication_data_type, self._ddp_options = settings.communication_data_type, settings.ddp_options
        self.exclude_frozen_parameters, self.verbose, self.auto_resume = (
            settings.exclude_frozen_parameters, settings.verbose, settings.auto_resume)
        self.activation_checkpoint_config, self.load_full_weights = (settings.activation_checkpoint_config,
                                                                     settings.load_full_weights)
        self._rendezvous_timeout = settings.rendezvous_timeout
        self._pp_mesh = None
        self._runner = None
        self._pipeline_grads = PipelineGradients()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin)
        self._process_group_backend = settings.process_group_backend
        self._timeout = settings.timeout
        self._start_method = settings.start_method
        self.async_save = settings.async_save
        self._num_nodes = 1
        self._mesh = None
        self._teardown_handles: list = []  # hooks setup added to the user's module, removed at teardown
        self._manual_backward: Optional[ManualBackward] = None
        self._forward_redirection = _DDPForwardRedirection() if self.stage <= 1 else RootForwardRedirection(self)

    # ------------------------------------------------------------------ properties Lightning reads
    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def ds_config(self) -> Optional[DeepSpeedConfigBinding]:
        """The DeepSpeed config binding (``None`` without ``config=`` or ``PL_DEEPSPEED_CONFIG_PATH``)."""
        return self._ds_config

    @property
    def config(self) -> dict:
        """The effective DeepSpeed config as a read-only dict, as ``DeepSpeedStrategy.config``."""
        return effective_ds_config(self)

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
        if self._pipeline.enabled and self._mesh is not None:  # data-parallel replicas, not pipeline ranks
            return {"num_replicas": self._mesh.size(), "rank": self._mesh.get_local_rank()}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def device_mesh(self):
        if self._mesh is None:
            raise RuntimeError("The device mesh exists only after the process group was set up")
        return self._mesh

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = self._adapt(Precision())
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = self._adapt(plugin) if plugin is not None else None

    def _adapt(self, plugin: Precision) -> Precision:
        fp16 = str(getattr(plugin, "precision", "")).startswith("16-")
        scaling = self._fp16_loss_scale_config if fp16 else self._loss_scale_config
        if isinstance(plugin, ZeroPrecision):
            scaling = self._loss_scale_config
        return adapt_precision_plugin(plugin, stage=self.stage, loss_scale_config=scaling,
                                      communication_data_type=self._communication_data_type)

    def _bind_ds_config(self, trainer) -> None:
        """Resolve the ds_config against the Trainer, adopt its precision, print it (see ds_config_binding)."""
        binding = self._ds_config
        if trainer.training:
            # DeepSpeed's batch arithmetic counts data-parallel replicas: under a pipeline, the "dp" mesh
            replicas = self._mesh.size() if self._mesh is not None else self.world_size
            binding.resolve(trainer, data_parallel_size=replicas)
        adopted = precision_from_config(binding.precision, self.precision_plugin.precision)
        if adopted is not None:
            self.precision_plugin = PrecisionFlag(adopted)  # adapted like Lightning's own choice would be
        if self.is_global_zero:
            binding.print_table(verbose=self.verbose)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # optimizer states can only be loaded into the sharded optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores them, sharded

    def connect(self, model) -> None:
        super().connect(model)
        if self._ds_config is not None and self._ds_config.translation.optimizer is not None:
            install_config_optimizers(model, self._ds_config)

    # ------------------------------------------------------------------ launch and process group
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            validation.check_launcher_world_size(self.cluster_environment, self.num_nodes, self.num_processes)
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = validation.check_launch(_SubprocessScriptLauncher(
                    self.cluster_environment, self.num_processes, self.num_nodes))
            else:  # ckpt_path is still checked before the process group (see validation.ValidatingLauncher)
                self._launcher = validation.ValidatingLauncher()
        else:
            self._launcher = ZeroMultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        validation.validate_before_process_group(self)  # on every rank, before init_process_group
        lifecycle.check_before_process_group(self)  # sync_batchnorm off GPU, SWA at stages 2-3
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type == "cuda" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              device_id=device_id, **validation.process_group_store(self))
        destroy_process_group_at_exit()  # see distributed/process_group_exit.py
        if self._pipeline.enabled:
            mesh, self._pp_mesh, self._mesh = pipeline_mesh(self.root_device.type, self.world_size, self._pipeline)
        else:  # 1-D, or 2-D ("replicate", "shard") with hybrid_shard_size
            mesh = self._mesh = hybrid.data_parallel_mesh(self.root_device.type, self.world_size,
                                                          self.zero_config.hybrid_shard_size)
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = mesh
        self.hang_guard.start(self.global_rank, self.world_size)
        if self.auto_resume:
            auto_resume.install_auto_resume(self)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model and optimizers
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``configure_model`` and ``Trainer.init_module`` run the model's own init (``empty_init`` never skips it),
        recorded at stages 2-3 and replayed per unit by ``setup``, which shards rank 0's values. See ``exact_init``."""
        deferred = self.stage >= 2 and not self._pipeline.enabled  # see lightning_zero.distributed.deferred_init
        with exact_init(InitConfig.from_env(max(1, self.num_processes), deferred), empty_init), \
                self.precision_plugin.tensor_init_context():
            yield

    def setup(self, trainer) -> None:
        from torch.distributed.fsdp import FSDPModule

        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        checkpointing.check_checkpoint_callbacks(self, trainer)
        if self._ds_config is not None:
            self._bind_ds_config(trainer)
        self.precision_plugin.device_type = self.root_device.type
        fitting = trainer.state.fn == TrainerFn.FITTING
        lifecycle.apply_layer_sync(self, fitting)  # Trainer(sync_batchnorm=True), before any wrapping
        self.precision_plugin.convert_module(self.model)
        if self._pipeline.enabled:
            self._runner = setup_pipeline_for_strategy(self, trainer)
        elif self.stage >= 2:
            if not isinstance(self.model, FSDPModule):  # evaluation after fit reuses the sharded module
                apply_zero(self.model, self._mesh, self.zero_config, device=self.root_device,
                           mp_policy=self.precision_plugin.fsdp_mp_policy(),
                           activation_checkpointing=self.activation_checkpoint_config)
            else:  # the last teardown stopped NVMe parameter swapping
                swap_parameters(self.model, self.zero_config, self.root_device)
            if fitting and not self.lightning_module.automatic_optimization:
                self._manual_backward = ManualBackward(self.model)
                self._teardown_handles.append(self._manual_backward)
        elif fitting:
            self.model = apply_zero(self.model, self._mesh, self.zero_config, device=self.root_device,
                                    ddp_kwargs=ddp_kwargs_for(self._ddp_options, self._ds_config, self.model),
                                    activation_checkpointing=self.activation_checkpoint_config)
            reduce_dtype = self.precision_plugin.ddp_reduce_dtype()
            if reduce_dtype is not None:
                self.model.register_comm_hook(self.model.process_group, low_precision_allreduce_hook(reduce_dtype))
        else:
            self.model.to(self.root_device)  # evaluation without DDP: every rank starts from rank 0's weights
            broadcast_module_states(self.model, hybrid.data_parallel_group(self._mesh), self.root_device)
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        binding = self._ds_config
        if binding is not None and binding.translation.optimizer is None and binding.translation.scheduler:
            self.lr_scheduler_configs = scheduler_from_config(binding.translation, trainer, self.optimizers,
                                                              self.lr_scheduler_configs)
        group = hybrid.shard_group(self._mesh) if self._mesh is not None else None  # stage 1: its partition
        for index, optimizer in enumerate(self.optimizers):
            if get_sharding(optimizer) is None:
                if self.stage >= 2 and not self._pipeline.enabled:  # see distributed/optimizer_check.py
                    check_optimizer_params(getattr(optimizer, "_optimizer", optimizer), self.lightning_module, index)
                shard_optimizer(optimizer, self.zero_config, group=group, device=self.root_device)
        install_partition_aware_toggle(self.lightning_module)  # see toggle.py's note
        guard_schedulers(self.lr_scheduler_configs, self.precision_plugin)

    def model_to_device(self) -> None:
        assert self.model is not None
        if self.stage <= 1 and not self._pipeline.enabled:  # a pipeline moves only its stages (at setup)
            self.model.to(self.root_device)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on the micro-steps of gradient accumulation."""
        assert self.model is not None
        with gradient_sync.blocked(self.model, self._runner):
            yield

    def backward(self, closure_loss: Tensor, optimizer, *args: Any, **kwargs: Any) -> Tensor:
        self.hang_guard.beat("backward")
        if self._runner is None:  # manual_backward runs inside training_step's forward: see manual_backward's note
            with self._manual_backward.backward(closure_loss) if self._manual_backward else nullcontext():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule already ran backward inside training_step (see pipeline_binding's PipelineGradients):
        # restore its gradients and run the hooks.
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._pipeline_grads.restore()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    def pre_backward(self, closure_loss: Tensor) -> None:
        if isinstance(self.model, DistributedDataParallel) and not self.lightning_module.automatic_optimization:
            from torch.nn.parallel.distributed import _find_tensors

            if self.model.require_backward_grad_sync:
                self.model.reducer.prepare_for_backward(list(_find_tensors(closure_loss)))

    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Route a step through the root module's ``__call__`` so its DDP/FSDP2 hooks run (see zero.py's note)."""
        assert self.lightning_module is not None
        if self.model is self.lightning_module and (self.stage <= 1 or self._pipeline.enabled):
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
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)  # over the gloo control group (checkpoint/save_guards.py)

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return checkpointing.module_state_dict(self.lightning_module)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return checkpointing.optimizer_state_dict(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint does not take storage_options: it writes with "
                            "torch.distributed.checkpoint")
        with self.hang_guard.phase("save"):
            checkpointing.save(self, checkpoint, self.broadcast(str(filepath)))

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        with self.hang_guard.phase("load"):
            return checkpointing.load(self, self.broadcast(str(checkpoint_path)))

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint already loaded the (sharded) weights in place

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # likewise for optimizer states

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            checkpointing.remove(filepath)

    def on_exception(self, exception: BaseException) -> None:
        explain_unused_parameters(exception, self.stage)

    # ------------------------------------------------------------------ teardown and registry
    def teardown(self) -> None:
        with self.hang_guard.teardown():  # then stops the watchdog
            wait_for_pending_saves(barrier=_distributed_is_initialized())  # an async save must land before exit
        lightning_module = self.lightning_module
        if lightning_module is not None:
            uninstall_config_optimizers(lightning_module)
            uninstall_partition_aware_toggle(lightning_module)
            if (pool := comm_buffer_pool(lightning_module)) is not None:
                pool.clear()  # the CPU communication buffers go with the run; refilled if the module trains again
        for handle in self._teardown_handles:
            handle.remove()
        self._teardown_handles.clear()
        self._manual_backward = None
        if isinstance(self.model, DistributedDataParallel):
            self.model = lightning_module
        if lightning_module is not None and lightning_module._trainer is not None:
            lifecycle.revert_layer_sync(self, lightning_module._trainer.state.fn == TrainerFn.FITTING)
        for optimizer in self.optimizers:
            sharding = get_sharding(optimizer)
            if sharding is not None:
                sharding.remove()
        if lightning_module is not None:
            reshard_gathered(lightning_module)  # an evaluation's last forward leaves units gathered (see it)
            detach_param_swapper(lightning_module)  # NVMe parameter swap files go with the run (docs/offload.md)
        if lifecycle.holds_sharded_parameters(lightning_module):
            lifecycle.teardown_in_place(self)  # never .cpu() a sharded module: see teardown_in_place
        else:
            super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, kwargs in STRATEGY_NAMES.items():  # shared with the Fabric strategy
            if name not in strategy_registry:
                strategy_registry.register(name, cls, **kwargs)

