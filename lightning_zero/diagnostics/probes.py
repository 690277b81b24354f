"""Collective bandwidth probe: time, algorithm bandwidth and bus bandwidth per collective and message size.

The bandwidth definitions follow nccl-tests (doc/PERFORMANCE.md there), so numbers are comparable with
``all_reduce_perf`` and friends:

* ``size`` is the nccl-tests "size" column: the full buffer of an all_reduce/broadcast, the *output* of an
  all_gather (each rank contributes size/n), the *input* of a reduce_scatter (each rank keeps size/n), and the
  per-rank send buffer of an all_to_all.
* ``algbw = size / time``.
* ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather,
  reduce_scatter and all_to_all, and ``1`` for broadcast: the bandwidth each link must sustain, which is what
  should approach the hardware's peak whatever the rank count.

Hand-written because no maintained Python library exposes this: nccl-tests is a C binary that needs CUDA/MPI,
while this probe runs on whatever process group is current (gloo on CPU measures gloo).
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_zero.torch_compat import all_gather_flat, backend_serving, reduce_scatter_flat

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

# Errors a backend raises for a collective it does not implement (checked identically on every rank, before any
# communication, so every rank skips the same collective and nobody is left waiting).
_UNSUPPORTED_ERRORS = (RuntimeError, NotImplementedError, ValueError, AttributeError)


def bus_bandwidth_factor(collective: str, world_size: int) -> float:
    """nccl-tests' busbw/algbw ratio for ``collective`` on ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    factors = {
        "all_reduce": 2.0 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "broadcast": 1.0,
    }
    if collective not in factors:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    return factors[collective]


def algorithm_bandwidth(size_bytes: int, seconds: float) -> float:
    """Bytes per second moved from the user's point of view (nccl-tests ``algbw``)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return size_bytes / seconds


def bus_bandwidth(collective: str, size_bytes: int, seconds: float, world_size: int) -> float:
    """nccl-tests ``busbw`` in bytes per second."""
    return algorithm_bandwidth(size_bytes, seconds) * bus_bandwidth_factor(collective, world_size)


@dataclass
class ProbeResult:
    """One (collective, size) measurement; times are seconds per operation, bandwidths bytes per second."""

    collective: str
    size_bytes: int
    world_size: int
    time_s: Optional[float] = None  # slowest rank's mean time: the job waits for it
    algbw: Optional[float] = None
    busbw: Optional[float] = None
    rank_times_s: list[float] = field(default_factory=list)
    slowest_rank: Optional[int] = None
    slowest_host: Optional[str] = None
    error: Optional[str] = None  # "unsupported on this backend: ..." when the backend lacks the collective

    def to_dict(self) -> dict:
        return asdict(self)


def format_bytes(size: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.4g}{unit}"
    return f"{int(size)}B"


def _make_op(collective: str, size_bytes: int, world_size: int, device: torch.device, group) -> tuple[Callable, int]:
    """Buffers and a closure running one ``collective``; returns (op, actual size in the nccl-tests sense)."""
    elem = 4  # float32
    # Every shape below divides evenly by world_size so the size reported is the size moved.
    per_rank = max(1, size_bytes // (elem * world_size))
    total = per_rank * world_size
    if collective == "all_reduce":
        buf = torch.ones(total, device=device)
        return (lambda: dist.all_reduce(buf, group=group)), total * elem
    if collective == "broadcast":
        buf = torch.ones(total, device=device)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        return (lambda: dist.broadcast(buf, src=src, group=group)), total * elem
    if collective == "all_gather":
        inp, out = torch.ones(per_rank, device=device), torch.empty(total, device=device)
        return (lambda: all_gather_flat(out, inp, group=group)), total * elem
    if collective == "reduce_scatter":
        inp, out = torch.ones(total, device=device), torch.empty(per_rank, device=device)
        return (lambda: reduce_scatter_flat(out, inp, group=group)), total * elem
    if collective == "all_to_all":
        inp, out = torch.ones(total, device=device), torch.empty(total, device=device)
        return (lambda: dist.all_to_all_single(out, inp, group=group)), total * elem
    raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_gather_json(obj, device: Optional[torch.device] = None, group=None) -> list:
    """Every rank's JSON-serialisable ``obj``, exchanged as UTF-8 bytes (no pickling, unlike all_gather_object)."""
    device = device if device is not None else _probe_device(group)
    world_size = dist.get_world_size(group)
    payload = json.dumps(obj).encode()
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world_size)]
    dist.all_gather(lengths, length, group=group)
    width = max(int(t.item()) for t in lengths)
    local = torch.zeros(width, dtype=torch.uint8, device=device)
    local[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else local[:0]
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=group)
    return [json.loads(bytes(t[: int(n.item())].cpu().tolist())) for t, n in zip(gathered, lengths)]


