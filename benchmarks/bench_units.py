"""How big should an FSDP2 unit be? Two measurements, both run side by side in one process launch.

``--part collective``: gloo all-gather time against message size on 2 CPU ranks, fitted as ``t(s) = a + b * s``
(``a``: the fixed cost of one collective, ``b``: seconds per byte). A model of ``P`` bytes split into units of
``u`` bytes pays ``(P / u) * a`` of fixed cost on top of ``P * b`` of transfer, so the fixed cost is a fraction
``a / (u b)`` of the communication: ``u = 10 a / b`` keeps it at 10 %.

``--part model``: the flat ``nn.Sequential`` of 24 ``Linear(1024, 1024)`` + GELU (the bench MLP's shape) at
stages 2 and 3 with several ``unit_bytes``, counting FSDP2 units and all-gathers per step and timing steps,
alternating the targets round-robin so machine load hits every target alike; prints each target's median step time
as a ratio to ``unit_bytes=0`` (one unit per Linear).

``--part reduce-scatter``: the CPU reduce-scatter FSDP2 runs through (``comm_buffers._pairwise_reduce_scatter``,
received straight into the output) against the all-to-all into a unit-sized buffer it replaced, one
collective at a time from 8 B to 20 MiB, the two alternated call by call; median ms of each.

Usage: ``python benchmarks/bench_units.py --part collective`` / ``--part model --stage 3 --repeat 5`` /
``--part reduce-scatter --repeat 60``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401

from benchmarks.common import free_port  # noqa: E402

SIZES = [2**k for k in range(12, 26)]  # 4 KiB .. 32 MiB


def _collective(rank: int, world: int, repeat: int, out: dict) -> None:
    rows = []
    for size in SIZES:
        numel = size // 4
        shard = torch.randn(numel // world)
        full = torch.empty(numel)
        dist.all_gather_into_tensor(full, shard)  # warm-up
        times = []
        for _ in range(repeat):
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_into_tensor(full, shard)
            times.append(time.perf_counter() - start)
        rows.append((size, min(times), statistics.median(times)))
    if rank == 0:
        out.update(rows=rows)


RS_NUMELS = (2, 256, 4096, 65536, 262144, 1 << 20, 5 << 20)  # the whole reduce-scatter input: 8 B .. 20 MiB


def _all_to_all_reduce_scatter(output, input_tensor, group, pool) -> None:
    """The reduce-scatter it replaced: every rank's chunks to their owner in one all-to-all, into a pooled
    buffer as large as the input, then a sum over its rows."""
    world = dist.get_world_size(group)
    received = pool.allocate(input_tensor.shape, dtype=input_tensor.dtype, device=input_tensor.device)
    dist.all_to_all_single(received, input_tensor, group=group)
    torch.sum(received.view(world, -1), dim=0, out=output.view(-1))


def _reduce_scatter(rank: int, world: int, repeat: int, out: dict) -> None:
    from lightning_zero.distributed.comm_buffers import CommBufferPool, _pairwise_reduce_scatter

    pool, group, rows = CommBufferPool(), dist.group.WORLD, []
    sides = (("pairwise", _pairwise_reduce_scatter), ("all-to-all", _all_to_all_reduce_scatter))
    for numel in RS_NUMELS:
        data, output = torch.randn(numel), torch.empty(numel // world)
        times: dict = {name: [] for name, _ in sides}
        for call in range(repeat + 5):  # 5 warm-up calls
            for name, fn in sides:
                dist.barrier()
                start = time.perf_counter()
                fn(output, data, group, pool)
                if call >= 5:
                    times[name].append(time.perf_counter() - start)
        rows.append((numel * 4, {name: statistics.median(t) for name, t in times.items()}))
    if rank == 0:
        out.update(rows=rows)


def _mlp(width: int = 1024, depth: int = 24) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _model(rank: int, world: int, stage: int, targets: list, repeat: int, width: int, batch: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from lightning_zero import ZeroConfig, apply_zero

    mesh = init_device_mesh("cpu", (world,))
    runs = {}
    for target in targets:
        torch.manual_seed(0)
        model = apply_zero(_mlp(width), mesh, ZeroConfig(stage=stage, unit_bytes=target))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        states = {id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)}
        runs[target] = dict(model=model, opt=opt, units=len(states), times=[], gathers=0)
    from lightning_zero.distributed import comm_buffers as buffers

    x = torch.randn(batch, width)
    real = buffers._all_gather_flat  # what FSDP2's all-gather calls on CPU (lightning_zero's pooled buffers)
    counter = {"n": 0}

    def counting(*args, **kwargs):
        counter["n"] += 1
        return real(*args, **kwargs)

    for step in range(repeat + 1):  # round-robin: every target sees the same load
        for _target, run in runs.items():
            dist.barrier()
            counter["n"] = 0
            buffers._all_gather_flat = counting
            start = time.perf_counter()
            run["model"](x).square().mean().backward()
            run["opt"].step()
            run["opt"].zero_grad()
            elapsed = time.perf_counter() - start
            buffers._all_gather_flat = real
            if step:  # the first step builds buffers
                run["times"].append(elapsed)
                run["gathers"] = counter["n"]
    if rank == 0:
        out.update(
            {
                t: (r["units"], r["gathers"], statistics.median(r["times"]), min(r["times"]), max(r["times"]))
                for t, r in runs.items()
            }
        )


def _entry(rank, world, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    fn(rank, world, *args, out)
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def launch(fn, *args, world: int = 2) -> dict:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(rank, world, port, fn, args, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("collective", "model", "reduce-scatter"), default="collective")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--targets", default="0,4MiB,16MiB,32MiB,64MiB")
    parser.add_argument("--width", type=int, default=1024, help="Linear width (64 measures per-unit overhead)")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    if args.part == "collective":
        rows = launch(_collective, args.repeat)["rows"]
        # The minimum of the repeats is the least disturbed by other load on a shared machine. A least-squares
        # line is dominated by the largest messages and by load spikes, so: the fixed cost is the median time of
        # the messages up to 64 KiB (all latency), the per-byte cost the median of t/s from 1 MiB up.
        a = statistics.median(low for size, low, _ in rows if size <= 2**16)
        b = statistics.median(low / size for size, low, _ in rows if size >= 2**20)
        print(f"{'bytes':>10} {'min ms':>10} {'median ms':>10}")
        for size, low, median in rows:
            print(f"{size:>10} {low * 1e3:>10.3f} {median * 1e3:>10.3f}")
        print(
            f"fit: fixed cost a = {a * 1e6:.0f} us, b = {b * 1e9:.3f} ns/byte ({1 / b / 2**30:.2f} GiB/s); "
            f"10 % fixed-cost unit size 10 a / b = {10 * a / b / 2**20:.1f} MiB"
        )
        return
    if args.part == "reduce-scatter":
        print(f"{'input bytes':>12} {'pairwise ms':>12} {'all-to-all ms':>14} {'ratio':>6}")
        for nbytes, median in launch(_reduce_scatter, args.repeat)["rows"]:
            print(
                f"{nbytes:>12} {median['pairwise'] * 1e3:>12.3f} {median['all-to-all'] * 1e3:>14.3f} "
                f"{median['pairwise'] / median['all-to-all']:>6.2f}"
            )
        return
    targets = [int(float(t[:-3]) * 2**20) if t.endswith("MiB") else int(t) for t in args.targets.split(",")]
    result = launch(_model, args.stage, targets, args.repeat, args.width, args.batch)
    base = result[targets[0]][2]
    print(
        f"stage {args.stage}, 24 x Linear({args.width},{args.width})+GELU, batch {args.batch}, 2 gloo ranks, "
        f"{args.repeat} steps each, round-robin"
    )
    print(f"{'unit_bytes':>12} {'units':>6} {'all-gathers/step':>17} {'median s':>9} {'ratio':>6} {'range':>14}")
    for target in targets:
        units, gathers, median, low, high = result[target]
        print(
            f"{target:>12} {units:>6} {gathers:>17} {median:>9.4f} {median / base:>6.2f} "
            f"{low / base:>6.2f}-{high / base:<6.2f}  min {low * 1e3:.2f} ms"
        )
    if len(targets) > 1:  # the fixed cost of one unit per step: the difference of the fastest steps per unit
        first, last = result[targets[0]], result[targets[-1]]
        if first[0] != last[0]:
            print(
                f"per-unit fixed cost per step (min step times): "
                f"{(first[3] - last[3]) / (first[0] - last[0]) * 1e3:.3f} ms"
            )


if __name__ == "__main__":
    main()
