"""Pipeline parallelism inside ZeroStrategy: its settings, the split over the ``("pp", "dp")`` mesh, global clipping.

With ``pipeline_parallel_size = p > 1`` the world is a 2-D mesh ``("pp", "dp")`` of shape ``(p, world / p)``. The
LightningModule holds one :class:`~lightning_zero.pipeline.PipelineModule`; at setup :func:`build_pipeline` keeps on
each rank only the layers of its stages and attaches the schedule, so ``self.model(inputs, targets)`` in
``training_step`` runs forward *and* backward of every micro-batch and returns the mean loss on every rank. The
ZeRO stage applies on the ``dp`` dimension:

=======  ==========================================================================================================
stage    data-parallel engine under the pipeline
=======  ==========================================================================================================
0        gradients all-reduced over ``dp`` after the schedule
1        as 0, and the optimizer partitioned over ``dp`` (each rank steps 1/dp, then broadcasts)
2        FSDP2 over ``dp`` on every layer and stage module, ``reshard_after_forward=False``
3        as 2 with ``reshard_after_forward=True``
=======  ==========================================================================================================

DeepSpeed allows only stages 0-1 with pipelines. Not supported here (each raises with this list): offload at
stages 2-3 (neither ``offload_optimizer`` nor ``offload_params`` is applied to the FSDP2-sharded stage modules),
fp16/bf16 (the schedule runs backward itself, outside the precision plugin's loss scaling), FSDP2 with a tied module
used by two stages of one rank (see
:class:`~lightning_zero.pipeline.schedules.PipelineRunner`), and parameters of the LightningModule outside its
PipelineModule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from lightning_zero.distributed.activation_checkpointing import apply_activation_checkpointing
from lightning_zero.pipeline.module import PipelineModule
from lightning_zero.pipeline.schedules import SCHEDULES, SINGLE_STAGE_SCHEDULES, PipelineConfig, build_pipeline
from lightning_zero.pipeline.specs import LayerSpec, get_parameter

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")


@dataclass(frozen=True)
class PipelineSettings:
    """ZeroStrategy's pipeline arguments, validated.

    Args:
        pipeline_parallel_size: pipeline stages across ranks (1: no pipeline).
        micro_batches: micro-batches each rank's batch is split into per step. Default: ``pipeline_parallel_size``
            (DeepSpeed runs ``gradient_accumulation_steps`` micro-batches, 1 by default, which leaves a full bubble;
            the smallest count that keeps every stage busy is the better default).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"`` or ``"zbv"``.
        virtual_stages: stages per rank (default 1, or 2 for the interleaved, zero-bubble and ZBV schedules).
    """

    pipeline_parallel_size: int = 1
    micro_batches: Optional[int] = None
    schedule: str = "1f1b"
    virtual_stages: Optional[int] = None

    def __post_init__(self) -> None:
        size = self.pipeline_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive int, got {size!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline_schedule must be one of {SCHEDULE_NAMES}, got {self.schedule!r}")
        if self.virtual_stages is None:
            object.__setattr__(self, "virtual_stages", 1 if self.schedule in SINGLE_STAGE_SCHEDULES else 2)
        if self.micro_batches is None:
            object.__setattr__(self, "micro_batches", size)
        self.runner_config("allreduce", False)  # validates micro_batches / virtual_stages against the schedule

    @property
    def enabled(self) -> bool:
        return self.pipeline_parallel_size > 1

    def runner_config(self, data_parallel: str, reshard_after_forward: bool) -> PipelineConfig:
        return PipelineConfig(
            schedule=self.schedule,
            micro_batches=self.micro_batches,
            virtual_stages=self.virtual_stages,
            data_parallel=data_parallel,
            reshard_after_forward=reshard_after_forward,
        )


def make_pipeline_settings(
    pipeline_parallel_size,
    micro_batches,
    schedule,
    virtual_stages,
    *,
    stage: int,
    offload_optimizer: str,
    offload_params: str,
) -> PipelineSettings:
    """Validate the strategy's pipeline arguments together with the ZeRO settings (constructor time)."""
    if pipeline_parallel_size is None or (pipeline_parallel_size == 1 and not isinstance(pipeline_parallel_size, bool)):
        given = {
            k: v
            for k, v in dict(
                micro_batches=micro_batches, pipeline_schedule=schedule, virtual_stages=virtual_stages
            ).items()
            if v is not None
        }
        if given:
            raise ValueError(f"{sorted(given)} only apply with pipeline_parallel_size > 1")
        return PipelineSettings()
    settings = PipelineSettings(pipeline_parallel_size, micro_batches, schedule or "1f1b", virtual_stages)
    offloads = {
        name: value
        for name, value in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params))
        if value != "none"
    }
    if stage >= 2 and offloads:
        given = ", ".join(f"{name}={value!r}" for name, value in offloads.items())
        raise NotImplementedError(
            f"pipeline_parallel_size > 1 with {given} at stage {stage} is not supported: offload is not applied to "
            "the FSDP2-sharded pipeline stage modules. Use stage 1 with offload_optimizer='cpu' or 'nvme', or no "
            "offload."
        )
    return settings


def find_pipeline_module(lightning_module):
    """The one PipelineModule of the LightningModule; everything trainable must live in it."""
    found = [m for m in lightning_module.modules() if isinstance(m, PipelineModule)]
    if len(found) != 1:
        raise ValueError(
            f"pipeline_parallel_size > 1 needs exactly one PipelineModule in the LightningModule, found {len(found)}"
        )
    inside = {id(p) for p in found[0].parameters()}
    outside = [n for n, p in lightning_module.named_parameters() if id(p) not in inside]
    if outside:
        raise ValueError(
            f"parameters outside the PipelineModule are not synchronised by the pipeline: {outside[:5]}"
            "; move them into the PipelineModule's layers"
        )
    return found[0]


