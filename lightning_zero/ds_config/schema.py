"""The DeepSpeed ``ds_config`` keys lightning-zero knows, with DeepSpeed's defaults and what each one becomes.

Every key DeepSpeed documents for the features we implement is listed here with one of these roles:

* ``strategy``: mapped onto a ``ZeroStrategy`` keyword argument.
* ``trainer``: a Trainer-level setting (precision, clipping, batch sizes, logging cadence) returned separately so
  the strategy can check it against the Trainer.
* ``returned``: handed to the integrator as data (optimizer, scheduler, model saving).
* ``no_effect``: accepted, because it tunes a DeepSpeed-internal mechanism our engines (DDP, FSDP2
  ``fully_shard``) do not have; the note says why. A value different from DeepSpeed's default also warns.
* ``unsupported``: accepted only at its default value; any other value fails (``strict=True``) or warns.

Defaults are those of DeepSpeed 0.19 (``deepspeed/runtime/zero/config.py``, ``precision_config.py``,
``runtime/constants.py``); they fill the *effective* configuration that is printed and saved with checkpoints.
The table in ``docs/ds_config.md`` is the human-readable version of this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STRATEGY = "strategy"
TRAINER = "trainer"
RETURNED = "returned"
NO_EFFECT = "no_effect"
UNSUPPORTED = "unsupported"
ROLES = (STRATEGY, TRAINER, RETURNED, NO_EFFECT, UNSUPPORTED)

# Sentinel default for keys whose DeepSpeed default is "decided from other keys" (e.g. overlap_comm).
DERIVED = "<derived>"


@dataclass(frozen=True)
class KeySpec:
    """One known key: DeepSpeed's default, its role for us, and a sentence saying what happens to it."""

    default: Any
    role: str
    note: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


_FSDP_UNITS = (
    "FSDP2 communicates per sharded module unit (one all-gather / reduce-scatter per unit) and DDP uses its own buckets"
)
_NVME_ONLY = "only used by NVMe offload (ZeRO-Infinity); no effect with device='cpu'"
_PARAM_SWAP_ONLY = "-> the same-named strategy argument with offload_param.device 'nvme' (stage 3); no effect otherwise"

# No-effect keys that only permit what our engines always do: no value of theirs is dropped, so none is warned about.
PERMISSIONS = ("zero_allow_untested_optimizer",)

