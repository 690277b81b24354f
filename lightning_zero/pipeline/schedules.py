"""Running a :class:`PipelineModule` with ``torch.distributed.pipelining`` schedules, optionally with data parallelism.

[Note: gradient scale]
torch's schedules call ``loss_fn`` once per micro-batch and backpropagate each micro-batch loss. The runner passes
``loss_fn(out, y) / m`` and ``scale_grads=False``, so the accumulated gradient is ``sum_i grad(loss_i) / m`` = the
gradient of the mean loss over the full batch (equal-sized micro-batches of a mean-reduced loss). Scaling the loss
rather than the gradients keeps gradient accumulation across steps correct and scales a tied module shared by two
local stages exactly once. Data parallelism then averages over the data-parallel ranks (all-reduce mean, or FSDP2's
reduce-scatter mean).

[Note: stage placement]
``"gpipe"``/``"1f1b"``: one stage per rank, stage ``s`` on pipeline rank ``s``. ``"interleaved_1f1b"`` and
``"zero_bubble"`` (ScheduleInterleavedZeroBubble): ``virtual_stages`` stages per rank in loop order, stage ``s`` on
rank ``s % p``. ``"zbv"`` (ScheduleZBVZeroBubble): two stages per rank in V order, rank ``r`` holds ``r`` and
``2p - 1 - r``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from lightning_zero.diagnostics.timing import collective_timer
from lightning_zero.distributed.cpu_tuning import tune_stage_modules
from lightning_zero.distributed.group_timeout import package_group_timeout
from lightning_zero.pipeline.module import PipelineModule
from lightning_zero.pipeline.specs import TiedLayerSpec, get_parameter
from lightning_zero.torch_compat import lower_forward_actions, set_stage_warmup_ops, stage_warmup_ops

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
DATA_PARALLEL_MODES = ("allreduce", "fully_shard")


@dataclass(frozen=True)
class PipelineConfig:
    """How to run the pipeline.

    Args:
        schedule: one of ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"``, ``"zbv"``.
        micro_batches: micro-batches per step; the per-rank batch must be divisible by it.
        virtual_stages: stages per pipeline rank: 1 for gpipe/1f1b, >= 2 for interleaved_1f1b, >= 1 for zero_bubble,
            exactly 2 for zbv.
        data_parallel: ``"allreduce"`` (ZeRO 0-1: gradients all-reduced over the data-parallel group after the
            schedule) or ``"fully_shard"`` (ZeRO 2-3: FSDP2 on every layer and stage module over the data mesh).
        reshard_after_forward: FSDP2's flag when ``data_parallel="fully_shard"`` (False: ZeRO-2, True: ZeRO-3).
    """

    schedule: str = "1f1b"
    micro_batches: int = 1
    virtual_stages: int = 1
    data_parallel: str = "allreduce"
    reshard_after_forward: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {self.schedule!r}")
        for name in ("micro_batches", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        v = self.virtual_stages
        if self.schedule in SINGLE_STAGE_SCHEDULES and v != 1:
            raise ValueError(
                f"schedule {self.schedule!r} runs one stage per rank: virtual_stages must be 1, got {v}"
                "; use 'interleaved_1f1b', 'zero_bubble' or 'zbv' for several stages per rank"
            )
        if self.schedule == "interleaved_1f1b" and v < 2:
            raise ValueError("'interleaved_1f1b' needs virtual_stages >= 2 (use '1f1b' for one stage per rank)")
        if self.schedule == "zbv" and v != 2:
            raise ValueError(f"'zbv' places exactly 2 stages per rank in a V: virtual_stages must be 2, got {v}")
        if self.data_parallel not in DATA_PARALLEL_MODES:
            raise ValueError(f"data_parallel must be one of {DATA_PARALLEL_MODES}, got {self.data_parallel!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be a bool, got {self.reshard_after_forward!r}")
        if self.reshard_after_forward and self.data_parallel != "fully_shard":
            raise ValueError("reshard_after_forward=True only applies with data_parallel='fully_shard'")


def stage_to_rank(num_stages: int, pp_size: int, schedule: str) -> list:
    """Pipeline rank of each stage (see the stage placement note)."""
    if schedule == "zbv":
        return [s if s < pp_size else 2 * pp_size - 1 - s for s in range(num_stages)]
    return [s % pp_size for s in range(num_stages)]


class PipelineRunner:
    """Runs one :class:`PipelineModule` pipeline step per call; built by :func:`build_pipeline`."""

    def __init__(
        self,
        module: PipelineModule,
        pp_mesh: DeviceMesh,
        dp_mesh: Optional[DeviceMesh],
        config: PipelineConfig,
        device: torch.device,
    ) -> None:
        if module.loss_fn is None:
            raise ValueError("a pipelined PipelineModule needs loss_fn: the last stage computes the loss")
        self.module, self.config, self.device = module, config, device
        self.pp_group = pp_mesh.get_group()
        self.pp_size, self.pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        self.dp_group = dp_mesh.get_group() if dp_mesh is not None and dp_mesh.size() > 1 else None
        self.dp_size = dp_mesh.size() if dp_mesh is not None else 1
        self.num_stages = self.pp_size * config.virtual_stages
        if self.num_stages > len(module):
            raise ValueError(
                f"{self.num_stages} stages (pipeline size {self.pp_size} x virtual_stages "
                f"{config.virtual_stages}) need at least as many layers; the model has {len(module)}"
            )
        self.boundaries = module.partition(self.num_stages)
        self.stage_ranks = stage_to_rank(self.num_stages, self.pp_size, config.schedule)
        self.local_stages = [s for s in range(self.num_stages) if self.stage_ranks[s] == self.pp_rank]
        if config.data_parallel == "fully_shard" and dp_mesh is not None:
            self._check_fully_shard_placement()  # on every rank, before any collective, so all ranks raise
        owned = [i for s in self.local_stages for i in range(self.boundaries[s], self.boundaries[s + 1])]
        if set(module.built_indices) - set(owned):
            module.drop_layers_except(owned)
        module.materialize(owned)
        module.to(device)
        self.stage_modules = [
            module.stage_module(self.boundaries[s], self.boundaries[s + 1]) for s in self.local_stages
        ]
        self.tied_groups = self._make_tied_groups()
        self._broadcast_initial_weights()
        if config.data_parallel == "fully_shard" and dp_mesh is not None:
            self._apply_fully_shard(dp_mesh)
        self.fully_sharded = config.data_parallel == "fully_shard" and dp_mesh is not None
        stages = [
            _no_self_warmup(PipelineStage(sm, s, self.num_stages, device, group=self.pp_group))
            for sm, s in zip(self.stage_modules, self.local_stages)
        ]
        m, loss_fn = config.micro_batches, module.loss_fn
        # grad_scale: a strategy's extra factor (Lightning's 1 / accumulate_grad_batches); sync_grads: whether the
        # next step() reduces gradients (False on the micro-steps of gradient accumulation).
        self.grad_scale, self.sync_grads = 1.0, True
        scaled_loss = lambda out, tgt: loss_fn(out, tgt) * (self.grad_scale / m)  # noqa: E731  (gradient scale note)
        cls = SCHEDULES[config.schedule]
        arg = stages[0] if config.schedule in SINGLE_STAGE_SCHEDULES else stages
        self.schedule = cls(arg, n_microbatches=m, loss_fn=scaled_loss, scale_grads=False)
        self.eval_schedule = self.schedule
        if config.schedule == "zbv":
            self.eval_schedule = _forward_only_zbv(
                self.stage_modules, self.local_stages, self.num_stages, device, self.pp_group, m, scaled_loss
            )
        self.has_first = 0 in self.local_stages
        self.has_last = self.num_stages - 1 in self.local_stages
        self.last_rank = self.stage_ranks[-1]
        module.runner = self

    # ------------------------------------------------------------------------------------------------- setup
    def _make_tied_groups(self) -> list:
        """``(key, module, attrs, group, src_global_rank)`` for every tie held by this rank and another pp rank."""
        spec_holders: dict = {}
        for s in range(self.num_stages):
            for i in range(self.boundaries[s], self.boundaries[s + 1]):
                layer = self.module.specs[i]
                if isinstance(layer, TiedLayerSpec):
                    spec_holders.setdefault(layer.key, set()).add(self.stage_ranks[s])
        pp_ranks = dist.get_process_group_ranks(self.pp_group)
        groups = []
        for key in sorted(spec_holders):
            holders = sorted(spec_holders[key])
            if len(holders) < 2 or self.pp_rank not in holders:
                continue
            ranks = [pp_ranks[r] for r in holders]
            # Only the members create the group: other pipeline replicas build their own with their ranks.
            group = dist.new_group(ranks, use_local_synchronization=True, timeout=package_group_timeout())
            first_stage_rank = self.stage_ranks[
                next(
                    s
                    for s in range(self.num_stages)
                    if self.boundaries[s] <= self.module.tied_first_index[key] < self.boundaries[s + 1]
                )
            ]
            owner = self.module.layers[str(self.module.tied_first_index[key])]
            spec = self.module.specs[self.module.tied_first_index[key]]
            groups.append((key, owner, spec.tied_weight_attrs, group, pp_ranks[first_stage_rank]))
        return groups

    @torch.no_grad()
    def _broadcast_initial_weights(self) -> None:
        """Make tied copies equal across stages and every replica equal across data-parallel ranks."""
        for _, owner, attrs, group, src in self.tied_groups:
            for attr in attrs:
                dist.broadcast(get_parameter(owner, attr).data, src=src, group=group)
        if self.dp_group is not None:
            src = dist.get_process_group_ranks(self.dp_group)[0]
            for tensor in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(tensor.data, src=src, group=self.dp_group)

    def _check_fully_shard_placement(self) -> None:
        for rank in range(self.pp_size):
            stages_of_key: dict = {}
            for s in (s for s in range(self.num_stages) if self.stage_ranks[s] == rank):
                for i in range(self.boundaries[s], self.boundaries[s + 1]):
                    layer = self.module.specs[i]
                    if isinstance(layer, TiedLayerSpec):
                        stages_of_key.setdefault(layer.key, set()).add(s)
            for key, stages in stages_of_key.items():
                if len(stages) > 1:
                    raise NotImplementedError(
                        f"data_parallel='fully_shard' with a tied module used by two stages of the same rank (key "
                        f"{key!r} in stages {sorted(stages)} on pipeline rank {rank}, e.g. embedding and head under "
                        "'zbv') is not supported: FSDP2 cannot shard one module under two stage roots. Use "
                        "data_parallel='allreduce', another schedule, or a partition that keeps them apart."
                    )

    def _apply_fully_shard(self, dp_mesh: DeviceMesh) -> None:
        from torch.distributed.fsdp import fully_shard

        for sm in self.stage_modules:
            for child in sm.layers.values():
                if any(p.requires_grad for p in child.parameters()):
                    fully_shard(child, mesh=dp_mesh, reshard_after_forward=self.config.reshard_after_forward)
            fully_shard(sm, mesh=dp_mesh, reshard_after_forward=self.config.reshard_after_forward)
        tune_stage_modules(self.stage_modules, torch.device(self.device))  # CPU only: see distributed/cpu_tuning.py

    # --------------------------------------------------------------------------------------------------- run
    def _run(self, inputs: Any, targets: Any, train: bool) -> torch.Tensor:
        m = self.config.micro_batches
        batch = inputs.shape[0] if isinstance(inputs, torch.Tensor) else None
        if batch is not None and batch % m:
            raise ValueError(f"the batch of {batch} samples does not split into micro_batches={m} equal parts")
        args = (inputs.to(self.device),) if self.has_first else ()
        kwargs: dict = {}
        losses: list = []
        if self.has_last:
            kwargs = {"target": targets.to(self.device), "losses": losses}
        if train:
            self.schedule.step(*args, **kwargs)
        else:
            with torch.no_grad():
                self.eval_schedule.eval(*args, **kwargs)
        loss = (
            torch.stack([part.detach().float() for part in losses]).sum()
            if self.has_last
            else torch.zeros((), device=self.device)
        )
        dist.broadcast(loss, group=self.pp_group, group_src=self.last_rank)
        return loss

    def step(self, inputs: Any, targets: Any, sync_grads: bool = True) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the mean loss (of this data-parallel replica's batch)
        on every pipeline rank. Gradients accumulate into ``.grad``: zero them between optimizer steps as usual.

        ``sync_grads=False`` skips the data-parallel all-reduce and the tied-weight all-reduce, for gradient
        accumulation (call with ``True`` on the last micro-step before the optimizer step). FSDP2 reduce-scatters
        every step regardless; its sharded gradients accumulate correctly.
        """
        loss = self._run(inputs, targets, train=True)
        if sync_grads:
            self.sync_gradients()
        return loss

    def eval_step(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Forward-only pass over the micro-batches; returns the mean loss on every pipeline rank."""
        return self._run(inputs, targets, train=False)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Average gradients over data-parallel ranks (``allreduce`` mode) and sum tied gradients over stages."""
        with collective_timer().record("pipeline_gradient_sync"):
            self._sync_gradients()

    def _sync_gradients(self) -> None:
        if self.dp_group is not None and not self.fully_sharded:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            if grads:
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=self.dp_group)
                flat.div_(self.dp_size)
                offset = 0
                for g in grads:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
        for _, owner, attrs, group, _ in self.tied_groups:
            for attr in attrs:
                grad = get_parameter(owner, attr).grad
                if grad is None:
                    raise RuntimeError(
                        f"tied parameter {attr!r} has no gradient on this stage; a tied weight must "
                        "be used in the loss on every stage that holds it"
                    )
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                dist.all_reduce(local, group=group)


