"""The jobs the hang tests run in a subprocess: two gloo ranks train with ``ZeroStrategy(hang_timeout=3)`` and rank 1
hangs (sleeps for an hour) in one place: a training step, a validation step, inside a checkpoint save (DCP writes)
inside a checkpoint load (DCP reads) or in teardown. The subprocess must end on its own, naming rank 1, with stacks."""

import sys
import time
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Trainer

from lightning_zero import ZeroStrategy
from tests.lightning_models import RegressionModule
from tests.ranks import run_distributed

HANG_TIMEOUT = 3.0
_root = "."


def _hang_here() -> None:
    Path(_root, "hang_started").write_text(repr(time.time()))  # the test measures detection from here
    time.sleep(3600)  # the injected hang


class HangingModule(RegressionModule):
    def __init__(self, case: str = ""):
        super().__init__()
        self.case = case

    def training_step(self, batch, batch_idx):
        if self.case == "train" and self.global_rank == 1 and batch_idx == 1:
            _hang_here()
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.case == "validation" and self.global_rank == 1 and batch_idx == 1:
            _hang_here()
        return super().validation_step(batch, batch_idx)


def _hang_in_dcp_io_on_rank_1(case: str) -> None:
    """Make rank 1's next DCP write (save) or read (load) hang, inside ``ZeroStrategy.save/load_checkpoint``."""
    from lightning_zero.checkpoint import io as ckpt_io

    if case == "save":

        class HangingWriter(ckpt_io.FileSystemWriter):
            def write_data(self, plan, planner):
                if dist.get_rank() == 1:
                    _hang_here()
                return super().write_data(plan, planner)

        ckpt_io.FileSystemWriter = HangingWriter
    else:

        class HangingReader(ckpt_io.SafeFileSystemReader):
            def read_data(self, plan, planner):
                if dist.get_rank() == 1:
                    _hang_here()
                return super().read_data(plan, planner)

        ckpt_io.SafeFileSystemReader = HangingReader


def _trainer(root, stage=2, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    defaults.update(kwargs)
    return Trainer(strategy=ZeroStrategy(stage=stage, hang_timeout=HANG_TIMEOUT), **defaults)


def _worker(rank, world_size, case, root):
    global _root
    _root = root
    if case == "train":
        _trainer(root, max_steps=3).fit(HangingModule(case))
    elif case == "validation":
        _trainer(root, max_steps=2, limit_val_batches=3, val_check_interval=1).fit(HangingModule(case))
    elif case == "save":
        trainer = _trainer(root, max_steps=1)
        trainer.fit(HangingModule(case))
        _hang_in_dcp_io_on_rank_1(case)
        trainer.save_checkpoint(f"{root}/hang.ckpt")
    elif case == "load":
        trainer = _trainer(root, max_steps=1)
        trainer.fit(HangingModule(case))
        trainer.save_checkpoint(f"{root}/resume.ckpt")
        _hang_in_dcp_io_on_rank_1(case)
        _trainer(root, max_steps=2).fit(HangingModule(case), ckpt_path=f"{root}/resume.ckpt")
    elif case == "teardown":  # rank 1 stops while teardown waits for pending saves (a barrier on rank 0)
        from lightning_zero.adapters import runtime_steps as zero_module  # the adapters' teardown waits there

        wait = zero_module.wait_for_pending_saves

        def hanging_wait(barrier=True):
            if dist.get_rank() == 1:
                _hang_here()
            wait(barrier=barrier)

        zero_module.wait_for_pending_saves = hanging_wait
        _trainer(root, max_steps=1).fit(HangingModule(case))
    else:
        raise ValueError(case)


if __name__ == "__main__":
    run_distributed(_worker, 2, sys.argv[1], sys.argv[2])