def _hostnames(world_size: int, device: torch.device, group) -> list[str]:
    """Every rank's hostname, exchanged as fixed-width bytes (no pickling)."""
    width = 64
    mine = socket.gethostname().encode()[:width].ljust(width, b"\0")
    local = torch.tensor(list(mine), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=group)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in gathered]


def probe_collectives(
    collectives: Sequence[str] = COLLECTIVES,
    sizes: Sequence[int] = (1 << 10, 1 << 16, 1 << 20),
    iters: int = 5,
    warmup: int = 1,
    device: Optional[torch.device] = None,
    group=None,
) -> list[ProbeResult]:
    """Run every (collective, size) on the current process group; all ranks must call it with the same arguments.

    Each rank times ``iters`` back-to-back operations after ``warmup`` untimed ones; per-rank mean times are
    exchanged with one all_gather so every rank returns the same results, with the slowest rank (and its host)
    named. A collective the backend lacks yields a result whose ``error`` says so instead of an exception.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("probe_collectives needs an initialised torch.distributed process group")
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    unknown = [c for c in collectives if c not in COLLECTIVES]
    if unknown:
        raise ValueError(f"unknown collectives {unknown}; allowed: {COLLECTIVES}")
    world_size = dist.get_world_size(group)
    if device is None:
        device = _probe_device(group)
    hosts = _hostnames(world_size, device, group)
    results = []
    for collective in collectives:
        for size in sizes:
            results.append(_probe_one(collective, int(size), iters, warmup, world_size, device, group, hosts))
    return results


def _probe_device(group) -> torch.device:
    if backend_serving("cuda", group) == "nccl":  # the probe measures NCCL, also in a "cpu:gloo,cuda:nccl" group
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _probe_one(collective, size, iters, warmup, world_size, device, group, hosts) -> ProbeResult:
    op, actual = _make_op(collective, size, world_size, device, group)
    result = ProbeResult(collective, actual, world_size)
    try:
        op()  # first call doubles as the capability check
    except _UNSUPPORTED_ERRORS as err:
        result.error = f"unsupported on this backend ({dist.get_backend(group)}): {type(err).__name__}: {err}"
        return result
    for _ in range(warmup):
        op()
    _sync(device)
    begin = time.perf_counter()
    for _ in range(iters):
        op()
    _sync(device)
    mine = (time.perf_counter() - begin) / iters
    local = torch.tensor([mine], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=group)
    result.rank_times_s = [float(t.item()) for t in gathered]
    slowest = max(range(world_size), key=lambda r: result.rank_times_s[r])
    result.time_s = result.rank_times_s[slowest]
    result.slowest_rank = slowest
    result.slowest_host = hosts[slowest]
    result.algbw = algorithm_bandwidth(actual, result.time_s)
    result.busbw = bus_bandwidth(collective, actual, result.time_s, world_size)
    return result


def slow_outliers(results: Sequence[ProbeResult], tolerance: float = 0.5) -> list[str]:
    """Human-readable flags for ranks whose time exceeds the median of their probe by more than ``tolerance``.

    In a synchronising collective every rank waits for the slowest, so per-rank times are close; a rank that is
    consistently far above the median points at its host (bad NIC, throttled GPU, noisy neighbour).
    """
    flags = []
    for result in results:
        if result.error or len(result.rank_times_s) < 2:
            continue
        median = statistics.median(result.rank_times_s)
        assert result.slowest_rank is not None and result.time_s is not None
        if median > 0 and result.time_s > median * (1.0 + tolerance):
            flags.append(
                f"{result.collective} {format_bytes(result.size_bytes)}: rank {result.slowest_rank} on host "
                f"{result.slowest_host} took {result.time_s * 1e3:.3f} ms vs median {median * 1e3:.3f} ms"
            )
    return flags


def rich_console():
    """A rich Console that does not truncate tables to 80 columns when output goes to a pipe or a log file."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 120))


def probe_table(results: Sequence[ProbeResult], title: str = "collective bandwidth"):
    """A rich Table of the results with nccl-tests columns (time, algbw, busbw in GB/s = 1e9 B/s)."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("collective", "size", "time (ms)", "algbw (GB/s)", "busbw (GB/s)", "slowest rank (host)"):
        table.add_column(column, justify="left" if column == "collective" else "right")
    for r in results:
        if r.error:
            table.add_row(r.collective, format_bytes(r.size_bytes), "-", "-", "-", r.error.split(":")[0])
            continue
        table.add_row(
            r.collective,
            format_bytes(r.size_bytes),
            f"{r.time_s * 1e3:.3f}",
            f"{r.algbw / 1e9:.3f}",
            f"{r.busbw / 1e9:.3f}",
            f"{r.slowest_rank} ({r.slowest_host})",
        )
    return table
