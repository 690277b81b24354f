"""The hang watchdog at N simulated ranks: one ``HangWatchdog`` per rank (its two threads, its own store client),
no model and no process group. Every rank "trains" (a step every ``step_s`` driven from the main thread), then one
rank stops before a collective the others wait in, and every rank's watchdog must name it."""

from __future__ import annotations

import io
import statistics
import sys
import threading
import time
import types

from lightning_zero.diagnostics import watchdog
from lightning_zero.diagnostics.watchdog import HangWatchdog

from .store_world import StoreWorld


def _count_phases(dog: HangWatchdog, store) -> None:
    """Count the round trips of a diagnosis and of the abort apart from the polls (and count the polls)."""
    diagnose, abort, liveness = dog._diagnose, dog._abort, dog._publish_liveness
    dog.polls = 0

    def counted_diagnose():
        store.phase = "diagnose"
        try:
            return diagnose()
        finally:
            store.phase = "poll"

    def counted_abort(*args, **kwargs):
        store.phase = "abort"
        return abort(*args, **kwargs)

    def counted_liveness():
        dog.polls += 1
        return liveness()

    dog._diagnose, dog._abort, dog._publish_liveness = counted_diagnose, counted_abort, counted_liveness


def _identity(rank: int) -> dict:
    node = rank // 8
    return {
        "host": f"node{node}",
        "address": f"10.{node // 65536}.{node // 256 % 256}.{node % 256}",
        "node_rank": node,
        "pid": 1000 + rank,
    }


class OneTrainingThread:
    """``sys`` for the watchdog module, whose ``_current_frames`` holds the main thread's frame only.

    torch's ``sys._current_frames()`` walks every thread of the process: one process of a real job has a handful, the
    simulation two per rank (2,049 at 1,024 ranks), and every poll of every rank calling it kept the GIL long enough
    to starve the store calls (measured: polls stalled for over 60 s). The frame is taken once, at the start."""

    def __init__(self) -> None:
        ident = threading.main_thread().ident
        self._frames = {ident: sys._current_frames()[ident]}

    def _current_frames(self) -> dict:
        return self._frames

    def __getattr__(self, name):
        return getattr(sys, name)


def run(world_size: int, timeout: float, poll: float, steady_s: float, step_s: float, hang: bool) -> dict:
    real_sys, watchdog.sys = watchdog.sys, OneTrainingThread()
    try:
        return _run(world_size, timeout, poll, steady_s, step_s, hang)
    finally:
        watchdog.sys = real_sys


def _run(world_size: int, timeout: float, poll: float, steady_s: float, step_s: float, hang: bool) -> dict:
    world = StoreWorld(world_size)
    stores = world.prefixed("lightning_zero/watchdog/bench/")
    exits: dict[int, float] = {}
    dogs = []
    for rank, store in enumerate(stores):
        dogs.append(simulated_watchdog(store, rank, world_size, timeout, poll, exits))
    # Warm-up, disarmed (no clock runs): every rank's first polls publish its identity and read rank 0's. At 1,024
    # ranks in one process these first seconds stall (see README.md); the measurement starts after them.
    begin = time.monotonic()
    for dog in dogs:
        dog.start()
    while min(dog.polls for dog in dogs) < 2 and time.monotonic() < begin + 300:
        time.sleep(0.1)
    warm_up = time.monotonic() - begin
    for dog, store in zip(dogs, stores):
        dog.polls = 0
        store.calls.clear()
    started = time.monotonic()
    step, end = 0, time.monotonic() + steady_s
    while time.monotonic() < end:  # steady state: every rank steps, its clock restarts, its progress changes
        step += 1
        for dog in dogs:
            dog.arm(f"training_step {step}")
            dog.beat(f"training_step {step}: backward")
        time.sleep(step_s)
    polls = [dog.polls for dog in dogs]
    poll_trips = [store.calls["poll"] for store in stores]
    steady_wall = time.monotonic() - started
    result = {
        "ranks": world_size,
        "warm_up_s": warm_up,
        "poll_round_trips_per_rank_per_poll": sum(poll_trips) / max(1, sum(polls)),
        "polls_per_rank_per_s": statistics.mean(polls) / steady_wall,
        "store_round_trips_per_s": sum(poll_trips) / steady_wall,
    }
    # One rank's diagnosis, counted alone on a connection of its own while every rank keeps polling: a watchdog
    # for rank 0 that is not started, armed with rank 0's progress.
    alone = world.observer("lightning_zero/watchdog/bench/")
    observer = HangWatchdog(alone, 0, world_size, timeout=timeout, poll_interval=poll)
    observer.arm(f"training_step {step}")
    observer.beat(f"training_step {step}: backward")
    begin = time.monotonic()
    observer._diagnose()
    result["diagnosis_s_one_rank"] = time.monotonic() - begin
    result["diagnosis_round_trips_one_rank"] = sum(alone.calls.values())
    if hang:
        result.update(_hang(dogs, stores, exits, step + 1, timeout))
    for dog in dogs:
        dog.stop()
    return result


def _hang(dogs, stores, exits, step: int, timeout: float) -> dict:
    """The last rank stops in its forward while the others reach the step's collective and wait there."""
    victim = len(dogs) - 1
    quiet = types.SimpleNamespace(dump_traceback=lambda **kwargs: None)  # see the README: one process, many ranks
    real_faulthandler, real_stderr = watchdog.faulthandler, sys.stderr
    watchdog.faulthandler, sys.stderr = quiet, io.StringIO()  # (1,024 "aborting" headers)
    try:
        hung_at = time.monotonic()
        for dog in dogs:
            dog.arm(f"training_step {step}")
        for dog in dogs[:victim]:
            dog.beat(f"training_step {step}: all_reduce")
        deadline = hung_at + timeout + 300
        while len(exits) < len(dogs) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        watchdog.faulthandler, sys.stderr = real_faulthandler, real_stderr
    named = [d for d in dogs if d.hang_message and f"never arrived: [{victim}]" in d.hang_message]
    diagnosed = [s.calls["diagnose"] for s in stores if s.calls["diagnose"]]
    messages = [d.hang_message for d in dogs if d.hang_message]
    return {
        "verdict": (messages[0] if messages else "none")[:400],
        "ranks_named_the_hung_rank": len(named),
        "hang_to_every_rank_named_s": (max(exits.values()) - hung_at) if len(exits) == len(dogs) else None,
        "ranks_that_diagnosed": len(diagnosed),
        "diagnosis_round_trips_per_rank_max": max(diagnosed, default=0),
        "abort_round_trips_per_rank_mean": statistics.mean(s.calls["abort"] for s in stores),
    }


def simulated_watchdog(store, rank: int, world_size: int, timeout: float, poll: float, exits: dict) -> HangWatchdog:
    """One simulated rank's watchdog over ``store``, its exit time recorded in ``exits`` and its store round trips
    counted per phase."""
    dog = HangWatchdog(
        store,
        rank,
        world_size,
        timeout=timeout,
        poll_interval=poll,
        grace=30.0,
        on_exit=lambda code, r=rank: exits.setdefault(r, time.monotonic()),
        identity=_identity(rank),
    )
    _count_phases(dog, store)
    return dog
