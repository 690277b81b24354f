"""Model-state memory: what each rank actually holds, and what the ZeRO formulas say it should hold.

Notation (as in the ZeRO paper): ``P`` parameters, ``N`` data-parallel ranks, ``bp``/``bg`` bytes per parameter
and gradient element, ``K`` bytes of optimizer state per parameter (Adam: m and v, ``K = 8``), ``bc`` bytes per
element of the gathered copies compute reads at stages 2-3.

[Note: ZeroStrategy's bytes under mixed precision]
DeepSpeed's mixed precision is "2 + 2 + 12": low-precision parameters and gradients (``bp = bg = 2``) and an fp32
master beside m and v (``K = 12``). ZeroStrategy keeps the same 16 bytes per parameter in another split, at every
stage and with every low-precision flag (``adapters/precision_policy.py``): the module's parameters are fp32 and are
the masters, their gradients are fp32, and low precision lives only in compute copies (at stages 0-1 autocast's
casts, counted with the activations, ``activations.layer_activation_bytes``; at stages 2-3 FSDP2's gathered
``param_dtype`` copies, ``bc = 2``). So ``bp = bg = 4`` and ``K = 8`` whatever the precision. The totals agree with
DeepSpeed's where everything is partitioned alike (stages 0, 2, 3: ``16P``, ``16P/N``) but not at stage 1, which
partitions only ``K``: ZeroStrategy holds ``8P + 8P/N`` where DeepSpeed's ZeRO-1 holds ``4P + 12P/N``. Counting
DeepSpeed's split for ZeroStrategy under-estimates a ``*-mixed`` stage-1 run by ``4P - 4P/N`` per rank
(``docs/memory.md``; ``tests/distributed/test_zero_parity.py`` measures the formula at every precision). The exception
is ``bf16-true`` at stages 0-1, which holds DeepSpeed's split (``bp = bg = 2``, ``K = 8 + 4`` with the fp32 masters
counted beside the states, as :func:`model_state_memory` counts them: ``distributed/replicas.py``).

Formulas at rest, i.e. between backward and the optimizer step, gradients allocated (``docs/stages.md``):

=======  ================================  ==================================================================
stage    held per rank                     peak during forward/backward
=======  ================================  ==================================================================
0        ``P (bp + bg + K)``               same
1        ``P (bp + bg) + P K / N``         same
2        ``P (bp + bg + K) / N``           ``+ P bc``: FSDP2 keeps the gathered parameters from forward to
                                           backward (the ZeRO-2 paper's ``bp P + (bg + K) P / N`` plus the shard)
3        ``P (bp + bg + K) / N``           ``+ ~2 P_unit bc``: one gathered unit and the prefetched next one
=======  ================================  ==================================================================

With hybrid sharding (``hybrid_shard_size=S``, :mod:`.hybrid`) states are partitioned over the ``S`` ranks of a shard
group and replicated across the ``N / S`` groups: every ``/ N`` above becomes ``/ S``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from lightning_zero.distributed.replicas import replica_dtype
from lightning_zero.estimate.activations import (
    CHECKPOINTING,
    ActivationBytes,
    TransformerShape,
    activation_bytes,
    precision_at_stage,
)
from lightning_zero.estimate.precisions import LOW_PRECISIONS, PRECISIONS
from lightning_zero.torch_compat import (
    fsdp_param_groups,
    fsdp_state,
    group_fsdp_params,
    sharded_parameter,
    unsharded_param,
)


@dataclass(frozen=True)
class StateBytes:
    """Bytes of parameters, gradients and optimizer states (optimizer states include offloaded fp32 masters)."""

    params: int = 0
    grads: int = 0
    optimizer_states: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states

    def __add__(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(
            self.params + other.params, self.grads + other.grads, self.optimizer_states + other.optimizer_states
        )


@dataclass(frozen=True)
class MemoryReport:
    """Per-device model-state bytes held by this rank (``by_device`` keys: ``"cpu"``, ``"cuda"``, ...)."""

    by_device: dict = field(default_factory=dict)

    @property
    def total(self) -> StateBytes:
        out = StateBytes()
        for value in self.by_device.values():
            out = out + value
        return out


def _local(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _StorageCounter:
    """Counts each storage once, so views and tied weights are not double counted."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.bytes: dict[str, dict[str, int]] = {}

    def add(self, tensor: Optional[Tensor], kind: str) -> None:
        if tensor is None:
            return
        tensor = _local(tensor)
        if tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:  # FSDP2 frees unsharded storage by resizing it to zero
            return
        key = (str(tensor.device), storage.data_ptr())
        if key in self.seen:
            return
        self.seen.add(key)
        per_kind = self.bytes.setdefault(tensor.device.type, {"params": 0, "grads": 0, "optimizer_states": 0})
        per_kind[kind] += nbytes


