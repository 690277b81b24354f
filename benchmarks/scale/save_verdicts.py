"""A save's verdicts on N local processes with a real gloo default group: ``prepare_save`` (two ``all_gather_object``
verdicts) on the save's control group as the package makes it (the default group's gloo) and as it made it before
(a separate world-sized gloo group, reproduced by hiding the default group's CPU backend from ``control_group``).
Per rank: process groups, sockets and threads the first save adds, and the time of the first and of a later save's
verdicts. ``payload_bytes`` gives what one rank receives per verdict at any N, from the reports' pickled sizes."""

from __future__ import annotations

import os
import pickle
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .sockets import _sockets, _threads

MODES = ("separate_group", "default_group")


def _rank(rank: int, world_size: int, port: int, mode: str, root: str, out) -> None:
    from lightning_zero.checkpoint import save_guards

    if mode == "separate_group":  # what control_group did before: always a gloo group of its own
        save_guards.backend_serving = lambda device_type, group=None: None
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    dist.all_reduce(torch.zeros(1))
    state = {"w": torch.zeros(16)}
    before = (len(dist.distributed_c10d._world.pg_map), _sockets(), _threads())
    times = []
    for save in range(4):
        path = os.path.join(root, f"save{save}.ckpt")
        begin = time.perf_counter()
        save_guards.prepare_save(path, state, lambda partial: None, None)
        times.append(time.perf_counter() - begin)
        dist.barrier()
    after = (len(dist.distributed_c10d._world.pg_map), _sockets(), _threads())
    out.put((rank, before, after, times))
    dist.barrier()
    os._exit(0)  # (a separate group's teardown order is not this benchmark's subject)


def _one(world_size: int, mode: str) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as root:
        procs = [context.Process(target=_rank, args=(r, world_size, port, mode, root, out)) for r in range(world_size)]
        for proc in procs:
            proc.start()
        rows = [out.get(timeout=600) for _ in procs]
        for proc in procs:
            proc.join()
    others = [row for row in rows if row[0] != 0]  # rank 0 also hosts the store
    _, before, after, _ = others[0] if others else rows[0]
    return {
        f"{mode}: groups added": after[0] - before[0],
        f"{mode}: sockets added per rank": after[1] - before[1],
        f"{mode}: threads added per rank": after[2] - before[2],
        f"{mode}: first save's verdicts s (slowest rank)": max(row[3][0] for row in rows),
        f"{mode}: later save's verdicts s (median of slowest)": statistics.median(
            max(row[3][i] for row in rows) for i in range(1, 4)
        ),
    }


def payload_bytes(world_size: int) -> dict:
    """Bytes one rank receives in ``prepare_save``'s two ``all_gather_object`` calls at ``world_size`` ranks:
    torch's ``all_gather_object`` (``torch/distributed/distributed_c10d.py``) gathers every rank's 8-byte size,
    then every rank's pickle padded to the largest. Reports as a job's ranks make them (host ``node<r // 8>``, a
    probe beside ``/checkpoints/run/last.ckpt``); the verdicts of a save that passes are empty lists."""
    reports = [
        (f"node{r // 8}", f"/checkpoints/run/.lightning-zero-probe-last.ckpt-r{r}", 3 << 30) for r in range(world_size)
    ]
    largest = max(len(pickle.dumps(report)) for report in reports)
    verdict = len(pickle.dumps([]))
    return {"reports_bytes_per_rank": world_size * (8 + largest), "verdicts_bytes_per_rank": world_size * (8 + verdict)}


def run(world_size: int) -> dict:
    row = {"ranks": world_size}
    for mode in MODES:
        row.update(_one(world_size, mode))
    row.update(payload_bytes(world_size))
    return row
