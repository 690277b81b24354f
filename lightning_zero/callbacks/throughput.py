"""``ThroughputLogger``: global samples/s, tokens/s, TFLOP/s, MFU, a per-step time breakdown and straggler detection.

Unlike Lightning's ``ThroughputMonitor`` (rank 0's rate times the world size, after a 100-step window) every rank
measures itself and the ranks' numbers are combined with one ``all_gather`` of a small vector per logging interval;
the first interval is reported like any other.

Per training batch the hooks split time into phases (CUDA events on GPU, wall clock on CPU)::

    data       previous on_train_batch_end -> on_train_batch_start   (dataloader; not measured after validation)
    forward    on_train_batch_start        -> on_before_backward     (training_step, loss)
    backward   on_before_backward          -> on_after_backward      (includes DDP's overlapped all-reduce wait)
    optimizer  on_after_backward           -> on_train_batch_end     (clipping, optimizer.step, zero_grad)

``collective`` is the part of those phases the strategy reported as waiting in collectives through
``lightning_zero.diagnostics.timing.collective_timer()``; strategies that report nothing (Lightning's DDP) show 0.
[Note: FSDP2's collectives are not timed] A model with FSDP2 modules (ZeRO stages 2-3, Lightning's FSDP2
strategies) spends its main waits in FSDP2's own all-gathers and reduce-scatters, which nothing records: there the
figure is left out (``phase_time`` has no ``"collective"``, no ``collective_time`` metric, "n/m" in the table)
rather than shown as a near-zero that reads as "no communication". Those waits are inside forward and backward.
A *step* is an optimizer step, so with gradient accumulation one step spans several batches and the samples of
all of them.

Straggler detection compares per-rank *compute time* = data + forward + optimizer minus reported collective waits.
[Note: backward is left out on purpose: under DDP-style overlap the fast ranks spend their wait for a slow rank
inside backward (the gradient all-reduce), so total step times are equal on every rank and only the phases that
never synchronise reveal which rank is slow.]
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.flop_counter import FlopCounterMode

from lightning_zero.diagnostics.probes import rich_console
from lightning_zero.diagnostics.timing import CollectiveRecord, collective_timer, total_seconds
from lightning_zero.estimate.flops import compute_dtype_for_precision, mfu, peak_flops_for

FlopsSpec = Union[int, float, Callable[[Any], float]]
PHASES = ("data", "forward", "backward", "optimizer")
_LOCAL_PHASES = ("data", "forward", "optimizer")


@dataclass(frozen=True)
class ThroughputSettings:
    """Validated options of ``ThroughputLogger`` (see its docstring)."""

    log_every_n_steps: int = 10
    table_every_n_steps: Optional[int] = 100
    peak_flops: Optional[float] = None
    measure_flops: bool = True
    straggler_tolerance: float = 0.25
    straggler_min_gap_s: float = 0.005
    prefix: str = "throughput/"

    def __post_init__(self) -> None:
        if self.log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {self.log_every_n_steps}")
        if self.table_every_n_steps is not None:
            if self.table_every_n_steps < 1 or self.table_every_n_steps % self.log_every_n_steps:
                raise ValueError(
                    "table_every_n_steps must be None (no table) or a positive multiple of log_every_n_steps "
                    f"({self.log_every_n_steps}), got {self.table_every_n_steps}"
                )
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ValueError(f"peak_flops must be positive FLOP/s (e.g. 989e12), got {self.peak_flops}")
        if self.straggler_tolerance < 0 or self.straggler_min_gap_s < 0:
            raise ValueError(
                "straggler_tolerance and straggler_min_gap_s must be >= 0, got "
                f"{self.straggler_tolerance} and {self.straggler_min_gap_s}"
            )


@dataclass
class RankInterval:
    """What one rank measured over one logging interval (times in seconds, summed over the interval)."""

    rank: int
    samples: float
    tokens: float
    has_tokens: float
    steps: float
    seconds: float
    data: float
    forward: float
    backward: float
    optimizer: float
    collective: float
    local_collective: float  # collective waits inside the data/forward/optimizer phases
    peak_memory_bytes: float
    flops: float

    @property
    def compute_time_per_step(self) -> float:
        local = self.data + self.forward + self.optimizer - self.local_collective
        return max(local, 0.0) / max(self.steps, 1.0)

    @property
    def step_time(self) -> float:
        return self.seconds / max(self.steps, 1.0)


@dataclass
class ThroughputReport:
    """Combined view of one logging interval, identical on every rank."""

    ranks: list[RankInterval]
    samples_per_sec: float
    tokens_per_sec: Optional[float]
    step_time_min: float
    step_time_median: float
    step_time_max: float
    phase_time: dict[str, float]  # mean over ranks, seconds per step, incl. "collective" where it is measured
    flops_per_sec_per_device: Optional[float]
    mfu: Optional[float]
    peak_memory_bytes_max: float
    stragglers: list[int]
    straggler_message: Optional[str]

    def metrics(self, prefix: str = "throughput/") -> dict[str, float]:
        out = {
            "samples_per_sec": self.samples_per_sec,
            "step_time_min": self.step_time_min,
            "step_time_median": self.step_time_median,
            "step_time_max": self.step_time_max,
            "peak_memory_gb_max": self.peak_memory_bytes_max / 1e9,
        }
        out.update({f"{phase}_time": value for phase, value in self.phase_time.items()})
        if self.tokens_per_sec is not None:
            out["tokens_per_sec"] = self.tokens_per_sec
        if self.flops_per_sec_per_device is not None:
            out["tflops_per_device"] = self.flops_per_sec_per_device / 1e12
        if self.mfu is not None:
            out["mfu"] = self.mfu
        if self.stragglers:
            out["straggler_rank"] = float(self.stragglers[0])
        return {prefix + key: float(value) for key, value in out.items()}


def summarize(
    ranks: Sequence[RankInterval],
    peak_flops: Optional[float],
    tolerance: float = 0.25,
    min_gap_s: float = 0.005,
    collective_measured: bool = True,
) -> ThroughputReport:
    """Combine per-rank intervals: rates are summed over ranks, times summarised as min/median/max or mean;
    ``collective_measured=False`` leaves the collective wait out (see the note on FSDP2)."""
    ranks = list(ranks)
    rates = [r.samples / r.seconds if r.seconds > 0 else 0.0 for r in ranks]
    has_tokens = any(r.has_tokens for r in ranks)
    tokens = sum(r.tokens / r.seconds for r in ranks if r.seconds > 0) if has_tokens else None
    step_times = [r.step_time for r in ranks]
    phase_time = {
        phase: statistics.fmean(getattr(r, phase) / max(r.steps, 1.0) for r in ranks)
        for phase in (*PHASES, "collective")
        if phase != "collective" or collective_measured
    }
    flops = None
    if any(r.flops > 0 for r in ranks):
        flops = statistics.fmean(r.flops / r.seconds if r.seconds > 0 else 0.0 for r in ranks)
    compute = [r.compute_time_per_step for r in ranks]
    median = statistics.median(compute)
    stragglers = sorted(
        (r.rank for r, c in zip(ranks, compute) if c > median * (1.0 + tolerance) and c - median > min_gap_s),
        key=lambda rank: -compute[[x.rank for x in ranks].index(rank)],
    )
    message = None
    if stragglers:
        described = ", ".join(
            f"rank {rank} ({compute[[x.rank for x in ranks].index(rank)] * 1e3:.1f} ms)" for rank in stragglers
        )
        message = (
            f"straggler: {described} of compute per step vs median {median * 1e3:.1f} ms "
            "(data + forward + optimizer, without collective waits); the other ranks wait for it"
        )
    return ThroughputReport(
        ranks=ranks,
        samples_per_sec=sum(rates),
        tokens_per_sec=tokens,
        step_time_min=min(step_times),
        step_time_median=statistics.median(step_times),
        step_time_max=max(step_times),
        phase_time=phase_time,
        flops_per_sec_per_device=flops,
        mfu=mfu(flops, peak_flops) if flops is not None and peak_flops else None,
        peak_memory_bytes_max=max(r.peak_memory_bytes for r in ranks),
        stragglers=stragglers,
        straggler_message=message,
    )


def first_tensor(batch: Any) -> Optional[torch.Tensor]:
    """The first tensor leaf of a (nested) batch: tensor, list/tuple, or mapping."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def default_batch_size(batch: Any) -> int:
    tensor = first_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        raise ValueError(
            "cannot infer the batch size: no tensor with a batch dimension in the batch; pass "
            "batch_size_fn=lambda batch: ..."
        )
    return int(tensor.shape[0])