ZERO_KEYS: dict[str, KeySpec] = {
    "stage": KeySpec(0, STRATEGY, "-> stage"),
    "offload_optimizer": KeySpec(None, STRATEGY, "device -> offload_optimizer (stages 1-3); pin_memory -> pin_memory"),
    "offload_param": KeySpec(
        None, STRATEGY, "device -> offload_params (stage 3 only; needs offload_optimizer); pin_memory -> pin_memory"
    ),
    "zero_hpz_partition_size": KeySpec(
        1,
        STRATEGY,
        "ZeRO++ hpZ secondary partition -> reshard_after_forward=<size> at stage 3 (FSDP2 reshards to "
        "a group of that size after forward)",
    ),
    "mics_shard_size": KeySpec(
        -1,
        STRATEGY,
        "MiCS (shard within groups of that size, replicate across them; removed from DeepSpeed 0.19) -> "
        "hybrid_shard_size=<size> (FSDP2 HSDP); -1: off",
    ),
    "stage3_gather_16bit_weights_on_model_save": KeySpec(
        False,
        RETURNED,
        "true -> every checkpoint also holds pytorch_model.bin (DeepSpeed's save_16bit_model file): "
        "the full weights in the run's 16-bit dtype (fp32 in an fp32 run), streamed from the saved shards on rank 0, "
        "read by torch.load(weights_only=True); at every stage",
    ),
    "overlap_comm": KeySpec(
        DERIVED,
        NO_EFFECT,
        "FSDP2 always overlaps all-gather/reduce-scatter with compute on "
        "separate streams, and DDP overlaps its all-reduce with backward",
    ),
    "contiguous_gradients": KeySpec(
        True,
        NO_EFFECT,
        "FSDP2 reduce-scatters each unit's gradients into one flat "
        "buffer already, so there is no fragmentation to avoid",
    ),
    "reduce_bucket_size": KeySpec(
        500_000_000,
        NO_EFFECT,
        _FSDP_UNITS + ": a written number -> unit_bytes "
        "(elements x 4 bytes) at stages 2-3, DDP's bucket_cap_mb at stages 0-1",
    ),
    "allgather_bucket_size": KeySpec(
        500_000_000,
        NO_EFFECT,
        _FSDP_UNITS + ": a written number -> unit_bytes "
        "(elements x 4 bytes) at stage 2; DeepSpeed's stage 3 does not use it",
    ),
    "allgather_partitions": KeySpec(True, NO_EFFECT, "updated shards are always all-gathered (never broadcast)"),
    "reduce_scatter": KeySpec(True, NO_EFFECT, "sharded stages always reduce-scatter gradients; stage 0 all-reduces"),
    "use_multi_rank_bucket_allreduce": KeySpec(True, NO_EFFECT, _FSDP_UNITS),
    "sub_group_size": KeySpec(
        1_000_000_000,
        NO_EFFECT,
        "-> sub_group_size with offload_optimizer.device 'nvme'; without NVMe the optimizer steps each shard directly",
    ),
    "stage3_prefetch_bucket_size": KeySpec(
        50_000_000,
        NO_EFFECT,
        "a written number -> prefetch_bytes (elements "
        "x 4 bytes) at stage 3; otherwise FSDP2 prefetches one unit in backward",
    ),
    "stage3_param_persistence_threshold": KeySpec(
        100_000,
        NO_EFFECT,
        "a written number -> "
        "param_persistence_threshold at stage 3 (units that small stay in "
        "the root unit); otherwise units are grouped by unit_bytes",
    ),
    "stage3_model_persistence_threshold": KeySpec(2**63 - 1, NO_EFFECT, "no persistent unsharded parameters in FSDP2"),
    "stage3_max_live_parameters": KeySpec(
        1_000_000_000,
        NO_EFFECT,
        "FSDP2 frees each unit's full parameters after "
        "its forward/backward (reshard_after_forward), not by a global count",
    ),
    "stage3_max_reuse_distance": KeySpec(
        1_000_000_000, NO_EFFECT, "FSDP2 does not track reuse distance; it reshards per unit"
    ),
    "stage3_module_granularity_threshold": KeySpec(
        0, NO_EFFECT, "units are chosen by sharded_module_classes and unit_bytes"
    ),
    "stage3_use_all_reduce_for_fetch_params": KeySpec(False, NO_EFFECT, "parameters are fetched with all-gather"),
    "stage3_allgather_sequential": KeySpec(False, NO_EFFECT, "FSDP2 all-gathers one unit at a time already"),
    "round_robin_gradients": KeySpec(
        False, NO_EFFECT, "a DeepSpeed gradient-copy schedule for CPU offload; our offload copies each rank's own shard"
    ),
    "load_from_fp32_weights": KeySpec(True, NO_EFFECT, "checkpoints always keep fp32 master weights and load them"),
    "elastic_checkpoint": KeySpec(False, NO_EFFECT, "distributed checkpoints reshard to any world size already"),
    "ignore_unused_parameters": KeySpec(
        True, NO_EFFECT, "sharded stages tolerate unused parameters; at stage 0 DDP's find_unused_parameters decides"
    ),
    "legacy_stage1": KeySpec(False, NO_EFFECT, "there is a single stage-1 implementation"),
    "parameter_alignment": KeySpec(False, NO_EFFECT, "no flat buffers to pad"),
    "compute_grad_norm": KeySpec(True, NO_EFFECT, "the norm is computed when clipping asks for it"),
    "memory_efficient_linear": KeySpec(True, NO_EFFECT, "no Linear replacement: FSDP2 works on plain nn.Linear"),
    "override_module_apply": KeySpec(True, NO_EFFECT, "no nn.Module.apply patching"),
    "pipeline_loading_checkpoint": KeySpec(False, NO_EFFECT, "checkpoints load through torch.distributed.checkpoint"),
    "log_trace_cache_warnings": KeySpec(False, NO_EFFECT, "no parameter trace cache in FSDP2"),
    "enable_sanity_checks": KeySpec(False, NO_EFFECT, "DeepSpeed-internal debugging switch"),
    "save_muon_momentum_buffer_in_memory": KeySpec(False, NO_EFFECT, _NVME_ONLY),
    "leaf_module": KeySpec(None, NO_EFFECT, "units are chosen by sharded_module_classes"),
    "zero_quantized_weights": KeySpec(False, UNSUPPORTED, "ZeRO++ quantized weight all-gather is not implemented"),
    "zero_quantized_nontrainable_weights": KeySpec(
        False, UNSUPPORTED, "ZeRO++ quantized frozen weights are not implemented"
    ),
    "zero_quantized_gradients": KeySpec(False, UNSUPPORTED, "ZeRO++ quantized gradient reduce is not implemented"),
    "zenflow": KeySpec(None, UNSUPPORTED, "ZenFlow (stall-free offload) is not implemented"),
    "mics_hierarchical_params_gather": KeySpec(
        False,
        UNSUPPORTED,
        "MiCS's hierarchical all-gather (removed from "
        "DeepSpeed 0.19): mics_shard_size maps to FSDP2 HSDP, which "
        "all-gathers within each shard group in one step",
    ),
    "zeropp_loco_param": KeySpec(
        None,
        UNSUPPORTED,
        "LoCo error feedback for ZeRO++ quantized gradients (removed from "
        "DeepSpeed 0.19); quantized gradients are not implemented",
    ),
}

