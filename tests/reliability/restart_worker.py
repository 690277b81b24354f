"""Processes of the restart tests (module level, so forked ranks can run them)."""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def form_group_as_an_attempt(rank, world_size, port, attempt, delay, result_dir, restart_count=None):
    """One rank of one torchrun "attempt" on an agent store that outlives attempts (as torchrun's does);
    ``restart_count``: this rank's agent's count when it differs from ``attempt`` (a node whose workers were only
    stopped counts no restart)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        TORCHELASTIC_RESTART_COUNT=str(attempt if restart_count is None else restart_count),
    )
    from lightning_zero.adapters.process_group import attempt_store

    time.sleep(delay)  # a rank slow to start, as on a loaded machine
    kwargs = attempt_store(timedelta(seconds=30))  # without it: env://, a client of the agent store
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30), **kwargs)
        total = torch.ones(1)
        dist.all_reduce(total)
        dist.destroy_process_group()
        outcome = f"ok {int(total.item())}"
    except Exception as err:  # noqa: BLE001 - reported to the test
        outcome = f"failed: {type(err).__name__}: {str(err)[:300]}"
    with open(os.path.join(result_dir, f"attempt{attempt}_rank{rank}.txt"), "w") as handle:
        handle.write(outcome)
