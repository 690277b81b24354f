"""Time spent waiting in collectives, recorded by whoever issues them and read by ``ThroughputLogger``.

A strategy (or any code issuing collectives) wraps the *blocking* part of each collective::

    from lightning_zero.diagnostics.timing import collective_timer

    with collective_timer().record("reduce_scatter"):
        work.wait()            # or a synchronous dist.reduce_scatter_single(...)

Only the time the training thread is held counts: an async collective that overlaps compute costs nothing until
somebody waits on it, so wrap the ``wait()``, not the launch. On GPU the wait is measured with CUDA events on the
current stream (the time the compute stream stalls), resolved lazily so recording never synchronises the device;
on CPU it is wall clock. Recording is off until a consumer (``ThroughputLogger``) calls ``enable()``, so code
that records pays one attribute check when nobody listens.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch


@dataclass
class CollectiveRecord:
    """One recorded wait: either ``seconds`` (wall clock) or a pair of CUDA events resolved later."""

    name: str
    seconds: Optional[float] = None
    start_event: Optional["torch.cuda.Event"] = None
    end_event: Optional["torch.cuda.Event"] = None

    def resolve(self) -> float:
        """Seconds waited; for CUDA events this blocks until ``end_event`` has completed."""
        if self.seconds is None:
            assert self.start_event is not None and self.end_event is not None
            self.end_event.synchronize()
            self.seconds = self.start_event.elapsed_time(self.end_event) / 1000.0
        return self.seconds


class CollectiveTimer:
    """Accumulates collective wait records between two ``take()`` calls (thread-safe, process-wide)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[CollectiveRecord] = []
        self._consumers = 0

    @property
    def enabled(self) -> bool:
        return self._consumers > 0

    def enable(self) -> None:
        """Register a consumer; records are kept while at least one is registered."""
        with self._lock:
            self._consumers += 1

    def disable(self) -> None:
        """Unregister a consumer; with none left, pending records are dropped and recording stops."""
        with self._lock:
            self._consumers = max(0, self._consumers - 1)
            if self._consumers == 0:
                self._pending.clear()

    @contextlib.contextmanager
    def record(self, name: str, device: Union[torch.device, str, None] = None) -> Iterator[None]:
        """Time the enclosed blocking wait under ``name``.

        ``device``: a CUDA device selects CUDA events on its current stream; None picks CUDA events when CUDA is
        initialised in this process, wall clock otherwise.
        """
        if not self.enabled:
            yield
            return
        use_events = _uses_cuda_events(device)
        if use_events:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._append(CollectiveRecord(name, start_event=start, end_event=end))
        else:
            begin = time.perf_counter()
            try:
                yield
            finally:
                self._append(CollectiveRecord(name, seconds=time.perf_counter() - begin))

    def add(self, name: str, seconds: float) -> None:
        """Record a wait measured elsewhere (e.g. by a comm hook's own timer)."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        if self.enabled:
            self._append(CollectiveRecord(name, seconds=float(seconds)))

    def take(self) -> list[CollectiveRecord]:
        """Return and forget the records made since the previous ``take()`` (unresolved: cheap to call)."""
        with self._lock:
            taken, self._pending = self._pending, []
        return taken

    def _append(self, record: CollectiveRecord) -> None:
        with self._lock:
            if self._consumers > 0:
                self._pending.append(record)


def _uses_cuda_events(device: Union[torch.device, str, None]) -> bool:
    if device is not None:
        return torch.device(device).type == "cuda"
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def total_seconds(records: list[CollectiveRecord]) -> float:
    """Sum of the waits in ``records`` (resolves CUDA events, so call it where a sync is acceptable)."""
    return sum(record.resolve() for record in records)


_TIMER = CollectiveTimer()


def collective_timer() -> CollectiveTimer:
    """The process-wide timer strategies record into and ``ThroughputLogger`` reads."""
    return _TIMER
