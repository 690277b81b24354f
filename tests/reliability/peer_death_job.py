"""The training script of the peer-death trials, one per node under torchrun with a c10d rendezvous::

    torchrun --nnodes 2 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint A:P \\
        -m tests.reliability.peer_death_job <root>

ZeRO-2 on CPU ranks (gloo), a checkpoint at every epoch end (2 steps; epoch ends, because a plain ``DataLoader`` does
not resume mid-epoch exactly). In the first attempt only, the ranks of node ``PEER_DEATH_NODE`` SIGKILL themselves at
``PEER_DEATH_POINT`` (``forward``, ``backward``, ``collective``: the first gradient reduce-scatter (an all-to-all on
gloo) or all-reduce inside backward,
``optimizer``: inside ``optimizer.step``, ``save``: inside the checkpoint's shard write) of global step
``PEER_DEATH_STEP`` (for ``save``: the save after that step), after writing ``killed.json`` (the instant, for the
trial's clock). Every rank of the first attempt writes its pid to ``pids/``; a rank whose fit fails writes the error
to ``errors/``. Rank 0 of the attempt that finishes writes ``final.pt`` (weights, step, attempt, resumed path).
``PEER_DEATH_POINT=none`` is the uninterrupted reference. ``PEER_DEATH_MODE=partition``: instead of dying, the rank
asks the trial to cut its node off the network (``cut_request_rank<R>.json``), waits until the trial says it is
(``cut``), and goes on into the collective that can no longer complete."""

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.diagnostics.peers import agreed_attempt
from tests.lightning_models import RegressionModule, full_state

EPOCHS = 4
STEPS_PER_EPOCH = 2
STEPS = EPOCHS * STEPS_PER_EPOCH
HANG_TIMEOUT = 10.0
POINTS = ("forward", "backward", "collective", "optimizer", "save")