def _no_self_warmup(stage: PipelineStage) -> PipelineStage:
    """Drop the point-to-point warm-up messages a stage would send to a neighbour stage on its own rank.

    [Note: torch 2.11's warm-up to itself] Before its first step, torch 2.11's ``PipelineScheduleMulti`` sends a
    dummy tensor from every stage to its neighbours (``_get_init_p2p_neighbors_ops``), also where the neighbour
    lives on the same rank, which ZBV's V placement always has (stages 1 and 2 of 2 ranks). Gloo has no pair to
    itself ("Pair is not connected"): on CPU the step fails on one rank and hangs the other. torch 2.13 warms up
    through a vote instead and calls this method only for other stage types. The messages carry nothing (stages on
    one rank pass activations in memory): dropping them in matched pairs (each self-send has its self-receive on the
    neighbour stage) leaves every other message as it was. A stage without the method (a later torch) is left alone.
    """
    original = stage_warmup_ops(stage)
    if original is not None:
        me = dist.get_rank()
        set_stage_warmup_ops(stage, lambda: [op for op in original() if op.peer != me])
    return stage


def _forward_only_zbv(stage_modules, local_stages, num_stages, device, group, m, loss_fn) -> ScheduleZBVZeroBubble:
    """A ZBV schedule reduced to its forward actions, for ``eval_step``.

    [Note: ZBV eval] torch 2.13's ``ScheduleZBVZeroBubble.eval`` fails on the rank that holds two adjacent stages
    ("can't steal_bwd_input if this stage doesn't have backward"): its action list still contains the backward steps.
    We build a second ZBV schedule on separate ``PipelineStage`` objects (same modules) and lower only its ``F``
    actions to send/recv with torch's private ``_add_send_recv`` (its public lowering validates that every
    micro-batch has a backward). Dropping backward actions only removes dependencies, so the forward order stays
    deadlock-free. Private API: ``tests/pipeline/test_pipeline_parity.py`` runs ZBV eval to catch a torch change.
    """
    stages = [
        _no_self_warmup(PipelineStage(sm, s, num_stages, device, group=group))
        for sm, s in zip(stage_modules, local_stages)
    ]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    schedule.pipeline_order_with_comms = lower_forward_actions(schedule, num_stages)
    return schedule


