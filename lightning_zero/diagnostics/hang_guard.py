"""``HangGuard``: the hang watchdog a strategy runs by default, as a handle whose calls are no-ops when it is off.

The strategy calls ``start`` once the process group exists, marks its phases (``step`` for training/evaluation
steps, ``beat`` inside a step, ``phase`` around checkpoint saves/loads and teardown) and ``stop``s it at teardown.
All marks are in-memory updates (see ``HangWatchdog``); the watchdog thread does the store traffic once per poll.

Only one watchdog runs per process: ``active_watchdog()`` returns it, so ``NCCLDiagnostics`` reuses the strategy's
instead of starting a second thread and heartbeat.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import ContextManager, Iterator, Optional, Union

import torch.distributed as dist

from lightning_zero.diagnostics.peers import identity
from lightning_zero.diagnostics.watchdog import HangWatchdog, store_for_watchdog

#: Default seconds one monitored region (a step, a validation batch, a save, a load, teardown) may last.
#: [Note: the default hang timeout] Many times a slow step of a large model, well under torch's default
#: process-group timeout that would otherwise end a hang with no name and no stacks, and long enough for the sharded
#: save of a multi-billion-parameter model to local disk (the figures: ``docs/reliability.md``, "Choosing the
#: default"). Raise it for longer saves or for work one rank does alone while the others wait.
DEFAULT_HANG_TIMEOUT = 600.0

_active: Optional[HangWatchdog] = None


def active_watchdog() -> Optional[HangWatchdog]:
    """The watchdog running in this process (started by a strategy or a callback), or ``None``."""
    return _active


def positive_seconds(value: Union[int, float, timedelta], name: str, none_means: str = "") -> float:
    """Seconds (positive, finite) from a number of seconds or a ``timedelta``, else an error naming ``name``."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{name} must be a number of seconds or a datetime.timedelta{none_means}, got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be positive and finite{none_means}, got {value!r}")
    return seconds


def parse_hang_timeout(value: Union[None, int, float, timedelta]) -> Optional[float]:
    """Seconds (positive, finite) from seconds or a ``timedelta``; ``None`` means the watchdog is off."""
    if value is None:
        return None
    return positive_seconds(value, "hang_timeout", none_means=" (or None to turn the watchdog off)")


class HangGuard:
    """A strategy's hang watchdog: ``timeout`` seconds per monitored region, ``None`` for off (every call a no-op).

    Args:
        timeout: seconds, ``timedelta`` or ``None`` (validated here, before any process group exists).
        poll_interval / grace / dump_dir: see ``HangWatchdog``.
    """

    def __init__(
        self,
        timeout: Union[None, int, float, timedelta] = DEFAULT_HANG_TIMEOUT,
        poll_interval: Optional[float] = None,
        grace: float = 5.0,
        dump_dir: Optional[Union[str, Path]] = None,
    ) -> None:
        self.timeout = parse_hang_timeout(timeout)
        self.poll_interval, self.grace = poll_interval, grace
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.watchdog: Optional[HangWatchdog] = None
        self._steps: dict[str, int] = {}
        self._current = "not started"

    def start(self, rank: int, world_size: int, node_rank: Optional[int] = None) -> None:
        """Start the thread (every rank, in the same order: the store namespace is numbered per process).
        ``node_rank``: published with the host, to name this rank if its heartbeat stops.

        No-op when off, when already running, or when another watchdog runs in this process."""
        global _active
        if self.timeout is None or self.watchdog is not None or _active is not None:
            return
        # a store call waits at most about the timeout: a cut-off store host is named within hang_timeout + 30 s
        store = store_for_watchdog(min(60.0, max(5.0, self.timeout / 2))) if dist.is_initialized() else dist.HashStore()
        self.watchdog = HangWatchdog(
            store,
            rank,
            world_size,
            self.timeout,
            poll_interval=self.poll_interval,
            grace=self.grace,
            dump_dir=self.dump_dir,
            identity=identity(node_rank),
        )
        self.watchdog.start()
        _active = self.watchdog

    def stop(self) -> None:
        global _active
        if self.watchdog is not None:
            self.watchdog.stop()
            if _active is self.watchdog:
                _active = None
            self.watchdog = None

    def step(self, kind: str) -> None:
        """A new step of ``kind`` (``training_step``, ``validation_step``, ...) starts: restart the clock."""
        if self.watchdog is not None:
            count = self._steps[kind] = self._steps.get(kind, -1) + 1
            self._current = f"{kind} {count}"
            self.watchdog.arm(self._current)

    def beat(self, where: str) -> None:
        """Progress inside the current step (names where a rank stopped), without restarting the clock."""
        if self.watchdog is not None:
            self.watchdog.beat(f"{self._current}: {where}")

    def phase(self, label: str) -> ContextManager[None]:
        """Monitor a region with its own clock (``save``, ``load``, ``teardown``).

        Outside a run (``trainer.save_checkpoint`` after ``fit`` tore the watchdog down) a watchdog is started for
        the region alone: every rank enters a save or load, so every rank starts it in the same order."""
        if self.watchdog is not None:
            return self.watchdog.phase(label)
        if self.timeout is not None and _active is None and dist.is_available() and dist.is_initialized():
            return self._scoped(label)
        return nullcontext()

    @contextmanager
    def _scoped(self, label: str) -> Iterator[None]:
        self.start(dist.get_rank(), dist.get_world_size())
        try:
            with self.phase(label):
                yield
        finally:
            self.stop()

    @contextmanager
    def teardown(self) -> Iterator[None]:
        """Monitor teardown's collectives, then stop the watchdog."""
        try:
            with self.phase("teardown"):
                yield
        finally:
            self.stop()
