"""The end-to-end hang at N ranks hosted by several processes: ``python -m benchmarks.scale.hang_processes``.

One interpreter cannot host 1,024 diagnosing thread-ranks (``docs/scale.md``): every rank parses every rank's keys
at the same moment under one GIL. Here a coordinator hosts one real ``TCPStore`` and starts ``--processes`` light
processes, each hosting a block of consecutive thread-ranks (one ``HangWatchdog`` and one client connection each, as
``watchdog_sim``); the blocks warm up, step together from a start time the coordinator publishes in the store, then
the last rank stops before a collective the others wait in. Each block reports when each of its ranks' watchdog
exited and what it named; the coordinator measures the hang to every rank having named it (``time.monotonic`` is
one clock for every process of a machine), and the CPU time of the store's host and of each block.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch.distributed as dist

from lightning_zero.diagnostics import watchdog
from lightning_zero.diagnostics.watchdog import HangWatchdog

from .store_world import CountingStore
from .watchdog_sim import OneTrainingThread, simulated_watchdog

PREFIX = "lightning_zero/watchdog/bench/"
CONTROL = "bench/"


def _connect(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=600))


def _block(
    port: int, first: int, count: int, world: int, timeout: float, poll: float, steady: float, step_s: float
) -> dict:
    """One process's ranks ``first`` .. ``first + count - 1``: warm up, report ready, step, hang, report."""
    watchdog.sys = OneTrainingThread()
    control = _connect(port)
    with ThreadPoolExecutor(count) as pool:  # (see store_world: the resolver's 5 s waits overlap)
        clients = list(pool.map(lambda _: _connect(port), range(count)))
    stores = [CountingStore(dist.PrefixStore(PREFIX, client)) for client in clients]
    exits: dict[int, float] = {}
    diagnoses: list[tuple[float, float]] = []
    dogs = []
    for rank, store in zip(range(first, first + count), stores):
        dog = simulated_watchdog(store, rank, world, timeout, poll, exits)
        _time_diagnosis(dog, diagnoses)
        dogs.append(dog)
    for dog in dogs:
        dog.start()
    while min(dog.polls for dog in dogs) < 2:
        time.sleep(0.1)
    control.add(CONTROL + "ready", 1)
    start = float(control.get(CONTROL + "start"))  # waits until the coordinator publishes it
    hang_at = start + steady
    steps = max(1, int(steady / step_s))
    for step in range(1, steps + 1):  # every rank steps; its progress changes between polls
        # A fixed number of steps, each at its time: a block starved of CPU steps late, never fewer times, so
        # every rank reaches the hang with the same progress count.
        time.sleep(max(0.0, start + (step - 1) * step_s - time.monotonic()))
        for dog in dogs:
            dog.arm(f"training_step {step}")
            dog.beat(f"training_step {step}: backward")
    time.sleep(max(0.0, hang_at - time.monotonic()))
    step = steps
    victim = world - 1
    watchdog.faulthandler = types.SimpleNamespace(dump_traceback=lambda **kwargs: None)  # (README: many ranks)
    real_stderr, sys.stderr = sys.stderr, io.StringIO()
    cpu_before = time.process_time()
    hung_at = time.monotonic()
    for dog in dogs:
        dog.arm(f"training_step {step + 1}")
        if dog.rank != victim:
            dog.beat(f"training_step {step + 1}: all_reduce")
    while len(exits) < count and time.monotonic() < hung_at + timeout + 300:
        time.sleep(0.1)
    sys.stderr = real_stderr
    named = [d.rank for d in dogs if d.hang_message and f"never arrived: [{victim}]" in d.hang_message]
    messages = [d.hang_message for d in dogs if d.hang_message]
    return {
        "first": first,
        "count": count,
        "hung_at": hung_at,
        "exits": [exits.get(d.rank) for d in dogs],
        "named": len(named),
        "verdict": (messages[0] if messages else "none")[:300],
        "diagnosis_round_trips_max": max((s.calls["diagnose"] for s in stores), default=0),
        "diagnoses": diagnoses,
        "cpu_s_after_hang": time.process_time() - cpu_before,
    }


def _time_diagnosis(dog: HangWatchdog, diagnoses: list) -> None:
    """Record when each diagnosis of ``dog`` started and ended."""
    diagnose = dog._diagnose

    def timed():
        begin = time.monotonic()
        try:
            return diagnose()
        finally:
            diagnoses.append((begin, time.monotonic()))

    dog._diagnose = timed


