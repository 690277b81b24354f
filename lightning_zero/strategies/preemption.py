"""Preemption: SIGTERM/SIGUSR1 become a checkpoint taken by every rank together at the next step boundary.

[Note: nothing collective in a signal handler]
A signal interrupts a rank at an arbitrary bytecode, possibly in the middle of an FSDP all-gather or a DCP save.
Lightning's own SIGTERM handler broadcasts a tensor from inside the handler, and its SLURM ``SIGUSR1`` handler
saves a checkpoint there: a collective the other ranks are not running at that moment, which gloo/NCCL pair with
whatever collective those ranks issue next (a hang, or data exchanged with the wrong operation). Here the handler
only records the signal number. At the start of every training batch each rank starts an all-reduce (max) of what it
recorded, and reads the result at the end of that batch, so all ranks see the same answer even when only one was
signalled (see ``[Note: agreeing without a per-step sync]``); when it is set, every rank saves the same checkpoint
through the strategy's normal atomic save, and then exits with ``128 + signal`` (a failure, so torchrun
restarts the job; SLURM requeues it through Lightning's requeue below). The restarted job resumes from that
checkpoint: it is the newest complete one in the ``ModelCheckpoint`` directory (:mod:`.auto_resume`).

[Note: composing with Lightning]
Lightning registers its handlers at the start of each fit, after the strategy's setup;
:func:`install_preemption_checkpoint` wraps that one call and replaces the SIGTERM and requeue-signal handlers with the
flag above (a handler the user had before the fit still runs; Lightning restores all of them at teardown). With
``SLURMEnvironment(auto_requeue=True)`` and its requeue signal, Lightning's requeue handler is called at the step
boundary instead (every rank together): it saves the ``hpc_ckpt`` Lightning restores on a requeued job and runs
``scontrol requeue``. Lightning's per-step broadcast of its own SIGTERM flag is replaced for the fit (next note).

[Note: Lightning's per-step SIGTERM broadcast]
Lightning's training loop broadcasts its SIGTERM flag from rank 0 before every batch and reads it with ``.item()``
(``_broadcast_sigterm_tensor``): a blocking collective on the training communicator, on the training device, every
step. On NCCL ``.item()`` waits for all queued GPU work, so the host stops running ahead of the GPU once per step;
on any backend it makes every rank wait for the slowest at the start of the batch, a meeting the minimal loop does
not have (``docs/performance.md``). Under this module Lightning's SIGTERM handler is replaced, so its flag
is never set and the broadcast always carries 0. For the fit the loop's method is replaced on the instance by one
that makes no collective (Lightning's local checks of the flag stay); ``on_train_end`` and ``on_exception`` put
Lightning's method back.

[Note: agreeing without a per-step sync]
The agreement runs on every training batch, so it must cost nothing a step notices. A blocking ``all_reduce`` plus
``.item()`` on the training device stalls the host on every step (on NCCL, ``.item()`` waits for all queued GPU work).
Instead the flag is a CPU tensor all-reduced over gloo (``control_group`` of
:mod:`lightning_zero.checkpoint.save_guards`: the default group's gloo backend, never NCCL) with ``async_op=True``,
started in ``on_train_batch_start`` and waited in ``on_train_batch_end``: gloo runs it on its own thread while the step
computes, so the wait finds it done. Every rank starts and waits the same operations in the same batches, so every rank
reads the same value and saves at the same step. A signal that arrives after a batch started is in the reduce started by
the next batch, so it is acted on one step later than a blocking check would: at most one step. (A c10d store key was
the other candidate: reading it is a round trip to the store on every step, and a rank can read it just before another
rank sets it, so ranks would not agree on the step.)

[Note: a notice after the last step]
A signal that arrives during the last batch (or after it, before the fit ends) is in no batch's agreement. Left
there it would be dropped: the fit ends normally, Lightning restores the handlers, and the process goes on after
``fit`` as if never asked to stop, until the scheduler's SIGKILL. ``on_train_end`` (every rank, after the last batch and
``ModelCheckpoint``'s saves) therefore agrees once more, blocking, and a signal found there is handled as at a step
boundary: the preemption checkpoint at the final step, then ``128 + signal``. The restarted job resumes at the
final step, its fit ends at once, and the script goes on after ``fit``.

A checkpoint taken in the middle of an epoch resumes there in the loop counters, but a plain ``DataLoader`` starts
the epoch's sampler order again from its first batch, so the resumed run equals an uninterrupted run *that resumed
at the same step*, not one never interrupted (``docs/reliability.md``).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_zero.checkpoint.save_guards import control_group
from lightning_zero.strategies.lifecycle import wrap_next_call

log = logging.getLogger(__name__)

PREEMPTED_CHECKPOINT = "preempted.ckpt"
_LIGHTNING_BROADCAST = "_broadcast_sigterm_tensor"  # Lightning's training loop method, see the note above


def _signals(trainer) -> list[int]:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if os.name == "nt":
        return [signal.SIGTERM]
    environment = trainer._accelerator_connector.cluster_environment
    requeue = environment.requeue_signal if isinstance(environment, SLURMEnvironment) else None
    return sorted({signal.SIGTERM, signal.SIGUSR1, *([requeue] if requeue is not None else [])})


class PreemptionCheckpoint(Callback):
    """Added by :func:`install_preemption_checkpoint` for one fit: records preemption signals, saves and exits at a
    step boundary."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.received: int = 0
        self._previous: dict[int, Any] = {}
        self._group: Optional[dist.ProcessGroup] = None
        self._flag: Optional[torch.Tensor] = None
        self._pending: Any = None  # the started, not yet waited all-reduce of ``_flag``

    def handle(self, signum: int, frame: Any) -> None:
        """The signal handler: record only (see the module note); a handler the user installed before still runs."""
        self.received = max(self.received, int(signum))
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    def register(self, original_handlers: dict) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # Lightning registers nothing off the main thread either
        for signum in _signals(self.trainer):
            self._previous[signum] = original_handlers.get(signum)
            signal.signal(signum, self.handle)

    def on_train_start(self, trainer, pl_module) -> None:
        if dist.is_available() and dist.is_initialized():
            self._group = control_group(None)  # collective on first use: every rank is here together
        _replace_lightning_broadcast(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """Start this batch's agreement (see ``[Note: agreeing without a per-step sync]``)."""
        if self._group is None or self._pending is not None:
            return  # not distributed, or the last batch's end was skipped (the module returned -1): that one stands
        self._flag = torch.tensor([self.received], dtype=torch.int64)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def agreed_signal(self) -> int:
        """Every rank's recorded signal as of this batch's start, all-reduced (max): the same answer everywhere."""
        if self._group is None:
            return self.received
        if self._pending is None:
            return 0
        self._pending.wait()
        self._pending = None
        return int(self._flag[0])

    def on_exception(self, trainer, pl_module, exception) -> None:
        _restore_lightning_broadcast(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        """A notice that came after the last batch's agreement started is acted on here, once, as at a step
        boundary (see ``[Note: a notice after the last step]``)."""
        _restore_lightning_broadcast(trainer)
        if self._pending is not None:  # a batch whose end hook did not run: finish its reduce before the fit ends
            self._pending.wait()
            self._pending = None
        signum = self.received
        if self._group is not None:  # blocking, once per fit: every rank is here together
            flag = torch.tensor([self.received], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            signum = int(flag[0])
        if signum:
            self._preempted(trainer, signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        signum = self.agreed_signal()
        if signum:
            self._preempted(trainer, signum)

    def _preempted(self, trainer, signum: int) -> None:
        """Every rank together: save the preemption checkpoint (or let SLURM requeue), then exit ``128 + signum``."""
        if _slurm_requeues(trainer, signum):
            trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)  # saves hpc_ckpt, then requeues
        else:
            path = preemption_checkpoint_path(trainer)
            if path is None:
                log.warning(
                    "lightning-zero: preempted (signal %d) at step %d but the Trainer has no ModelCheckpoint "
                    "with a directory: no checkpoint is saved, a restart will start from step 0",
                    signum,
                    trainer.global_step,
                )
            else:
                trainer.save_checkpoint(path)
                if trainer.is_global_zero:
                    log.warning(
                        "lightning-zero: preempted (signal %d): saved %s at step %d; exiting so the job is restarted",
                        signum,
                        path,
                        trainer.global_step,
                    )
        raise SystemExit(128 + signum)


def _epoch_loop(trainer):
    return getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)


def _agreement_stands_in() -> None:
    """Lightning's per-step flag broadcast, replaced: :class:`PreemptionCheckpoint`'s agreement carries the signals."""


def _replace_lightning_broadcast(trainer) -> None:
    """Stand in for the training loop's per-step broadcast of Lightning's SIGTERM flag for this fit (see
    ``[Note: Lightning's per-step SIGTERM broadcast]``); a Lightning without that method is left as it is."""
    loop = _epoch_loop(trainer)
    if loop is not None and callable(getattr(type(loop), _LIGHTNING_BROADCAST, None)):
        setattr(loop, _LIGHTNING_BROADCAST, _agreement_stands_in)


def _restore_lightning_broadcast(trainer) -> None:
    loop = _epoch_loop(trainer)
    if loop is not None and _LIGHTNING_BROADCAST in vars(loop):
        delattr(loop, _LIGHTNING_BROADCAST)


def _slurm_requeues(trainer, signum: int) -> bool:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = trainer._accelerator_connector.cluster_environment
    return (
        isinstance(environment, SLURMEnvironment) and environment.auto_requeue and signum == environment.requeue_signal
    )


def preemption_checkpoint_path(trainer) -> Optional[str]:
    """``<dirpath of the first ModelCheckpoint>/preempted.ckpt``: where :mod:`.auto_resume` looks on a restart."""
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return os.path.join(str(callback.dirpath), PREEMPTED_CHECKPOINT)
    return None


def install_preemption_checkpoint(trainer) -> None:
    """For a fit: record preemption signals and checkpoint at the next step boundary (see the module notes)."""
    from lightning.pytorch.trainer.states import TrainerFn

    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return
    trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, PreemptionCheckpoint)]
    callback = PreemptionCheckpoint(trainer)
    trainer.callbacks.append(callback)
    connector = trainer._signal_connector

    def after_lightning_registers(register):
        def register_signal_handlers() -> None:
            register()
            callback.register(connector._original_handlers)

        return register_signal_handlers

    wrap_next_call(connector, "register_signal_handlers", after_lightning_registers)
