"""``NCCLDiagnostics``: environment audit, collective bandwidth probe and hang watchdog for a Lightning run.

Works with any process-group backend (on gloo it measures gloo). The pieces are framework-free and live in
``lightning_zero.diagnostics``: ``env_audit`` (versions, variables, topology, InfiniBand, warnings), ``probes``
(nccl-tests algbw/busbw) and ``watchdog`` (cross-rank hang detection); this callback only wires them to hooks.

[Note: NCCL reads ``TORCH_NCCL_TRACE_BUFFER_SIZE`` / ``TORCH_NCCL_DUMP_ON_TIMEOUT`` (the flight recorder) when a
process group is *created* (newer torch names the first ``TORCH_FR_BUFFER_SIZE``; ``enable_flight_recorder`` picks
the name the installed torch reads). The callback sets them in ``__init__``, which runs before ``Trainer.fit`` creates
the group; if a group already exists (the user called ``init_process_group`` first) it warns that they come too late
instead of pretending they apply.]
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_zero.diagnostics.env_audit import EnvAudit, audit_environment, audit_text
from lightning_zero.diagnostics.hang_guard import HangGuard, active_watchdog
from lightning_zero.diagnostics.network import startup_check
from lightning_zero.diagnostics.probes import (
    COLLECTIVES,
    ProbeResult,
    all_gather_json,
    probe_collectives,
    probe_table,
    rich_console,
    slow_outliers,
)
from lightning_zero.diagnostics.watchdog import HangWatchdog, enable_flight_recorder
from lightning_zero.torch_compat import backend_serving


@dataclass(frozen=True)
class DiagnosticsSettings:
    """Validated options of ``NCCLDiagnostics`` (see its docstring)."""

    audit: bool = True
    probe: bool = True
    probe_collectives: tuple = COLLECTIVES
    probe_sizes: tuple = (1 << 10, 1 << 20)
    probe_iters: int = 5
    probe_warmup: int = 1
    hang_timeout: Optional[float] = 600.0
    watchdog_poll_interval: Optional[float] = None
    watchdog_grace: float = 5.0
    dump_dir: Optional[str] = None
    flight_recorder: bool = True
    flight_recorder_buffer: int = 2000
    slow_rank_tolerance: float = 0.5

    def __post_init__(self) -> None:
        unknown = [c for c in self.probe_collectives if c not in COLLECTIVES]
        if unknown:
            raise ValueError(f"probe_collectives: unknown {unknown}; allowed: {COLLECTIVES}")
        if not self.probe_sizes or any(int(s) <= 0 for s in self.probe_sizes):
            raise ValueError(f"probe_sizes must be positive byte counts, got {self.probe_sizes}")
        if self.probe_iters < 1 or self.probe_warmup < 0:
            raise ValueError(
                f"probe_iters must be >= 1 and probe_warmup >= 0, got {self.probe_iters}, {self.probe_warmup}"
            )
        if self.hang_timeout is not None and self.hang_timeout <= 0:
            raise ValueError(f"hang_timeout must be positive seconds or None (watchdog off), got {self.hang_timeout}")
        if self.watchdog_grace < 0 or self.flight_recorder_buffer < 1 or self.slow_rank_tolerance < 0:
            raise ValueError("watchdog_grace and slow_rank_tolerance must be >= 0 and flight_recorder_buffer >= 1")


class NCCLDiagnostics(Callback):
    """Audit the environment, probe collective bandwidth and guard against hangs.

    Args:
        audit: at setup, every node audits versions, backend, sizes, NCCL/TORCH_NCCL/GLOO variables, GPU topology,
            InfiniBand devices and its identity (hostname, node rank, address and interface towards the master);
            rank 0 prints every node's audit and warns, naming the host, for settings known to hurt (P2P/SHM/IB
            disabled, NCCL_DEBUG=INFO).
        probe: at fit setup, every rank times ``probe_collectives`` x ``probe_sizes`` (bytes, nccl-tests size)
            and rank 0 prints time/algbw/busbw, flags slow ranks and logs ``diagnostics/<op>_<bytes>_busbw_gbps``.
        hang_timeout: seconds a training/validation batch may take before the watchdog dumps every rank's stack
            and ends the job naming the ranks that never arrived (None: no watchdog).
        watchdog_poll_interval / watchdog_grace: see ``HangWatchdog``.
        dump_dir: where stacks (and NCCL flight-recorder dumps) are written besides stderr.
        flight_recorder: set the flight-recorder buffer size and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` now, for the
            NCCL groups created after this constructor (``enable_flight_recorder``).
        slow_rank_tolerance: a probe rank slower than the median by this fraction is flagged.

    Results are kept in ``audits`` (every node's, on rank 0), ``audit`` (node 0's, on rank 0) and
    ``probe_results`` (every rank).
    """

    def __init__(
        self,
        audit: bool = True,
        probe: bool = True,
        probe_collectives: Sequence[str] = COLLECTIVES,
        probe_sizes: Sequence[int] = (1 << 10, 1 << 20),
        probe_iters: int = 5,
        probe_warmup: int = 1,
        hang_timeout: Optional[float] = 600.0,
        watchdog_poll_interval: Optional[float] = None,
        watchdog_grace: float = 5.0,
        dump_dir: Optional[str] = None,
        flight_recorder: bool = True,
        flight_recorder_buffer: int = 2000,
        slow_rank_tolerance: float = 0.5,
    ) -> None:
        self.settings = DiagnosticsSettings(
            audit,
            probe,
            tuple(probe_collectives),
            tuple(int(s) for s in probe_sizes),
            probe_iters,
            probe_warmup,
            hang_timeout,
            watchdog_poll_interval,
            watchdog_grace,
            dump_dir,
            flight_recorder,
            flight_recorder_buffer,
            slow_rank_tolerance,
        )
        self.audit: Optional[EnvAudit] = None
        self.audits: list[EnvAudit] = []  # one per node (local rank 0 of each), complete on rank 0
        self.probe_results: list[ProbeResult] = []
        self.watchdog: Optional[HangWatchdog] = None
        if flight_recorder:
            enable_flight_recorder(flight_recorder_buffer, dump_dir)
            if dist.is_available() and dist.is_initialized() and backend_serving("cuda") == "nccl":
                warnings.warn(
                    "NCCLDiagnostics: the NCCL process group already exists, so the flight recorder "
                    "variables set now do not apply to it; create the callback before "
                    "init_process_group (or export TORCH_NCCL_TRACE_BUFFER_SIZE yourself)"
                )

    # ----- audit and probe -----
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        backend = dist.get_backend() if distributed else None
        if self.settings.audit:
            self._audit_every_node(trainer, backend, distributed)
        if self.settings.probe and stage == "fit":
            if not distributed:
                if trainer.is_global_zero:
                    warnings.warn("NCCLDiagnostics: no torch.distributed process group, collective probe skipped")
                return
            self.probe_results = probe_collectives(
                self.settings.probe_collectives,
                self.settings.probe_sizes,
                self.settings.probe_iters,
                self.settings.probe_warmup,
                device=trainer.strategy.root_device,
            )
            if trainer.is_global_zero:
                self._report_probe(trainer)

    def _audit_every_node(self, trainer: Trainer, backend: Optional[str], distributed: bool) -> None:
        """Local rank 0 of every node audits its host (with its identity: node rank, address, interface); rank 0
        prints them all and warns naming the host, so a misconfigured node other than node 0 is seen too."""
        mine = None
        if trainer.local_rank == 0:
            audit = audit_environment(
                backend=backend, world_size=trainer.world_size, local_world_size=trainer.num_devices
            )
            audit.network = startup_check(os.environ, trainer.num_nodes, trainer.node_rank).identity
            mine = audit.to_dict()
        found = all_gather_json(mine, device=trainer.strategy.root_device) if distributed else [mine]
        self.audits = [EnvAudit(**a) for a in found if a is not None]
        if not trainer.is_global_zero:
            return
        self.audit = self.audits[0] if self.audits else None
        for audit in self.audits:
            print(audit_text(audit), flush=True)
            for warning in audit.warnings:
                node = audit.network.get("node_rank")
                warnings.warn(f"NCCLDiagnostics: host {audit.hostname} (node rank {node}): {warning}")

    def _report_probe(self, trainer: Trainer) -> None:
        rich_console().print(probe_table(self.probe_results, title=f"collective bandwidth ({dist.get_backend()})"))
        for flag in slow_outliers(self.probe_results, self.settings.slow_rank_tolerance):
            warnings.warn(f"NCCLDiagnostics: slow rank in probe: {flag}")
        metrics = {
            f"diagnostics/{r.collective}_{r.size_bytes}_busbw_gbps": r.busbw / 1e9
            for r in self.probe_results
            if r.busbw is not None
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=0)

    # ----- watchdog -----
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start the watchdog, or adopt the one already running (``ZeroStrategy`` starts one by default): one
        mechanism, one thread; this callback's ``hang_timeout``, poll interval, grace and ``dump_dir`` then apply to
        it."""
        if self.settings.hang_timeout is None:
            return
        running = active_watchdog()
        if running is not None:
            self.watchdog = running
            running.timeout = self.settings.hang_timeout
            # as a watchdog of its own would poll (derived from the new timeout when not given) and wait
            poll = self.settings.watchdog_poll_interval
            running.poll_interval = poll if poll is not None else min(1.0, running.timeout / 4)
            running.grace = self.settings.watchdog_grace
            if self.settings.dump_dir:
                running.dump_dir = Path(self.settings.dump_dir)
            return
        self._guard = HangGuard(
            self.settings.hang_timeout,
            self.settings.watchdog_poll_interval,
            self.settings.watchdog_grace,
            self.settings.dump_dir,
        )
        self._guard.start(trainer.global_rank, trainer.world_size)  # single process: a HashStore
        self.watchdog = self._guard.watchdog

    def _stop_watchdog(self) -> None:
        guard = getattr(self, "_guard", None)
        if guard is not None:  # only the watchdog this callback started; an adopted one belongs to its owner
            guard.stop()
            self._guard = None
        self.watchdog = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_watchdog()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_watchdog()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_watchdog()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.watchdog:
            self.watchdog.arm(f"epoch {trainer.current_epoch} train batch {batch_idx}: forward")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.watchdog:
            self.watchdog.beat(f"epoch {trainer.current_epoch} step {trainer.global_step}: backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.watchdog:
            self.watchdog.beat(f"epoch {trainer.current_epoch} step {trainer.global_step}: after backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.watchdog:
            self.watchdog.beat(f"epoch {trainer.current_epoch} step {trainer.global_step}: optimizer step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.watchdog:
            self.watchdog.disarm(f"epoch {trainer.current_epoch} train batch {batch_idx}: done")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.watchdog:
            self.watchdog.arm(f"epoch {trainer.current_epoch} validation batch {batch_idx}")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.watchdog:
            self.watchdog.disarm(f"epoch {trainer.current_epoch} validation batch {batch_idx}: done")
