"""Destroy the process group this package created when the interpreter exits cleanly.

[Note: why a finished gloo job died with SIGABRT]
With torch 2.13 a two-rank gloo job that ends without ``destroy_process_group()`` can die at exit (SIGABRT, exit code
-6, ``terminate called without an active exception``): gloo's C++ worker threads still hold finished work objects
whose tensors reference Python objects, and releasing them while the interpreter is being torn down aborts the process
(how often: ``docs/reliability.md``, "Starting and ending rank processes"). Under ``torchrun --max-restarts`` a
*finished* job then counts as failed and is restarted. Lightning registers this clean-up only for ``nccl``; torch's own
fix (pytorch/pytorch#179291) was withdrawn. So both strategies register it, for every backend. (A group the user created
before the strategy is destroyed too: at a clean exit that is what torch asks for anyway.)

[Note: gloo workers still holding the last work at teardown]
``destroy_process_group()`` does not stop gloo's worker threads (``pt_gloo_runloop``): they live until the last
reference to their group dies, which for a model that keeps its groups (FSDP2, DeviceMesh) is during interpreter
teardown. A worker drops its reference to the collective it just ran *after* the caller's ``wait()`` returned; if the
worker is descheduled at that moment, the caller can run on into teardown first, free the Python objects of the
collective's tensors (their ``PyObject`` then stays owned by the tensor), and the worker's late drop must take the GIL
to release them: during teardown Python ends such a thread with ``pthread_exit``, whose unwinding through C++ aborts the
whole process (``terminate called without an active exception``; core dump: ``~AsyncAllreduceWork`` ->
``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``). So, after destroying the groups, the
handler sleeps in short steps (releasing the GIL, letting any worker finish its drop) until no gloo worker thread has
been running for three consecutive looks, at most :data:`QUIESCE_SECONDS`. A worker blocked rather than runnable is not
seen by this; it narrows the window, it cannot close it (torch's fix would be to drop the work before completing it).

On an exit by an uncaught exception the group is left alone: a peer may be dead with a collective in flight, and
destroying the group could then wait for gloo's timeout instead of letting the failed process exit (its exit code
is non-zero either way).
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import torch.distributed as dist

_registered = False


def _exiting_on_an_exception() -> bool:
    # The interpreter stores an uncaught exception in ``sys.last_value`` (3.12+: also ``sys.last_exc``) before
    # running atexit handlers; a ``SystemExit`` (``sys.exit(code)``) is not stored there.
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


#: The longest the exit handler waits for gloo's worker threads to go idle (see the note).
QUIESCE_SECONDS = 2.0


def _running_gloo_workers() -> int:
    """How many of this process's gloo worker threads are runnable (``R``) right now (Linux ``/proc``)."""
    running = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue  # the thread ended
        name, _, rest = stat.partition("(")[2].rpartition(")")
        if "gloo" in name and rest.split()[0] == "R":
            running += 1
    return running


def quiesce_gloo_workers(timeout: float = QUIESCE_SECONDS) -> None:
    """Sleep in 10 ms steps until no gloo worker thread was runnable in three consecutive looks (or ``timeout``)."""
    deadline, quiet = time.monotonic() + timeout, 0
    while quiet < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
        quiet = quiet + 1 if _running_gloo_workers() == 0 else 0


def _destroy_at_exit() -> None:
    if _exiting_on_an_exception():
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        quiesce_gloo_workers()


def destroy_process_group_at_exit() -> None:
    """Register (once per process) the destruction of the default process group at a clean interpreter exit.

    Call right after the strategy initialised the group. Handlers registered later (a pending asynchronous
    checkpoint save's wait) run first, as ``atexit`` runs them in reverse order.
    """
    global _registered
    if not _registered:
        atexit.register(_destroy_at_exit)
        _registered = True
