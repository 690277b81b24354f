"""Asynchronous, aligned file I/O between CPU tensors and a local disk: the engine under NVMe offload.

[Note: why this is hand-written]
No maintained Python library moves CPU tensors to and from a file asynchronously with ``O_DIRECT``: torch has no
file I/O engine (``torch.save`` is synchronous and pickles), DeepSpeed's ``AsyncIOBuilder`` is a C++ extension that
needs ``libaio`` headers at build time (absent here, and we ship no compiled code), and ``aiofiles``/``asyncio``
wrap buffered ``read``/``write`` on bytes objects (a copy per call, no ``O_DIRECT``). What is needed is small:
``os.preadv``/``os.pwritev`` release the GIL, so a thread pool issuing block-sized, block-aligned requests on an
``O_DIRECT`` descriptor keeps several requests in flight (the queue depth) while Python steps the optimizer.

[Note: alignment]
``O_DIRECT`` needs the memory address, the file offset and the length to be multiples of the device's logical
block size. :func:`aligned_buffer` returns ``ALIGNMENT``-aligned memory, and callers lay files out in
``ALIGNMENT``-multiples (:func:`align_up`). Where the filesystem refuses ``O_DIRECT`` (tmpfs, some overlays) the
engine falls back to buffered I/O with a warning: same bytes, page cache in between.

Framework-free: imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

ALIGNMENT = 4096
MAX_IN_FLIGHT = 256  # requests in flight per engine, i.e. I/O threads


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def aligned_buffer(nbytes: int, *, pin_memory: bool = False, alignment: int = ALIGNMENT) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``align_up(nbytes)`` bytes whose first byte is ``alignment``-aligned."""
    size = align_up(max(nbytes, 1), alignment)
    raw = torch.empty(size + alignment, dtype=torch.uint8, pin_memory=pin_memory)
    shift = (-raw.data_ptr()) % alignment
    return raw[shift : shift + size]


class SwapIOError(OSError):
    """A swap read/write failed; the message names the file, the swap folder and the bytes involved."""


@dataclass(frozen=True)
class AioSettings:
    """The engine's knobs (DeepSpeed's ``aio`` section, mapped to this engine).

    Args:
        block_size: bytes per request; a transfer is split into requests of this size (rounded to ``ALIGNMENT``).
        queue_depth: requests each I/O worker keeps in flight (libaio's submission depth in DeepSpeed).
        thread_count: I/O workers sharing each transfer (DeepSpeed's ``intra_op_parallelism``).
            So up to ``thread_count * queue_depth`` requests are in flight at once; as ``os.preadv``/``os.pwritev``
            are blocking calls (that release the GIL), each in-flight request is one OS thread of the engine's pool,
            which therefore has ``thread_count * queue_depth`` threads (at most :data:`MAX_IN_FLIGHT`).
        single_submit: submit one request at a time (each waits for the previous one) instead of up to
            ``thread_count * queue_depth`` at once.
        overlap_events: ``True`` lets reads/writes run in the background while the caller computes; ``False`` makes
            every :meth:`AsyncFileIO.read`/:meth:`AsyncFileIO.write` wait for its completion before returning.
        use_direct: ``None`` tries ``O_DIRECT`` and falls back with a warning; ``True`` refuses the fallback;
            ``False`` always uses buffered I/O.
    """

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_direct: Optional[bool] = None

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "thread_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"aio {name} must be a positive int, got {value!r}")
        if self.in_flight > MAX_IN_FLIGHT:
            raise ValueError(
                f"aio thread_count * queue_depth = {self.thread_count} * {self.queue_depth} requests in "
                f"flight needs as many I/O threads; at most {MAX_IN_FLIGHT} are allowed"
            )
        for name in ("single_submit", "overlap_events"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"aio {name} must be True or False, got {getattr(self, name)!r}")
        if self.use_direct is not None and not isinstance(self.use_direct, bool):
            raise TypeError(f"use_direct must be True, False or None, got {self.use_direct!r}")

    @property
    def in_flight(self) -> int:
        """Requests in flight at once (one I/O thread each)."""
        return 1 if self.single_submit else self.thread_count * self.queue_depth