def default_token_count(batch: Any) -> Optional[int]:
    """Tokens = batch x sequence length when the first tensor is integer token ids of shape (B, T, ...)."""
    tensor = first_tensor(batch)
    if tensor is not None and tensor.dim() >= 2 and not tensor.is_floating_point() and not tensor.is_complex():
        return int(tensor.shape[0] * tensor.shape[1])
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's on GPU; on Linux CPU the resident set's high-water mark (``VmHWM``),
    which writing ``5`` to ``/proc/self/clear_refs`` sets back to the current resident set. Elsewhere the CPU peak
    cannot be reset and stays the process's peak since it started."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process since the last :func:`reset_peak_memory`: CUDA allocator peak on GPU, peak
    resident set size (VmHWM) on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # not Linux /proc: ru_maxrss is KiB on Linux, bytes on macOS

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class ThroughputLogger(Callback):
    """Log throughput, FLOPs/MFU, a time breakdown, per-rank step times, stragglers and peak memory.

    Args:
        log_every_n_steps: combine and log every this many optimizer steps (and once more at the end of fit).
        table_every_n_steps: also print a rich per-rank table on rank 0 every this many steps (None: never).
        peak_flops: the device's peak FLOP/s for MFU; default from the GPU table and the Trainer precision.
        flops_per_batch: FLOPs of one training batch (forward+backward) as a number or ``fn(batch)``; default
            the LightningModule's ``flops_per_batch`` attribute, else measured once on the first batch with
            ``FlopCounterMode`` and scaled by batch size.
        measure_flops: set False to skip the measurement (no TFLOP/s or MFU unless flops_per_batch is given).
        batch_size_fn / length_fn: samples and tokens of a batch; default the first tensor's dim 0, and B*T of
            the first integer tensor of shape (B, T, ...).
        straggler_tolerance / straggler_min_gap_s: a rank is a straggler when its compute time per step exceeds
            the median by this fraction and by at least this many seconds.
        prefix: metric name prefix.

    The last combined report is kept in ``last_report`` on every rank.
    """

    def __init__(
        self,
        log_every_n_steps: int = 10,
        table_every_n_steps: Optional[int] = 100,
        peak_flops: Optional[float] = None,
        flops_per_batch: Optional[FlopsSpec] = None,
        measure_flops: bool = True,
        batch_size_fn: Optional[Callable[[Any], int]] = None,
        length_fn: Optional[Callable[[Any], int]] = None,
        straggler_tolerance: float = 0.25,
        straggler_min_gap_s: float = 0.005,
        prefix: str = "throughput/",
    ) -> None:
        self.settings = ThroughputSettings(
            log_every_n_steps,
            table_every_n_steps,
            peak_flops,
            measure_flops,
            straggler_tolerance,
            straggler_min_gap_s,
            prefix,
        )
        if flops_per_batch is not None and not callable(flops_per_batch) and flops_per_batch <= 0:
            raise ValueError(f"flops_per_batch must be a positive number or a callable(batch), got {flops_per_batch}")
        self._flops_arg = flops_per_batch
        self.batch_size_fn = batch_size_fn or default_batch_size
        self.length_fn = length_fn
        self.last_report: Optional[ThroughputReport] = None
        self.reports: list[ThroughputReport] = []
        self._flops_spec: Optional[FlopsSpec] = None
        self._flops_per_sample: Optional[float] = None
        self._counter: Optional[FlopCounterMode] = None
        self._peak: Optional[float] = None
        self._device = torch.device("cpu")
        self._clear_counters()

    # ----- setup -----
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        module_flops = getattr(pl_module, "flops_per_batch", None)
        if self._flops_arg is not None and module_flops is not None:
            raise ValueError(
                "flops_per_batch is given both to ThroughputLogger and as the LightningModule "
                "attribute `flops_per_batch`; keep one"
            )
        self._flops_spec = self._flops_arg if self._flops_arg is not None else module_flops
        self._peak = self.settings.peak_flops
        self._device = trainer.strategy.root_device
        if self._peak is None and self._device.type == "cuda":
            dtype = compute_dtype_for_precision(trainer.precision)
            name = torch.cuda.get_device_name(self._device)
            self._peak = peak_flops_for(name, dtype) if dtype else None
            if self._peak is None and trainer.is_global_zero:
                warnings.warn(
                    f"ThroughputLogger: no peak FLOP/s known for {name!r} at precision "
                    f"{trainer.precision!r}; pass peak_flops=... to get MFU"
                )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule

        # set up by now: FSDP2's fully_shard has turned the sharded modules into FSDPModules (see the note)
        modules = pl_module.modules() if isinstance(pl_module, torch.nn.Module) else ()
        self._collective_measured = not any(isinstance(m, FSDPModule) for m in modules)
        collective_timer().enable()
        collective_timer().take()
        self._reset_interval()
        self._last_end = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._batches:
            self._flush(trainer)
        collective_timer().disable()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_counter()
        collective_timer().disable()

    # ----- per-batch phases -----
    def _mark(self) -> Any:
        if self._device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _switch(self, next_phase: Optional[str]) -> Any:
        now = self._mark()
        if self._phase is not None:
            self._spans.append((self._phase, self._phase_start, now))
            self._collectives.append((self._phase, collective_timer().take()))
        self._phase, self._phase_start = next_phase, now
        return now

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None  # the next batch's data time would include validation

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._last_end is not None:
            self._phase, self._phase_start = "data", self._last_end
        else:
            collective_timer().take()  # waits outside any measured phase are not attributed
        self._switch("forward")
        self._step_before = trainer.global_step
        samples = int(self.batch_size_fn(batch))
        self._samples += samples
        tokens = self.length_fn(batch) if self.length_fn is not None else default_token_count(batch)
        if tokens is not None:
            self._tokens += int(tokens)
            self._has_tokens = 1.0
        self._batch_samples = samples
        if self._flops_spec is not None:
            self._flops += float(self._flops_spec(batch) if callable(self._flops_spec) else self._flops_spec)
        elif self._flops_per_sample is not None:
            self._flops += self._flops_per_sample * samples
        elif self.settings.measure_flops and self._counter is None:
            # Counted on the real model during this real batch: no extra forward/backward, nothing to restore.
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._switch("backward")

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._switch("optimizer")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._last_end = self._switch(None)
        self._batches += 1
        counted = self._stop_counter()
        if counted is not None:
            self._flops += counted
            self._flops_per_sample = counted / max(self._batch_samples, 1)
        if trainer.global_step != self._step_before:
            self._steps += 1
            if trainer.global_step % self.settings.log_every_n_steps == 0:
                self._flush(trainer)

    def _stop_counter(self) -> Optional[float]:
        if self._counter is None:
            return None
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        return float(counter.get_total_flops())

    # ----- combining and logging -----
    def _reset_interval(self) -> None:
        """Start an interval: its counters and its memory peak (each interval reports its own peak)."""
        self._clear_counters()
        reset_peak_memory(self._device)

    def _clear_counters(self) -> None:
        self._spans: list[tuple[str, Any, Any]] = []
        self._collectives: list[tuple[str, list[CollectiveRecord]]] = []
        self._phase: Optional[str] = None
        self._phase_start: Any = None
        self._samples = self._tokens = self._steps = self._batches = 0
        self._has_tokens = 0.0
        self._flops = 0.0

    def _local_interval(self, rank: int) -> RankInterval:
        phases = dict.fromkeys(PHASES, 0.0)
        for phase, start, end in self._spans:
            seconds = start.elapsed_time(end) / 1000.0 if self._device.type == "cuda" else end - start
            phases[phase] += seconds
        collective = local_collective = 0.0
        for phase, records in self._collectives:
            waited = total_seconds(records)
            collective += waited
            local_collective += waited if phase in _LOCAL_PHASES else 0.0
        return RankInterval(
            rank=rank,
            samples=self._samples,
            tokens=self._tokens,
            has_tokens=self._has_tokens,
            steps=self._steps,
            seconds=sum(phases.values()),
            collective=collective,
            local_collective=local_collective,
            peak_memory_bytes=peak_memory_bytes(self._device),
            flops=self._flops,
            **phases,
        )

    def _flush(self, trainer: Trainer) -> None:
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()
        rank = trainer.global_rank
        local = self._local_interval(rank)
        names = [f.name for f in fields(RankInterval)]
        vector = torch.tensor([float(getattr(local, n)) for n in names], dtype=torch.float64, device=self._device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [torch.empty_like(vector) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, vector)  # the only collective per interval
            rows = [dict(zip(names, t.cpu().tolist())) for t in gathered]
        else:
            rows = [dict(zip(names, vector.cpu().tolist()))]
        intervals = [RankInterval(**{**row, "rank": int(row["rank"])}) for row in rows]
        report = summarize(
            intervals,
            self._peak,
            self.settings.straggler_tolerance,
            self.settings.straggler_min_gap_s,
            getattr(self, "_collective_measured", True),
        )
        self.last_report = report
        self.reports.append(report)
        self._reset_interval()
        if not trainer.is_global_zero:
            return
        metrics = report.metrics(self.settings.prefix)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        if report.straggler_message and report.stragglers != getattr(self, "_warned_stragglers", None):
            warnings.warn(f"ThroughputLogger at step {trainer.global_step}: {report.straggler_message}")
        self._warned_stragglers = report.stragglers
        every = self.settings.table_every_n_steps
        if every and trainer.global_step % every == 0:
            rich_console().print(report_table(report, trainer.global_step, self._peak))


def report_table(report: ThroughputReport, step: int, peak_flops: Optional[float] = None):
    """A compact rich Table: one row per rank (times in ms per step) and the global rates in the title."""
    from rich.table import Table

    title = f"step {step}: {report.samples_per_sec:,.1f} samples/s"
    if report.tokens_per_sec is not None:
        title += f", {report.tokens_per_sec:,.0f} tokens/s"
    if report.flops_per_sec_per_device is not None:
        title += f", {report.flops_per_sec_per_device / 1e12:.2f} TFLOP/s/device"
    if report.mfu is not None:
        title += f", MFU {report.mfu:.1%}"
    table = Table(title=title)
    for column in ("rank", "step", *PHASES, "collective", "compute", "peak mem GB", ""):
        table.add_column(column, justify="right")
    for r in report.ranks:
        per_step = [f"{getattr(r, phase) / max(r.steps, 1.0) * 1e3:.1f}" for phase in PHASES]
        per_step.append(f"{r.collective / max(r.steps, 1.0) * 1e3:.1f}" if "collective" in report.phase_time else "n/m")
        table.add_row(
            str(r.rank),
            f"{r.step_time * 1e3:.1f}",
            *per_step,
            f"{r.compute_time_per_step * 1e3:.1f}",
            f"{r.peak_memory_bytes / 1e9:.2f}",
            "straggler" if r.rank in report.stragglers else "",
        )
    return table


def report_to_dict(report: ThroughputReport) -> dict:
    """JSON-friendly form of a report (for tests and tooling)."""
    return asdict(report)