class _CpuSampler:
    """The coordinator's CPU seconds (its only work is the store's host thread) sampled every ``interval``."""

    def __init__(self, interval: float = 0.25) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.samples.append((time.monotonic(), time.process_time()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def busiest_second(self, begin: float, end: float) -> float:
        """The most CPU seconds the host spent in any one-second window between ``begin`` and ``end``."""
        inside = [(t, c) for t, c in self.samples if begin <= t <= end]
        best = 0.0
        for i, (t, c) in enumerate(inside):
            later = [c2 for t2, c2 in inside[i:] if t2 <= t + 1.0]
            best = max(best, later[-1] - c)
        return best

    def seconds(self, begin: float, end: float) -> float:
        inside = [c for t, c in self.samples if begin <= t <= end]
        return inside[-1] - inside[0] if len(inside) > 1 else 0.0


def run(
    world_size: int, processes: int, timeout: float = 10.0, poll: float = 0.5, steady: float = 4.0, step_s: float = 0.25
) -> dict:
    """The coordinator: host the store, start the blocks, publish the start, gather and summarise their reports."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    sizes = [world_size // processes + (p < world_size % processes) for p in range(processes)]
    firsts = [sum(sizes[:p]) for p in range(processes)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    blocks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.scale.hang_processes",
                "--block",
                str(host.port),
                str(first),
                str(size),
                str(world_size),
                str(timeout),
                str(poll),
                str(steady),
                str(step_s),
            ],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for first, size in zip(firsts, sizes)
    ]
    begin = time.monotonic()
    while host.add(CONTROL + "ready", 0) < processes:
        if any(block.poll() not in (None, 0) for block in blocks):
            raise RuntimeError("a block of ranks failed before it was ready")
        time.sleep(0.2)
    warm_up = time.monotonic() - begin
    sampler = _CpuSampler()
    start = time.monotonic() + 1.0
    host.set(CONTROL + "start", str(start))
    reports = []
    for block in blocks:
        out, _ = block.communicate()
        reports.append(json.loads(out.strip().splitlines()[-1]))
    sampler.stop()
    exits = [e for report in reports for e in report["exits"]]
    hung_at = min(report["hung_at"] for report in reports)
    last = max(e for e in exits if e is not None) if any(exits) else time.monotonic()
    diagnoses = [d for report in reports for d in report["diagnoses"]]
    return {
        "ranks": world_size,
        "processes": processes,
        "warm_up_s": warm_up,
        "hang_to_every_rank_named_s": max(exits) - hung_at if None not in exits else None,
        "hang_to_first_rank_named_s": min(e for e in exits if e is not None) - hung_at if any(exits) else None,
        "ranks_named_the_hung_rank": sum(report["named"] for report in reports),
        "diagnosis_round_trips_per_rank_max": max(report["diagnosis_round_trips_max"] for report in reports),
        "ranks_that_diagnosed": len(diagnoses),
        "diagnosis_s_max": max((end - begin for begin, end in diagnoses), default=None),
        "diagnosis_s_median": statistics.median(end - begin for begin, end in diagnoses) if diagnoses else None,
        "store_host_cpu_s_per_s_steady": sampler.seconds(start, hung_at) / max(1e-9, hung_at - start),
        "store_host_cpu_s_after_hang": sampler.seconds(hung_at, last),
        "store_host_busiest_second_after_hang": sampler.busiest_second(hung_at, last),
        "block_cpu_s_after_hang_max": max(report["cpu_s_after_hang"] for report in reports),
        "verdict": reports[-1]["verdict"],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale.hang_processes", description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024])
    parser.add_argument("--processes", type=int, default=8, help="processes hosting the thread-ranks")
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--poll", type=float, default=0.5)
    parser.add_argument("--steady", type=float, default=4.0)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--block", nargs=8, help=argparse.SUPPRESS)  # a block of ranks, started by the coordinator
    args = parser.parse_args(argv)
    if args.block:
        port, first, count, world = (int(v) for v in args.block[:4])
        timeout, poll, steady, step_s = (float(v) for v in args.block[4:])
        report = _block(port, first, count, world, timeout, poll, steady, step_s)
        print(json.dumps(report), flush=True)
        os._exit(0)  # the watchdogs' threads and store clients need no orderly shutdown
    rows = []
    for n in args.ranks:
        rows.append(run(n, args.processes, args.hang_timeout, args.poll, args.steady))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
