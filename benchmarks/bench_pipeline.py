"""Measured pipeline bubble per schedule against theory, on CPU with gloo.

Every layer is a fixed-duration "compute" (``time.sleep`` in forward and in backward, so the measurement does not
depend on how many cores the machine has): each pipeline rank spends ``t = m * 2 * (t_fwd + t_bwd)`` per step on
its two layers, whatever the schedule; ``t`` is measured in the same run without a pipeline (so sleep overshoot and
autograd overhead count as work). The step time ``T`` is measured on rank 0 (median of several steps after warm-up)
and ``bubble = 1 - t / T``: it includes the schedule's idle time and its own overhead (p2p, Python). Theory: ``(p - 1)
/ (m + p - 1)`` for GPipe and 1F1B, ``(p - 1) / (v * m + p - 1)`` for
interleaved 1F1B with ``v`` stages per rank; zero-bubble schedules aim at 0 when forward, input-backward and
weight-backward take equal time. Here the sleep in backward is not split between input and weight gradients (torch
re-runs one autograd node for each), so zero-bubble rows are an upper bound of what a real model would see.

Usage: ``python benchmarks/bench_pipeline.py [--ranks 2 4] [--micro-batches 2 4 8] [--ms 5]``
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
from torch.distributed.device_mesh import init_device_mesh

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401

from benchmarks.common import free_port  # noqa: E402
from lightning_zero.pipeline import LayerSpec, PipelineModule, build_pipeline  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2)]


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds_fwd, seconds_bwd):
        time.sleep(seconds_fwd)
        ctx.seconds_bwd = seconds_bwd
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds_bwd)
        return grad, None, None


class SleepLayer(nn.Module):
    """A layer that takes a fixed time in forward and in backward."""

    def __init__(self, seconds_fwd: float, seconds_bwd: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.seconds_fwd, self.seconds_bwd = seconds_fwd, seconds_bwd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.seconds_fwd, self.seconds_bwd)


def theory(schedule: str, p: int, m: int, v: int) -> str:
    if schedule in ("gpipe", "1f1b"):
        return f"{(p - 1) / (m + p - 1):.3f}"
    if schedule == "interleaved_1f1b":
        return f"{(p - 1) / (v * m + p - 1):.3f}"
    return "~0 (ideal)"


def _measured_work(m: int, t_fwd: float, t_bwd: float, steps: int) -> float:
    """Time of one rank's work without a pipeline: m micro-batches through its 2 layers, forward and backward.

    Measured rather than nominal, so sleep overshoot and autograd overhead count as work, not as bubble."""
    layers = nn.Sequential(SleepLayer(t_fwd, t_bwd), SleepLayer(t_fwd, t_bwd))
    x = torch.randn(4, 8, requires_grad=True)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(m):
            layers(x).square().mean().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, micro_batches: list, ms: float, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    # Two layers per rank, so one- and two-stages-per-rank schedules do the same work per rank.
    t_fwd, t_bwd = ms / 1000, 2 * ms / 1000
    for m in micro_batches:
        for schedule, v in SCHEDULES:
            if m < world:
                continue  # torch's schedules (1F1B and the multi-stage ones) need m >= pipeline ranks
            model = PipelineModule(
                [LayerSpec(SleepLayer, t_fwd, t_bwd) for _ in range(2 * world)],
                loss_fn=lambda out, y: ((out - y) ** 2).mean(),
                partition_method="uniform",
            )
            build_pipeline(model, mesh["pp"], schedule=schedule, micro_batches=m, virtual_stages=v)
            x, y = torch.randn(4 * m, 8), torch.randn(4 * m, 8)
            times = []
            for step in range(steps + 2):
                dist.barrier()
                start = time.perf_counter()
                model(x, y)
                dist.barrier()
                if step >= 2:
                    times.append(time.perf_counter() - start)
            if rank == 0:
                queue.put((world, m, schedule, v, _measured_work(m, t_fwd, t_bwd, steps), statistics.median(times)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--ms", type=float, default=5.0, help="forward time of one layer (backward is twice that)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print("| p | m | schedule | v | measured work/rank (ms) | step T (ms) | measured bubble | theory |")
    print("|---|---|----------|---|----------------|-------------|-----------------|--------|")
    for world in args.ranks:
        queue = ctx.Queue()
        mp.start_processes(
            _worker,
            args=(world, free_port(), args.micro_batches, args.ms, args.steps, queue),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        while not queue.empty():
            p, m, schedule, v, work, step = queue.get()
            print(
                f"| {p} | {m} | {schedule} | {v} | {work * 1e3:.0f} | {step * 1e3:.0f} | "
                f"{1 - work / step:.3f} | {theory(schedule, p, m, v)} |"
            )


if __name__ == "__main__":
    main()
