"""The control plane's store round trips do not grow with the world size (``docs/scale.md``).

Every test counts the calls one rank makes on its store client through a counting wrapper and compares a small
simulated world with a larger one: a per-rank cost that grows with the world is a cost every rank pays at once on
thousands of GPUs, against one store host.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_zero.diagnostics.peers import agree_attempt, lost_peer_note, publish_identity
from lightning_zero.diagnostics.store_reads import present_values
from lightning_zero.diagnostics.watchdog import HangWatchdog

ROUND_TRIPS = ("get", "set", "add", "check", "multi_get", "multi_set", "wait", "compare_set")


class CountingStore:
    """A store whose calls that reach the store's host are counted (one call, one round trip)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        attribute = getattr(self.inner, name)
        if name not in ROUND_TRIPS:
            return attribute

        def counted(*args, **kwargs):
            self.calls.append((name, args[0] if args else None))
            return attribute(*args, **kwargs)

        return counted


def _published_world(world_size: int) -> dist.Store:
    """A store holding what every rank's watchdog publishes, all ranks armed at the same step."""
    store = dist.HashStore()
    for rank in range(world_size):
        store.set(f"hb/{rank}", "3|training_step 1: backward")
        store.set(f"at/{rank}", "1|distributed_c10d.py:10 in all_reduce")
        store.add(f"alive/{rank}", 5)
        store.set(f"id/{rank}", json.dumps({"host": f"node{rank}", "address": "10.0.0.1", "node_rank": rank}))
    return store


def _diagnosis_round_trips(world_size: int) -> tuple[int, str]:
    store = CountingStore(_published_world(world_size))
    dog = HangWatchdog(store, rank=0, world_size=world_size, timeout=60, poll_interval=0.01)
    dog.arm("training_step 1")
    dog.beat("training_step 1: backward")
    dog._probe = 0.0  # no heartbeat measured over time: the round trips of the reads alone
    message = dog._diagnose()
    return len(store.calls), message


def test_a_hang_diagnosis_costs_the_same_round_trips_at_any_world_size():
    small, message = _diagnosis_round_trips(4)
    large, _ = _diagnosis_round_trips(32)
    assert small == large <= 10, (small, large)
    # the reads still see every rank: with no heartbeat moving, the others are named with where they run
    assert "Unreachable: rank 1 (node rank 1, host node1" in message and "rank 3 (node rank 3" in message, message


def test_a_watchdog_poll_costs_at_most_three_round_trips():
    for world_size in (4, 32):
        store = CountingStore(_published_world(world_size))
        dog = HangWatchdog(store, rank=0, world_size=world_size, timeout=60, poll_interval=0.02)
        dog.arm("training_step 1")
        dog.start()
        for step in range(10):  # progress changes between polls: every key of this rank is rewritten
            time.sleep(0.03)
            dog.beat(f"training_step 1: micro-batch {step}")
        dog._stop.set()
        dog._thread.join()
        polls = sum(1 for name, key in store.calls if name == "add" and key == "alive/0")
        assert polls >= 5 and len(store.calls) <= 3 * polls + 1, (polls, store.calls)  # (+1: identity of rank 0)
        dog.stop()


def test_naming_a_lost_peer_reads_every_identity_in_a_few_round_trips(monkeypatch):
    error = RuntimeError("[pair.cc:553] Connection closed by peer [10.77.5.2]:4253. This is typically caused by")
    counts = []
    for world_size in (4, 32):
        inner = dist.HashStore()
        for rank in range(world_size):
            address = "10.77.5.2" if rank == world_size - 1 else "10.77.5.1"
            monkeypatch.setattr("lightning_zero.diagnostics.peers.gloo_address", lambda a=address: a)
            publish_identity(inner, rank, node_rank=rank)
        store = CountingStore(inner)
        assert f"rank {world_size - 1} (node rank {world_size - 1}" in lost_peer_note(error, store, world_size)
        counts.append(len(store.calls))
    assert counts[0] == counts[1] <= 2, counts


def test_present_values_leaves_out_missing_keys():
    store = dist.HashStore()
    for key in ("a", "c", "d"):
        store.set(key, key.upper())
    counted = CountingStore(store)
    assert present_values(counted, ["a", "b", "c", "d"]) == {"a": b"A", "c": b"C", "d": b"D"}
    assert present_values(counted, []) == {} and present_values(counted, ["x"]) == {}
    counted.calls.clear()
    assert present_values(counted, ["a", "c", "d"]) == {"a": b"A", "c": b"C", "d": b"D"}
    assert [name for name, _ in counted.calls] == ["check", "multi_get"]


