"""``python -m benchmarks.scale.checkpoint_plans``: DCP save and load planning for a Llama-3-8B-shaped state at N ranks.

Metadata only: no tensor data, no process group, no file. Every rank's state is the layout the package saves
(``lightning_zero/checkpoint/states.py``: ``{"state_dict": {...}, "optimizer_states": {"0": {"state": {name:
{"exp_avg", "exp_avg_sq", "step"}}}}}``) with each parameter and Adam state a dim-0 shard as FSDP2 places it
(``Shard(0)``, sizes from torch's ``Shard.local_shard_size_and_offset``) and buffers and ``step`` replicated.

A shard is a :class:`ShardSpec`: it answers torch's ``__create_write_items__`` / ``__create_chunk_list__`` hooks
(the ones ``torch/distributed/checkpoint/planner_helpers.py``'s ``_create_write_items`` and ``_create_chunk_list``
call on a DTensor) with the WriteItem and chunk a DTensor of that placement gives, so torch's own
``DefaultSavePlanner`` (``set_up_planner``, ``create_local_plan``, ``create_global_plan`` with its dedup and
validation) and ``DefaultLoadPlanner`` (``create_local_plan``: the resharding reads) run unchanged on it.
The files' ``storage_data`` (which a ``FileSystemWriter`` fills after writing) is simulated: one file per rank,
items in plan order, each item's length its raw bytes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import pickle
import time
from typing import Any, Dict, List, Tuple

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import Shard

Shapes = Dict[str, Tuple[torch.Size, torch.dtype]]
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def llama_config(tiny: bool = False):
    """Llama-3-8B's shape (or a two-layer miniature of it for tests)."""
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=250,
        )
    from benchmarks.scale.memory import SHAPES

    return LlamaConfig(**SHAPES["llama-3-8b"], tie_word_embeddings=False)


def model_shapes(config) -> Tuple[Shapes, Shapes]:
    """Parameter and buffer names and shapes of ``LlamaForCausalLM(config)`` built on the meta device."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    params = {name: (p.shape, torch.float32) for name, p in model.named_parameters()}
    buffers = {name: (b.shape, b.dtype) for name, b in model.named_buffers()}
    return params, buffers


@functools.lru_cache(maxsize=None)
def _dim0_split(rows: int, world: int) -> Tuple[Tuple[int, int], ...]:
    """(rows, offset) of every rank's ``Shard(0)`` piece, as torch computes it for a DTensor."""
    return tuple(Shard.local_shard_size_and_offset(rows, world, rank) for rank in range(world))


class ShardSpec:
    """A rank's dim-0 shard of a tensor, metadata only: what DCP's planners ask of a DTensor."""

    __slots__ = ("global_size", "offsets", "sizes", "properties")

    def __init__(self, global_size: torch.Size, dtype: torch.dtype, rank: int, world: int, requires_grad: bool):
        rows, offset = _dim0_split(global_size[0], world)[rank]
        self.global_size = global_size
        self.offsets = torch.Size((offset,) + (0,) * (len(global_size) - 1))
        self.sizes = torch.Size((rows,) + tuple(global_size[1:]))
        self.properties = TensorProperties(dtype=dtype, requires_grad=requires_grad)

    def size(self) -> torch.Size:
        return self.global_size

    def numel(self) -> int:
        return math.prod(self.sizes)

    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        chunk = ChunkStorageMetadata(offsets=self.offsets, sizes=self.sizes)
        data = TensorWriteData(chunk=chunk, properties=self.properties, size=self.global_size)
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.sizes)]


def rank_state(params: Shapes, buffers: Shapes, rank: int, world: int) -> dict:
    """One rank's checkpoint state in the package's layout; replicated tensors are small real CPU tensors."""
    model: Dict[str, Any] = {}
    optim: Dict[str, Any] = {}
    for name, (shape, dtype) in params.items():
        model[name] = ShardSpec(shape, dtype, rank, world, requires_grad=True)
        optim[name] = {key: ShardSpec(shape, dtype, rank, world, requires_grad=False) for key in ADAM_STATES}
        optim[name]["step"] = torch.zeros(())
    for name, (shape, dtype) in buffers.items():
        model[name] = torch.zeros(shape, dtype=dtype)
    return {"state_dict": model, "optimizer_states": {"0": {"state": optim}}}