def _fsdp_params(module: nn.Module) -> Iterable[Tensor]:
    """Every parameter storage FSDP2 holds: the shards, and any gathered copies (stage 2 keeps them from forward
    to backward). While gathered, the module exposes the gathered tensors, so the shards must be asked for."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        for fsdp_param in (fp for group in fsdp_param_groups(fsdp_state(sub)) for fp in group_fsdp_params(group)):
            yield sharded_parameter(fsdp_param)
            unsharded = unsharded_param(fsdp_param)
            if unsharded is not None:
                yield unsharded


def model_state_memory(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> MemoryReport:
    """Measure the bytes this rank holds for parameters, gradients and optimizer states, from tensor storages.

    Counts the module's parameters (local shards for DTensors, plus any parameters FSDP2 currently holds gathered),
    their gradients, every tensor in the optimizers' state, and offloaded fp32 masters (as optimizer states).
    """
    from lightning_zero.distributed.optimizer import get_sharding

    counter = _StorageCounter()
    for param in module.parameters():
        counter.add(param, "params")
    for held in _fsdp_params(module):
        counter.add(held, "params")
        counter.add(held.grad, "grads")
    for param in module.parameters():
        counter.add(param.grad, "grads")
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        sharding = get_sharding(optimizer)
        masters = sharding.masters.values() if sharding is not None else ()
        for master in masters:
            counter.add(master, "optimizer_states")
            counter.add(master.grad, "grads")
        for buffer in sharding.master_grads.values() if sharding is not None else ():
            counter.add(buffer, "grads")  # kept for the run even while zero_grad has set .grad to None
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and value.numel() > 1:  # scalar step counters are not model states
                    counter.add(value, "optimizer_states")
    return MemoryReport({device: StateBytes(**kinds) for device, kinds in counter.bytes.items()})


def compute_bytes(precision: str) -> int:
    """``bc``: bytes per element of the parameter copies FSDP2 gathers for compute at stages 2-3 (its
    ``param_dtype``: the low dtype under a low-precision flag, else fp32)."""
    _check_precision(precision)
    return 2 if precision in LOW_PRECISIONS else 4


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def shard_ranks(world_size: int, hybrid_shard_size: Optional[int] = None) -> int:
    """How many ranks the model states are partitioned over: the world, or the HSDP shard group."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if hybrid_shard_size is None:
        return world_size
    from lightning_zero.distributed.hybrid import check_hybrid_world

    check_hybrid_world(hybrid_shard_size, world_size)
    return hybrid_shard_size