def _agree(world_size: int) -> tuple[set[int], int]:
    """Every rank of a simulated world agrees on an attempt over one TCPStore; rank 0's round trips."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    clients = [
        CountingStore(dist.TCPStore("127.0.0.1", host.port, is_master=False, wait_for_workers=False))
        for _ in range(world_size)
    ]
    found = {}
    ranks = [
        threading.Thread(
            target=lambda r=r: found.setdefault(r, agree_attempt(clients[r], r, world_size, timedelta(seconds=30)))
        )
        for r in range(1, world_size)
    ]
    for thread in ranks:
        thread.start()
    while not host.check([f"lightning_zero/attempts/starts/{r}" for r in range(1, world_size)]):
        time.sleep(0.01)  # every other rank started: rank 0's first sweep finds them all
    found[0] = agree_attempt(clients[0], 0, world_size, timedelta(seconds=30), poll=0.2)
    for thread in ranks:
        thread.join()
    return set(found.values()), len(clients[0].calls)


def test_agreeing_on_the_attempt_costs_rank_0_the_same_round_trips_at_any_world_size(monkeypatch):
    monkeypatch.setattr("lightning_zero.diagnostics.peers._agreed", None)  # (restored: the threads set it)
    small_agreed, small = _agree(4)
    large_agreed, large = _agree(32)
    # two counters, then a few sweeps of at most five round trips (all ranks had started: the answers come within
    # two or three); one round trip per rank would already be 31
    assert small_agreed == large_agreed == {0}
    assert small <= 17 and large <= 17, (small, large)


def test_the_verdict_names_ranks_in_the_same_state_together():
    """Every rank prints the verdict: its progress part grows with the distinct states, not with the world."""
    lengths = []
    for world_size in (4, 64):
        store = _published_world(world_size)
        store.set(f"hb/{world_size - 1}", "2|training_step 1: forward")  # the last rank is behind
        dog = HangWatchdog(store, rank=0, world_size=world_size, timeout=60, poll_interval=0.01)
        dog.arm("training_step 1")
        dog.beat("training_step 1: backward")
        dog._probe = 0.0
        message = dog._diagnose()
        progress = message.partition("Progress: ")[2]
        waiting = "training_step 1: backward at distributed_c10d.py:10 in all_reduce"
        assert f"ranks 1-{world_size - 2}: {waiting}" in progress, progress
        assert f"rank {world_size - 1}: training_step 1: forward at" in progress, progress
        lengths.append(len(progress))
    assert lengths[0] == lengths[1] - 2 * (len("62") - len("2")), lengths  # only the numbers got longer


def _hang_in_one_process(world_size: int, store: dist.Store) -> tuple[dict, list[CountingStore], list[HangWatchdog]]:
    """``world_size`` watchdogs on one store; the last rank stops before the collective the others wait in."""
    exits: dict[int, int] = {}
    clients = [CountingStore(store) for _ in range(world_size)]
    dogs = [
        HangWatchdog(
            client,
            rank,
            world_size,
            timeout=0.5,
            poll_interval=0.05,
            grace=5.0,
            on_exit=lambda code, r=rank: exits.setdefault(r, code),
        )
        for rank, client in enumerate(clients)
    ]
    for dog in dogs:
        dog.arm("training_step 1")
        dog.start()
    for dog in dogs[:-1]:
        dog.beat("training_step 1: all_reduce")
    deadline = time.monotonic() + 30
    while len(exits) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    for dog in dogs:
        dog.stop()
    return exits, clients, dogs


def _read_every_rank(client: CountingStore, world_size: int) -> bool:
    return any(name == "multi_get" and len(keys) >= world_size for name, keys in client.calls)


def test_one_rank_diagnoses_a_hang_for_the_world():
    # Every rank times out within a poll of the others; when each diagnosed, the store's host served every rank's
    # read of every rank's keys at once (N² at 1,024 ranks), and the polls queued behind them went unanswered.
    world_size = 8
    exits, clients, dogs = _hang_in_one_process(world_size, dist.HashStore())
    assert len(exits) == world_size, exits
    assert all(f"never arrived: [{world_size - 1}]" in (dog.hang_message or "") for dog in dogs)
    readers = [rank for rank, client in enumerate(clients) if _read_every_rank(client, world_size)]
    assert len(readers) == 1, readers


def test_a_rank_diagnoses_itself_when_the_diagnosing_rank_never_answers():
    # the rank that took the diagnosis died before writing its verdict: the others must not wait forever
    store = dist.HashStore()
    store.add("diagnosing", 1)
    world_size = 4
    exits, clients, dogs = _hang_in_one_process(world_size, store)
    assert len(exits) == world_size, exits
    assert all(f"never arrived: [{world_size - 1}]" in (dog.hang_message or "") for dog in dogs)
