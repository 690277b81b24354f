"""What the CPU backend beside NCCL costs at start-up: ``init_process_group`` (plus one first collective) timed
with NCCL alone and with ``"cpu:gloo,cuda:nccl"``, the package's default on CUDA, on N local ranks.

Without a GPU, NCCL is emulated as gloo bound to CUDA tensors only (``tests/emulation/nccl.py``), so the two rows
differ by exactly what a GPU run adds: one gloo backend, which connects every rank to every other at start-up.
Runs alternate between the two, so drift on a noisy machine falls on both.

    python benchmarks/bench_group_start.py --world-sizes 2 4 8 --repeat 5   (or python -m benchmarks.bench_group_start)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401

from benchmarks.common import free_port  # noqa: E402
from tests.emulation.nccl import emulated_backend  # noqa: E402

BACKENDS = {"nccl alone": "nccl", "cpu:gloo,cuda:nccl": "cpu:gloo,cuda:nccl"}


def _rank(rank: int, world_size: int, port: int, backend: str, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0)
    begin = time.perf_counter()
    dist.init_process_group(emulated_backend(backend), store=store, rank=rank, world_size=world_size)
    # the first collective on the CPU backend, where it exists: gloo connects its full mesh at creation
    if "cpu" in backend:
        dist.all_reduce(torch.zeros(1))
    elapsed = time.perf_counter() - begin
    # no rank tears its sockets down while a peer is still connecting to it
    store.add("started", 1)
    while int(store.add("started", 0)) < world_size:
        time.sleep(0.01)
    dist.destroy_process_group()
    out.put((rank, elapsed))


def start_seconds(world_size: int, backend: str) -> float:
    """The slowest rank's start-up, in seconds."""
    context = mp.get_context("fork")
    out = context.SimpleQueue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(r, world_size, port, backend, out)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return max(out.get()[1] for _ in range(world_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("| ranks | NCCL alone (s) | cpu:gloo,cuda:nccl (s) | difference (s) |")
    print("|---|---|---|---|")
    for world_size in args.world_sizes:
        times: dict[str, list[float]] = {name: [] for name in BACKENDS}
        for _ in range(args.repeat):
            for name, backend in BACKENDS.items():
                times[name].append(start_seconds(world_size, backend))
        alone, both = (statistics.median(times[name]) for name in BACKENDS)
        print(f"| {world_size} | {alone:.3f} | {both:.3f} | {both - alone:+.3f} |")


if __name__ == "__main__":
    main()