# DeepSpeed's pydantic field names of the stage-3 keys: its models accept them as well as the documented
# stage3_* aliases (populate_by_name), so they are the same keys under another spelling.
ZERO_FIELD_NAMES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}

# Deprecated spellings DeepSpeed still reads, and the key they become.
DEPRECATED_ZERO_KEYS = {
    "cpu_offload": "offload_optimizer",
    "cpu_offload_param": "offload_param",
    "cpu_offload_use_pin_memory": "offload_optimizer.pin_memory / offload_param.pin_memory",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}

OFFLOAD_COMMON_KEYS: dict[str, KeySpec] = {
    "device": KeySpec("none", STRATEGY, "-> offload_optimizer / offload_params ('none', 'cpu', 'nvme')"),
    "pin_memory": KeySpec(
        True,
        STRATEGY,
        "true -> pin_memory=None (pin whenever the device is CUDA, the only case "
        "where DeepSpeed can pin); false -> pin_memory=False",
    ),
    "nvme_path": KeySpec(None, NO_EFFECT, "-> nvme_path with device 'nvme'; " + _NVME_ONLY),
    "buffer_count": KeySpec(5, NO_EFFECT, "-> buffer_count with device 'nvme'; " + _NVME_ONLY),
}
OFFLOAD_PARAM_KEYS: dict[str, KeySpec] = {
    **OFFLOAD_COMMON_KEYS,
    "buffer_size": KeySpec(100_000_000, NO_EFFECT, _PARAM_SWAP_ONLY),
    "max_in_cpu": KeySpec(1_000_000_000, NO_EFFECT, _PARAM_SWAP_ONLY),
}
OFFLOAD_OPTIMIZER_KEYS: dict[str, KeySpec] = {
    **OFFLOAD_COMMON_KEYS,
    "buffer_count": KeySpec(4, NO_EFFECT, "-> buffer_count with device 'nvme'; " + _NVME_ONLY),
    "pipeline_read": KeySpec(False, NO_EFFECT, "the swapped step always reads the next sub-group while stepping"),
    "pipeline_write": KeySpec(False, NO_EFFECT, "the swapped step always writes the previous sub-group while stepping"),
    "fast_init": KeySpec(
        False, NO_EFFECT, "swap files are written at the first step, there is no separate initialisation to speed up"
    ),
    "ratio": KeySpec(
        1.0, NO_EFFECT, "partial optimizer offload is not implemented: the whole optimizer state is offloaded"
    ),
    "super_offload": KeySpec(False, UNSUPPORTED, "SuperOffload is not implemented"),
    "cpuadam_cores_perc": KeySpec(0.8, NO_EFFECT, "the CPU optimizer step uses torch's intra-op threads"),
}