def zero_formula(
    num_params: int,
    stage: int,
    world_size: int,
    *,
    precision: str = "32-true",
    optimizer_bytes_fp32: int = 8,
    hybrid_shard_size: Optional[int] = None,
    swapped_masters: bool = False,
    stage1_heaviest: Optional[int] = None,
) -> StateBytes:
    """Bytes per rank at rest (between backward and step) for ``stage``; see the module table. ``swapped_masters``:
    the optimizer's masters are swapped to NVMe (no bf16 replicas then: ``distributed/replicas.py``).
    ``stage1_heaviest``: at stage 1, the parameters (elements) the most loaded rank steps, in place of the even
    share ``P / N`` (:func:`stage1_heaviest_share`)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    _check_precision(precision)
    # [Note: ZeroStrategy's bytes under mixed precision]: fp32 parameters (the masters) and gradients, except for the
    # bf16 replicas of bf16-true at stages 0-1, whose fp32 masters sit beside the optimizer's states
    replicas = replica_dtype(precision, stage, swapped_masters) is not None
    bp = bg = 2 if replicas else 4
    k = optimizer_bytes_fp32 + (4 if replicas else 0)
    p, n = num_params, shard_ranks(world_size, hybrid_shard_size)
    if stage == 0:
        return StateBytes(p * bp, p * bg, p * k)
    if stage == 1:
        return StateBytes(p * bp, p * bg, k * stage1_heaviest if stage1_heaviest is not None else p * k // n)
    return StateBytes(p * bp // n, p * bg // n, p * k // n)


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated per-rank bytes on the accelerator and in CPU memory, at rest and at the forward/backward peak."""

    accelerator: StateBytes
    cpu: StateBytes
    accelerator_peak: int
    cpu_peak: int
    nvme: int = 0  # swapped to disk (offload="nvme"), per rank: optimizer states; at stage 3 the fp32 shards too

    def as_table(self) -> list[tuple[str, str]]:
        gib = 1024**3
        return [
            ("accelerator at rest (GiB)", f"{self.accelerator.total / gib:.2f}"),
            ("accelerator peak (GiB)", f"{self.accelerator_peak / gib:.2f}"),
            ("cpu at rest (GiB)", f"{self.cpu.total / gib:.2f}"),
            ("cpu peak (GiB)", f"{self.cpu_peak / gib:.2f}"),
            ("nvme (GiB)", f"{self.nvme / gib:.2f}"),
        ]


