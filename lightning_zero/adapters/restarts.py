"""Restarted jobs (``torchrun --max-restarts``, SLURM requeue): a process group that re-forms, and automatic resume.

[Note: why a restarted torchrun attempt failed to form its gloo group]
Under ``torchrun`` the workers' ``env://`` rendezvous uses the *agent's* TCPStore (``TORCHELASTIC_USE_AGENT_STORE``),
and a restarted attempt gets the same ``MASTER_ADDR:MASTER_PORT`` and the same store server, with the previous
attempt's keys still in it (torch's rendezvous assumes a new store per attempt; the c10d rendezvous backend keeps
one). ``init_process_group`` writes its keys under the same names every attempt, so a rank of attempt 2 that starts
before its peers reads the *old* attempt's gloo addresses and connects to ports nobody listens on any more:
"Connection refused" after gloo's few retries, or a hang when a stale barrier count looks complete. A rank that is
slow to start (imports on a loaded machine) makes it likely. ``process_group_store`` gives each attempt its own
namespace, ``lightning_zero/attempt_<TORCHELASTIC_RESTART_COUNT>/``, on a client of the same server. Plain DDP
(``init_process_group("gloo")`` with ``env://``) has the same failure; it is torch's to fix there.

[Note: automatic resume]
A restart runs the same command again, and the same ``trainer.fit(model)`` without ``ckpt_path`` would start again
from step 0 and overwrite the run's checkpoints. When the job is a restart (``TORCHELASTIC_RESTART_COUNT`` or
``SLURM_RESTART_COUNT`` > 0), the fit has no ``ckpt_path`` and ``ZeroStrategy(auto_resume=True)`` (the default),
the newest *complete* sharded checkpoint (one with ``zero.json``: interrupted saves never qualify) in the
``ModelCheckpoint`` directories is resumed, and the log says which. Lightning has no public hook that chooses the
checkpoint after the process group exists (rank 0 chooses, every rank loads the same one), so the Trainer adapter
(:mod:`lightning_zero.strategies.auto_resume`) wraps the Trainer's ``_checkpoint_connector.resume_start`` for that
one call; this module keeps the framework-free part (:func:`newest_complete_checkpoint`). A preempted job
(SIGTERM/SIGUSR1) saves ``preempted.ckpt`` there first, at a step boundary (:mod:`lightning_zero.strategies.preemption`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional, Union

import torch.distributed as dist

from lightning_zero.checkpoint.directory import INFO_FILE, is_sharded_checkpoint


def check_auto_resume(value) -> Union[bool, str]:
    """``auto_resume``: ``True`` (on a restart), ``"always"`` (every fit without ``ckpt_path``) or ``False``."""
    if isinstance(value, bool) or value == "always":
        return value
    raise TypeError(f"auto_resume must be True (resume on a restarted job), 'always' (resume every fit that has no "
                    f"ckpt_path) or False, got {value!r}")


def restart_count() -> int:
    """How many times this job was restarted: torchrun's ``TORCHELASTIC_RESTART_COUNT``, SLURM's requeue count."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 0


def process_group_store(timeout: Optional[timedelta]) -> dict[str, Any]:
    """``init_process_group`` keyword arguments: under torchrun's agent store, a store namespace of this attempt."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout or timedelta(minutes=30))
    return {"store": dist.PrefixStore(f"lightning_zero/attempt_{attempt}/", client)}


def newest_complete_checkpoint(directories: list[str]) -> Optional[str]:
    """The most recently finished complete sharded checkpoint in ``directories`` (by its ``zero.json``, written
    last), or ``None``. A checkpoint interrupted mid-swap (only ``.<name>.old`` left) counts under its name."""
    found = []
    for directory in directories:
        if not os.path.isdir(directory):
            continue
        for entry in os.listdir(directory):
            path = os.path.join(directory, entry)
            if entry.startswith(".") and entry.endswith(".old"):
                name = os.path.join(directory, entry[1:-len(".old")])
                if not os.path.exists(name) and is_sharded_checkpoint(path):
                    found.append((os.path.getmtime(os.path.join(path, INFO_FILE)), name))
            elif not entry.startswith(".") and is_sharded_checkpoint(path):
                found.append((os.path.getmtime(os.path.join(path, INFO_FILE)), path))
    return max(found)[1] if found else None
