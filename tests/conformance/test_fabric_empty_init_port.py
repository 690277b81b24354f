"""Lightning's Fabric ModelParallel ``test_train_save_load`` (``tests_fabric/strategies/test_model_parallel_integration
.py``) builds its model under ``fabric.init_module(empty_init=True)`` and trains it: ``ModelParallelStrategy`` builds
on the meta device and gives each module its values from ``reset_parameters()`` at setup. Its pattern here, at
stages 2-3 (ModelParallel's FSDP2), with the save loaded at every stage and at another world size; and the refusal
of a parameter that nothing initialised, reset or loaded before the first forward, at every stage.
"""

import os

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero.fabric import ZeroStrategy
from tests.conformance.test_fabric_model_parallel_port import (
    FeedForward,
    assert_equal,
    assert_states_equal,
    full_state,
    launch,
    optimizer_states,
)
from tests.ranks import run_distributed


def reset_reference(seed: int) -> nn.Module:
    """What Lightning's FSDP/ModelParallel start from: a meta build, then ``reset_parameters()`` of each module
    holding tensors, in ``modules()`` order (``_materialize_distributed_module``), from the same random state."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = FeedForward()
    model.to_empty(device="cpu")
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.reset_parameters()
    return model


def step(fabric, model, optimizer) -> torch.Tensor:
    """Lightning's ``_train`` step: the same batch on every rank (drawn from the stream setup left); ``fabric=None``
    steps an unsharded model."""
    loss = model(torch.rand(2, 8)).sum()
    fabric.backward(loss) if fabric is not None else loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def build_and_set_up(fabric, seed: int):
    fabric.seed_everything(seed)
    with fabric.init_module(empty_init=True):
        module = FeedForward()
    model = fabric.setup(module)
    return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))


def _train_save_load_worker(rank, world_size, root):
    for stage in (2, 3):
        path = os.path.join(root, f"stage-{stage}")
        # the unsharded model from Lightning's start, and its step (the batch drawn after the resets)
        reference = reset_reference(seed=0)
        start = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        reference_loss = step(None, reference, torch.optim.AdamW(reference.parameters()))
        fabric = launch(ZeroStrategy(stage=stage))
        model, optimizer = build_and_set_up(fabric, seed=0)
        assert_equal(full_state(model), start, f"stage {stage}: the start is each module's reset_parameters()")
        loss = step(fabric, model, optimizer)
        assert torch.isfinite(loss) and torch.equal(loss, reference_loss), (stage, loss, reference_loss)
        for name, value in full_state(model).items():
            torch.testing.assert_close(value, reference.state_dict()[name], rtol=0, atol=1e-6, msg=name)
        saved, saved_optimizer = full_state(model), optimizer_states(model, optimizer)
        fabric.save(path, {"model": model, "optimizer": optimizer, "steps": 1})
        if rank == 0 and stage == 3:
            torch.save(saved, os.path.join(root, "saved.pt"))

        for load_stage in (0, 1, 2, 3):  # re-init everything, as Lightning's test does, and resume
            where = f"saved at stage {stage}, loaded at stage {load_stage}"
            fabric = launch(ZeroStrategy(stage=load_stage))
            model, optimizer = build_and_set_up(fabric, seed=7)
            if load_stage >= 2:  # setup gave the weights values: Lightning's test takes a step before loading
                assert torch.isfinite(step(fabric, model, optimizer)), where
            state = {"model": model, "optimizer": optimizer, "steps": 0}
            assert fabric.load(path, state) == {} and state["steps"] == 1, where
            assert_equal(full_state(model), saved, where)
            assert_states_equal(optimizer_states(model, optimizer), saved_optimizer, where)
            assert torch.isfinite(step(fabric, model, optimizer)), where


def _load_on_one_rank_worker(rank, world_size, root):
    saved = torch.load(os.path.join(root, "saved.pt"), weights_only=True)
    for stage in (0, 3):
        fabric = Fabric(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage))
        fabric.launch()
        model, optimizer = build_and_set_up(fabric, seed=7)
        fabric.load(os.path.join(root, "stage-3"), {"model": model, "optimizer": optimizer})
        assert_equal(full_state(model), saved, f"one rank, stage {stage}")
        assert torch.isfinite(step(fabric, model, optimizer)), stage


def test_train_save_load_built_under_empty_init(tmp_path):
    run_distributed(_train_save_load_worker, 2, str(tmp_path))
    run_distributed(_load_on_one_rank_worker, 1, str(tmp_path))


class Gate(nn.Module):
    """A module without ``reset_parameters()``: its init is a ``torch.nn.init`` call that ``empty_init`` skips."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(8))
        nn.init.normal_(self.scale)

    def forward(self, x):
        return x * self.scale


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff, self.gate = FeedForward(), Gate()

    def forward(self, x):
        return self.gate(self.ff(x))


def _refusal_worker(rank, world_size, root):
    weights = os.path.join(root, "gated.pt")
    if rank == 0:
        torch.save(Gated().state_dict(), weights)
    torch.distributed.barrier()
    for stage in (0, 1, 2, 3):
        fabric = launch(ZeroStrategy(stage=stage))
        with fabric.init_module(empty_init=True):
            module = Gated()
        for sub in module.ff.modules():  # the script initialises what has reset_parameters(), as LitGPT does
            if callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()
        model = fabric.setup(module)
        with pytest.raises(
            RuntimeError,
            match=r"^gate\.scale hold memory that nothing wrote: the model was built "
            r"under empty_init=True",
        ):
            model(torch.rand(2, 8))
        fabric.load_raw(weights, model)  # a load before the (next) first forward writes it
        assert torch.isfinite(model(torch.rand(2, 8))).all(), stage


def test_a_parameter_nothing_wrote_is_refused_at_the_first_forward(tmp_path):
    run_distributed(_refusal_worker, 2, str(tmp_path))
