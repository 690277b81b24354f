"""``python -m tests.emulation.day_one_script trainer|fabric OUT [--as-on-cuda]``: what a GPU user runs first.

``ZeroStrategy(stage=3, offload="cpu")`` with gradient clipping, fp16 (DeepSpeed's dynamic loss scaling, so the
overflow check of offloaded gradients; given as the precision plugin, since on CPU Lightning turns
``precision="16-mixed"`` into bf16), FusedLamb on the offloaded shards, and the fork launcher, on 2 CPU ranks. With
``--as-on-cuda`` the strategy starts its process group as it would on a GPU, with NCCL emulated (``nccl.py``).
Writes the trained weights the launching process holds afterwards (the launcher sends them back whole) to OUT.
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_zero.ops import FusedLamb
from tests.emulation.nccl import started_as_on_cuda
from tests.lightning_models import Net, RegressionModule, dataset, quiet_trainer

STEPS, CLIP = 3, 0.5


def _strategy(adapter):
    return adapter(stage=3, offload="cpu", start_method="fork")


class LambModule(RegressionModule):
    def configure_optimizers(self):
        return FusedLamb(self.parameters(), lr=1e-2, weight_decay=0.01)


def trainer(out: str) -> None:
    torch.manual_seed(0)
    module = LambModule()
    # the plugin itself: on CPU Lightning turns precision="16-mixed" into bf16-mixed
    from lightning_zero import ZeroStrategy
    from lightning_zero.strategies.trainer_precision import ZeroPrecision

    quiet_trainer(
        _strategy(ZeroStrategy), 2, max_steps=STEPS, plugins=[ZeroPrecision("16-mixed")], gradient_clip_val=CLIP
    ).fit(module)
    torch.save(module.state_dict(), out)


def _fabric_work(fabric, out: str) -> None:
    torch.manual_seed(0)
    model = Net()
    model, optimizer = fabric.setup(model, FusedLamb(model.parameters(), lr=1e-2, weight_decay=0.01))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=4))
    for _, (x, y) in zip(range(STEPS), loader):
        fabric.backward(nn.functional.mse_loss(model(x), y))
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if fabric.global_rank == 0:
        torch.save(state, out)


def fabric(out: str) -> None:
    from lightning.fabric import Fabric

    from lightning_zero.fabric import FabricZeroPrecision, ZeroStrategy

    Fabric(
        accelerator="cpu", devices=2, strategy=_strategy(ZeroStrategy), plugins=FabricZeroPrecision("16-mixed")
    ).launch(_fabric_work, out)


if __name__ == "__main__":
    run = {"trainer": trainer, "fabric": fabric}[sys.argv[1]]
    if "--as-on-cuda" in sys.argv:
        with started_as_on_cuda():
            run(sys.argv[2])
    else:
        run(sys.argv[2])
    print("finished")
