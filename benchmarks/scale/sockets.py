"""Sockets and threads per rank of one world-sized gloo group, measured on N local processes: the default group,
then one more gloo group (the checkpoint saves' control group is one; ``async_save`` adds another)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rank(rank: int, world_size: int, port: int, out) -> None:
    before = (_sockets(), _threads())
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, wait_for_workers=False)
    with_store = (_sockets(), _threads())
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    dist.all_reduce(torch.zeros(1))
    with_default = (_sockets(), _threads())
    extra = dist.new_group(backend="gloo")
    dist.all_reduce(torch.zeros(1), group=extra)
    with_extra = (_sockets(), _threads())
    out.put((rank, before, with_store, with_default, with_extra))
    dist.barrier()
    dist.destroy_process_group()


def run(world_size: int) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    procs = [context.Process(target=_rank, args=(r, world_size, port, out)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    rows = [out.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join()
    others = [row for row in rows if row[0] != 0]  # rank 0 also hosts the store: its sockets count the clients
    row = others[0] if others else rows[0]
    _, before, with_store, with_default, with_extra = row
    return {
        "ranks": world_size,
        "default_gloo_group_sockets_per_rank": with_default[0] - with_store[0],
        "default_gloo_group_threads_per_rank": with_default[1] - with_store[1],
        "one_more_gloo_group_sockets_per_rank": with_extra[0] - with_default[0],
        "one_more_gloo_group_threads_per_rank": with_extra[1] - with_default[1],
    }
