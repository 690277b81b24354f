"""The constructor arguments of both ZeroStrategy adapters (Trainer and Fabric), validated in one place.

``lightning_zero.strategies.ZeroStrategy`` and ``lightning_zero.fabric.ZeroStrategy`` take the same arguments and
both hand them to :func:`resolve_settings`, which applies the ds_config under the explicit arguments and validates
every value before any process group exists. An argument added to the strategies belongs here (and in
:class:`ZeroSettings`), so the two adapters cannot drift apart.

Each setting is validated by the module that owns it (``ZeroConfig``, ``DDPOptions``, ``PipelineSettings``,
``LossScaleConfig``, the ds_config binding, the launch checks); this module only puts them together.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, Literal, Optional, Union

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_zero.adapters.launch_checks import check_backend_name, check_backend_serves_offload, check_timeout
from lightning_zero.adapters.precision_policy import LossScaleConfig, loss_scale_configs, parse_communication_data_type
from lightning_zero.checkpoint.consolidate import weights_16bit_dtype
from lightning_zero.checkpoint.full_file import check_load_full_weights
from lightning_zero.checkpoint.full_save import check_state_dict_type
from lightning_zero.diagnostics.hang_guard import DEFAULT_HANG_TIMEOUT, parse_hang_timeout
from lightning_zero.diagnostics.network import DEFAULT_RENDEZVOUS_TIMEOUT, check_rendezvous_timeout
from lightning_zero.distributed.activation_checkpointing import ActivationCheckpointConfig
from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.distributed.ddp import DDPOptions
from lightning_zero.ds_config.binding import (
    DeepSpeedConfigBinding,
    activation_checkpointing_over_config,
    arguments_over_config,
    bind_ds_config,
    hybrid_shard_size_over_config,
    unit_knobs_over_config,
)
from lightning_zero.ds_config.strategy_arguments import DEEPSPEED_ARGUMENT_NAMES, DeepSpeedArguments
from lightning_zero.offload.nvme_config import config_params_offload_at_stage, offload_arguments
from lightning_zero.pipeline.zero_pipeline import PipelineSettings, make_pipeline_settings

START_METHODS = ("popen", "spawn", "fork", "forkserver")

# The registry names of both adapters (Trainer and Fabric): name -> description and constructor arguments.
STRATEGY_NAMES = {
    # "zero" names no stage: the strategy's default (2) or a ds_config's (config=, PL_DEEPSPEED_CONFIG_PATH), as
    # DeepSpeedStrategy's "deepspeed"; the numbered names are explicit arguments and win over a config.
    "zero": dict(
        description="ZeRO, stage 2 unless a DeepSpeed config sets another (FSDP2, gradients and optimizer "
        "states sharded)"
    ),
    "zero_stage_1": dict(description="ZeRO stage 1: optimizer states sharded", stage=1),
    "zero_stage_2": dict(description="ZeRO stage 2: gradients and optimizer states sharded", stage=2),
    "zero_stage_2_offload": dict(
        description="ZeRO stage 2 with the optimizer offloaded to CPU", stage=2, offload="cpu"
    ),
    "zero_stage_3": dict(description="ZeRO stage 3: parameters, gradients, optimizer states sharded", stage=3),
    "zero_stage_3_offload": dict(
        description="ZeRO stage 3 with the optimizer and parameters offloaded to CPU", stage=3, offload="cpu"
    ),
    "zero_stage_3_offload_nvme": dict(
        description="ZeRO stage 3, parameters and optimizer states on NVMe (ZeRO-Infinity; needs nvme_path)",
        stage=3,
        offload_optimizer="nvme",
        offload_params="nvme",
    ),
}


@dataclass(frozen=True)
class ZeroSettings:
    """Everything a ZeroStrategy was asked for, validated; each argument is documented in :class:`ZeroArguments`."""

    zero_config: ZeroConfig
    ds_config: Optional[DeepSpeedConfigBinding]
    loss_scale_config: Optional[LossScaleConfig]  # the explicit knobs only
    fp16_loss_scale_config: Optional[LossScaleConfig]  # explicit over the ds_config's fp16 section
    communication_data_type: Optional[str]
    pipeline: PipelineSettings
    ddp_options: DDPOptions
    process_group_backend: Optional[str]
    timeout: Optional[timedelta]
    start_method: str
    async_save: bool
    exclude_frozen_parameters: bool
    verbose: bool
    auto_resume: Union[bool, str]
    hang_timeout: Optional[float]
    activation_checkpoint_config: Optional[ActivationCheckpointConfig]
    load_full_weights: bool
    rendezvous_timeout: float
    state_dict_type: str


@dataclass(frozen=True)
class ZeroArguments:
    """A ZeroStrategy's own constructor arguments, declared once: both adapters' signatures are generated from these
    fields (:mod:`lightning_zero.adapters.arguments`, with ``DeepSpeedStrategy``'s in
    :class:`~lightning_zero.ds_config.strategy_arguments.DeepSpeedArguments`); :func:`resolve_settings` validates
    them into :class:`ZeroSettings`. ``docs/reference.md`` lists the page of each.

    Args:
        stage: ZeRO stage, 0-3 (default 2, or the config's). Stage 0 is DDP; 1 is DDP with the optimizer
            partitioned in place; 2 and 3 are FSDP2 ``fully_shard`` with ``reshard_after_forward`` False and True.
        offload: ``None``, ``"cpu"`` (optimizer states and fp32 masters live and step in CPU memory; at stage 3
            the sharded parameters and gradients too, as DeepSpeed's ``zero_stage_3_offload``) or ``"nvme"``.
        offload_optimizer: ``"cpu"``/``"nvme"`` for the optimizer alone (``True``: DeepSpeedStrategy's switch).
        offload_params: ``"cpu"``/``"nvme"`` for the stage-3 parameters alone (``docs/offload.md``).
        nvme_path: the directory NVMe offload swaps to.
        buffer_count: NVMe swap buffers (``docs/offload.md``, as the rest of the NVMe knobs).
        sub_group_size: elements per NVMe optimizer-state swap group.
        buffer_size: bytes per NVMe parameter swap buffer.
        max_in_cpu: parameter elements NVMe offload may keep in CPU memory.
        aio: DeepSpeed's ``aio`` section (block size, queue depth, ...) for the NVMe reads and writes.
        pin_memory: pin offloaded CPU tensors (default: when computing on CUDA).
        sharded_module_classes: classes or class names that become FSDP units at stages 2-3 (default: repeated blocks).
        reshard_after_forward: stage-3 override of FSDP2's ``reshard_after_forward``, for every unit: ``True``
            also reshards the root and the last unit, which the default keeps (see ``ZeroConfig``).
        checkpoint_io: refused (the strategy writes its checkpoints with ``torch.distributed.checkpoint`` itself).
        process_group_backend: ``"gloo"``, ``"nccl"``, ... (default: from the accelerator).
        timeout: the process-group timeout, a positive ``timedelta`` or number of seconds.
        start_method: ``"popen"`` (re-run the script per rank, like ``DDPStrategy``), ``"spawn"``, ``"fork"``,
            ``"forkserver"``.
        async_save: write checkpoints in the background (staged to CPU first; the next save, a load and the end
            of training wait for it). Every save is atomic: a crash mid-save leaves the previous one loadable.
        communication_data_type: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: the gradients' reduce dtype.
        loss_scale: DeepSpeed's fp16 loss scale (``0``: dynamic); with the five below, DeepSpeed's names, meanings
            and defaults, valid only with an fp16 precision (``docs/precision.md``).
        initial_scale_power: the dynamic scale starts at ``2**initial_scale_power``.
        loss_scale_window: steps without overflow before the dynamic scale grows.
        hysteresis: overflows tolerated before the dynamic scale shrinks.
        consecutive_hysteresis: refill the hysteresis on every step without overflow.
        min_loss_scale: the dynamic scale's floor.
        config: a DeepSpeed ``ds_config`` (dict, ``.json``/``.yaml`` path or JSON string). Its settings fill every
            argument left at ``None``; explicit arguments win; ``"auto"`` values are resolved at setup from the
            Trainer, DataLoader and LightningModule (``docs/ds_config.md``). Without it the file
            ``PL_DEEPSPEED_CONFIG_PATH`` names is read, as ``DeepSpeedStrategy`` does.
        strict: with ``config``, unknown keys and unsupported features are errors (``False``: warnings).
        pipeline_parallel_size: pipeline stages over a ``PipelineModule``, ZeRO on the data-parallel dimension
            (``docs/pipeline.md``, as the next three).
        micro_batches: micro-batches per pipelined batch.
        pipeline_schedule: the pipeline schedule's name.
        virtual_stages: pipeline stages per rank (interleaved schedules).
        find_unused_parameters: ``DDPStrategy``'s option, for the DDP of stages 0-1 (as the next three).
        static_graph: ``DDPStrategy``'s option.
        gradient_as_bucket_view: ``DDPStrategy``'s option; unlike ``DDPStrategy`` it defaults to True (one gradient
            buffer per rank).
        bucket_cap_mb: ``DDPStrategy``'s option.
        exclude_frozen_parameters: frozen parameters stay out of checkpoints.
        verbose: print the whole ds_config.
        hang_timeout: seconds (or ``timedelta``) a step, validation batch, checkpoint save/load or teardown may last
            before the job exits naming the stuck rank(s) with every rank's stacks (default 600; ``None``: off).
        auto_resume: on a restarted job (``"always"``: every fit) without ``ckpt_path``, resume from the newest
            complete checkpoint, and checkpoint on preemption signals (Trainer only; Fabric refuses ``True``).
        hybrid_shard_size: HSDP: shard within groups of this many ranks, replicate across (opt-in).
        activation_checkpointing: recompute blocks' activations in backward (``docs/activation_checkpointing.md``).
        cpu_checkpointing: keep the checkpointed blocks' inputs on CPU.
        activation_checkpointing_policy: which blocks are checkpointed.
        load_full_weights: ``ckpt_path`` must be one file, which may lack optimizer states (Trainer only).
        rendezvous_timeout: seconds a multi-node start waits for every node before naming the missing ones (300).
        unit_bytes: stages 2-3: consecutive blocks share one FSDP2 unit up to this many parameter bytes (``0``: a
            unit per block; ``docs/units.md``, as the next two).
        param_persistence_threshold: units under this many elements stay in the root.
        prefetch_bytes: prefetch of the next units' all-gathers up to this many bytes.
        state_dict_type: ``"sharded"`` (a checkpoint directory) or ``"full"`` (one torch file, streamed out of the
            shards), as Lightning's ``FSDPStrategy``.
        broadcast_buffers: every rank takes rank 0's buffers before a forward, on DDP's schedule, at every stage (the
            default, except under a pipeline); ``False``: each rank keeps its own (``docs/stages.md``, "Buffers").
    """

    # Literal: LightningCLI (jsonargparse) refuses stage=4 or offload="gpu" while it parses the config
    stage: Optional[Literal[0, 1, 2, 3]] = None
    offload: Optional[Literal["none", "cpu", "nvme"]] = None
    offload_optimizer: Union[str, bool, None] = None
    offload_params: Optional[str] = None
    nvme_path: Optional[str] = None
    buffer_count: Optional[int] = None
    sub_group_size: Optional[int] = None
    buffer_size: Optional[int] = None
    max_in_cpu: Optional[int] = None
    aio: Optional[dict] = None
    pin_memory: Optional[bool] = None
    sharded_module_classes: Optional[Union[set, list, tuple]] = None
    reshard_after_forward: Optional[Union[bool, int]] = None
    checkpoint_io: Optional[Any] = None
    process_group_backend: Optional[str] = None
    timeout: Optional[timedelta] = default_pg_timeout
    start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen"
    async_save: bool = False
    communication_data_type: Optional[str] = None
    loss_scale: Optional[float] = None
    initial_scale_power: Optional[int] = None
    loss_scale_window: Optional[int] = None
    hysteresis: Optional[int] = None
    consecutive_hysteresis: Optional[bool] = None
    min_loss_scale: Optional[float] = None
    config: Optional[Union[str, dict]] = None
    strict: bool = True
    pipeline_parallel_size: Optional[int] = None
    micro_batches: Optional[int] = None
    pipeline_schedule: Optional[str] = None
    virtual_stages: Optional[int] = None
    find_unused_parameters: Optional[bool] = None
    static_graph: Optional[bool] = None
    gradient_as_bucket_view: Optional[bool] = None
    bucket_cap_mb: Optional[float] = None
    exclude_frozen_parameters: bool = False
    verbose: bool = False
    hang_timeout: Optional[Union[float, timedelta]] = DEFAULT_HANG_TIMEOUT
    auto_resume: Union[bool, str] = True
    hybrid_shard_size: Optional[int] = None
    activation_checkpointing: Any = None
    cpu_checkpointing: Optional[bool] = None
    activation_checkpointing_policy: Any = None
    load_full_weights: bool = False
    rendezvous_timeout: Union[float, timedelta] = DEFAULT_RENDEZVOUS_TIMEOUT
    unit_bytes: Optional[int] = None
    param_persistence_threshold: Optional[int] = None
    prefetch_bytes: Optional[int] = None
    state_dict_type: Literal["sharded", "full"] = "sharded"
    broadcast_buffers: Optional[bool] = None


def resolve_settings(**arguments: Any) -> ZeroSettings:
    """Validate a ZeroStrategy's constructor arguments (the fields of :class:`ZeroArguments`); the ds_config
    (``config=``, else the file ``PL_DEEPSPEED_CONFIG_PATH`` names) fills every argument left at ``None``, explicit
    arguments win."""
    args, deepspeed_arguments = _split_arguments(arguments)
    timeout = check_timeout(args.timeout)
    rendezvous_timeout = check_rendezvous_timeout(args.rendezvous_timeout)
    check_backend_name(args.process_group_backend)
    deepspeed_arguments.apply_logging_level()
    ds_config = _bind(args.config, args.strict, deepspeed_arguments, args.stage, args.nvme_path)
    hang_seconds = parse_hang_timeout(args.hang_timeout)
    zero_config, communication_data_type, pipeline_parallel_size, micro_batches = _zero_config(args, ds_config)
    deepspeed_arguments.check_remote_device(zero_config.stage, zero_config.offload_params)
    check_backend_serves_offload(args.process_group_backend, zero_config)
    activation_checkpoint = activation_checkpointing_over_config(
        ds_config, args.activation_checkpointing, args.cpu_checkpointing, args.activation_checkpointing_policy
    )
    if args.start_method not in START_METHODS:
        raise ValueError(f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', got {args.start_method!r}")
    loss_scale_config, fp16_loss_scale_config = loss_scale_configs(
        ds_config.loss_scale_kwargs() if ds_config is not None else {},
        loss_scale=args.loss_scale,
        initial_scale_power=args.initial_scale_power,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        consecutive_hysteresis=args.consecutive_hysteresis,
        min_loss_scale=args.min_loss_scale,
    )
    parse_communication_data_type(communication_data_type)
    pipeline = make_pipeline_settings(
        pipeline_parallel_size,
        micro_batches,
        args.pipeline_schedule,
        args.virtual_stages,
        stage=zero_config.stage,
        offload_optimizer=zero_config.offload_optimizer,
        offload_params=zero_config.offload_params,
    )
    ddp_options = DDPOptions(
        args.find_unused_parameters, args.static_graph, args.gradient_as_bucket_view, args.bucket_cap_mb
    )
    ddp_options.check_stage(zero_config.stage, pipeline=pipeline.enabled)
    exclude_frozen_parameters, verbose, async_save = require_flags(
        exclude_frozen_parameters=args.exclude_frozen_parameters, verbose=args.verbose, async_save=args.async_save
    )
    if args.checkpoint_io is not None:
        raise ValueError(
            "ZeroStrategy writes sharded checkpoints with torch.distributed.checkpoint itself, so a "
            "custom checkpoint_io would be ignored; remove it"
        )
    return ZeroSettings(
        zero_config=zero_config,
        ds_config=ds_config,
        loss_scale_config=loss_scale_config,
        fp16_loss_scale_config=fp16_loss_scale_config,
        communication_data_type=communication_data_type,
        pipeline=pipeline,
        ddp_options=ddp_options,
        process_group_backend=args.process_group_backend,
        timeout=timeout,
        start_method=args.start_method,
        async_save=async_save,
        exclude_frozen_parameters=exclude_frozen_parameters,
        verbose=verbose,
        auto_resume=check_auto_resume(args.auto_resume),
        hang_timeout=hang_seconds,
        activation_checkpoint_config=activation_checkpoint,
        load_full_weights=check_load_full_weights(args.load_full_weights),
        rendezvous_timeout=rendezvous_timeout,
        state_dict_type=check_state_dict_type(args.state_dict_type, async_save=async_save),
    )


def _split_arguments(arguments: dict) -> tuple[ZeroArguments, DeepSpeedArguments]:
    """ZeroStrategy's own arguments and DeepSpeedStrategy's (:mod:`lightning_zero.ds_config.strategy_arguments`).
    ``offload_optimizer`` is both: a bool is DeepSpeedStrategy's switch, a device name ZeroStrategy's;
    ``cpu_checkpointing=True`` alone is DeepSpeedStrategy's config key; ``zero_optimization=False`` is ``stage=0``."""
    deepspeed = {
        name: arguments.pop(name)
        for name in DEEPSPEED_ARGUMENT_NAMES
        if name not in ("offload_optimizer", "cpu_checkpointing") and name in arguments
    }
    if isinstance(arguments.get("offload_optimizer"), bool):
        deepspeed["offload_optimizer"] = arguments.pop("offload_optimizer")
    if (
        arguments.get("cpu_checkpointing") is True
        and arguments.get("activation_checkpointing") is None
        and arguments.get("activation_checkpointing_policy") is None
    ):
        deepspeed["cpu_checkpointing"] = arguments.pop("cpu_checkpointing")
    deepspeed_arguments = DeepSpeedArguments(**deepspeed)
    args = ZeroArguments(**arguments)
    return replace(args, stage=deepspeed_arguments.stage_over(args.stage)), deepspeed_arguments


def _bind(
    config: Any, strict: bool, deepspeed_arguments: DeepSpeedArguments, stage: Optional[int], nvme_path: Any
) -> Optional[DeepSpeedConfigBinding]:
    """The ds_config binding, saying on rank 0 when the config came from ``PL_DEEPSPEED_CONFIG_PATH``."""
    binding = bind_ds_config(config, strict, deepspeed_arguments, stage, nvme_path)
    if binding is not None and binding.origin is not None:
        rank_zero_info(f"ZeroStrategy: loading the DeepSpeed config from {binding.origin}")
    return binding


def _zero_config(args: ZeroArguments, ds_config: Optional[DeepSpeedConfigBinding]) -> tuple:
    """The :class:`ZeroConfig` from the explicit arguments over the ds_config's, and the three arguments the config
    may also fill that live elsewhere: ``(zero_config, communication_data_type, pipeline_parallel_size,
    micro_batches)``."""
    offloads = offload_arguments(
        ds_config.strategy_kwargs() if ds_config else {},
        args.offload,
        args.offload_optimizer,
        args.offload_params,
        args.nvme_path,
        args.buffer_count,
        args.sub_group_size,
        args.buffer_size,
        args.max_in_cpu,
        args.aio,
    )
    offload = offloads.pop("offload") or "none"  # "none": the config's shorthand was already considered
    (
        stage,
        offload,
        pin_memory,
        reshard_after_forward,
        communication_data_type,
        pipeline_parallel_size,
        micro_batches,
    ) = arguments_over_config(
        ds_config,
        args.stage,
        offload,
        args.pin_memory,
        args.reshard_after_forward,
        args.communication_data_type,
        args.pipeline_parallel_size,
        args.micro_batches,
    )
    offloads = config_params_offload_at_stage(offloads, stage, args.offload_params)
    zero_config = ZeroConfig(
        stage=stage,
        offload=offload,
        pin_memory=pin_memory,
        **offloads,
        sharded_module_classes=frozenset(args.sharded_module_classes) if args.sharded_module_classes else None,
        reshard_after_forward=reshard_after_forward,
        hybrid_shard_size=hybrid_shard_size_over_config(ds_config, args.hybrid_shard_size),
        **unit_knobs_over_config(
            ds_config,
            unit_bytes=args.unit_bytes,
            prefetch_bytes=args.prefetch_bytes,
            param_persistence_threshold=args.param_persistence_threshold,
        ),
        broadcast_buffers=_broadcast_buffers(args.broadcast_buffers, pipeline_parallel_size),
    )
    return zero_config, communication_data_type, pipeline_parallel_size, micro_batches


def _broadcast_buffers(value: Optional[bool], pipeline_parallel_size: Optional[int]) -> bool:
    """``broadcast_buffers``: ``None`` is DDP's default, True, except under a pipeline, whose schedule broadcasts
    buffers once at setup (:mod:`lightning_zero.pipeline.schedules`) and never before a forward."""
    pipelined = pipeline_parallel_size is not None and pipeline_parallel_size > 1
    if value is None:
        return not pipelined
    if value is True and pipelined:
        raise ValueError(
            "broadcast_buffers=True: a pipeline (pipeline_parallel_size > 1) broadcasts buffers only at "
            "setup, not before every forward; leave broadcast_buffers unset or set it to False"
        )
    return value  # a non-bool is refused by ZeroConfig


def checkpoint_save_options(binding: Optional[DeepSpeedConfigBinding], precision: str) -> dict:
    """What a checkpoint save takes from the ds_config (both adapters' ``save_checkpoint``): the effective config
    for ``zero.json``, and with ``stage3_gather_16bit_weights_on_model_save: true`` the dtype of the consolidated
    weights file it adds (what DeepSpeed's ``save_16bit_model`` writes at this ``precision``); ``"auto"`` left
    unresolved is accelerate's default, false."""
    gather = binding is not None and binding.translation.gather_16bit_weights_on_model_save is True
    return {
        "ds_config_report": binding.report() if binding is not None else None,
        "weights_16bit": weights_16bit_dtype(precision) if gather else None,
    }


def require_flags(**flags) -> tuple:
    """The values of ``flags``, each checked to be a bool (a string "false" would otherwise count as true)."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    return tuple(flags.values())


# The argument names resolve_settings takes: an adapter passes exactly these of its own constructor arguments.
SETTING_NAMES = frozenset(field.name for field in fields(ZeroArguments)) | frozenset(DEEPSPEED_ARGUMENT_NAMES)


def check_auto_resume(value) -> Union[bool, str]:
    """``auto_resume``: ``True`` (on a restart), ``"always"`` (every fit without ``ckpt_path``) or ``False``."""
    if isinstance(value, bool) or value == "always":
        return value
    raise TypeError(
        f"auto_resume must be True (resume on a restarted job), 'always' (resume every fit that has no "
        f"ckpt_path) or False, got {value!r}"
    )
