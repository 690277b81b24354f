"""One real ``TCPStore`` host and one client connection per simulated rank, each client wrapped in a counter."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch.distributed as dist

ROUND_TRIPS = ("get", "set", "add", "check", "multi_get", "multi_set", "wait", "compare_set")


class CountingStore:
    """A store client whose calls that reach the store's host are counted (one call, one round trip), by phase.

    ``phase`` is set by the benchmark around the piece it measures (a diagnosis, an abort), so the count of each
    piece is exact whatever the timing."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.phase = "poll"
        self.calls: Counter = Counter()
        self._lock = threading.Lock()

    def __getattr__(self, name):
        attribute = getattr(self.inner, name)
        if name not in ROUND_TRIPS:
            return attribute

        def counted(*args, **kwargs):
            with self._lock:
                self.calls[self.phase] += 1
            return attribute(*args, **kwargs)

        return counted


class StoreWorld:
    """``world_size`` simulated ranks against one store host; ``client(rank)`` is rank's own counted connection."""

    def __init__(self, world_size: int, timeout_s: float = 120.0) -> None:
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        # In parallel: on a machine whose resolver does not answer, an odd connection waits 5 s for a host-name
        # lookup (torch's "hostname of the client socket cannot be retrieved"); the waits overlap.
        with ThreadPoolExecutor(128) as pool:
            self.clients = list(pool.map(lambda _: self._connect(), range(world_size)))

    def _connect(self) -> CountingStore:
        client = dist.TCPStore(
            "127.0.0.1", self.host.port, is_master=False, wait_for_workers=False, timeout=self.timeout
        )
        return CountingStore(client)

    def prefixed(self, prefix: str) -> list[CountingStore]:
        """One counted client per rank, each under ``prefix`` (a namespace, as the watchdog's own store has)."""
        return [CountingStore(dist.PrefixStore(prefix, c.inner)) for c in self.clients]

    def observer(self, prefix: str) -> CountingStore:
        """One more counted connection under ``prefix``, for a piece measured alone beside the ranks."""
        return CountingStore(dist.PrefixStore(prefix, self._connect().inner))
