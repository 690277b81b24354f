"""``python -m tests.reliability.inherited_group_script``: the parent leaves a gloo group in an unreachable cycle
(as an earlier in-process test can), then forks ranks with ``run_distributed`` whose work runs the garbage
collector. Exits 0 when the ranks finish."""

import gc
import os

import torch
import torch.distributed as dist

from tests.ranks import free_port, run_distributed


class _Holder:
    pass


def _collect(rank, world_size):
    gc.collect()  # DCP's object collectives, or any allocation, can trigger this inside a rank


def leave_an_unreachable_gloo_group() -> None:
    """A gloo group in a reference cycle nothing else reaches (what an earlier test or fit can leave); the default
    group and ``MASTER_ADDR``/``MASTER_PORT`` are gone again afterwards."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    holder = _Holder()
    holder.group, holder.cycle = dist.new_group(backend="gloo"), holder
    dist.all_reduce(torch.ones(1), group=holder.group)
    del holder
    dist.destroy_process_group()
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        del os.environ[name]


def main() -> None:
    leave_an_unreachable_gloo_group()
    gc.disable()  # keep the cycle alive until the fork, as a busy test process does by chance
    run_distributed(_collect, 2)
    print("ranks finished")


if __name__ == "__main__":
    main()
