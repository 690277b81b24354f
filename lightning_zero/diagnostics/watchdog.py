"""Hang watchdog: turn a stuck step or collective into a clean failure that names the ranks that never arrived.

Each rank runs a daemon thread. The training thread only updates in-memory progress (``arm``/``beat``/``disarm``
are an integer increment and a string assignment, no I/O); the thread publishes that progress into the job's
c10d store and checks two things every ``poll_interval``:

* has *this* rank been inside an armed region (a training step, a validation batch, a checkpoint save or load,
  teardown) longer than ``timeout``? Then the first rank to get there (``[Note: one rank diagnoses for the world]``)
  reads every rank's published progress, names the ranks that are
  behind the furthest rank (they never reached the point the others wait at) or, when every rank reached the same
  point, the ranks whose training thread is *not* waiting inside a collective (the others wait for them), and
  raises the job-wide abort flag with that message;
* has any rank raised the abort flag? Then it dumps every Python thread's stack (``faulthandler``), acknowledges,
  waits until all ranks acknowledged (or ``grace`` expires) so the store's host (rank 0) stays up for the others,
  and exits the process with ``HANG_EXIT_CODE``.

[Note: what "hung" means]
A rank blocked in a collective is not stopped: it waits for a peer. The rank to name is the one that does not
arrive. Two signals find it: the progress counter (a rank that is behind never reached the point where the others
wait) and, when counters are equal (a rank hung *inside* a save while the others wait in that save's collective),
where its training thread is: while armed, each rank's thread also publishes the innermost Python frame of the
training thread (``at/<rank>``) and whether that frame is inside ``torch.distributed``'s collective code (outside
``torch.distributed.checkpoint``'s file I/O). A rank at the furthest point that is not in a collective is named.

[Note: progress is comparable across ranks only because every rank makes the same sequence of ``arm``/``beat``/
``disarm`` calls (the Lightning hooks fire identically on every rank of a data-parallel job). A rank stuck in a
Python ``sleep``, a dataloader or a collective still runs this thread: the GIL is released while it blocks.]

The thread talks to the store over its own client connection (``store_for_watchdog``) so its blocking calls never
interleave with the training thread's use of the default store. Hand-written: torch's NCCL watchdog only covers
NCCL collectives (not gloo, not Python-side hangs) and reports no cross-rank progress.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch.distributed as dist

from lightning_zero.diagnostics.peers import agreed_attempt
from lightning_zero.diagnostics.store_reads import present_values
from lightning_zero.torch_compat import default_store

HANG_EXIT_CODE = 124
_ABORT_KEY = "abort"
_DETECTED_KEY = "detected"
_DIAGNOSING_KEY = "diagnosing"
_ACK_KEY = "acks"
_LEFT = 1 << 62  # the progress a rank publishes when its watchdog stops
_COLLECTIVE_DIR = os.sep.join(("torch", "distributed", ""))
_NOT_COLLECTIVE_DIR = os.sep.join(("torch", "distributed", "checkpoint", ""))
_generation = itertools.count()


def _flight_recorder_names() -> tuple[str, str]:
    """(buffer-size variable, dump-file variable) for the installed torch.

    Newer torch renamed TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE to TORCH_FR_BUFFER_SIZE /
    TORCH_FR_DUMP_TEMP_FILE and warns on the old names; the Python side of c10d names the new one when it exists.
    """
    import torch.distributed.distributed_c10d as c10d

    try:
        renamed = "TORCH_FR_BUFFER_SIZE" in Path(c10d.__file__).read_text()
    except OSError:
        renamed = False
    if renamed:
        return "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"
    return "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def enable_flight_recorder(buffer_size: int = 2000, dump_dir: Optional[str] = None) -> list[str]:
    """Set the NCCL flight-recorder variables (keeping values the user set); returns the names it set.

    Must run before the NCCL process group is created; afterwards it has no effect on that group.
    """
    buffer_var, file_var = _flight_recorder_names()
    wanted = {buffer_var: str(buffer_size), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if dump_dir is not None:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        wanted[file_var] = str(Path(dump_dir) / "nccl_trace_rank_")
    set_now = [name for name in wanted if name not in os.environ]
    for name in set_now:
        os.environ[name] = wanted[name]
    return set_now


def store_for_watchdog(timeout: float = 60.0) -> dist.Store:
    """A store namespace private to one watchdog run, on a fresh client connection to the default group's store
    (each of its calls waits at most ``timeout`` seconds: a store host cut off must not hold the thread longer).

    Must be called by every rank in the same order (namespaces are numbered per process, so they match).
    """
    if not dist.is_initialized():
        raise RuntimeError("the hang watchdog needs an initialised torch.distributed process group (for its store)")
    base = default_store()
    inner = base
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        client = dist.TCPStore(
            inner.host, inner.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout)
        )
    else:  # FileStore / HashStore: already safe to share
        client = base
    # A restarted torchrun attempt reuses the agent's store: its keys (an old abort flag) must not be seen again.
    agreed = agreed_attempt()  # the restart counts of different nodes' agents can differ (diagnostics.peers)
    attempt = str(agreed) if agreed is not None else os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"lightning_zero/watchdog/{attempt}/{next(_generation)}/", client)


def _frame_summary(frame) -> tuple[bool, str]:
    """(is the frame waiting in a collective, ``file:line in function``) for a thread's innermost frame."""
    if frame is None:
        return False, "unknown"
    code = frame.f_code
    path = code.co_filename
    waiting = _COLLECTIVE_DIR in path and _NOT_COLLECTIVE_DIR not in path
    return waiting, f"{os.path.basename(path)}:{frame.f_lineno} in {code.co_name}"