_AIO = "with an offload device 'nvme' (else no effect: only NVMe offload does file I/O)"
AIO_KEYS: dict[str, KeySpec] = {
    "block_size": KeySpec(1_048_576, STRATEGY, "-> aio block_size " + _AIO),
    "queue_depth": KeySpec(8, STRATEGY, "-> aio queue_depth " + _AIO),
    "intra_op_parallelism": KeySpec(1, STRATEGY, "-> aio thread_count " + _AIO),
    "thread_count": KeySpec(1, STRATEGY, "the older name of intra_op_parallelism -> aio thread_count " + _AIO),
    "single_submit": KeySpec(False, STRATEGY, "-> aio single_submit " + _AIO),
    "overlap_events": KeySpec(True, STRATEGY, "-> aio overlap_events " + _AIO),
    "use_gds": KeySpec(False, UNSUPPORTED, "GPUDirect Storage: the engine reads into host memory"),
}

_LOSS_SCALE = "-> strategy kwarg of the same name (used when fp16 is enabled)"
FP16_KEYS: dict[str, KeySpec] = {
    "enabled": KeySpec(False, TRAINER, "true -> precision='16-mixed'"),
    "auto_cast": KeySpec(
        False,
        NO_EFFECT,
        "precision='16-mixed' runs the forward under torch.autocast, which casts "
        "op inputs itself, so there is no separate input cast",
    ),
    "loss_scale": KeySpec(0.0, STRATEGY, "-> loss_scale (0 = dynamic)"),
    "initial_scale_power": KeySpec(16, STRATEGY, _LOSS_SCALE),
    "loss_scale_window": KeySpec(1000, STRATEGY, _LOSS_SCALE),
    "hysteresis": KeySpec(2, STRATEGY, _LOSS_SCALE),
    "consecutive_hysteresis": KeySpec(False, STRATEGY, _LOSS_SCALE),
    "min_loss_scale": KeySpec(1, STRATEGY, _LOSS_SCALE),
    "fp16_master_weights_and_grads": KeySpec(False, UNSUPPORTED, "master weights are always fp32"),
}

BF16_KEYS: dict[str, KeySpec] = {
    "enabled": KeySpec(False, TRAINER, "true -> precision='bf16-mixed'"),
    "immediate_grad_update": KeySpec(False, NO_EFFECT, "gradients are accumulated in fp32 by the engines"),
    "check_grad_overflow": KeySpec(True, NO_EFFECT, "bf16 runs no loss scaler, so there is no overflow skip"),
    "bf16_master_weights_and_grads": KeySpec(False, UNSUPPORTED, "master weights are always fp32"),
    "bf16_optimizer_states": KeySpec(False, UNSUPPORTED, "optimizer states are always fp32"),
}

TORCH_AUTOCAST_KEYS: dict[str, KeySpec] = {
    "enabled": KeySpec(
        False, TRAINER, "true -> precision from dtype (bfloat16 -> 'bf16-mixed', float16 -> '16-mixed')"
    ),
    "dtype": KeySpec(
        None,
        TRAINER,
        "selects the mixed precision (bfloat16 -> 'bf16-mixed', float16 -> '16-mixed'); "
        "absent: torch.autocast's default on the GPUs DeepSpeed trains on, float16",
    ),
    "lower_precision_safe_modules": KeySpec(None, NO_EFFECT, "torch.autocast applies its own per-op lists"),
}