def _memoryview(buffer: torch.Tensor) -> memoryview:
    if buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError("swap I/O buffers must be contiguous uint8 CPU tensors (see aligned_buffer)")
    if buffer.numel() == 0:
        return memoryview(bytearray())
    # ctypes, not ``buffer.numpy()``: exporting to numpy marks the storage as not resizable for good, and a shard
    # read in place (lightning_zero.offload.shard_memory) is freed at eviction by resizing its storage to zero.
    # The view does not keep ``buffer`` alive: the transfer holds it until its requests end.
    return memoryview((ctypes.c_char * buffer.numel()).from_address(buffer.data_ptr())).cast("B")


class AsyncFileIO:
    """Reads and writes whole aligned buffers at offsets of files, in the background (see the module notes).

    ``read``/``write`` return a ``Future`` that completes when every request of the transfer has finished (its
    result is the byte count; its exception a :class:`SwapIOError`). ``close`` waits for everything in flight.
    """

    def __init__(self, settings: Optional[AioSettings] = None) -> None:
        self.settings = settings or AioSettings()
        depth = self.settings.in_flight
        # [Note: queue depth] one thread per request in flight: blocking preadv/pwritev calls on `depth` threads
        # keep `depth` requests queued at the device, which is what libaio's submission depth achieves. The pool's
        # size is the bound: requests beyond it wait in the pool's queue (in submission order), never in the
        # caller, so read()/write() return at once however large the transfer (the caller computes meanwhile).
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="lz-swap-io")
        # bytes and busy seconds (time with at least one transfer of the kind in flight) per kind, for benchmarks
        # ("any": reads and writes together, over the time at least one transfer of either kind was in flight)
        self.stats = {"read": [0, 0.0], "write": [0, 0.0], "any": [0, 0.0]}
        self._active = {"read": 0, "write": 0, "any": 0}
        self._since = {"read": 0.0, "write": 0.0, "any": 0.0}
        self._fds: dict[str, tuple[int, bool]] = {}
        self._lock = threading.Lock()
        self.direct_fallback_warned = False

    # ---------------------------------------------------------------- files
    def open(self, path: str) -> bool:
        """Open (creating) ``path`` for swapping; returns whether it uses ``O_DIRECT``."""
        with self._lock:
            if path in self._fds:
                return self._fds[path][1]
        flags = os.O_RDWR | os.O_CREAT
        direct = self.settings.use_direct is not False and hasattr(os, "O_DIRECT")
        fd = -1
        if direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as error:
                if error.errno == errno.EINVAL and self.settings.use_direct:
                    raise SwapIOError(
                        errno.EINVAL, f"use_direct=True but the filesystem of {path!r} refuses O_DIRECT"
                    ) from error
                if error.errno != errno.EINVAL:
                    raise _io_error(error, "open", path, 0) from error
                direct = False
        if self.settings.use_direct and not direct:
            raise SwapIOError(errno.EINVAL, f"use_direct=True but O_DIRECT is not available for {path!r}")
        if fd < 0:
            try:
                fd = os.open(path, flags, 0o600)
            except OSError as error:
                raise _io_error(error, "open", path, 0) from error
            if self.settings.use_direct is None and not self.direct_fallback_warned:
                self.direct_fallback_warned = True
                warnings.warn(
                    f"O_DIRECT is not supported for {os.path.dirname(path)!r}: NVMe offload falls back to "
                    "buffered I/O (correct, but the page cache sits between memory and disk)",
                    stacklevel=2,
                )
        with self._lock:
            self._fds[path] = (fd, direct)
        return direct

    def close_file(self, path: str) -> None:
        with self._lock:
            entry = self._fds.pop(path, None)
        if entry is not None:
            os.close(entry[0])

    # ---------------------------------------------------------------- transfers
    def read(self, path: str, buffer: torch.Tensor, offset: int = 0) -> Future:
        """Fill ``buffer`` (aligned ``uint8``) from ``path`` at ``offset``."""
        return self._transfer("read", path, buffer, offset)

    def write(self, path: str, buffer: torch.Tensor, offset: int = 0) -> Future:
        """Write ``buffer`` (aligned ``uint8``) to ``path`` at ``offset``."""
        return self._transfer("write", path, buffer, offset)

    def _transfer(self, kind: str, path: str, buffer: torch.Tensor, offset: int) -> Future:
        fd, direct = self._fds[path]
        view = _memoryview(buffer)
        if direct and (buffer.data_ptr() % ALIGNMENT or offset % ALIGNMENT or len(view) % ALIGNMENT):
            raise ValueError(
                f"O_DIRECT {kind} of {path} needs {ALIGNMENT}-aligned address, offset and length; "
                f"got address {buffer.data_ptr():#x}, offset {offset}, length {len(view)}"
            )
        block = align_up(self.settings.block_size)
        done: Future = Future()
        pieces = [(start, min(start + block, len(view))) for start in range(0, len(view), block)] or [(0, 0)]
        state = {"left": len(pieces), "error": None}
        guard = threading.Lock()

        def finish(error: Optional[BaseException]) -> None:
            with guard:
                if error is not None and state["error"] is None:
                    state["error"] = error
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                self._busy(kind, False, len(view))
                if state["error"] is not None:
                    done.set_exception(state["error"])
                else:
                    done.set_result(len(view))

        def run(start: int, end: int, keep: torch.Tensor = buffer) -> None:  # keep: the memory of ``view``
            try:
                _io_all(kind, fd, view[start:end], offset + start, path)
            except BaseException as error:  # reported through the future
                finish(error)
            else:
                finish(None)

        self._busy(kind, True)
        for start, end in pieces:
            self._pool.submit(run, start, end)
        if not self.settings.overlap_events:
            done.result()
        return done

    def _busy(self, kind: str, starting: bool, nbytes: int = 0) -> None:
        now = time.perf_counter()
        with self._lock:
            for key in (kind, "any"):
                if starting:
                    if self._active[key] == 0:
                        self._since[key] = now
                    self._active[key] += 1
                    continue
                self._active[key] -= 1
                self.stats[key][0] += nbytes
                if self._active[key] == 0:
                    self.stats[key][1] += now - self._since[key]

    def reset_stats(self) -> None:
        """Start counting bytes and busy time afresh (transfers in flight keep their start time)."""
        with self._lock:
            for key, value in self.stats.items():
                value[0], value[1] = 0, 0.0
                if self._active[key]:
                    self._since[key] = time.perf_counter()

    def throughput(self, kind: str) -> float:
        """Bytes per second of ``kind`` (``"read"``/``"write"``/``"any"``) transfers while at least one was in
        flight."""
        nbytes, busy = self.stats[kind]
        return nbytes / busy if busy > 0 else 0.0

    def close(self) -> None:
        """Wait for every request in flight, then close all files and the threads."""
        self._pool.shutdown(wait=True)
        for path in list(self._fds):
            self.close_file(path)


