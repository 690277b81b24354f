"""Helpers shared by the Fabric ports (``test_fabric_fsdp_port.py``, ``test_fabric_fsdp_checkpoint_port.py``): a
2-rank Fabric on ``lightning_zero.fabric.ZeroStrategy``, Lightning's ``BasicTrainer`` step, full weights, the dtype
layers compute in. Module level, so forked ranks (``tests.distributed.run_distributed``) can use them.
"""

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero.fabric import ZeroStrategy

IN, OUT = 32, 2  # Lightning's BoringModel under Fabric is a Linear(32, 2)


def make_fabric(stage=3, precision="32-true", plugins=None, **kwargs):
    chosen = {"plugins": plugins} if plugins else {"precision": precision}
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=stage, **kwargs), **chosen)
    fabric.launch()  # the ranks exist already (tests.ranks): joins their process group, builds the mesh
    return fabric


def full(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def full_weights(model):
    inner = model._forward_module if hasattr(model, "_forward_module") else model
    inner = getattr(inner, "module", inner)  # DDP at stages 0-1
    return {k: full(v) for k, v in inner.state_dict().items()}


def max_diff(got, expected):
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    return max((got[k].float() - expected[k].float()).abs().max().item() for k in expected)


def batch(seed=0, n=4):
    return torch.randn(n, IN, generator=torch.Generator().manual_seed(seed))


def train_step(fabric, model, optimizer, seed=0):
    """One step of Lightning's ``BasicTrainer``: MSE towards ones, the same batch on every rank (so the averaged
    gradient is the single-process one)."""
    out = model(batch(seed))
    fabric.backward(nn.functional.mse_loss(out.float(), torch.ones_like(out, dtype=torch.float32)))
    optimizer.step()
    optimizer.zero_grad()


def fresh_run(fabric, seed=0, model_fn=lambda: nn.Linear(IN, OUT), lr=0.1):
    torch.manual_seed(seed)
    with fabric.init_module():
        model = model_fn()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=lr))
    train_step(fabric, model, optimizer)
    return model, optimizer


def compute_dtypes(model):
    """The weight dtypes the ``Linear`` layers compute with (FSDP2 casts the gathered parameters for forward)."""
    seen = set()
    handles = [
        m.register_forward_pre_hook(lambda m, args: seen.add(m.weight.dtype))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    with torch.no_grad():
        model(batch())
    for handle in handles:
        handle.remove()
    return seen
