"""The Fabric training script of the peer-death trials (``peer_death_trials --fabric``), one per node under torchrun::

    torchrun --nnodes 2 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint A:P \\
        -m tests.reliability.peer_death_fabric_job <root>

The Trainer job's run (:mod:`tests.reliability.peer_death_job`) written as a Fabric loop: the same model, optimizer,
per-step LR schedule and data (4 epochs of 2 steps), ZeRO-2 on gloo, ``fabric.save`` every 2 steps (an epoch's end)
to ``checkpoints/step=N``, and on start a resume from the newest complete one. The same kill points, by the same
``KillNode`` (``forward``: after the forward; ``backward``: at the loss's gradient; ``collective``: the first
gradient collective of backward; ``optimizer``: in ``optimizer.step``, after backward; ``save``: in the shard write
of the save after the step), the same files (``pids/``, ``errors/``, ``killed_rank<R>.json``, ``final.pt``).
A user's cleanup runs the strategy's teardown in a ``finally`` (Fabric itself never calls it)."""

import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

from lightning_zero.fabric import ZeroStrategy
from lightning_zero.strategies.auto_resume import newest_complete_checkpoint
from tests.lightning_models import RegressionModule, dataset, full_state, make_optimizer_and_scheduler
from tests.reliability.peer_death_job import EPOCHS, HANG_TIMEOUT, STEPS_PER_EPOCH, KillNode, _attempt


def _killer(root: Path, fabric: Fabric) -> KillNode:
    killer = KillNode(root)
    # KillNode reads the Trainer's global_step/global_rank/node_rank: this loop keeps the same three up to date
    killer.trainer = SimpleNamespace(global_step=0, global_rank=fabric.global_rank, node_rank=fabric.node_rank)
    if _attempt() == 0:
        (root / "pids").mkdir(exist_ok=True)
        (root / "pids" / f"rank{fabric.global_rank}").write_text(f"{os.getpid()} {fabric.node_rank}")
    if killer._mine(killer.trainer):
        from tests.reliability.peer_death_job import _patch_collectives, _patch_save

        _patch_collectives(killer)
        _patch_save(killer)
    return killer


def train(fabric: Fabric, root: Path) -> dict:
    torch.manual_seed(0)
    module = RegressionModule()
    optimizer, scheduler = make_optimizer_and_scheduler(module.named_parameters())
    model, optimizer = fabric.setup(module, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=module.hparams.batch_size))
    killer = _killer(root, fabric)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    resumed = fabric.broadcast(newest_complete_checkpoint([str(root / "checkpoints")]) if _attempt() else None)
    if resumed:
        rest = fabric.load(resumed, {"model": model, "optimizer": optimizer})
        scheduler.load_state_dict(rest["scheduler"])
        state["step"] = rest["step"]
    precision, precision_step = fabric.strategy.precision, fabric.strategy.precision.optimizer_step

    def step_dying(opt, **kwargs):  # inside optimizer.step (Fabric's, through the strategy), after backward
        if killer.pending == "optimizer":
            killer.die(killer.trainer, "optimizer step")
        return precision_step(opt, **kwargs)

    precision.optimizer_step = step_dying
    for _epoch in range(state["step"] // STEPS_PER_EPOCH, EPOCHS):
        for batch_idx, (x, y) in enumerate(loader):
            if batch_idx == STEPS_PER_EPOCH:
                break
            killer.trainer.global_step = state["step"]
            mine = killer._mine(killer.trainer) and state["step"] == killer.step
            killer.pending = killer.point if mine else None
            loss = nn.functional.mse_loss(model(x), y)
            if killer.pending == "forward":
                killer.die(killer.trainer, "forward")
            elif killer.pending == "backward":
                loss.register_hook(lambda grad: killer.die(killer.trainer, "backward"))
            elif killer.pending == "collective":
                killer.armed_for = "collective"
            fabric.backward(loss)
            if killer.armed_for == "collective":
                raise RuntimeError("no gradient collective ran in backward")  # the trial must not pass silently
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            state["step"] += 1
            if killer.pending == "save":
                killer.armed_for = "save"  # this step's save (the step must be an epoch's last)
            if state["step"] % STEPS_PER_EPOCH == 0:
                fabric.save(root / "checkpoints" / f"step={state['step']}", state)
            if killer.pending not in (None, "save") and not killer.fired:
                raise RuntimeError(f"the kill at {killer.pending} never happened")
    return {"weights": full_state(module), "global_step": state["step"], "attempt": _attempt(), "resumed_from": resumed}


def main(root: str) -> None:
    torch.set_num_threads(1)
    root_path = Path(root)
    nproc = int(os.environ["LOCAL_WORLD_SIZE"])
    fabric = Fabric(
        strategy=ZeroStrategy(stage=2, hang_timeout=HANG_TIMEOUT),
        accelerator="cpu",
        devices=nproc,
        num_nodes=int(os.environ["WORLD_SIZE"]) // nproc,
    )
    fabric.launch()
    error = None
    try:
        final = train(fabric, root_path)
    except BaseException as err:
        error = err
    try:
        fabric.strategy.teardown()  # as a user's ``finally`` would: its error is the one such a user sees
    except BaseException as err:
        error = err
    if error is not None:
        (root_path / "errors").mkdir(exist_ok=True)
        (root_path / "errors" / f"attempt{_attempt()}_rank{os.environ['RANK']}.json").write_text(
            json.dumps(
                {
                    "time": time.time(),
                    "type": type(error).__name__,
                    "message": str(error),
                    "traceback": "".join(traceback.format_exception(error))[-4000:],
                }
            )
        )
        raise error
    if fabric.global_rank == 0:
        torch.save(final, root_path / "final.pt")


if __name__ == "__main__":
    main(sys.argv[1])