def local_bytes(state: dict) -> int:
    """Bytes of one rank's tensors (its shards and its copies of the replicated ones)."""
    total = 0
    stack = [state]
    while stack:
        node = stack.pop()
        for value in node.values():
            if isinstance(value, dict):
                stack.append(value)
            elif isinstance(value, ShardSpec):
                total += value.numel() * value.properties.dtype.itemsize
            else:
                total += value.numel() * value.element_size()
    return total


def chunk_bytes(item: WriteItem) -> int:
    """Bytes of the chunk a write item stores (torch's ``WriteItem.tensor_storage_size`` counts the whole tensor)."""
    data = item.tensor_data
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


def _simulated_storage(global_plans, metadata: Metadata) -> None:
    """Fill ``metadata.storage_data`` as one file per rank, written in plan order (raw bytes per item)."""
    storage = {}
    for rank, plan in enumerate(global_plans):
        offset = 0
        for item in plan.items:
            length = chunk_bytes(item)
            storage[item.index] = _StorageInfo(f"__{rank}_0.distcp", offset, length)
            offset += length
    metadata.storage_data = storage


def _hold_other_ranks() -> None:
    """Keep the garbage collector off the objects already made (other simulated ranks' plans), which a rank of a job
    does not hold; the coordinator's global plan is timed without this, since it holds every rank's plan in a job too.
    """
    gc.freeze()


def local_save_plans(params: Shapes, buffers: Shapes, world: int) -> Tuple[list, float]:
    """Every rank's local save plan (torch's DefaultSavePlanner; the dedup flag plays no part here), and the
    slowest rank's seconds."""
    local_plans = []
    local_s = 0.0
    for rank in range(world):
        state = rank_state(params, buffers, rank, world)
        _hold_other_ranks()
        begin = time.perf_counter()
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=rank == 0)
        local_plans.append(planner.create_local_plan())
        local_s = max(local_s, time.perf_counter() - begin)
    return local_plans, local_s


def plan_save(params: Shapes, buffers: Shapes, local_plans: list, local_s: float, lowest_rank: bool):
    """The coordinator's global plan over every rank's local plan, timed; the row and the metadata."""
    world = len(local_plans)
    gc.unfreeze()
    coordinator = DefaultSavePlanner(dedup_save_to_lowest_rank=lowest_rank)
    coordinator.set_up_planner(rank_state(params, buffers, 0, world), is_coordinator=True)
    begin = time.perf_counter()
    global_plans, metadata = coordinator.create_global_plan(local_plans)
    global_s = time.perf_counter() - begin
    without_storage = len(pickle.dumps(metadata))
    _simulated_storage(global_plans, metadata)
    written = [sum(chunk_bytes(item) for item in plan.items) for plan in global_plans]
    row = {
        "writers": world,
        "dedup_to_lowest_rank": lowest_rank,
        "items_per_rank": len(local_plans[0].items),
        "chunks": sum(len(md.chunks) for md in metadata.state_dict_metadata.values()),
        "metadata_bytes": len(pickle.dumps(metadata)),
        "metadata_bytes_no_storage": without_storage,
        "local_plan_s_max": local_s,
        "global_plan_s": global_s,
        "rank0_written_MB": written[0] / 2**20,
        "max_written_MB": max(written) / 2**20,
    }
    return row, metadata