def build_pipeline(
    module: PipelineModule,
    pp_mesh: DeviceMesh,
    schedule: str = "1f1b",
    micro_batches: int = 1,
    virtual_stages: int = 1,
    dp_mesh: Optional[DeviceMesh] = None,
    data_parallel: str = "allreduce",
    reshard_after_forward: bool = False,
    device: Optional[torch.device] = None,
) -> PipelineRunner:
    """Split ``module`` over the ranks of ``pp_mesh`` and attach a runner (``module(x, y)`` then runs the schedule).

    Args:
        module: the model; its layers are built here when it was created before the process group existed or in a
            multi-process run (only this rank's stages are built and kept).
        pp_mesh: 1-D mesh of this rank's pipeline group (``mesh["pp"]`` of a 2-D ``("pp", "dp")`` mesh).
        dp_mesh: 1-D mesh of this rank's data-parallel group (``mesh["dp"]``), or ``None``.
        schedule, micro_batches, virtual_stages, data_parallel, reshard_after_forward: see :class:`PipelineConfig`.
        device: where the stage runs; defaults to the mesh's device type (:func:`default_pipeline_device`).

    Call it on every rank, before creating the optimizer (it replaces parameters when ``fully_shard`` is used).
    """
    config = PipelineConfig(
        schedule=schedule,
        micro_batches=micro_batches,
        virtual_stages=virtual_stages,
        data_parallel=data_parallel,
        reshard_after_forward=reshard_after_forward,
    )
    if pp_mesh.ndim != 1:
        raise ValueError(f"pp_mesh must be 1-D (the pipeline dimension), got a {pp_mesh.ndim}-D mesh")
    if dp_mesh is not None and dp_mesh.ndim != 1:
        raise ValueError(f"dp_mesh must be 1-D (the data-parallel dimension), got a {dp_mesh.ndim}-D mesh")
    if device is None:
        device = default_pipeline_device(pp_mesh)
    return PipelineRunner(module, pp_mesh, dp_mesh, config, device)


def default_pipeline_device(pp_mesh: DeviceMesh) -> torch.device:
    """The device of the mesh's type: a CPU mesh (whose groups are gloo's) stays on CPU even where a GPU exists, and
    an accelerator mesh runs on the current device of its type. Stages must run where their send/recv can go."""
    if pp_mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(pp_mesh.device_type, torch.get_device_module(pp_mesh.device_type).current_device())
