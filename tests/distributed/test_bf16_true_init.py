"""``bf16-true``: the same script starts from the same weights at every stage, those of Lightning's DDP under the flag.

Lightning's ``HalfPrecision`` builds under the low default dtype, so torch's layer init and a script's own init
after the build (LitGPT's) draw in bf16; ZeroStrategy builds the same way and makes the parameters fp32 masters of
those values at setup (``[Note: the build under bf16-true]`` in ``lightning_zero/distributed/exact_init.py``).
"""

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero.checkpoint.states import module_state_dict
from lightning_zero.fabric import ZeroStrategy
from tests.conformance.test_fabric_model_parallel_port import inner
from tests.ranks import run_distributed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(32, 16)  # normal_
        self.hidden = nn.Linear(16, 64)  # kaiming_uniform_ and uniform_
        self.out = nn.Linear(64, 16)

    def forward(self, ids):
        return self.out(torch.relu(self.hidden(self.embedding(ids))))


def full(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _start(strategy):
    """The weights and the masters the optimizer steps, right after setup."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-true")
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():
        module = Net()
    nn.init.normal_(module.out.weight, std=0.02)  # the script's own init after the build, as LitGPT's
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters()))
    weights = {k: full(v) for k, v in inner(model).state_dict().items()}
    masters = (
        None if strategy == "ddp" else {k: full(v) for k, v in module_state_dict(inner(model), [optimizer]).items()}
    )
    return weights, masters


def _worker(rank, world_size):
    expected, _ = _start("ddp")  # Lightning's own DDPStrategy under HalfPrecision
    assert {t.dtype for t in expected.values()} == {torch.bfloat16}
    for stage in (0, 1, 2, 3):
        weights, masters = _start(ZeroStrategy(stage=stage))
        for name, value in expected.items():
            assert torch.equal(weights[name].float(), value.float()), f"stage {stage}: {name} starts elsewhere"
            if name in masters:  # at stage 1 a rank holds the masters it steps
                assert masters[name].dtype == torch.float32, (stage, name)
                assert torch.equal(masters[name], value.float()), f"stage {stage}: the master of {name}"


def test_bf16_true_starts_from_lightning_ddp_weights_at_every_stage():
    run_distributed(_worker, 2)
