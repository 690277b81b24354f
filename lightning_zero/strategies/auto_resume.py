"""Automatic resume of a restarted ``trainer.fit`` (``torchrun --max-restarts``, SLURM requeue).

[Note: automatic resume]
A restart runs the same command again, and the same ``trainer.fit(model)`` without ``ckpt_path`` would start again
from step 0 and overwrite the run's checkpoints. When the job is a restart (``TORCHELASTIC_RESTART_COUNT`` or
``SLURM_RESTART_COUNT`` > 0), the fit has no ``ckpt_path`` and ``ZeroStrategy(auto_resume=True)`` (the default),
the newest *complete* checkpoint (a sharded one with ``zero.json``, or a full file of ours: interrupted saves never
qualify) in the ``ModelCheckpoint`` directories is resumed, and the log says which. Lightning has no public hook
that chooses the checkpoint after the process group exists (rank 0 chooses, every rank loads the same one), so
:func:`install_auto_resume` wraps the Trainer's ``_checkpoint_connector.resume_start`` for that one call and
:func:`newest_complete_checkpoint` finds the checkpoint. A preempted job (SIGTERM/SIGUSR1) saves ``preempted.ckpt``
there first, at a step boundary (:mod:`lightning_zero.strategies.preemption`).

[Note: "last" resumes the newest complete checkpoint]
Lightning resolves ``ckpt_path="last"`` to the newest ``last*.ckpt`` of the ``ModelCheckpoint`` directories (and
``OnExceptionCheckpoint``'s file), by the files' times (``_CheckpointConnector._parse_ckpt_path``); when there is
none it warns and starts from step 0. The newest state of a run is not always there: a job preempted between two
saves leaves it in ``preempted.ckpt``, which ``"last"`` never names (the resume would silently redo the steps since
the last save and, with preemptions more frequent than saves, never get further); a kill between a save and
``save_last="link"``'s re-link leaves ``last.ckpt`` pointing at the checkpoint before; and a run killed while
Lightning's own re-link ran (``[Note: re-pointing last.ckpt]`` in :mod:`lightning_zero.strategies.last_link`) has
no ``last.ckpt`` at all. Lightning resolves the name before the strategy exists on the rank, so the launchers keep
the ``ckpt_path`` asked for (``strategy.ckpt_path_asked``) and, on such a fit, ``resume_start`` takes the newest
complete checkpoint of those directories (:func:`complete_checkpoints`: a sharded directory with its ``zero.json``,
or a full file of ours) instead when it was finished after Lightning's choice (or Lightning found none), and the log
says so. A checkpoint older than Lightning's choice is left alone, and so is every choice with
``auto_resume=False``.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from lightning_zero.checkpoint.directory import INFO_FILE, is_sharded_checkpoint
from lightning_zero.checkpoint.full_save import is_full_file
from lightning_zero.diagnostics.peers import agreed_attempt
from lightning_zero.strategies import preemption
from lightning_zero.strategies.lifecycle import wrap_next_call

log = logging.getLogger(__name__)


def restart_count() -> int:
    """How many times this job was restarted: the attempt the ranks agreed on under torchrun (the agents' own
    ``TORCHELASTIC_RESTART_COUNT`` can be 0 on a node whose workers were only stopped, see ``diagnostics.peers``),
    else torchrun's count or SLURM's requeue count."""
    agreed = agreed_attempt()
    if agreed:
        return agreed
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 0


def complete_checkpoints(directories: list[str]) -> list[tuple[float, str]]:
    """``(finished at, path)`` of every complete checkpoint in ``directories``: a sharded directory by its
    ``zero.json`` (written last; a link is followed to its target), a full file of ours by its own time (renamed
    into place once written). A checkpoint interrupted mid-swap (only ``.<name>.old`` left) counts under its name."""
    found = []
    for directory in directories:
        if not os.path.isdir(directory):
            continue
        for entry in os.listdir(directory):
            path = os.path.join(directory, entry)
            if entry.startswith(".") and entry.endswith(".old"):
                name = os.path.join(directory, entry[1 : -len(".old")])
                if not os.path.exists(name) and is_sharded_checkpoint(path):
                    found.append((os.path.getmtime(os.path.join(path, INFO_FILE)), name))
            elif entry.startswith("."):
                continue
            elif is_sharded_checkpoint(path):
                found.append((os.path.getmtime(os.path.join(path, INFO_FILE)), path))
            elif entry.endswith(".ckpt") and is_full_file(path):
                found.append((os.path.getmtime(path), path))
    return found


def newest_complete_checkpoint(directories: list[str]) -> Optional[str]:
    """The most recently finished complete checkpoint in ``directories`` (:func:`complete_checkpoints`), or
    ``None``."""
    found = complete_checkpoints(directories)
    return max(found)[1] if found else None


def _checkpoint_directories(trainer) -> list[str]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return [str(cb.dirpath) for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]


def _choose_resume_path(trainer, broadcast) -> Optional[str]:
    count = restart_count()
    why = f"this job is restart {count}" if count else "auto_resume='always'"
    path = newest_complete_checkpoint(_checkpoint_directories(trainer)) if trainer.is_global_zero else None
    path = broadcast(path)
    if trainer.is_global_zero:
        if path is not None:
            log.warning(
                f"lightning-zero auto_resume: {why}; resuming from the newest complete "
                f"checkpoint {path} (pass ckpt_path to choose, or ZeroStrategy(auto_resume=False))"
            )
        else:
            log.warning(
                f"lightning-zero auto_resume: {why} but no complete checkpoint is in "
                f"{_checkpoint_directories(trainer) or 'any ModelCheckpoint dirpath'}; training starts from "
                f"step 0"
            )
    return path


def _finished_at(path: str) -> float:
    info = os.path.join(path, INFO_FILE)  # written last (a link is followed to its target)
    return os.path.getmtime(info if os.path.isfile(info) else path)


def newer_complete_checkpoint(trainer, chosen: Optional[str]) -> Optional[str]:
    """The newest complete checkpoint in the ``ModelCheckpoint`` directories if it was finished after ``chosen``
    (Lightning's ``ckpt_path="last"`` choice, ``None`` if it found none), else ``None``. See ``[Note: "last" resumes
    the newest complete checkpoint]``."""
    found = complete_checkpoints(_checkpoint_directories(trainer))
    if not found:
        return None
    finished, newest = max(found)
    if chosen is not None and os.path.exists(chosen) and _finished_at(chosen) >= finished:
        return None
    return newest


def _resume_last(trainer, chosen: Optional[str], broadcast) -> Optional[str]:
    newer = newer_complete_checkpoint(trainer, chosen) if trainer.is_global_zero else None
    newer = broadcast(newer)
    if newer is None:
        return chosen
    if trainer.is_global_zero:
        kind = "preemption checkpoint" if os.path.basename(newer) == preemption.PREEMPTED_CHECKPOINT else "checkpoint"
        if chosen:
            log.warning(
                f'lightning-zero: ckpt_path="last" resumes from {newer}, the newest complete {kind}, '
                f"finished after Lightning's choice {chosen} (pass a path to choose)"
            )
        else:
            log.warning(
                f'lightning-zero: ckpt_path="last" found no last*.ckpt (a kill while ModelCheckpoint('
                'save_last="link") re-pointed it leaves none, or save_last is off); resuming from the newest '
                f"complete {kind} {newer} instead of step 0 (pass a path to choose)"
            )
    return newer


def install_auto_resume(trainer, auto_resume, broadcast, ckpt_path_asked: Optional[str] = None) -> None:
    """On a restarted fit without ``ckpt_path`` (or every fit with ``auto_resume="always"``), make the Trainer resume
    from the newest complete checkpoint (rank 0 chooses; ``broadcast(obj)`` shares its choice); on a fit asked for
    ``ckpt_path="last"``, from the newest complete checkpoint if it is newer than Lightning's choice; on every fit,
    turn preemption signals into a checkpoint at the next step boundary (:mod:`.preemption`)."""
    from lightning.pytorch.trainer.states import TrainerFn

    preemption.install_preemption_checkpoint(trainer)
    asked = restart_count() > 0 or auto_resume == "always"
    last = ckpt_path_asked == "last"
    if trainer is None or not (asked or last) or trainer.state.fn != TrainerFn.FITTING:
        return

    def choosing_the_checkpoint(original):
        def resume_start(checkpoint_path=None, weights_only=None):
            if last:
                checkpoint_path = _resume_last(trainer, checkpoint_path, broadcast)
            elif checkpoint_path is None and asked:
                checkpoint_path = _choose_resume_path(trainer, broadcast)
            return original(checkpoint_path, weights_only=weights_only)

        return resume_start

    wrap_next_call(trainer._checkpoint_connector, "resume_start", choosing_the_checkpoint)
