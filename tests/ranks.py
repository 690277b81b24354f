"""Run a function on N local CPU processes joined by a gloo process group.

Used by every multi-process test: ``run_distributed(worker, world_size, *args)`` forks ``world_size`` processes,
initialises gloo on a free port, calls ``worker(rank, world_size, *args)``, and re-raises the first failure with the
child's traceback. Workers must be module-level functions. Results come back through files (``tmp_path``) or by
asserting inside the worker.

Fork is used because it avoids re-importing torch and Lightning in every child (about 3 s each on the CI
machine); set ``LZ_TEST_START_METHOD=spawn`` to check a test under spawn.
"""

from __future__ import annotations

import gc
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, env: dict, start_group: bool) -> None:
    # [Note: a forked rank must never collect what it inherited] Objects the parent left in unreachable cycles are
    # copied into the child; a gloo process group among them (an earlier in-process test's) would be destroyed by
    # the child's garbage collector, and its destructor waits on a condition variable whose waiters (the parent's
    # worker threads) do not exist in the child: the rank hangs mid-test (seen in CI, inside DCP's gather_object).
    # Freezing moves everything inherited out of the collector's reach; what the rank creates itself is collected.
    # The parent forked with the collector off, so nothing inherited was collected before this line.
    gc.freeze()
    gc.enable()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    if start_group:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def job_output(result, head: int = 6000, tail: int = 3000) -> str:
    """What a failed launched job printed, for an assertion message: the start of its stderr holds the ranks' own
    messages (a rank's traceback, ``terminate called ...``, faulthandler's thread stacks: conftest.py turns it on
    for every process the tests start), the end holds the launcher's summary."""
    err = result.stderr or ""
    shown = err if len(err) <= head + tail else err[:head] + "\n[...]\n" + err[-tail:]
    stdout = (result.stdout or "")[-2000:]
    return f"exit code {result.returncode}\n--- stdout (end) ---\n{stdout}\n--- stderr ---\n{shown}"


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, env: dict | None = None, start_group: bool = True
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise if any rank fails. With
    ``start_group=False`` the ranks get the rendezvous variables but no process group: ``fn`` starts its own."""
    method = os.environ.get("LZ_TEST_START_METHOD", "fork")
    # The collector is off from the first fork until every rank is started, so no rank can collect what it inherits
    # before freezing it (see _entry); a full collection here instead costs a second a launch with Lightning loaded.
    enabled = gc.isenabled()
    gc.disable()
    try:
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), fn, args, dict(env or {}), start_group),
            nprocs=world_size,
            join=False,
            start_method=method,
        )
    finally:
        if enabled:
            gc.enable()
    while not context.join():
        pass


def kill_rank_in_the_middle_of_the_next_save(rank_to_die: int = 1) -> None:
    """Fault injection for atomic-save tests: the next sharded save makes ``rank_to_die`` exit (code 17) right after
    writing its part of the checkpoint, before the save is finalised. Call it inside a worker."""
    from lightning_zero.checkpoint import io as ckpt_io

    class DyingWriter(ckpt_io.FileSystemWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            if dist.get_rank() == rank_to_die:
                future.wait()
                os._exit(17)
            return future

    ckpt_io.FileSystemWriter = DyingWriter


def kill_rank_at_save_step(step: str, rank_to_die: int) -> None:
    """Fault injection: ``rank_to_die`` exits (code 17) when the next sharded save reaches ``step``, one of
    ``"after_shards"`` (its shards written, the save not finalised) or the steps of
    :data:`lightning_zero.checkpoint.atomic.FAULT_STEPS`. Call it inside a worker."""
    from lightning_zero.checkpoint import atomic

    if step == "after_shards":
        kill_rank_in_the_middle_of_the_next_save(rank_to_die)
        return
    if step not in atomic.FAULT_STEPS:
        raise ValueError(f"unknown save step {step!r}")

    def hook(reached: str) -> None:
        if reached == step and dist.get_rank() == rank_to_die:
            os._exit(17)

    atomic.FAULT_HOOK = hook