def build_for_strategy(
    lightning_module, settings: PipelineSettings, pp_mesh, dp_mesh, stage: int, device, accumulate_grad_batches: int
):
    """Split the LightningModule's PipelineModule over ``pp_mesh`` with ZeRO ``stage`` on ``dp_mesh``."""
    module = find_pipeline_module(lightning_module)
    if module.runner is not None:
        return module.runner  # evaluation after fit reuses the split model
    dp = dp_mesh if dp_mesh is not None and dp_mesh.size() > 1 else None
    runner = build_pipeline(
        module,
        pp_mesh,
        schedule=settings.schedule,
        micro_batches=settings.micro_batches,
        virtual_stages=settings.virtual_stages,
        dp_mesh=dp,
        data_parallel="fully_shard" if stage >= 2 else "allreduce",
        reshard_after_forward=stage == 3,
        device=device,
    )
    runner.grad_scale = 1.0 / accumulate_grad_batches
    return runner


def checkpoint_pipeline_layers(module, config) -> None:
    """Activation checkpointing of the layers this rank's stages hold. ``True`` means the layer classes that occur
    at least twice in the whole ``PipelineModule`` (its layers sit in a ``ModuleDict``, and a stage may hold a
    single block, so :func:`find_repeated_blocks` on the built layers would not see them). ``every_k`` and
    ``number_checkpoints`` count the blocks of each rank. The replaced ``forward`` composes with the FSDP2 units
    ``build_pipeline`` already made (see the note in :mod:`lightning_zero.distributed.activation_checkpointing`)."""
    import dataclasses
    from collections import Counter

    if config is None:
        return
    if module.activation_checkpoint_interval:
        raise ValueError(
            "the PipelineModule already checkpoints its layers (activation_checkpoint_interval="
            f"{module.activation_checkpoint_interval}); use that or the strategy's "
            "activation_checkpointing, not both"
        )
    if config.policy is True:
        # A tied layer is one module however often it is used: count it once.
        distinct = {
            getattr(spec, "key", None) or id(spec): spec
            for spec in module.specs
            if isinstance(spec, (LayerSpec, torch.nn.Module))
        }
        counts = Counter(spec.cls if isinstance(spec, LayerSpec) else type(spec) for spec in distinct.values())
        classes = frozenset(cls for cls, count in counts.items() if count >= 2)
        if not classes:
            raise ValueError(
                "activation_checkpointing=True checkpoints the layer classes a PipelineModule repeats, "
                "but this one repeats none: pass the classes or a callable(module) -> bool"
            )
        config = dataclasses.replace(config, policy=classes)
    apply_activation_checkpointing(module, config, require_match=False)


def global_grad_norm(runner, params) -> torch.Tensor:
    """L2 norm of the gradients of the whole pipelined model: every stage, every data shard, tied weights once."""
    duplicates = set()
    pp_rank = dist.get_rank(runner.pp_group)
    pp_ranks = dist.get_process_group_ranks(runner.pp_group)
    for _, owner, attrs, _, src in runner.tied_groups:
        if pp_ranks[pp_rank] != src:  # the first stage holding the tie counts it
            duplicates.update(id(get_parameter(owner, attr)) for attr in attrs)
    # Summed where the gradients are: a host copy per parameter would stall the host on the device each time.
    squares = []
    for param in params:
        if param.grad is None or id(param) in duplicates:
            continue
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        squares.append(grad.detach().double().pow(2).sum().to(runner.device))
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=runner.device)
    dist.all_reduce(total, group=runner.pp_group)
    if runner.fully_sharded and runner.dp_group is not None:
        dist.all_reduce(total, group=runner.dp_group)  # disjoint shards; replicated gradients are not summed
    return total.sqrt()


def clip_by_global_norm(runner, params, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` over the whole pipelined model (same coefficient formula)."""
    params = list(params)
    norm = float(global_grad_norm(runner, params))  # the step's one read of the device
    coefficient = float(max_norm) / (norm + 1e-6)
    if coefficient < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(coefficient)
    return norm if math.isfinite(norm) else float("nan")


def check_pipeline_world(pipeline: PipelineSettings, num_processes: int, num_nodes: int) -> None:
    """Before the process group: the pipeline size must divide the world (both adapters)."""
    world_size = num_processes * num_nodes
    if pipeline.enabled and world_size % pipeline.pipeline_parallel_size:
        raise ValueError(
            f"pipeline_parallel_size={pipeline.pipeline_parallel_size} must divide the world size "
            f"{world_size} (devices={num_processes} x num_nodes={num_nodes})"
        )


def setup_pipeline(
    root,
    settings: PipelineSettings,
    pp_mesh,
    dp_mesh,
    stage: int,
    device,
    precision,
    activation_checkpointing,
    accumulate_grad_batches: int = 1,
):
    """Split ``root``'s one ``PipelineModule`` over the pp x dp mesh, checkpoint its layers, and clip over every
    stage (both adapters: the Trainer's ``setup``, Fabric's ``setup_module``)."""
    if precision.low_dtype is not None:
        raise NotImplementedError(
            f"pipeline_parallel_size > 1 with precision={precision.precision!r} is not supported: the "
            "pipeline schedule runs backward itself, outside the precision plugin. Use precision='32-true'."
        )
    runner = build_for_strategy(root, settings, pp_mesh, dp_mesh, stage, device, accumulate_grad_batches)
    checkpoint_pipeline_layers(find_pipeline_module(root), activation_checkpointing)
    precision.grad_norm_clipper = lambda params, max_norm: clip_by_global_norm(runner, params, max_norm)
    return runner
