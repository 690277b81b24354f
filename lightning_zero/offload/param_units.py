"""The swap units of a stage-3 module for :mod:`lightning_zero.offload.param_swapper`: one :class:`SwapUnit` per
FSDP2 ``fully_shard`` call, with what the swapper tracks about it (layout on disk, residency, reads and writes).
Framework-free: imports only torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from torch import nn

from lightning_zero.offload.shard_memory import can_read_in_place
from lightning_zero.torch_compat import (
    all_gather_in_flight,
    fsdp_param_groups,
    fsdp_state,
    group_fsdp_params,
    sharded_param_data,
    sharded_parameter,
)


@dataclass(eq=False)
class SwapUnit:
    index: int
    name: str
    groups: list
    path: str
    sizes: list[int]  # bytes of each shard storage when resident
    elements: int  # padded shard elements
    in_place: list = field(default_factory=list)  # per shard: read into new aligned memory (shard_memory's note)
    chunks: list = field(default_factory=list)  # (storage index, start, length, file offset)
    resident: bool = True
    dirty: bool = True  # memory is newer than the file (or there is no file yet)
    held: int = 0
    reads: int = 0  # times the unit was read from its file (tests and benchmarks count them per step)
    writes: int = 0  # times it was written back
    lost: bool = False  # a write-back failed after its memory was released: the file is stale
    pending_writes: int = 0
    prefetched: deque = field(default_factory=deque)  # (chunk number, buffer, future), chunks 0..k-1
    state: object = None  # the FSDP2 state of the unit's fully_shard call (shared by a grouped call's modules)

    def members(self) -> list:
        """The unit's ``FSDPParam`` objects, group by group."""
        return [fp for group in self.groups for fp in group_fsdp_params(group)]

    def storages(self) -> list:
        return [sharded_param_data(fp).untyped_storage() for fp in self.members()]

    def gathering(self) -> bool:
        return any(all_gather_in_flight(group) for group in self.groups)


def unit_name(names: list[str]) -> str:
    """A unit's name in messages: its module, or the modules of one grouped ``fully_shard([...])`` call."""
    if len(names) <= 3:
        return "+".join(names)
    return f"{names[0]}+...+{names[-1]} ({len(names)} modules)"


def swap_units(module: nn.Module) -> tuple[list[SwapUnit], dict[int, SwapUnit]]:
    """The swap units of ``module``'s FSDP2 units, not yet laid out on disk, and ``{id(sharded parameter): unit}``."""
    from torch.distributed.fsdp import FSDPModule

    units: list[SwapUnit] = []
    unit_of: dict[int, SwapUnit] = {}
    # [Note: one swap unit per fully_shard call] ``fully_shard([block_a, block_b])`` (byte-grouped units, see
    # lightning_zero.distributed.units) makes every module of the list an FSDPModule sharing ONE state and
    # param group. Units are keyed by that state: one per module would swap the same storages twice (the
    # second write finds them already freed) and wrap the group's methods twice.
    members: dict[int, list[str]] = {}  # id(FSDP state) -> the names of its modules
    for name, sub in module.named_modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = fsdp_state(sub)
        if id(state) in members:
            members[id(state)].append(name or "<root>")
            continue
        members[id(state)] = [name or "<root>"]
        groups = fsdp_param_groups(state)
        if not groups:
            continue
        unit = SwapUnit(len(units), "", groups, f"unit{len(units)}.bin", [], 0, state=state)
        for fp in unit.members():
            data = sharded_param_data(fp)  # swapped as bytes: any dtype
            unit.sizes.append(data.untyped_storage().nbytes())
            unit.in_place.append(can_read_in_place(fp))
            unit.elements += data.numel()
            unit_of[id(sharded_parameter(fp))] = unit
        units.append(unit)
    for unit in units:
        unit.name = unit_name(members[id(unit.state)])
    return units, unit_of
