"""benchmarks/scale/checkpoint_plans.py on a two-layer Llama: torch's DCP planners, 8 writers resharded to 4 readers."""

import math

import pytest

from benchmarks.scale import checkpoint_plans as bench

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved():
    params, buffers = bench.model_shapes(bench.llama_config(tiny=True))
    local_plans, local_s = bench.local_save_plans(params, buffers, 8)
    row, metadata = bench.plan_save(params, buffers, local_plans, local_s, lowest_rank=True)
    return params, buffers, row, metadata


def test_metadata_covers_every_element_once(saved):
    params, buffers, row, metadata = saved
    tensors = metadata.state_dict_metadata
    assert "state_dict.lm_head.weight" in tensors and "optimizer_states.0.state.lm_head.weight.exp_avg_sq" in tensors
    assert len(tensors) == 4 * len(params) + len(buffers)  # weight, exp_avg, exp_avg_sq, step; buffers
    for fqn, md in tensors.items():
        rows = sorted((c.offsets[0], c.sizes[0]) for c in md.chunks if c.sizes[0]) if md.size else [(0, 1)]
        assert [start for start, _ in rows] == [0] + [start + n for start, n in rows[:-1]], fqn  # no gap, no overlap
        assert sum(math.prod(c.sizes) for c in md.chunks) == math.prod(md.size), fqn
        sharded = fqn.endswith(("weight", "exp_avg", "exp_avg_sq")) and md.size[0] >= 8
        assert len(md.chunks) == (8 if sharded else 1), fqn  # replicated tensors are written once (dedup)


def test_resharding_8_to_4_reads_each_shard_once_and_exactly_the_local_bytes(saved):
    params, buffers, _, metadata = saved
    for rank in range(4):
        state = bench.rank_state(params, buffers, rank, 4)
        planner = bench.MetadataLoadPlanner()
        planner.set_up_planner(state, metadata, is_coordinator=rank == 0)
        plan = planner.create_local_plan()
        tuples, requested, touched = bench.read_tuples(plan, metadata)
        assert len(tuples) == len(set(tuples)) == len(plan.items)
        assert requested == bench.local_bytes(state)
        # whole stored items are read: more than asked where vocab 250 splits unevenly (32-row vs 63-row shards)
        assert requested <= touched < 1.2 * requested
        files = {path for path, _, _ in tuples}
        assert "__0_0.distcp" in files and files <= {f"__{k}_0.distcp" for k in range(8)}  # rank 0: replicated


def test_the_load_row_counts_no_duplicate_and_no_mismatch(saved):
    params, buffers, _, metadata = saved
    row = bench.plan_load(params, buffers, metadata, 8, 4)
    assert row["duplicate_reads"] == 0 and row["readers_bytes_mismatch"] == 0 and row["read_items_min"] > 0
