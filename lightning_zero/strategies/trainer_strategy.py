"""``ZeroStrategy``: the Trainer's adapter over the ZeRO runtime (:mod:`lightning_zero.distributed.runtime`): each
hook calls the steps both adapters share (:mod:`lightning_zero.adapters.runtime_steps`) and the Trainer's own
(:mod:`.trainer_steps`), as Lightning's ``lightning/pytorch/strategies/model_parallel.py`` calls Fabric's functions.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Generator, Optional

import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_zero.adapters import runtime_steps
from lightning_zero.adapters.arguments import StrategyArguments, lightning_parameter
from lightning_zero.adapters.launch_checks import check_launcher_world_size
from lightning_zero.adapters.precision_policy import PrecisionFlag
from lightning_zero.adapters.process_group import barrier
from lightning_zero.adapters.settings import STRATEGY_NAMES, resolve_settings
from lightning_zero.checkpoint.save_guards import broadcast_object
from lightning_zero.checkpoint.states import module_state_dict, optimizer_state_dict
from lightning_zero.diagnostics.hang_guard import HangGuard
from lightning_zero.diagnostics.peers import LostPeer
from lightning_zero.distributed import runtime
from lightning_zero.distributed.ddp import explain_unused_parameters, prepare_manual_backward
from lightning_zero.strategies import auto_resume, ds_config_fit, lifecycle, trainer_checkpoints, trainer_steps
from lightning_zero.strategies.ckpt_path_check import ValidatingLauncher, check_launch
from lightning_zero.strategies.multiprocessing_launcher import ZeroMultiProcessingLauncher
from lightning_zero.strategies.optimizer_toggle import install_partition_aware_toggle
from lightning_zero.strategies.pipeline_gradients import PipelineGradients
from lightning_zero.strategies.trainer_precision import adapt_precision_plugin, guard_schedulers

TRAINER_ARGUMENTS = StrategyArguments(lightning_parameter("precision_plugin", Optional[Precision]))


class ZeroStrategy(ParallelStrategy):
    """DeepSpeed's ZeRO stages 0-3 with CPU and NVMe offload for Lightning's Trainer, on DDP and FSDP2.

    Its arguments (``DeepSpeedStrategy``'s included, ``docs/deepspeed_arguments.md``) are declared and documented
    once, in :class:`lightning_zero.adapters.settings.ZeroArguments` (by page: ``docs/reference.md``), and checked
    before any process group exists. As ``DeepSpeedStrategy``, :attr:`config` is the effective ds_config as a dict.
    Precision comes from the Trainer's ``precision`` flag (:mod:`lightning_zero.adapters.precision_policy`).
    """

    strategy_name = "zero"

    @TRAINER_ARGUMENTS.declare
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        lightning, arguments = TRAINER_ARGUMENTS.bind(args, kwargs)
        # Validate everything before Lightning (or anyone) starts a process group; shared with the Fabric strategy.
        self.settings = settings = resolve_settings(**arguments)
        self.zero_config = settings.zero_config
        self.hang_guard = HangGuard(settings.hang_timeout)
        self.lost_peer = LostPeer()  # set when a collective failed on a dead peer: teardown then skips its agreement
        self.ckpt_path_asked: Optional[str] = None  # the fit's ckpt_path before Lightning resolves it (launchers)
        self.exclude_frozen_parameters, self.verbose = settings.exclude_frozen_parameters, settings.verbose
        self.auto_resume, self.async_save = settings.auto_resume, settings.async_save
        self.activation_checkpoint_config = settings.activation_checkpoint_config
        self.load_full_weights = settings.load_full_weights
        super().__init__(**lightning)
        self._process_group_backend = settings.process_group_backend
        self.num_nodes = 1  # set by the Trainer
        self.meshes: Optional[runtime.Meshes] = None  # once the process group exists
        self._runner = None  # the pipeline's runner (pipeline_parallel_size > 1)
        self._pipeline_grads = PipelineGradients()
        self._teardown_handles: list = []  # hooks setup added to the user's module, removed at teardown
        self._manual_backward, self._bucket_rebuild = None, None

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def ds_config(self):  # the DeepSpeed config binding (None without config= or PL_DEEPSPEED_CONFIG_PATH)
        return self.settings.ds_config

    @property
    def config(self) -> dict:
        """The effective DeepSpeed config as a read-only dict, as ``DeepSpeedStrategy.config``."""
        return ds_config_fit.effective_config_of_fit(self.settings, self._precision_plugin, self._trainer())

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:  # once the process group exists: torchmetrics and sync_dist reduce then
        return _distributed_is_initialized()

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
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = adapt_precision_plugin(Precision(), self.settings)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = adapt_precision_plugin(plugin, self.settings) if plugin is not None else None

    @property
    def checkpoint_io(self):
        return super().checkpoint_io  # Lightning's default, which only teardown reaches: saves never use it

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:  # Trainer(plugins=[MyCheckpointIO()]) sets it
        runtime_steps.refuse_checkpoint_io(io, "Trainer(plugins=...)")

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # optimizer states can only be loaded into the sharded optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores them, sharded

    def connect(self, model) -> None:
        super().connect(model)
        ds_config_fit.install_config_optimizers(model, self.ds_config)  # a ds_config's optimizer, if it has one

    def _trainer(self):
        return getattr(self.lightning_module, "_trainer", None)

    def _configure_launcher(self) -> None:
        if self.settings.start_method != "popen":
            self._launcher = ZeroMultiProcessingLauncher(self, start_method=self.settings.start_method)
            return
        check_launcher_world_size(self.cluster_environment, self.num_nodes, self.num_processes)
        if self.cluster_environment.creates_processes_externally:  # ckpt_path is still checked before the group
            self._launcher = ValidatingLauncher()
        else:
            launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            self._launcher = check_launch(launcher)

    def setup_environment(self) -> None:
        settings, trainer = self.settings, self._trainer()
        environment, device = self.cluster_environment, self.root_device
        data_parallel = runtime_steps.check_launch_settings(
            settings, environment, self.num_nodes, self.num_processes, device, self.process_group_backend
        )
        precision = self.precision_plugin.precision
        trainer_steps.check_fit_settings(trainer, settings, precision, data_parallel, device, self._layer_sync)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend, self.meshes = runtime_steps.start(
            settings, environment, self._process_group_backend, device, self.num_nodes
        )
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self.meshes.world
        self.hang_guard.start(self.global_rank, self.world_size, self.node_rank)
        if self.auto_resume:
            auto_resume.install_auto_resume(trainer, self.auto_resume, self.broadcast, self.ckpt_path_asked)

    def set_world_ranks(self) -> None:
        runtime_steps.set_world_ranks(self.cluster_environment, self.num_nodes, self.num_processes)

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``configure_model`` and ``Trainer.init_module`` run the model's own init, recorded at stages 2-3 and
        replayed per unit by ``setup``; ``Trainer.init_module(empty_init=True)`` skips torch's layer init as Lightning
        does (not passed around ``configure_model``, which always runs the init; :func:`runtime.init_context`)."""
        precision = self.precision_plugin
        init = runtime_steps.module_init_context(self.settings, self.num_processes, empty_init, precision.init_dtype())
        with init, precision.tensor_init_context():
            yield

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        trainer_checkpoints.prepare_checkpoint_callbacks(self.async_save, trainer.checkpoint_callbacks)
        adopted = trainer_steps.bind_ds_config_to_fit(
            self.settings, trainer, self.precision_plugin.precision, self.meshes, self.is_global_zero
        )
        if adopted is not None:
            self.precision_plugin = PrecisionFlag(adopted)  # adapted like Lightning's own choice would be
        self.precision_plugin.device_type = self.root_device.type
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.model = lifecycle.apply_layer_sync(self._layer_sync, self.model, fitting)  # before any wrapping
        self.precision_plugin.convert_module(self.model)
        module, precision = self.lightning_module, self.precision_plugin
        wrapped = trainer_steps.wrap_for_trainer(
            self.model, module, self.settings, self.meshes, self.root_device, precision, trainer
        )
        self.model, self._runner, self._bucket_rebuild, self._manual_backward = wrapped
        if self._manual_backward is not None:
            self._teardown_handles.append(self._manual_backward)
        self._forward_redirection = trainer_steps.forward_redirection(self.stage, self.root_device, wrapped[3])
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        optimizers, module, precision = self.optimizers, self.lightning_module, self.precision_plugin
        configs = ds_config_fit.scheduler_from_config(self.ds_config, trainer, optimizers, self.lr_scheduler_configs)
        trainer_steps.shard_optimizers(optimizers, module, self.settings, self.meshes, self.root_device, precision)
        install_partition_aware_toggle(module)  # see optimizer_toggle.py's note
        self.lr_scheduler_configs = configs
        guard_schedulers(configs, precision)

    def model_to_device(self) -> None:
        if runtime.needs_placing(self.model, self.zero_config, self.settings.pipeline.enabled):
            self.model.to(self.root_device)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on the micro-steps of gradient accumulation."""
        with runtime.no_gradient_sync(self.model, self._runner):
            yield

    def backward(self, closure_loss: Tensor, optimizer, *args: Any, **kwargs: Any) -> Tensor:
        self.hang_guard.beat("backward")
        if self._runner is None:  # manual_backward runs inside training_step's forward: see manual_backward's note
            with self._manual_backward.backward(closure_loss) if self._manual_backward else nullcontext():
                closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
            return closure_loss if self._bucket_rebuild is None else self._bucket_rebuild.after_backward(closure_loss)
        # The schedule already ran backward inside training_step (pipeline_gradients.py): restore, run the hooks
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._pipeline_grads.restore()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    def pre_backward(self, closure_loss: Tensor) -> None:
        if not self.lightning_module.automatic_optimization:
            prepare_manual_backward(self.model, closure_loss)

    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Route a step through the root module's ``__call__`` so its DDP/FSDP2 hooks run (see apply_zero's note)."""
        if self.model is self.lightning_module and (self.stage <= 1 or self._runner is not None):
            return getattr(self.lightning_module, method)(*args, **kwargs)
        return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.hang_guard.step("training_step")
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self.precision_plugin.train_step_context():
            if self._runner is not None:
                step = lambda: self._redirect("training_step", *args, **kwargs)  # noqa: E731
                return self._pipeline_grads.training_step(self.lightning_module, step)
            output = self._redirect("training_step", *args, **kwargs)
        if self._manual_backward is not None:
            self._manual_backward.step_finished()
        return output

    def _evaluation_step(self, method: str, context, args: tuple, kwargs: dict) -> Any:
        self.hang_guard.step(method)
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with context():
            return self._redirect(method, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def barrier(self, name: Optional[str] = None) -> None:
        barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)  # over the gloo control group (checkpoint/save_guards.py)

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, Tensor) else tensor

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return module_state_dict(self.lightning_module, self.optimizers)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return optimizer_state_dict(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        runtime_steps.refuse_storage_options(storage_options)
        with self.hang_guard.phase("save"):
            path, precision = self.broadcast(str(filepath)), self.precision_plugin.precision
            self._newest_save = trainer_checkpoints.save(
                checkpoint, path, self.lightning_module, self.optimizers, self.settings, self.global_rank, precision
            )

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        with self.hang_guard.phase("load"):
            path, precision_key = self.broadcast(str(checkpoint_path)), type(self.precision_plugin).__qualname__
            optimizers = trainer_checkpoints.optimizers_to_restore(self._trainer(), self.optimizers)
            flags = dict(
                load_full_weights=self.load_full_weights, exclude_frozen_parameters=self.exclude_frozen_parameters
            )
            return trainer_checkpoints.load(
                path, self.lightning_module, optimizers, precision_key=precision_key, **flags
            )

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

    def teardown(self) -> None:
        runtime_steps.finish_saves(self.hang_guard, self.lost_peer)
        module, trainer = self.lightning_module, self._trainer()
        trainer_steps.detach(module, self._teardown_handles, self.precision_plugin)
        self._manual_backward, self._bucket_rebuild = None, None  # keep no wrapper alive
        self.model = trainer_steps.model_at_teardown(self.model, module, self._layer_sync, trainer)
        runtime.release([module] if module is not None else [], self.optimizers)
        if lifecycle.stays_in_place(module):  # never .cpu() a sharded module (or one on meta): see teardown_in_place
            lifecycle.teardown_in_place(
                self.cluster_environment, self.precision_plugin, self.accelerator, self.checkpoint_io
            )
        else:
            super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, kwargs in STRATEGY_NAMES.items():  # shared with the Fabric strategy
            if name not in strategy_registry:
                strategy_registry.register(name, cls, **kwargs)