ACTIVATION_CHECKPOINTING_KEYS: dict[str, KeySpec] = {
    "partition_activations": KeySpec(
        False,
        NO_EFFECT,
        "splits each checkpoint across the tensor-parallel ranks of "
        "one model replica; here one rank holds a whole replica (no tensor "
        "parallelism), so there is nothing to split",
    ),
    "cpu_checkpointing": KeySpec(
        False,
        STRATEGY,
        "-> cpu_checkpointing: the inputs kept by checkpointed blocks "
        "live in CPU memory (torch.autograd.graph.save_on_cpu)",
    ),
    "contiguous_memory_optimization": KeySpec(
        False,
        NO_EFFECT,
        "copies checkpoints into one preallocated buffer "
        "against fragmentation; torch.utils.checkpoint keeps each input as "
        "its own tensor in the caching allocator",
    ),
    "number_checkpoints": KeySpec(
        None,
        NO_EFFECT,
        "sizes the buffer DeepSpeed copies checkpoints into with "
        "contiguous_memory_optimization; which blocks are checkpointed does not depend on "
        "it, here as in DeepSpeed (every detected block is; to checkpoint only some, pass "
        "ActivationCheckpointConfig(number_checkpoints=N) or every_k)",
    ),
    "synchronize_checkpoint_boundary": KeySpec(
        False,
        NO_EFFECT,
        "a CUDA synchronize at DeepSpeed's checkpoint boundaries, for its profiling; torch needs none for correctness",
    ),
    "profile": KeySpec(False, NO_EFFECT, "DeepSpeed's own timers of its checkpoint API; use Lightning's profiler"),
}

PIPELINE_KEYS: dict[str, KeySpec] = {
    "stages": KeySpec("auto", STRATEGY, "an int -> pipeline_parallel_size; 'auto' leaves it to the strategy"),
    "partition": KeySpec("best", NO_EFFECT, "stages are split by the strategy's pipeline splitter"),
    "seed_layers": KeySpec(False, NO_EFFECT, "no per-layer seeding"),
    "activation_checkpoint_interval": KeySpec(0, NO_EFFECT, "use activation checkpointing on the blocks instead"),
    "pipe_partitioned": KeySpec(True, NO_EFFECT, "needs tensor parallelism"),
    "grad_partitioned": KeySpec(True, NO_EFFECT, "needs tensor parallelism"),
    "use_reentrant": KeySpec(True, NO_EFFECT, "torch.utils.checkpoint is used non-reentrant"),
}

CHECKPOINT_KEYS: dict[str, KeySpec] = {
    "tag_validation": KeySpec("Warn", NO_EFFECT, "distributed checkpoints are validated by their metadata"),
    "load_universal": KeySpec(False, NO_EFFECT, "distributed checkpoints are universal (reshardable) by design"),
    "use_node_local_storage": KeySpec(
        False,
        UNSUPPORTED,
        "node-local checkpoint storage: every rank must see one "
        "shared checkpoint directory, else no node holds a loadable checkpoint",
    ),
    "parallel_write": KeySpec({"pipeline_stage": False}, NO_EFFECT, "every rank writes its own shard files"),
    "checkpoint_serialization": KeySpec(
        True,
        NO_EFFECT,
        "torch.save's zip-or-legacy switch of DeepSpeed's fast "
        "writer; checkpoints are written by torch.distributed.checkpoint",
    ),
    "writer": KeySpec(
        None,
        NO_EFFECT,
        "DeepSpeed's checkpoint writer engines (fast, decoupled); checkpoints are "
        "written by torch.distributed.checkpoint, every rank its shards; ZeroStrategy(async_save=True) "
        "writes in the background",
    ),
}

