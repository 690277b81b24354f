"""``python -m tests.reliability.fork_inherited_group_script trainer|fabric``: the launching process leaves a gloo
group in an unreachable cycle (as an earlier fit can), then ``ZeroStrategy(start_method="fork")`` forks two ranks
whose training step runs the garbage collector. Prints "ranks finished" when both ranks are done."""

import gc
import sys

import torch

from tests.reliability.inherited_group_script import leave_an_unreachable_gloo_group


def _trainer() -> None:
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy
    from tests.lightning_models import RegressionModule

    class Collecting(RegressionModule):
        def training_step(self, batch, batch_idx):
            gc.collect()  # what any allocation-heavy step can trigger
            return super().training_step(batch, batch_idx)

    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=2, start_method="fork"),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Collecting())


def _fabric_work(fabric) -> None:
    model = torch.nn.Linear(4, 4)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        gc.collect()
        fabric.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()


def _fabric() -> None:
    from lightning.fabric import Fabric

    from lightning_zero.fabric import ZeroStrategy

    Fabric(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2, start_method="fork")).launch(_fabric_work)


if __name__ == "__main__":
    leave_an_unreachable_gloo_group()
    gc.disable()  # keep the cycle alive until the fork, as a busy process does by chance
    {"trainer": _trainer, "fabric": _fabric}[sys.argv[1]]()
    print("ranks finished")