def estimate_model_states_memory(
    model_or_num_params: Union[nn.Module, int],
    stage: int,
    world_size: int,
    offload: Optional[str] = None,
    precision: str = "32-true",
    *,
    largest_unit_params: Optional[int] = None,
    optimizer_bytes_fp32: int = 8,
    sub_group_size: int = 1_000_000_000,
    buffer_count: int = 4,
    max_in_cpu: int = 1_000_000_000,
    buffer_size: int = 100_000_000,
    hybrid_shard_size: Optional[int] = None,
    offload_optimizer: Optional[str] = None,
    offload_params: Optional[str] = None,
    parameter_sizes: Optional[Sequence[int]] = None,
) -> MemoryEstimate:
    """Estimate per-rank model-state memory, like DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs``.

    Args:
        model_or_num_params: a module (its parameters are counted; its largest default FSDP2 unit, repeated blocks
            grouped up to the default ``unit_bytes``, sizes the stage-3 peak) or a parameter count.
        stage: 0-3. world_size: data-parallel ranks. offload: ``None``, ``"cpu"`` or ``"nvme"``, the strategy's
            shorthand (at stage 3 it offloads the parameters too). ``"nvme"`` is laid out as ``"cpu"`` with the
            optimizer states on disk (with the optimizer alone offloaded, the fp32 masters too; at stage 3 the fp32
            parameter shards too, ZeRO-Infinity); ``buffer_count``, ``sub_group_size``, ``max_in_cpu`` and
            ``buffer_size``, DeepSpeed's knobs of those names, size the CPU buffers at the swapped step's peak.
        offload_optimizer, offload_params: the precise form instead of ``offload``, as the strategy takes them
            (``offload_optimizer`` alone keeps parameters and gradients on the accelerator; ``offload_params`` at
            stage 3 also moves them: ``"nvme"`` swaps them as above). Validated by the same rules as the strategy.
        precision: a Trainer precision string; low precision makes the gathered compute copies of stages 2-3
            half-size (``bc = 2``); the states at rest are fp32 whatever it is (``[Note: ZeroStrategy's bytes under
            mixed precision]``).
        largest_unit_params: parameters of the largest FSDP unit (stage-3 peak); inferred from a module.
        optimizer_bytes_fp32: fp32 optimizer-state bytes per parameter (Adam: 8, SGD with momentum: 4).
        hybrid_shard_size: HSDP shard-group size: states are partitioned over it instead of ``world_size``.
        parameter_sizes: the element counts of the trainable parameters (one optimizer param group); read from a
            module. At stage 1 the most loaded rank's share of these whole parameters replaces the even share.
    """
    from lightning_zero.distributed.config import ZeroConfig

    # same validation and messages as the strategy; NVMe is laid out as CPU offload plus swapped states
    config = ZeroConfig(
        stage=stage,
        offload=_as_cpu(offload),
        offload_optimizer=_as_cpu(offload_optimizer),
        offload_params=_as_cpu(offload_params),
        hybrid_shard_size=hybrid_shard_size,
    )
    swaps_optimizer = _swaps_optimizer_states(offload, offload_optimizer)
    swaps_params = stage == 3 and (_is_nvme(offload) or _is_nvme(offload_params))
    num_params, largest_unit_params = _parameter_counts(model_or_num_params, largest_unit_params)
    n, p = shard_ranks(world_size, hybrid_shard_size), num_params
    heaviest = _stage1_heaviest(model_or_num_params, parameter_sizes, n) if stage == 1 else None
    rest = zero_formula(
        num_params,
        stage,
        world_size,
        precision=precision,
        optimizer_bytes_fp32=optimizer_bytes_fp32,
        hybrid_shard_size=hybrid_shard_size,
        swapped_masters=swaps_optimizer,
        stage1_heaviest=heaviest,
    )
    accel, cpu = _offload_placement(
        rest, p, n, optimizer_bytes_fp32, offloads=config.offloads, offloads_params=config.offloads_params
    )
    # Stage 3 gathers one unit and prefetches the next; never more than the whole model.
    bc = compute_bytes(precision)
    gathered = {2: p * bc, 3: min(2 * largest_unit_params, p) * bc}.get(stage, 0)
    if not (swaps_optimizer or swaps_params):
        return MemoryEstimate(accel, cpu, accel.total + gathered, cpu.total)
    knobs = dict(
        sub_group_size=sub_group_size, buffer_count=buffer_count, max_in_cpu=max_in_cpu, buffer_size=buffer_size
    )
    swap = NvmeSwap(swaps_optimizer, swaps_params, config.offloads_params, optimizer_bytes_fp32, **knobs)
    cpu, on_disk, buffers = _nvme_placement(cpu, p, n, largest_unit_params, swap)
    return MemoryEstimate(accel, cpu, accel.total + gathered, cpu.total + buffers, nvme=on_disk)


@dataclass(frozen=True)
class NvmeSwap:
    """What an estimate swaps to NVMe, and the DeepSpeed knobs that size its CPU buffers (elements)."""

    optimizer_states: bool  # the optimizer's states (and, without offloaded parameters, the fp32 masters)
    params: bool  # the FSDP2 parameter shards (stage 3)
    params_offloaded: bool  # the parameters live on the CPU: the shards are the masters
    optimizer_bytes_fp32: int
    sub_group_size: int
    buffer_count: int
    max_in_cpu: int
    buffer_size: int