TOP_LEVEL_KEYS: dict[str, KeySpec] = {
    "train_batch_size": KeySpec(None, TRAINER, "checked: train_batch_size = micro x accumulation x data-parallel size"),
    "train_micro_batch_size_per_gpu": KeySpec(None, TRAINER, "checked against the DataLoader's batch_size"),
    "gradient_accumulation_steps": KeySpec(
        None, TRAINER, "-> Trainer accumulate_grad_batches (and micro_batches when pipelining)"
    ),
    "steps_per_print": KeySpec(None, TRAINER, "-> Trainer log_every_n_steps"),
    "wall_clock_breakdown": KeySpec(False, TRAINER, "returned; true asks for per-phase timings (Lightning profiler)"),
    "aio": KeySpec(None, STRATEGY, "the NVMe swap engine's knobs; see the aio table"),
    "gradient_clipping": KeySpec(
        None,
        TRAINER,
        "-> Trainer gradient_clip_val (norm clipping); 0 disables; absent: "
        "the Trainer's, as DeepSpeedStrategy writes it (DeepSpeed alone would clip at 1.0)",
    ),
    "optimizer": KeySpec(None, RETURNED, "built by lightning_zero.ds_config.optimizers.build_optimizer"),
    "scheduler": KeySpec(
        None, RETURNED, "built by lightning_zero.ds_config.optimizers.build_scheduler, stepped every optimizer step"
    ),
    "zero_optimization": KeySpec(None, STRATEGY, "see the zero_optimization table"),
    "fp16": KeySpec(None, TRAINER, "see the fp16 table"),
    "bf16": KeySpec(None, TRAINER, "see the bf16 table"),
    "torch_autocast": KeySpec(None, TRAINER, "see the torch_autocast table"),
    "activation_checkpointing": KeySpec(
        None,
        STRATEGY,
        "present -> activation_checkpointing=True (the repeated "
        "blocks) unless the argument is given; see the activation_checkpointing "
        "table",
    ),
    "pipeline": KeySpec(None, STRATEGY, "see the pipeline table"),
    "communication_data_type": KeySpec(None, STRATEGY, "-> communication_data_type ('fp32', 'bf16', 'fp16')"),
    "prescale_gradients": KeySpec(
        False,
        NO_EFFECT,
        "DDP and FSDP2 already divide by the world size before (or "
        "split around) the reduction; the averaged gradient is identical",
    ),
    "gradient_predivide_factor": KeySpec(
        1.0,
        NO_EFFECT,
        "only moves where the average's division happens (an fp16 "
        "overflow guard); FSDP2 chooses its own pre/post-divide split",
    ),
    "gradient_allreduce_op": KeySpec("mean", UNSUPPORTED, "gradients are always averaged ('mean')"),
    "zero_allow_untested_optimizer": KeySpec(
        False,
        NO_EFFECT,
        "any torch.optim optimizer works with our engines "
        "(true asks for that; false only made DeepSpeed refuse the optimizers it "
        "had not tested)",
    ),
    "zero_force_ds_cpu_optimizer": KeySpec(True, NO_EFFECT, "CPU offload steps the torch optimizer on CPU"),
    "memory_breakdown": KeySpec(False, NO_EFFECT, "use Lightning's DeviceStatsMonitor"),
    "dump_state": KeySpec(False, NO_EFFECT, "DeepSpeed-internal debugging switch"),
    "disable_allgather": KeySpec(False, NO_EFFECT, "DeepSpeed-internal switch"),
    "disable_python_gc": KeySpec(False, NO_EFFECT, "DeepSpeed-internal switch"),
    "dataloader_drop_last": KeySpec(False, NO_EFFECT, "the LightningModule owns its DataLoader; set drop_last there"),
    "log_level": KeySpec(None, NO_EFFECT, "use Python logging for 'lightning_zero'"),
    "checkpoint": KeySpec(None, NO_EFFECT, "see the checkpoint table"),
    "vocabulary_size": KeySpec(None, NO_EFFECT, "only used by DeepSpeed for an alignment warning"),
    "seed": KeySpec(None, NO_EFFECT, "use lightning.seed_everything"),
    "allgather_size": KeySpec(500_000_000, NO_EFFECT, "bucket size of the deprecated 'zero_optimization: true' form"),
    "managed_gradient_accumulation": KeySpec(
        True,
        UNSUPPORTED,
        "the optimizer steps every gradient_accumulation_steps "
        "micro-batches (the Trainer's accumulate_grad_batches), as DeepSpeed's "
        "managed accumulation does; false (every step() updates) is not "
        "supported",
    ),
    "seq_parallel_communication_data_type": KeySpec(
        "fp32", NO_EFFECT, "used only by Ulysses sequence parallelism (sequence_parallel_size), which is not supported"
    ),
    "use_data_before_expert_parallelism": KeySpec(
        False,
        NO_EFFECT,
        "orders the data- and expert-parallel groups of DeepSpeed-MoE (expert_parallel), which is not supported",
    ),
    "data_parallel_size": KeySpec(
        None,
        NO_EFFECT,
        "DeepSpeed reads it only with sequence_parallel_size (not "
        "supported); the data-parallel size is the world size over the pipeline stages",
    ),
}