def _attempt() -> int:
    """The attempt the ranks agreed on once the process group exists (node 0's agent may count no restart when only
    node 1's ranks died: see ``lightning_zero.diagnostics.peers``), torchrun's count before."""
    agreed = agreed_attempt()
    return agreed if agreed is not None else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class KillNode(Callback):
    """SIGKILLs this rank at the chosen point of the chosen step when it is on the chosen node, first attempt only."""

    def __init__(self, root: Path):
        self.root, self.point = root, os.environ.get("PEER_DEATH_POINT", "none")
        self.step, self.node = int(os.environ.get("PEER_DEATH_STEP", "-1")), int(os.environ.get("PEER_DEATH_NODE", "1"))
        self.pending = None  # the point of this step, on the rank that dies
        self.armed_for = None  # what the patched functions (collectives, the shard write) die in
        self.partition, self.fired = os.environ.get("PEER_DEATH_MODE", "kill") == "partition", False

    def _mine(self, trainer) -> bool:
        return self.point != "none" and _attempt() == 0 and trainer.node_rank == self.node

    def die(self, trainer, where: str) -> None:
        if self.fired:  # (a partitioned rank goes on; its later collectives must not fire again)
            return
        self.fired = True
        record = {
            "time": time.time(),
            "point": where,
            "step": trainer.global_step,
            "rank": trainer.global_rank,
            "node": trainer.node_rank,
        }
        if self.partition:
            (self.root / f"cut_request_rank{trainer.global_rank}.json").write_text(json.dumps(record))
            deadline = time.time() + 60
            while not (self.root / "cut").exists() and time.time() < deadline:
                time.sleep(0.05)
            record["time"] = float((self.root / "cut").read_text())  # the instant the link went down
            (self.root / f"killed_rank{trainer.global_rank}.json").write_text(json.dumps(record))
            return
        (self.root / f"killed_rank{trainer.global_rank}.json").write_text(json.dumps(record))
        os.kill(os.getpid(), signal.SIGKILL)

    def setup(self, trainer, pl_module, stage):
        self.trainer = trainer
        if _attempt() == 0:
            (self.root / "pids").mkdir(exist_ok=True)
            (self.root / "pids" / f"rank{trainer.global_rank}").write_text(f"{os.getpid()} {trainer.node_rank}")
        if self._mine(trainer):
            _patch_collectives(self)
            _patch_save(self)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.pending = self.point if self._mine(trainer) and trainer.global_step == self.step else None

    def on_before_backward(self, trainer, pl_module, loss):
        if self.pending == "forward":
            self.die(trainer, "forward")  # the forward ran; the others wait in its collectives or the next ones
        elif self.pending == "backward":  # inside autograd, at the first gradient it computes
            loss.register_hook(lambda grad: self.die(trainer, "backward"))
        elif self.pending == "collective":
            self.armed_for = "collective"  # the first reduce-scatter/all-reduce from here on is backward's

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.armed_for == "collective":
            raise RuntimeError("no gradient collective ran in backward")  # the trial must not pass silently
        if self.pending == "optimizer":  # Lightning calls this inside optimizer.step, after the closure's backward
            self.die(trainer, "optimizer step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.pending not in (None, "save") and not self.fired:  # (a partitioned rank goes on past its point)
            raise RuntimeError(f"the kill at {self.pending} never happened")  # the trial must not pass silently
        if self.pending == "save":
            self.armed_for = "save"  # this step's epoch-end save (the step must be an epoch's last)


def _patch_collectives(killer: KillNode) -> None:
    """Die on the first reduce-scatter/all-reduce after the armed step's forward: a gradient collective of backward,
    so the other ranks are left inside it."""
    # FSDP2's reduce-scatter on CPU goes through the package's buffer pool: pairwise exchanges on gloo
    # (lightning_zero.distributed.comm_buffers), its own reduce-scatter reference otherwise
    from lightning_zero.distributed import comm_buffers

    for module, name in (
        (dist, "reduce_scatter_single"),
        (dist, "reduce_scatter_tensor"),
        (dist, "all_reduce"),
        (comm_buffers, "_pairwise_reduce_scatter"),
        (comm_buffers, "_reduce_scatter_flat"),
    ):
        original = getattr(module, name, None)
        if original is None:
            continue

        def wrapped(*args, _original=original, _name=name, **kwargs):
            if killer.armed_for == "collective":
                killer.die(killer.trainer, f"collective ({_name.strip('_')} in backward)")
            return _original(*args, **kwargs)

        setattr(module, name, wrapped)


def _patch_save(killer: KillNode) -> None:
    from lightning_zero.checkpoint import io as ckpt_io

    class DyingWriter(ckpt_io.FileSystemWriter):
        def write_data(self, plan, planner):
            if killer.armed_for == "save":
                killer.die(killer.trainer, "save (shard write)")
            return super().write_data(plan, planner)

    ckpt_io.FileSystemWriter = DyingWriter


def make_trainer(root: Path, devices: int, num_nodes: int, callbacks=()) -> Trainer:
    """The job's Trainer (also the in-process reference's, with ``devices=2, num_nodes=1``)."""
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", save_top_k=-1)  # every epoch
    return Trainer(
        strategy=ZeroStrategy(stage=2, hang_timeout=HANG_TIMEOUT),
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_epochs=EPOCHS,
        limit_train_batches=STEPS_PER_EPOCH,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[checkpoints, *callbacks],
        default_root_dir=str(root),
    )


def reference_worker(rank: int, world_size: int, out: str) -> None:
    """An uninterrupted run on forked ranks (``tests.distributed.run_distributed``): rank 0 writes the weights."""
    torch.manual_seed(0)
    module = RegressionModule()
    trainer = make_trainer(Path(out).parent, world_size, 1)
    trainer.fit(module)
    state = full_state(module)
    if trainer.global_rank == 0:
        torch.save({"weights": state, "global_step": trainer.global_step}, out)


def main(root: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    root_path = Path(root)
    nproc = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = make_trainer(root_path, nproc, int(os.environ["WORLD_SIZE"]) // nproc, [KillNode(root_path)])
    module = RegressionModule()
    try:
        trainer.fit(module)
    except BaseException as err:
        (root_path / "errors").mkdir(exist_ok=True)
        (root_path / "errors" / f"attempt{_attempt()}_rank{os.environ['RANK']}.json").write_text(
            json.dumps(
                {
                    "time": time.time(),
                    "type": type(err).__name__,
                    "message": str(err),
                    "traceback": traceback.format_exc()[-4000:],
                }
            )
        )
        raise
    state = full_state(module)
    if trainer.global_rank == 0:
        torch.save(
            {
                "weights": state,
                "global_step": trainer.global_step,
                "attempt": _attempt(),
                "resumed_from": trainer.ckpt_path,
            },
            root_path / "final.pt",
        )


if __name__ == "__main__":
    main(sys.argv[1])
