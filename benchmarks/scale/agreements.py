"""The store agreements besides the watchdog, at N simulated ranks (one thread and one store client per rank):
the attempt every rank agrees on, each rank's identity, naming a dead peer, and the checked rendezvous."""

from __future__ import annotations

import json
import statistics
import threading
import time
from datetime import timedelta

from lightning_zero.diagnostics import peers
from lightning_zero.diagnostics.network import checked_store, free_port
from lightning_zero.diagnostics.peers import agree_attempt, lost_peer_note, publish_identity

from .store_world import StoreWorld

GLOO_ERROR = "[pair.cc:553] Connection closed by peer [{address}]:4253. This is typically caused by a remote worker"


def _threads(targets) -> float:
    threads = [threading.Thread(target=target) for target in targets]
    begin = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - begin


def run(world_size: int, all_ranks_note: bool) -> dict:
    world = StoreWorld(world_size)
    stores = world.clients
    timeout = timedelta(seconds=300)
    wall = _threads([lambda r=r: agree_attempt(stores[r], r, world_size, timeout) for r in range(world_size)])
    result = {
        "ranks": world_size,
        "agree_attempt_s": wall,
        "agree_attempt_round_trips_rank0": stores[0].calls["poll"],
        "agree_attempt_round_trips_other_mean": statistics.mean(s.calls["poll"] for s in stores[1:]),
    }
    for store in stores:
        store.calls.clear()

    where = threading.local()  # each simulated rank's node has its own address (8 ranks a node)

    def publish(rank: int) -> None:
        node = rank // 8
        where.address = f"10.{node // 65536}.{node // 256 % 256}.{node % 256}"
        publish_identity(stores[rank], rank, node_rank=node)

    real_address, peers.gloo_address = peers.gloo_address, lambda: where.address
    try:
        _threads([lambda r=r: publish(r) for r in range(world_size)])
    finally:
        peers.gloo_address = real_address
    result["publish_identity_round_trips_per_rank"] = statistics.mean(s.calls["poll"] for s in stores)
    # Every survivor of a dead peer names it: one rank's cost, then every rank at once.
    address = json.loads(stores[0].inner.get(f"lightning_zero/peers/{world_size - 1}"))["address"]
    error = RuntimeError(GLOO_ERROR.format(address=address))
    for store in stores:
        store.calls.clear()
    begin = time.monotonic()
    note = lost_peer_note(error, stores[0], world_size)
    result["lost_peer_note_s_one_rank"] = time.monotonic() - begin
    result["lost_peer_note_round_trips_one_rank"] = stores[0].calls["poll"]
    result["lost_peer_named"] = f"{world_size - 1}]" in (note or "")  # the dead rank's node: the last 8 ranks
    if all_ranks_note:
        result["lost_peer_note_s_all_ranks"] = _threads(
            [lambda r=r: lost_peer_note(error, stores[r], world_size) for r in range(world_size - 1)]
        )
    result["checked_store_s"] = _checked_rendezvous(world_size)
    return result


def _checked_rendezvous(world_size: int) -> float:
    """``network.checked_store`` on every rank (rank 0 hosts a fresh store): until every rank holds its store."""
    port, kept = free_port(), []

    def rank_side(rank: int) -> None:
        store = checked_store(
            "127.0.0.1",
            port,
            rank,
            world_size,
            node_rank=rank // 8,
            num_nodes=max(1, world_size // 8),
            timeout=timedelta(seconds=300),
            rendezvous_timeout=300.0,
        )
        kept.append(store)  # (rank 0's store hosts the others: kept until every rank checked in)

    return _threads([lambda r=r: rank_side(r) for r in range(world_size)])