# Whole sections of other DeepSpeed features, and why they are not supported. A section that is present but
# explicitly disabled ({"enabled": false}) is accepted with a note: it asks for nothing.
UNSUPPORTED_SECTIONS = {
    "sparse_attention": "DeepSpeed Sparse Attention kernels",
    "compression_training": "DeepSpeed's compression library (quantization/pruning aware training)",
    "flops_profiler": "DeepSpeed's FLOPs profiler (use Lightning's profiler or torch.utils.flop_counter)",
    "autotuning": "DeepSpeed's autotuner",
    "data_efficiency": "DeepSpeed's data-efficiency library (curriculum learning, random-LTD)",
    "curriculum_learning": "DeepSpeed's legacy curriculum learning",
    "elasticity": "DeepSpeed elastic training",
    "progressive_layer_drop": "Progressive Layer Dropping",
    "quantize_training": "Mixture-of-Quantization training",
    "eigenvalue": "eigenvalue-based quantization scheduling",
    "nebula": "Nebula checkpointing",
    "amp": "NVIDIA Apex AMP (use fp16/bf16, which map to Lightning precision)",
    "hybrid_engine": "DeepSpeed-Chat's hybrid (train + inference) engine",
    "tensorboard": "DeepSpeed's monitor (use a Lightning logger, e.g. TensorBoardLogger)",
    "wandb": "DeepSpeed's monitor (use a Lightning logger, e.g. WandbLogger)",
    "csv_monitor": "DeepSpeed's monitor (use a Lightning logger, e.g. CSVLogger)",
    "comet": "DeepSpeed's monitor (use a Lightning logger, e.g. CometLogger)",
    "comms_logger": "DeepSpeed's communication logger (use the torch profiler)",
    "data_types": "DeepSpeed's gradient-accumulation dtype switch (gradients accumulate in fp32)",
    "compile": "DeepSpeed's compile/DeepCompile (compile the LightningModule with torch.compile)",
    "weight_quantization": "DeepSpeed's weight quantization",
    "tensor_parallel": "DeepSpeed AutoTP tensor parallelism",
    "sequence_parallel_size": "Ulysses sequence parallelism",
    "expert_parallel": "DeepSpeed-MoE expert parallelism",
    "sparse_gradients": "sparse embedding gradient compression",
    "graph_harvesting": "CUDA graph harvesting",
    "timers": "DeepSpeed's internal timers (use Lightning's profiler)",
    "datastates_ckpt": "DataStates asynchronous checkpointing (use ZeroStrategy(async_save=True))",
    "zenflow": "ZenFlow stall-free offload",
}

# Sub-tables by section name, used by the translator and by the unknown-key suggestions.
SECTION_KEYS: dict[str, dict[str, KeySpec]] = {
    "zero_optimization": ZERO_KEYS,
    "zero_optimization.offload_optimizer": OFFLOAD_OPTIMIZER_KEYS,
    "zero_optimization.offload_param": OFFLOAD_PARAM_KEYS,
    "fp16": FP16_KEYS,
    "bf16": BF16_KEYS,
    "torch_autocast": TORCH_AUTOCAST_KEYS,
    "activation_checkpointing": ACTIVATION_CHECKPOINTING_KEYS,
    "pipeline": PIPELINE_KEYS,
    "checkpoint": CHECKPOINT_KEYS,
    "aio": AIO_KEYS,
}


def all_known_paths() -> list[str]:
    """Every dotted key path we know (``zero_optimization.reduce_bucket_size``...), for suggestions."""
    paths = list(TOP_LEVEL_KEYS) + list(UNSUPPORTED_SECTIONS) + ["bfloat16"]
    for section, keys in SECTION_KEYS.items():
        paths.extend(f"{section}.{key}" for key in keys)
    paths.extend(f"zero_optimization.{key}" for key in DEPRECATED_ZERO_KEYS)
    return paths
