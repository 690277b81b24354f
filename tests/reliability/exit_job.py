"""The job the exit trials launch under torchrun:

    torchrun --standalone --nproc-per-node 2 -m tests.reliability.exit_job KIND STAGE ROOT

Two gloo CPU ranks train a tiny model for ``STEPS`` steps with the Trainer or Fabric ``ZeroStrategy`` at ``STAGE``,
write a final sharded checkpoint to ``ROOT/final.ckpt``, print :data:`COMPLETED` (with the rank) and return: all that
is left is the interpreter's teardown, so a non-zero exit after that line is a teardown failure.

``LZ_EXIT_JOB_ABORT_KIND=KIND`` makes jobs of that kind abort (SIGABRT) at interpreter exit after the line, as the
teardown abort did: the check that the trials count such a job (``tests/reliability/test_exit_trials.py``).
``KIND`` ``bare`` is the control without this package (a gloo group, one all-reduce, no destroy).
``LZ_EXIT_JOB_KEEP_GROUP=1`` unregisters the strategies' exit handler (``distributed/process_group_exit.py``): the
control run, a job as it ended before that handler existed.
"""

import atexit
import os
import sys
from pathlib import Path

import torch
from torch import nn

from lightning_zero.distributed import process_group_exit
from tests.lightning_models import Net, RegressionModule, dataset

STEPS = 2
#: What each rank prints (``rank N: ...``) once training and the final save finished, before interpreter teardown.
COMPLETED = "training and final save completed"


def _trainer(stage: int, root: Path) -> int:
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy

    trainer = Trainer(
        strategy=ZeroStrategy(stage=stage),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=root,
    )
    trainer.fit(RegressionModule())
    trainer.save_checkpoint(root / "final.ckpt")
    return trainer.global_rank


def _fabric(stage: int, root: Path) -> int:
    from lightning.fabric import Fabric

    from lightning_zero.fabric import ZeroStrategy

    fabric = Fabric(strategy=ZeroStrategy(stage=stage), accelerator="cpu", devices=2)
    fabric.launch()
    with fabric.init_module():
        module = Net()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    x, y = dataset(n=4 * STEPS).tensors
    for step in range(STEPS):
        batch = slice(4 * step + 2 * fabric.global_rank, 4 * step + 2 * fabric.global_rank + 2)
        fabric.backward(nn.functional.mse_loss(model(x[batch]), y[batch]))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(root / "final.ckpt", {"model": model, "optimizer": optimizer, "step": STEPS})
    return fabric.global_rank


def _bare(stage: int, root: Path) -> int:
    """The control without this package: a gloo group, one all-reduce, and no ``destroy_process_group()``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(4))
    return dist.get_rank()


def main(kind: str, stage: str, root: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = {"trainer": _trainer, "fabric": _fabric, "bare": _bare}[kind](int(stage), Path(root))
    print(f"rank {rank}: {COMPLETED}", flush=True)
    if os.environ.get("LZ_EXIT_JOB_KEEP_GROUP") == "1":
        atexit.unregister(process_group_exit._destroy_at_exit)
    if os.environ.get("LZ_EXIT_JOB_ABORT_KIND") == kind:
        atexit.register(os.abort)


if __name__ == "__main__":
    main(*sys.argv[1:])
