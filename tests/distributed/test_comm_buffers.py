"""The CPU buffer pool behind FSDP2's collectives (lightning_zero.distributed.comm_buffers).

Reuse must never alias a live tensor: a buffer comes back only once nothing but the pool holds it. The pairwise
reduce-scatter must equal gloo's own and hold no unit-sized buffer of its own. And at stages 2-3 on CPU, the
buffer count stays bounded over steps.
"""

import torch
import torch.distributed as dist

from lightning_zero import ZeroConfig, apply_zero
from lightning_zero.distributed.comm_buffers import POOL_MAX_BYTES, CommBufferPool, _comm_classes, comm_buffer_pool
from tests.distributed.test_zero_parity import LOCAL_BATCH, TinyNet
from tests.ranks import run_distributed


def test_pool_hands_a_buffer_out_again_only_once_released():
    pool = CommBufferPool()
    first = pool.allocate((4, 6), dtype=torch.float32, device=torch.device("cpu"))
    assert first.shape == (4, 6)
    address = first.data_ptr()
    second = pool.allocate((24,), dtype=torch.float32, device="cpu")
    assert second.data_ptr() != address, "a buffer still referenced was handed out twice"
    view_of_first = first[1]
    del first
    third = pool.allocate((24,), dtype=torch.float32, device="cpu")
    assert third.data_ptr() not in (address, second.data_ptr()), "a buffer kept alive by a view was reused"
    del view_of_first
    fourth = pool.allocate((2, 12), dtype=torch.float32, device="cpu")
    assert fourth.data_ptr() == address, "a released buffer was not reused"
    other_dtype = pool.allocate((24,), dtype=torch.bfloat16, device="cpu")
    assert other_dtype.dtype == torch.bfloat16
    assert pool.nbytes == 3 * 24 * 4 + 24 * 2
    pool.clear()
    assert pool.nbytes == 0


def test_buffers_above_glibcs_mmap_ceiling_are_never_kept():
    """A block above 32 MiB is mapped and unmapped by glibc itself, so it cannot fragment the heap: the pool hands
    it out fresh and keeps none (GPT-2 small's embedding unit used to keep ~0.4 GB per rank resident this way)."""
    assert POOL_MAX_BYTES == 32 * 2**20
    pool = CommBufferPool()
    big = pool.allocate((2, POOL_MAX_BYTES // 8 + 1), dtype=torch.float32, device="cpu")  # pages never touched
    assert big.shape == (2, POOL_MAX_BYTES // 8 + 1) and pool.nbytes == 0
    del big
    at_limit = pool.allocate((POOL_MAX_BYTES // 2,), dtype=torch.bfloat16, device="cpu")
    assert pool.nbytes == POOL_MAX_BYTES
    address = at_limit.data_ptr()
    del at_limit
    assert pool.allocate((POOL_MAX_BYTES // 2,), dtype=torch.bfloat16, device="cpu").data_ptr() == address


def _reduce_scatter_worker(rank, world_size):
    _, reduce_scatter_cls = _comm_classes()
    pool = CommBufferPool()
    reduce_scatter = reduce_scatter_cls(pool)
    group = dist.group.WORLD
    real_all_reduce = dist.all_reduce

    def no_all_reduce(*args, **kwargs):
        raise AssertionError("the reduce-scatter all-reduced: twice the bytes of an all-to-all")

    gen = torch.Generator().manual_seed(rank)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        for numel in (6, 1000):
            data = torch.randn(world_size * numel, generator=gen)
            expected = torch.empty(numel)
            dist.reduce_scatter_tensor(expected, data.clone(), op=op, group=group)
            got = torch.empty(numel)
            pool.clear()
            dist.all_reduce = no_all_reduce
            try:
                assert reduce_scatter(got, data.clone(), group, op) is None
            finally:
                dist.all_reduce = real_all_reduce
            # 2 ranks: a + b in either order, bitwise; 3 ranks: another summation order, last-bit differences
            tolerance = dict(rtol=0, atol=0) if world_size == 2 else dict(rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got, expected, **tolerance)
            # The all-to-all it replaced received into a pooled buffer as large as the input: one more unit-sized
            # buffer at every backward's peak. Two ranks receive into the output; more ranks into one chunk.
            largest = max((b.numel() for kept in pool._buffers.values() for b in kept), default=0)
            assert largest == (0 if world_size == 2 else numel), f"a pooled buffer of {largest} elements"
    # An op the in-place path does not cover goes to torch's reduce-scatter unchanged.
    data = torch.ones(world_size * 3) * (rank + 1)
    got = torch.empty(3)
    reduce_scatter(got, data, group, dist.ReduceOp.MAX)
    torch.testing.assert_close(got, torch.full((3,), float(world_size)))


def test_pairwise_reduce_scatter_equals_gloos():
    run_distributed(_reduce_scatter_worker, 2)
    run_distributed(_reduce_scatter_worker, 3)


def _steady_state_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    for stage, offload in ((2, None), (3, None), (3, "cpu")):
        torch.manual_seed(0)
        module = TinyNet(depth=4)
        apply_zero(module, mesh, ZeroConfig(stage=stage, offload=offload))
        pool = comm_buffer_pool(module)
        assert pool is not None, "apply_zero did not pool the CPU communication buffers"
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        steps = 8
        for _ in range(steps):
            module(torch.randn(LOCAL_BATCH, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        # Without reuse every step would add three buffers per unit (6 units: 4 blocks, the root's layers): 144.
        # With it the count stops at what is alive at once; when gloo's worker lets go of a finished all-gather
        # varies, so it may settle a step later, but stays a small bound.
        buffers = sum(len(group) for group in pool._buffers.values())
        assert buffers <= 15, f"stage {stage}: {buffers} buffers after {steps} steps: they are not reused"


def test_stages_2_3_on_cpu_reuse_their_buffers_across_steps():
    run_distributed(_steady_state_worker, 2)


def _accumulate_without_zero_grad_worker(rank, world_size):
    """Gradients left in place across synced backwards: a reused buffer would alias the gradient it adds to."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randn(world_size * LOCAL_BATCH, 8, generator=gen) for _ in range(3)]
    torch.manual_seed(0)
    reference = TinyNet()
    for x in batches:
        (reference(x) ** 2).mean().backward()
    for stage in (2, 3):
        torch.manual_seed(0)
        module = TinyNet()
        apply_zero(module, mesh, ZeroConfig(stage=stage))
        for x in batches:
            (module(x[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]) ** 2).mean().backward()
        for (name, expected), param in zip(reference.named_parameters(), module.parameters()):
            torch.testing.assert_close(
                param.grad.full_tensor(),
                expected.grad,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=name: f"stage {stage} {n}: {m}",
            )


def test_gradients_accumulated_across_synced_backwards_stay_exact():
    run_distributed(_accumulate_without_zero_grad_worker, 2)