def _rank_ranges(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-5, 7`` for sorted ``ranks``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs, start = [], ranks[0]
    for previous, rank in zip(ranks, ranks[1:] + [None]):
        if rank is None or rank != previous + 1:
            runs.append(f"{start}-{previous}" if previous > start else str(start))
            start = rank
    return f"ranks {', '.join(runs)}"


def _grouped(states: dict[int, str]) -> str:
    """Every rank's state, ranks in the same state named together (``ranks 0-1022: training_step 7 at ...``): the
    verdict every rank prints grows with the number of distinct states, not with the world."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(states):
        groups.setdefault(states[rank], []).append(rank)
    return "; ".join(f"{_rank_ranges(ranks)}: {state}" for state, ranks in groups.items())


def _exit_process(code: int) -> None:
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


class HangWatchdog:
    """Per-rank watchdog thread; see the module docstring for the protocol.

    Args:
        store: a c10d store shared by all ranks (use ``store_for_watchdog()``).
        rank / world_size: this rank and the job size.
        timeout: seconds an armed region may last before the job is declared hung.
        poll_interval: how often the thread publishes progress and checks (default ``min(1, timeout / 4)``).
        grace: seconds to wait for every rank to dump its stack before exiting.
        dump_dir: if set, each rank also writes its stack to ``dump_dir/hang_rank{rank}.txt``.
        on_exit: called with ``HANG_EXIT_CODE`` instead of ``os._exit`` (tests).
        identity: where this rank runs (``diagnostics.peers.identity``), published for the others to name it when
            its heartbeat stops (see [Note: a heartbeat that stops]).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: float,
        poll_interval: Optional[float] = None,
        grace: float = 5.0,
        dump_dir: Optional[Path] = None,
        on_exit: Callable[[int], None] = _exit_process,
        identity: Optional[dict] = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        if poll_interval is not None and poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive seconds, got {poll_interval}")
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, float(timeout)
        self.poll_interval = poll_interval if poll_interval is not None else min(1.0, self.timeout / 4)
        self.grace, self.dump_dir, self.on_exit = grace, dump_dir, on_exit
        self._progress = 0
        self._label = "not started"
        self._armed_since: Optional[float] = None
        self._training_thread = threading.get_ident()  # the thread whose frames say where a hung rank is
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store_watcher: Optional[threading.Thread] = None
        self.hang_message: Optional[str] = None
        self.identity = identity
        self._store_host: Optional[dict] = None  # rank 0's identity (its node hosts the store), once read
        self._probe = max(3 * self.poll_interval, 2.0)  # how long a stopped heartbeat is watched before it is named
        self._store_answered = time.monotonic()  # when a store call last returned (see _watch_the_store)
        self._aborted = threading.Event()
        self._deferred_since: Optional[float] = None  # when another rank was found diagnosing (_may_diagnose)

    # ----- training-thread side: no I/O -----
    def arm(self, label: str) -> None:
        """Enter a monitored region (a step): the timeout clock starts now."""
        self._progress += 1
        self._label = label
        self._armed_since = time.monotonic()

    def beat(self, label: str) -> None:
        """Record progress inside the region without restarting the clock (names where a rank is stuck)."""
        self._progress += 1
        self._label = label

    def disarm(self, label: str) -> None:
        """Leave the monitored region (time outside it, e.g. validation or checkpointing, is not limited)."""
        self._progress += 1
        self._label = label
        self._armed_since = None

    @contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """Monitor a region (a checkpoint save or load, teardown) with its own clock; on exit the enclosing state
        comes back (still armed, with a fresh clock, if it was armed: the region's time is not charged to it)."""
        was_armed = self._armed_since is not None
        self.arm(label)
        try:
            yield
        finally:
            self._progress += 1
            self._label = f"{label}: done"
            self._armed_since = time.monotonic() if was_armed else None

    # ----- thread side -----
    def start(self) -> None:
        """Start the thread; the calling thread is the training thread whose stack locates a hang."""
        self._training_thread = threading.get_ident()
        self._store_answered = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"lightning-zero-watchdog-{self.rank}", daemon=True)
        self._thread.start()
        self._store_watcher = threading.Thread(
            target=self._watch_the_store, daemon=True, name=f"lightning-zero-watchdog-store-{self.rank}"
        )
        self._store_watcher.start()

    def stop(self) -> None:
        """Stop the thread and publish that this rank has left the monitored run.

        [Note: a rank that left is ahead of everyone] Its last heartbeat would otherwise stay in the store and make
        a rank still inside the run (stuck in teardown while this one already waits at a final barrier) see it as
        *behind*; a rank that finished is past every point the others can wait at."""
        self._stop.set()
        watcher, self._store_watcher = self._store_watcher, None
        if watcher is not None:  # it makes no store call, so it ends at once: joined, no thread outlives a fit
            watcher.join(timeout=self.poll_interval * 4 + 1)
        if self._thread is not None:
            self._thread.join(timeout=self.poll_interval * 4 + 1)
            if not self._thread.is_alive():
                try:
                    self.store.set(f"hb/{self.rank}", f"{_LEFT}|left the monitored run after '{self._label}'")
                except Exception:  # noqa: BLE001 - the store's host may be gone already
                    pass
            self._thread = None

    def _run(self) -> None:
        published = None
        while not self._stop.wait(self.poll_interval):
            try:
                published = self._publish(published)
                self._store_answered = time.monotonic()
                if self.store.check([_ABORT_KEY]):
                    self._abort(self.store.get(_ABORT_KEY).decode())
                    return
                armed_since = self._armed_since
                if armed_since is not None and time.monotonic() - armed_since > self.timeout and self._may_diagnose():
                    message = self._diagnose()
                    if self.store.add(_DETECTED_KEY, 1) == 1:  # the first detector writes the verdict
                        self.store.set(_ABORT_KEY, message)
            except Exception as err:  # noqa: BLE001 - the store's host may be gone; never die silently
                if self._armed_since is not None and time.monotonic() - self._armed_since > self.timeout:
                    self._abort(self._store_lost(f"{type(err).__name__}: {err}"), wait_for_others=False)
                    return

    def _may_diagnose(self) -> bool:
        """Whether this rank, past its timeout, diagnoses now.

        [Note: one rank diagnoses for the world]
        A diagnosis reads every rank's keys and, in a hang, every rank times out within a poll of the others: if each
        diagnosed, the store's host would serve N reads of N ranks' keys at once, N² in all, while the ranks' own
        polls queue behind them past the "store unreachable" limit, and every rank would blame the store instead of
        the stopped rank (the figures at 1,024 ranks: ``docs/scale.md``, "The hang watchdog"). Only the
        first rank past its timeout (the first ``add`` of a shared counter) diagnoses; its verdict is the one every
        rank prints anyway (the first detector writes it). The others keep polling, and read the verdict from the
        abort flag. A diagnoser that dies before writing it (frozen, cut off) must not leave the job hanging: a rank
        still without a verdict ``timeout`` + the heartbeat probe after it deferred diagnoses itself, as if it had
        been first."""
        now = time.monotonic()
        if self._deferred_since is None:
            if self.store.add(_DIAGNOSING_KEY, 1) == 1:
                return True
            self._deferred_since = now
        return now - self._deferred_since > self.timeout + self._probe

    def _publish(self, published: Optional[tuple[int, str]]) -> tuple[int, str]:
        """One poll's writes: what changed of this rank's keys (its identity once, its progress, where its training
        thread is while armed) in one ``multi_set``, then its liveness count; returns the progress published.
        [Note: round trips per poll] Two to three, whatever the world size: the ``multi_set``, the liveness ``add``
        (and the abort flag's ``check`` in ``_run``); rank 0's identity is read once, on the first polls."""
        keys, values = [], []
        if self.identity is not None:
            keys.append(f"id/{self.rank}")
            values.append(json.dumps(self.identity))
        state = (self._progress, self._label)
        if state != published:
            keys.append(f"hb/{self.rank}")
            values.append(f"{state[0]}|{state[1]}")
        if self._armed_since is not None:
            waiting, where = _frame_summary(sys._current_frames().get(self._training_thread))
            keys.append(f"at/{self.rank}")
            values.append(f"{int(waiting)}|{where}")
        if keys:
            self.store.multi_set(keys, values)
        self.identity = None
        self._publish_liveness()
        return state

    def _watch_the_store(self) -> None:
        """[Note: a store that stops answering] A store host cut off the network (no RST) leaves a store call of
        ``_run`` blocked for as long as TCP retries: no return while the link stays down, whatever the client's
        timeout (``docs/reliability.md``, "The store"). This second thread makes no store call: past ``timeout`` in an
        armed region with no store answer for ``timeout`` + the heartbeat probe, it ends the process naming the store's
        host."""
        while not self._stop.wait(self.poll_interval):
            now, armed = time.monotonic(), self._armed_since
            silent = now - self._store_answered
            if armed is not None and now - armed > self.timeout and silent > self.timeout + self._probe:
                self._abort(self._store_lost(f"no answer for {silent:.0f}s"), wait_for_others=False)
                return

    def _store_lost(self, why: str) -> str:
        host = self._store_host
        named = (
            f"rank 0 (node rank {host.get('node_rank')}, host {host.get('host')}, address "
            f"{host.get('address')}), whose node hosts the store,"
            if host
            else "rank 0 (the store host)"
        )
        return (
            f"rank {self.rank} timed out after {self.timeout:g}s in '{self._label}' and the job's store is "
            f"unreachable ({why}): {named} died or is cut off from this rank"
        )

    def _publish_liveness(self) -> None:
        """[Note: a heartbeat that stops] Every poll adds one to ``alive/<rank>``, whatever the training thread
        does; a rank whose count stops moving is dead or cut off (a partition leaves gloo waiting with no error).
        Its identity goes out once (``_publish``); rank 0's (the store's host) is kept, to name it when the store is
        cut off."""
        self.store.add(f"alive/{self.rank}", 1)
        if self._store_host is None and self.rank != 0 and self.store.check(["id/0"]):
            self._store_host = json.loads(self.store.get("id/0"))

    def _stopped_heartbeats(self, progress: dict[int, tuple[int, str]]) -> dict[int, str]:
        """The ranks (other than this one, still in the run) whose liveness count did not move over a few polls,
        each with where it runs. A constant number of round trips (see [Note: reading every rank's key] in
        :mod:`lightning_zero.diagnostics.store_reads`)."""
        candidates = [r for r in range(self.world_size) if r != self.rank and progress.get(r, (0, ""))[0] < _LEFT]

        def counts(ranks: list[int]) -> dict[int, int]:
            found = present_values(self.store, [f"alive/{r}" for r in ranks])
            self._store_answered = time.monotonic()
            return {r: int(found[f"alive/{r}"]) for r in ranks if f"alive/{r}" in found}

        before = counts(candidates)  # (a rank that never beat is left out: it is named as never reported)
        if not before:
            return {}
        # Keep beating while measuring: every rank past its timeout measures at about the same moment, and a thread
        # that only slept here would look stopped to the others measuring it.
        deadline = time.monotonic() + self._probe
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(self.poll_interval, left))
            self.store.add(f"alive/{self.rank}", 1)
        after = counts(list(before))
        still = [r for r in before if after.get(r) == before[r]]
        identities = present_values(self.store, [f"id/{r}" for r in still])
        stopped = {}
        for rank in still:
            where = json.loads(identities[f"id/{rank}"]) if f"id/{rank}" in identities else {}
            stopped[rank] = (
                f"rank {rank} (node rank {where.get('node_rank')}, host {where.get('host')}, address "
                f"{where.get('address')})"
                if where
                else f"rank {rank}"
            )
        return stopped

    def _peer_states(self) -> tuple[dict[int, tuple[int, str]], dict[int, tuple[bool, str]]]:
        """Every rank's published progress and, for the others, where their training thread is: one read of all
        ranks' keys (a constant number of round trips, see ``_stopped_heartbeats``)."""
        ranks = range(self.world_size)
        found = present_values(self.store, [f"hb/{r}" for r in ranks] + [f"at/{r}" for r in ranks if r != self.rank])
        progress, locations = {}, {}
        for rank in ranks:
            if f"hb/{rank}" in found:
                count, _, label = found[f"hb/{rank}"].decode().partition("|")
                progress[rank] = (int(count), label)
            if f"at/{rank}" in found:
                waiting, _, where = found[f"at/{rank}"].decode().partition("|")
                locations[rank] = (waiting == "1", where)
        locations[self.rank] = _frame_summary(sys._current_frames().get(self._training_thread))
        return progress, locations

    def _diagnose(self) -> str:
        progress, locations = self._peer_states()
        progress[self.rank] = (self._progress, self._label)  # own state is fresher than the published one
        silent = [r for r in range(self.world_size) if r not in progress]
        furthest = max(count for count, _ in progress.values())
        behind = sorted(r for r, (count, _) in progress.items() if count < furthest)
        # Equal counters: the ranks at the furthest point that are not waiting in a collective hold the others.
        stopped = [] if behind else sorted(r for r in progress if r in locations and not locations[r][0])
        where = _grouped(
            {
                r: label + (f" at {locations[r][1]}" if r in locations and count < _LEFT else "")
                for r, (count, label) in progress.items()
            }
        )
        head = (
            f"lightning-zero hang watchdog: rank {self.rank} spent more than {self.timeout:g}s (hang_timeout) in "
            f"'{self._label}' (raise hang_timeout if a rank may legitimately work that long while others wait)."
        )
        cut_off = self._stopped_heartbeats(progress)
        if cut_off:
            return (
                f"{head} Unreachable: {'; '.join(cut_off.values())}: "
                f"{'its heartbeat' if len(cut_off) == 1 else 'their heartbeats'} stopped (the process is frozen "
                f"or dead, or its host is cut off from the network) while this rank waits. Progress: {where}"
            )
        if silent or behind or (stopped and len(stopped) < len(progress)):
            named = sorted(set(silent) | set(behind) | set(stopped))
            return (
                f"{head} Ranks that never arrived: {named} (never reported: {silent}; behind the others: "
                f"{behind}; stopped outside a collective while the others wait in one: {stopped}). "
                f"Progress: {where}"
            )
        return (
            f"{head} All ranks are at the same point, so they are stuck together (a collective that never "
            f"completes: network, mismatched collective order or a dead peer). Progress: {where}"
        )

    def _abort(self, message: str, wait_for_others: bool = True) -> None:
        if self._aborted.is_set():  # (both threads may get here)
            return
        self._aborted.set()
        self.hang_message = message
        header = (
            f"\n[lightning-zero watchdog] rank {self.rank} aborting: {message}\n"
            f"[lightning-zero watchdog] rank {self.rank} Python stacks:\n"
        )
        sys.stderr.write(header)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            with open(self.dump_dir / f"hang_rank{self.rank}.txt", "w") as handle:
                handle.write(header)
                handle.flush()
                faulthandler.dump_traceback(file=handle, all_threads=True)
        deadline = time.monotonic() + self.grace
        try:
            if wait_for_others:  # (without the store there is no one to wait for)
                self.store.add(_ACK_KEY, 1)
            while wait_for_others and time.monotonic() < deadline and self.store.add(_ACK_KEY, 0) < self.world_size:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - peers exiting first may take the store down; exit anyway
            pass
        self.on_exit(HANG_EXIT_CODE)