def _io_all(kind: str, fd: int, view: memoryview, offset: int, path: str) -> None:
    """One request: loop over short reads/writes (the kernel may transfer less than asked)."""
    while len(view):
        try:
            if kind == "read":
                count = os.preadv(fd, [view], offset)
            else:
                count = os.pwritev(fd, [view], offset)
        except OSError as error:
            raise _io_error(error, kind, path, len(view)) from error
        if count == 0:
            raise SwapIOError(
                errno.EIO,
                f"swap {kind} of {path} at offset {offset}: unexpected end of file ({len(view)} bytes missing)",
            )
        view = view[count:]
        offset += count


def _io_error(error: OSError, kind: str, path: str, nbytes: int) -> SwapIOError:
    folder = os.path.dirname(path)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:  # what is left now: another process may be what filled the disk
            free = f", {shutil.disk_usage(folder).free} bytes free"
        except OSError:
            free = ""
        hint = f"the disk of nvme_path ({folder!r}) is full ({nbytes} more bytes were being written{free})"
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = f"no permission to {kind} swap files under nvme_path ({folder!r})"
    else:
        hint = f"swap {kind} of {nbytes} bytes failed under nvme_path ({folder!r})"
    return SwapIOError(error.errno, f"{hint}: {error.strerror} [{path}]")
