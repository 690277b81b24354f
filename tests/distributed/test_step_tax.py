"""Per-step work the framework adds beyond a plain loop (docs/performance.md "The framework tax"): what a
change removed must stay removed, counted (allocations, ops, Python calls), never timed."""

import cProfile
import pstats

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.distributed.optimizer import shard_optimizer
from lightning_zero.distributed.owner_broadcast import broadcast_from_owners
from tests.ranks import run_distributed


def _params():
    torch.manual_seed(0)
    shapes = [(7, 5), (13,), (3, 4, 2), (1,), (40,), (6, 6)]
    params = [nn.Parameter(torch.randn(shape)) for shape in shapes]
    params.append(nn.Parameter(torch.randn(9, dtype=torch.bfloat16)))  # a second dtype: its own buckets
    return params


def _allocations_and_calls(fn, ops=("aten::cat",)) -> tuple[int, int]:
    """(storage allocations, calls of any of ``ops``) while ``fn`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations, calls = 0, 0
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if str(event.tag).endswith("Allocation") and event.extra_fields.alloc_size > 0:
            allocations += 1
        elif event.name in ops:
            calls += 1
    return allocations, calls


def _broadcast_worker(rank, world_size):
    params = _params()
    optimizer = torch.optim.AdamW(params, lr=0.1)
    sharding = shard_optimizer(optimizer, ZeroConfig(stage=1))
    owners = sharding.owners[0]
    assert set(owners) == {0, 1}
    for bucket_bytes in (64, 1 << 20):  # several buckets per owner, then one
        for step in range(3):
            with torch.no_grad():  # each rank writes its own values; only the owners' must survive
                for index, param in enumerate(params):
                    param.fill_(100 * step + 10 * index + rank)
            counts = _allocations_and_calls(lambda: broadcast_from_owners(sharding, bucket_bytes))
            for index, (param, owner) in enumerate(zip(params, owners)):
                assert torch.all(param == 100 * step + 10 * index + owner), (bucket_bytes, step, index)
            if step > 0:
                # planned once: no torch.cat and no buffer per step (before: one cat and its buffer per bucket)
                assert counts == (0, 0), f"bucket_bytes={bucket_bytes} step {step}: (allocations, cats) {counts}"
    # a parameter group added after sharding is held by the optimizer: its gradient must survive the post-step
    extra = nn.Parameter(torch.ones(3))
    params[0].grad = torch.ones_like(params[0])
    extra.grad = torch.ones(3)
    optimizer.step()
    optimizer.add_param_group({"params": [extra]})
    sharding.model_params.append([extra])
    sharding.owners.append([-1])
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert extra.grad is not None, "the gradient of a parameter the optimizer holds was dropped"
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert all((p.grad is None) == (id(p) not in held) for p in params)


def test_stage1_broadcast_is_planned_once_and_sends_the_owners_values():
    run_distributed(_broadcast_worker, 2)


def _bucket_worker(rank, world_size):
    params = _params()
    optimizer = torch.optim.AdamW(params, lr=0.1)
    sharding = shard_optimizer(optimizer, ZeroConfig(stage=1))
    owners = sharding.owners[0]
    # Sharding made the plan: every parameter already lives in its bucket, before any gradient or state exists, so
    # the storages it freed are reused by those rather than added to the first step's peak (the broadcast note).

    def storage(param):
        return param.untyped_storage().data_ptr()

    for dtype in (torch.float32, torch.bfloat16):
        for owner in (0, 1):
            same = {storage(p) for p, o in zip(params, owners) if o == owner and p.dtype == dtype}
            assert len(same) <= 1, f"owner {owner}'s {dtype} parameters are not one bucket: {len(same)} storages"
    with torch.no_grad():
        for index, param in enumerate(params):
            param.fill_(10 * index + rank)
    copies = ("aten::copy_", "aten::_foreach_copy_", "aten::_foreach_copy")
    counts = _allocations_and_calls(lambda: broadcast_from_owners(sharding), copies)
    assert counts == (0, 0), f"the first step links, packs or unpacks buckets: (allocations, copies) {counts}"
    assert all(torch.all(p == 10 * i + o) for i, (p, o) in enumerate(zip(params, owners)))

    # A parameter re-pointed elsewhere (here on rank 1 only, as `param.data = ...` does) must not silently stop
    # receiving its owner's values: the next broadcast sees it and links it into a bucket again.
    moved = next(i for i, o in enumerate(owners) if o == 0)
    if rank == 1:
        params[moved].data = torch.full_like(params[moved], -1.0)
    with torch.no_grad():
        params[moved].fill_(-1.0 if rank == 1 else 5.0)
    broadcast_from_owners(sharding)
    assert torch.all(params[moved] == 5.0)
    assert storage(params[moved]) == storage(
        next(p for p, o in zip(params, owners) if o == 0 and p is not params[moved] and p.dtype == params[moved].dtype)
    )
    # a dtype change (module.double()) moves every parameter: new buckets of the new dtype, values kept
    for param in params:
        param.data = param.data.double()
    with torch.no_grad():
        for index, param in enumerate(params):
            param.fill_(10 * index + rank)
    broadcast_from_owners(sharding)
    assert all(p.dtype == torch.float64 and torch.all(p == 10 * i + o) for i, (p, o) in enumerate(zip(params, owners)))


def test_stage1_parameters_live_in_their_broadcast_buckets():
    run_distributed(_bucket_worker, 2)


def _local_step_worker(rank, world_size):
    from tests.distributed.test_local_step import _train

    module, optimizer, _ = _train(rank, 2, torch.optim.AdamW, dict(lr=1e-2), local=True, steps=1, accumulate=1)
    module(torch.randn(4, 6)).sum().backward()
    profile = cProfile.Profile()
    profile.enable()
    optimizer.step()
    profile.disable()
    imports = 0
    for (_, _, function), (*_, callers) in pstats.Stats(profile).stats.items():
        if "__import__" in function or function == "_handle_fromlist":
            imports += sum(count[1] for caller, count in callers.items() if "lightning_zero" in caller[0])
    assert imports == 0, f"the local step ran {imports} function-level imports"
    assert dist.is_initialized()


def test_local_step_runs_no_import_per_step():
    run_distributed(_local_step_worker, 2)
