"""Validated configuration for the ZeRO engines.

Every knob a user can pass lands in one of these frozen dataclasses, and each one is checked in
``__post_init__`` so that a wrong value fails in the constructor, before any process group starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from lightning_zero.distributed.units import (
    DEFAULT_PARAM_PERSISTENCE_THRESHOLD,
    DEFAULT_UNIT_BYTES,
    check_unit_knobs,
)
from lightning_zero.offload.nvme_config import PARAM_ONLY_KNOBS, NvmeConfig

STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# DeepSpeed's ``communication_data_type`` names and the dtype each reduces gradients in (DDP's comm hook at stages
# 0-1, FSDP2's ``reduce_dtype`` at 2-3)
COMMUNICATION_DATA_TYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

ModuleClassSpec = Union[str, type]


def _normalise_offload(offload: Optional[str], name: str = "offload") -> str:
    if offload is None or offload is False:
        return "none"
    if not isinstance(offload, str):
        raise TypeError(f"{name} must be one of {OFFLOAD_DEVICES} or None, got {offload!r}")
    value = offload.lower()
    if value not in OFFLOAD_DEVICES:
        raise ValueError(f"{name} must be one of {OFFLOAD_DEVICES} or None, got {offload!r}")
    return value


def _resolve_offload(stage: int, offload: str, optimizer: Optional[str], params: Optional[str]) -> tuple[str, str]:
    """The shorthand ``offload`` or the precise pair as ``(offload_optimizer, offload_params)``, both normalised.

    [Note: which offload combinations are honoured]
    DeepSpeed's two sections, honoured separately:
      - ``offload_optimizer`` alone (stages 1-3, DeepSpeed's ZeRO-Offload): parameters and gradients stay on the
        compute device; the optimizer steps fp32 CPU masters of this rank's shards and copies the result back
        (:mod:`lightning_zero.distributed.optimizer`). ``"nvme"`` also swaps the optimizer's states to disk.
      - ``offload_params="cpu"`` (stage 3 only) with an offloaded optimizer: FSDP2's ``CPUOffloadPolicy``, which
        keeps the sharded fp32 parameters (the masters), their gradients and the optimizer states in CPU memory.
      - ``offload_params`` without ``offload_optimizer`` is refused: DeepSpeed then keeps the fp32 masters and the
        optimizer on the accelerator and only the low-precision parameters in CPU memory; here the sharded fp32
        parameters are the masters, so moving them to CPU moves the optimizer step with them.
    The shorthand means DeepSpeed's registry names: ``offload="cpu"`` is ``offload_optimizer="cpu"`` at stages 1-2
    (``zero_stage_2_offload``) and both sections at stage 3 (``zero_stage_3_offload``).
    ``"nvme"`` for the optimizer swaps its states to disk on top of the CPU placement; ``"nvme"`` for the parameters
    (stage 3) swaps the sharded parameters to disk on top of it (:mod:`.offload.param_swapper`).
    """
    precise = optimizer is not None or params is not None
    if precise and offload != "none":
        raise ValueError(f"give either offload={offload!r} (shorthand) or offload_optimizer/offload_params, not both")
    if not precise:
        return offload, (offload if stage == 3 else "none")
    opt = _normalise_offload(optimizer, "offload_optimizer")
    par = _normalise_offload(params, "offload_params")
    if par != "none" and stage != 3:
        raise ValueError(
            f"offload_params={par!r} needs stage 3 (only stage 3 shards parameters; DeepSpeed would "
            f"silently ignore it below stage 3); got stage {stage}. Use offload_optimizer={par!r} alone."
        )
    if par != "none" and opt == "none":
        raise ValueError(
            f"offload_params={par!r} without offload_optimizer is not supported: the sharded fp32 parameters are the "
            "optimizer's masters, so FSDP2's CPU offload moves the optimizer step to CPU with them (DeepSpeed would "
            "keep fp32 masters and optimizer states on the accelerator). Offload both (offload_optimizer='cpu', "
            "offload_params='cpu', i.e. offload='cpu' at stage 3) or only the optimizer (offload_optimizer='cpu')."
        )
    return opt, par


@dataclass(frozen=True)
class ZeroConfig:
    """What to shard and where to keep it.

    Args:
        stage: ZeRO stage. 0 replicates everything (DDP); 1 shards optimizer states; 2 also shards gradients;
            3 also shards parameters. See ``docs/stages.md`` for the memory formula of each stage.
        offload: shorthand. ``None``/``"none"``, ``"cpu"`` (optimizer states and fp32 master weights live and step
            in CPU memory; at stage 3 parameters and gradients too, as DeepSpeed's ``zero_stage_3_offload``) or
            ``"nvme"`` (as ``"cpu"``, plus optimizer states swapped to ``nvme.nvme_path``; at stage 3 the sharded
            parameters too, as DeepSpeed's ZeRO-Infinity).
            After validation it holds where the optimizer states live.
        offload_optimizer, offload_params: the precise form (DeepSpeed's two sections); see ``_resolve_offload``.
        nvme: the NVMe settings, required with ``offload_optimizer="nvme"`` or ``offload_params="nvme"``.
        pin_memory: pin the CPU copies used by offload. ``None`` pins when the compute device is CUDA; pinning
            needs a CUDA device, so ``True`` on a CPU-only run is an error at setup.
        sharded_module_classes: module classes (classes or class names) that become their own FSDP unit at
            stages 2-3. ``None`` detects repeated blocks automatically (see :func:`find_repeated_blocks`).
        reshard_after_forward: stage-3 override of FSDP2's ``reshard_after_forward`` (an ``int`` reshards to a
            smaller group, as FSDP2 allows) applied to every unit, the root included. ``None`` keeps the stage's
            meaning; at stage 3 the root and the unit that runs last in forward then stay gathered from forward to
            backward (one gathered unit more while the head and the loss run, one all-gather each fewer per step:
            see :func:`lightning_zero.distributed.apply_zero._kept_from_forward_to_backward`).
        hybrid_shard_size: hybrid sharding (HSDP): model states are sharded within groups of this many consecutive
            ranks and replicated across the groups, on a 2-D ``("replicate", "shard")`` mesh
            (:mod:`lightning_zero.distributed.hybrid`). Stages 1-3 only; it must divide the world size (checked
            before the process group). ``None``: shard over every rank.
        unit_bytes: stages 2-3: consecutive blocks are grouped into one FSDP2 unit (one all-gather, one
            reduce-scatter) until their parameters reach this many bytes (:mod:`lightning_zero.distributed.units`).
            ``0``: one unit per block. ``None``: ``DEFAULT_UNIT_BYTES``.
        param_persistence_threshold: stages 2-3: a unit with fewer parameter elements than this is left to the root
            unit (gathered once per step, never re-gathered in backward). ``None``: the default (0, off).
        prefetch_bytes: stages 2-3: each unit prefetches the next units' all-gathers up to this many parameter
            bytes, in forward and backward. ``None`` or ``0``: FSDP2's own schedule.
        broadcast_buffers: before a forward, every rank takes the data-parallel group's rank 0 buffers (BatchNorm's
            running statistics), on DDP's schedule: DDP's own ``broadcast_buffers`` at stages 0-1, the same
            broadcast on the FSDP2 root at stages 2-3 (:mod:`lightning_zero.distributed.buffer_sync`). ``False``:
            each rank's buffers follow its own data (``docs/stages.md``, "Buffers").
    """

    stage: int = 2
    offload: Optional[str] = None
    pin_memory: Optional[bool] = None
    sharded_module_classes: Optional[frozenset] = None
    reshard_after_forward: Optional[Union[bool, int]] = None
    hybrid_shard_size: Optional[int] = None
    offload_optimizer: Optional[str] = None
    offload_params: Optional[str] = None
    nvme: Optional[NvmeConfig] = None
    unit_bytes: Optional[int] = None
    param_persistence_threshold: Optional[int] = None
    prefetch_bytes: Optional[int] = None
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.broadcast_buffers, bool):  # a string "false" would otherwise count as true
            raise TypeError(f"broadcast_buffers must be True or False, got {self.broadcast_buffers!r}")
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage not in STAGES:
            raise ValueError(
                f"stage must be one of {STAGES} (0: DDP, 1: +optimizer states sharded, "
                f"2: +gradients sharded, 3: +parameters sharded), got {self.stage!r}"
            )
        offload = self._resolve_offloads()
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise TypeError(f"pin_memory must be True, False or None, got {self.pin_memory!r}")
        if self.pin_memory and offload == "none":
            raise ValueError("pin_memory=True only applies with offload='cpu'; set offload='cpu' or drop pin_memory")
        if self.sharded_module_classes is not None:
            classes = _sharded_module_classes(self.sharded_module_classes, self.stage)
            object.__setattr__(self, "sharded_module_classes", classes)
        if self.reshard_after_forward is not None:
            if self.stage != 3:
                raise ValueError(
                    "reshard_after_forward only applies to stage 3 (stage 2 never reshards after "
                    f"forward by definition); got stage={self.stage}"
                )
            value = self.reshard_after_forward
            if not isinstance(value, (bool, int)) or (not isinstance(value, bool) and value < 1):
                raise ValueError(f"reshard_after_forward must be a bool or a positive int, got {value!r}")
        if self.hybrid_shard_size is not None:
            size = self.hybrid_shard_size
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"hybrid_shard_size must be a positive int (ranks per shard group), got {size!r}")
            if self.stage == 0:
                raise ValueError(
                    f"hybrid_shard_size={size} needs ZeRO stage 1, 2 or 3: stage 0 shards nothing, so "
                    "there is no shard group to make hybrid. Use stage=1/2/3 or drop hybrid_shard_size."
                )

        check_unit_knobs(self.stage, self.unit_bytes, self.param_persistence_threshold, self.prefetch_bytes)

    def _resolve_offloads(self) -> str:
        """Resolve ``offload``/``offload_optimizer``/``offload_params`` into the two placements (stored back) and
        check the NVMe settings against them; the placement of the optimizer's states."""
        opt, par = _resolve_offload(
            self.stage, _normalise_offload(self.offload), self.offload_optimizer, self.offload_params
        )
        object.__setattr__(self, "offload_optimizer", opt)
        object.__setattr__(self, "offload_params", par)
        # `offload` is where the optimizer's states live: "nvme" swaps them from the same CPU placement as "cpu".
        offload = opt if opt != "none" else par
        object.__setattr__(self, "offload", offload)
        if "nvme" in (opt, par) and self.nvme is None:
            what = " and ".join(
                f"{name}='nvme'"
                for name, value in (("offload_optimizer", opt), ("offload_params", par))
                if value == "nvme"
            )
            raise ValueError(
                f"{what} (offload='nvme' is the shorthand) needs nvme_path: a directory on a fast "
                "local disk where the swapped states live"
            )
        if "nvme" not in (opt, par) and self.nvme is not None:
            raise ValueError(
                f"nvme_path and the NVMe knobs need offload_optimizer='nvme' (or offload='nvme') or "
                f"offload_params='nvme'; this "
                f"configuration offloads the optimizer to {opt!r}, so they would have no effect"
            )
        if self.nvme is not None and not isinstance(self.nvme, NvmeConfig):
            raise TypeError(f"nvme must be an NvmeConfig, got {self.nvme!r}")
        if self.nvme is not None and par != "nvme":
            for name, default in PARAM_ONLY_KNOBS.items():
                if getattr(self.nvme, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self.nvme, name)} only drives parameter swapping "
                        f"(offload_params='nvme', stage 3); this configuration keeps parameters on "
                        f"{par!r}, so it would have no effect"
                    )
        if offload != "none" and self.stage == 0:
            raise ValueError(
                f"offload={offload!r} needs a ZeRO stage of 1, 2 or 3: stage 0 keeps every state replicated on "
                "the device, so there is nothing partitioned to offload. Use stage=1/2/3 or offload=None."
            )
        return offload

    @property
    def effective_unit_bytes(self) -> int:
        return DEFAULT_UNIT_BYTES if self.unit_bytes is None else self.unit_bytes

    @property
    def effective_param_persistence_threshold(self) -> int:
        if self.param_persistence_threshold is None:
            return DEFAULT_PARAM_PERSISTENCE_THRESHOLD
        return self.param_persistence_threshold

    @property
    def offloads(self) -> bool:
        """States live in CPU memory (``"cpu"``, and under ``"nvme"`` swapping, which starts from the same place)."""
        return self.offload != "none"

    @property
    def offloads_params(self) -> bool:
        """Stage 3 with ``offload_params``: FSDP2's ``CPUOffloadPolicy`` keeps the sharded parameters, their
        gradients and the optimizer states in CPU memory."""
        return self.offload_params != "none"

    @property
    def offloads_optimizer_only(self) -> bool:
        """DeepSpeed's ZeRO-Offload: the optimizer steps CPU fp32 masters of the device-resident shards."""
        return self.offload_optimizer != "none" and self.offload_params == "none"

    @property
    def swaps_optimizer_states(self) -> bool:
        return self.offload_optimizer == "nvme"

    @property
    def swaps_parameters(self) -> bool:
        return self.offload_params == "nvme"

    @property
    def shards_parameters_at_rest(self) -> bool:
        """Stages 2-3 use FSDP2, whose parameters are sharded between steps."""
        return self.stage >= 2


def _sharded_module_classes(classes, stage: int) -> frozenset:
    """``sharded_module_classes`` as a frozenset of ``nn.Module`` subclasses or class names, at stages 2-3 only."""
    if isinstance(classes, (str, type)):
        classes = (classes,)
    try:
        classes = frozenset(classes)
    except TypeError:
        raise TypeError(f"sharded_module_classes must be a set of classes or class names, got {classes!r}") from None
    for item in classes:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, torch.nn.Module))):
            raise TypeError(f"sharded_module_classes entries must be nn.Module subclasses or class names, got {item!r}")
    if stage < 2:
        raise ValueError(
            "sharded_module_classes only applies to stages 2 and 3 (FSDP2 units); "
            f"stage {stage} does not shard parameters into units"
        )
    return classes