def read_tuples(plan, metadata: Metadata) -> Tuple[List[Tuple[str, int, int]], int, int]:
    """(file, byte offset, byte length) each read item asks for; bytes asked; bytes of the stored items touched.

    DCP's ``FileSystemReader.read_data`` reads a touched item whole (``torch.load`` of its slice, then a narrow),
    hence the second total.
    """
    tuples = []
    requested = 0
    touched: Dict[MetadataIndex, int] = {}
    for item in plan.items:
        md = metadata.state_dict_metadata[item.storage_index.fqn]
        info = metadata.storage_data[item.storage_index]
        stored = md.chunks[item.storage_index.index].sizes
        elsize = md.properties.dtype.itemsize
        row_bytes = math.prod(stored[1:]) * elsize
        length = math.prod(item.lengths) * elsize
        first_row = item.storage_offsets[0] if len(item.storage_offsets) else 0  # a 0-d ``step`` has no rows
        # dim-0 shards: the asked rows are one contiguous run of the stored chunk
        tuples.append((info.relative_path, info.offset + first_row * row_bytes, length))
        requested += length
        touched[item.storage_index] = info.length
    return tuples, requested, sum(touched.values())


class MetadataLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` less ``_init_state_dict``, which allocates meta tensors (no planning) and replaces
    objects it does not know, a :class:`ShardSpec` among them, by ``None``; the rest of torch's ``set_up_planner``
    (flattening) is kept, and ``create_local_plan`` is torch's."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.original_state_dict = state_dict
        state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator


def plan_load(params: Shapes, buffers: Shapes, metadata: Metadata, writers: int, readers: int) -> dict:
    """Every reader's DefaultLoadPlanner local plan against the writers' metadata, timed and checked."""
    items, plan_s, amplification = [], [], []
    duplicates = mismatched = 0
    for rank in range(readers):
        state = rank_state(params, buffers, rank, readers)
        need = local_bytes(state)
        _hold_other_ranks()
        begin = time.perf_counter()
        planner = MetadataLoadPlanner()
        planner.set_up_planner(state, metadata, is_coordinator=rank == 0)
        plan = planner.create_local_plan()
        plan_s.append(time.perf_counter() - begin)
        tuples, requested, touched = read_tuples(plan, metadata)
        duplicates += len(tuples) - len(set(tuples))
        mismatched += requested != need
        items.append(len(plan.items))
        amplification.append(touched / need)
    return {
        "writers": writers,
        "readers": readers,
        "read_items_min": min(items),
        "read_items_max": max(items),
        "plan_s_per_reader_max": max(plan_s),
        "plan_s_all_readers": sum(plan_s),
        "duplicate_reads": duplicates,
        "readers_bytes_mismatch": mismatched,
        "bytes_touched_per_needed_max": max(amplification),
    }


def _table(title: str, rows: List[dict]) -> None:
    print(f"\n### {title}\n")
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale.checkpoint_plans", description=__doc__)
    parser.add_argument("--writers", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--reshard", nargs="+", default=["1024:8", "8:1024"], help="N:M pairs, writers:readers")
    parser.add_argument(
        "--compare-dedup-max",
        type=int,
        default=256,
        help="plan dedup_save_to_lowest_rank=False too up to this many writers (the package saves with True)",
    )
    parser.add_argument("--tiny", action="store_true", help="a two-layer miniature instead of Llama-3-8B's shape")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    begin = time.monotonic()
    params, buffers = model_shapes(llama_config(tiny=args.tiny))
    pairs = [tuple(int(n) for n in pair.split(":")) for pair in args.reshard]
    keep = {n for n, _ in pairs}
    saves, kept = [], {}
    for world in sorted(set(args.writers) | keep):
        local_plans, local_s = local_save_plans(params, buffers, world)
        for lowest in (True, False) if world <= args.compare_dedup_max else (True,):
            row, metadata = plan_save(params, buffers, local_plans, local_s, lowest)
            if world in args.writers:
                saves.append(row)
            if lowest and world in keep:  # the package saves with dedup_save_to_lowest_rank=True
                kept[world] = metadata
            del metadata
    _table("save planning", saves)
    gc.unfreeze()
    loads = [plan_load(params, buffers, kept[n], n, m) for n, m in pairs]
    _table("load planning (resharding)", loads)
    print(f"\n(total {time.monotonic() - begin:.0f} s)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"save": saves, "load": loads}, handle, indent=1)


if __name__ == "__main__":
    main()