def _nvme_placement(
    cpu: StateBytes, p: int, n: int, largest_unit_params: int, swap: NvmeSwap
) -> tuple[StateBytes, int, int]:
    """What NVMe swapping moves from CPU memory to disk, per rank: ``(cpu at rest, bytes on disk, CPU buffers at the
    step's peak)`` (see :func:`estimate_model_states_memory`'s ``offload``)."""
    on_disk = buffers = 0
    if swap.optimizer_states:  # lightning_zero.offload.optimizer_swapper: the optimizer states live on disk
        # Optimizer-only offload (any stage) swaps the fp32 masters with the states; their gradients exist for the
        # stepping sub-group only. With the parameters offloaded (stage 3) the FSDP2 shards are the masters.
        masters_swapped = not swap.params_offloaded
        per_element = swap.optimizer_bytes_fp32 + (4 if masters_swapped else 0)
        on_disk = p * per_element // n
        cpu = StateBytes(cpu.params, 0 if masters_swapped else cpu.grads, cpu.optimizer_states - on_disk)
        buffers = min(on_disk, swap.buffer_count * swap.sub_group_size * per_element)
        if masters_swapped:
            buffers += min(p // n, swap.sub_group_size) * 4
    if swap.params:  # parameter swapping (lightning_zero.offload.param_swapper): the fp32 shards live on disk
        shard = cpu.params
        on_disk += shard
        cpu = StateBytes(0, cpu.grads, cpu.optimizer_states)
        # max_in_cpu bounds the units kept between uses; the units in use are read on top of them (as DeepSpeed
        # streams them through its swap buffers, outside max_in_cpu)
        in_use = min(2 * largest_unit_params, p) * 4 // n
        buffers += min(shard, swap.max_in_cpu * 4 + in_use) + min(shard, swap.buffer_count * swap.buffer_size * 4)
    return cpu, on_disk, buffers


def _is_nvme(device) -> bool:
    return isinstance(device, str) and device.lower() == "nvme"


def _as_cpu(device):
    return "cpu" if _is_nvme(device) else device


def _swaps_optimizer_states(offload, offload_optimizer) -> bool:
    """The optimizer's states (and, with the parameters not offloaded, its masters) are swapped to NVMe. At stages
    0-1, where ``bf16-true`` would keep bf16 replicas, that is what ``replica_dtype``'s ``swapped_masters`` asks."""
    return _is_nvme(offload) or _is_nvme(offload_optimizer)


def stage1_heaviest_share(parameter_sizes: Sequence[int], shard_ranks: int) -> int:
    """The parameters (elements) the most loaded rank steps at stage 1, which partitions whole parameters, largest
    first, each to the lightest rank (``distributed/optimizer.py``, :func:`partition_by_size`, the same assignment):
    the even share ``P / N`` plus at most the largest parameter."""
    from lightning_zero.distributed.optimizer import partition_by_size

    sizes = list(parameter_sizes)
    loads = [0] * shard_ranks
    for size, owner in zip(sizes, partition_by_size(sizes, shard_ranks)):
        loads[owner] += size
    return max(loads)


def _stage1_heaviest(model_or_num_params, parameter_sizes: Optional[Sequence[int]], n: int) -> Optional[int]:
    """:func:`stage1_heaviest_share` of the given sizes, else of a module's trainable parameters; ``None`` for a bare
    count (the even share)."""
    if parameter_sizes is None and isinstance(model_or_num_params, nn.Module):
        parameter_sizes = [q.numel() for q in model_or_num_params.parameters() if q.requires_grad]
    return stage1_heaviest_share(parameter_sizes, n) if parameter_sizes else None


def _parameter_counts(
    model_or_num_params: Union[nn.Module, int], largest_unit_params: Optional[int]
) -> tuple[int, int]:
    """``(parameters, parameters of the largest FSDP unit)`` for :func:`estimate_model_states_memory`: a module's
    are counted, its largest unit among those ``apply_zero`` makes by default unless given; for a bare count the
    largest unit is the whole model unless given."""
    if isinstance(model_or_num_params, nn.Module):
        num_params = sum(p.numel() for p in model_or_num_params.parameters())
        if largest_unit_params is None:
            from lightning_zero.distributed.apply_zero import unit_groups
            from lightning_zero.distributed.config import ZeroConfig

            # the units apply_zero makes by default: repeated blocks, grouped up to the default unit_bytes
            groups, _ = unit_groups(model_or_num_params, ZeroConfig(stage=3))
            sizes = [sum(p.numel() for m in group for p in m.parameters()) for group in groups]
            largest_unit_params = max(sizes, default=num_params)
    else:
        num_params = int(model_or_num_params)
    return num_params, largest_unit_params or num_params


def _offload_placement(
    rest: StateBytes, p: int, n: int, optimizer_bytes_fp32: int, *, offloads: bool, offloads_params: bool
) -> tuple[StateBytes, StateBytes]:
    """``(accelerator, cpu)`` bytes at rest of the stage's states ``rest`` (:func:`zero_formula`) once the offload
    (``ZeroConfig.offloads``, ``.offloads_params``) has moved them: ``p`` parameters over ``n`` ranks."""
    if not offloads:
        return rest, StateBytes()
    if not offloads_params:
        # ZeRO-Offload: the device keeps the stage's parameters and gradients; CPU holds this rank's fp32 masters,
        # their gradients and the optimizer states.
        return StateBytes(rest.params, rest.grads, 0), StateBytes(0, p * 4 // n, p * (optimizer_bytes_fp32 + 4) // n)
    # Stage 3 FSDP2 CPUOffloadPolicy: the sharded fp32 parameters (they are the masters), their gradients and
    # the optimizer states all live in CPU memory.
    return StateBytes(), StateBytes(p * 4 // n, p * 4 // n, p * optimizer_bytes_fp32 // n)


@dataclass(frozen=True)
class FullEstimate:
    """Per-rank bytes of one training configuration: model states (``states``) plus one micro-batch's activations.

    ``accelerator_peak`` and ``cpu_peak`` add the activations to the model-state peaks; ``nvme`` is the swapped
    optimizer states' bytes (``offload="nvme"``).
    """

    states: MemoryEstimate
    activations: ActivationBytes
    checkpointing: str = "none"

    @property
    def accelerator_peak(self) -> int:
        return self.states.accelerator_peak + self.activations.accelerator

    @property
    def cpu_peak(self) -> int:
        return self.states.cpu_peak + self.activations.cpu

    @property
    def nvme(self) -> int:
        return self.states.nvme

    def as_table(self) -> list[tuple[str, str]]:
        gib = 1024**3
        return self.states.as_table() + [
            ("activations on the accelerator (GiB)", f"{self.activations.accelerator / gib:.2f}"),
            ("activations in cpu memory (GiB)", f"{self.activations.cpu / gib:.2f}"),
            ("accelerator peak with activations (GiB)", f"{self.accelerator_peak / gib:.2f}"),
            ("cpu peak with activations (GiB)", f"{self.cpu_peak / gib:.2f}"),
        ]


def estimate_memory(
    model_or_num_params: Union[nn.Module, int],
    stage: int,
    world_size: int,
    offload: Optional[str] = None,
    precision: str = "32-true",
    *,
    shape: Optional[TransformerShape] = None,
    checkpointing: str = "none",
    **state_kwargs: Any,
) -> FullEstimate:
    """Estimate per-rank memory of model states plus activations (``docs/memory.md``).

    The model-state part is ``estimate_model_states_memory`` (same arguments: ``state_kwargs`` are its keywords,
    ``largest_unit_params``, ``hybrid_shard_size``, the NVMe ``sub_group_size``/``buffer_count``, ...). ``shape`` (a
    ``lightning_zero.estimate.activations.TransformerShape``: hidden size, layers, heads, sequence length,
    micro-batch, vocabulary) adds the activations of one micro-batch; without it the activations are 0, which the
    result says (``activations.accelerator == 0``) rather than guessing. ``checkpointing``: ``"none"``, ``"full"``
    (activation checkpointing of every block) or ``"full+cpu"`` (checkpointed inputs kept in CPU memory).
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    states = estimate_model_states_memory(model_or_num_params, stage, world_size, offload, precision, **state_kwargs)
    swapped = _swaps_optimizer_states(offload, state_kwargs.get("offload_optimizer"))
    acts = (
        activation_bytes(shape, precision_at_stage(precision, stage, swapped), checkpointing)
        if shape is not None
        else ActivationBytes(0)
    )
    return FullEstimate(states, acts, checkpointing)
