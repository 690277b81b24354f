"""``empty_init=True``: the recorder follows the memory nothing wrote, stages 2-3 give the modules the script left
alone their ``reset_parameters()`` values at setup (Lightning's FSDP/ModelParallel), and a first forward that would
read memory nothing wrote is refused by name at every stage, the Trainer's included.
"""

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.distributed.deferred_init import materialize_module, undefined_state
from lightning_zero.distributed.empty_init import reset_unwritten_modules, skipped_names
from lightning_zero.distributed.exact_init import InitConfig, exact_init, to_fp32_masters
from tests.conformance.test_fabric_empty_init_port import Gated, reset_reference
from tests.conformance.test_fabric_model_parallel_port import FeedForward, assert_equal
from tests.ranks import run_distributed


def test_the_recorder_follows_memory_nothing_wrote_and_setup_resets_untouched_modules():
    with exact_init(InitConfig(deferred=True), empty_init=True):
        model = nn.Sequential(
            nn.Embedding(10, 4, padding_idx=0),  # normal_ skipped; zeroing the padding row writes a part only
            nn.Linear(4, 4),
            nn.LayerNorm(4),  # ones_/zeros_ are not skipped
            nn.Linear(4, 4),
        )
    nn.init.normal_(model[3].weight)  # the script initialises this module's weight only, after the build
    undefined = [name for name, param in model.named_parameters() if undefined_state(param)[0]]
    assert undefined == ["0.weight", "1.weight", "1.bias", "3.bias"]
    torch.manual_seed(3)
    assert reset_unwritten_modules(model) == ["3.bias"]  # the script's module is kept: its bias nothing wrote
    materialize_module(model)
    torch.manual_seed(3)
    embedding, linear = nn.Embedding(10, 4, padding_idx=0), nn.Linear(4, 4)  # their reset_parameters() draws
    assert torch.equal(model[0].weight, embedding.weight) and torch.equal(model[1].weight, linear.weight)
    assert torch.equal(model[1].bias, linear.bias) and torch.equal(model[2].weight, torch.ones(4))
    assert torch.isnan(model[3].bias).all() and torch.isfinite(model[3].weight).all()  # NaN, not garbage


def test_memory_nothing_wrote_stays_so_through_a_conversion_and_bf16_resets_draw_in_bf16():
    with exact_init(InitConfig(deferred=True), empty_init=True, init_dtype=torch.bfloat16):
        model = nn.Linear(4, 4)
    assert model.weight.dtype == torch.bfloat16
    torch.manual_seed(5)
    assert reset_unwritten_modules(model) == []
    to_fp32_masters(model)
    model.half().float()  # conversions of defined memory stay defined
    materialize_module(model)
    torch.manual_seed(5)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # what Lightning's FSDP resets under bf16-true: a bf16 meta build
    try:
        reference = nn.Linear(4, 4)
    finally:
        torch.set_default_dtype(previous)
    assert model.weight.dtype == torch.float32 and torch.equal(model.weight, reference.weight.float())
    with exact_init(InitConfig(deferred=True), empty_init=True):
        model = nn.Linear(4, 4)
        model.weight.data = model.weight.data.to(torch.float64)  # computed from memory nothing wrote
    assert undefined_state(model.weight)[0] and not undefined_state(model.weight)[1]


def test_a_real_build_fills_what_it_skipped_with_nan_and_names_it_until_written():
    with exact_init(InitConfig(), empty_init=True):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert torch.isnan(model[0].weight).all() and torch.equal(model[1].weight, torch.ones(4))
    assert skipped_names(model) == ["0.weight", "0.bias"]
    model[0].weight.data[:2].normal_()  # a part written: the rest still counts
    assert skipped_names(model) == ["0.weight", "0.bias"]
    model[0].reset_parameters()
    assert skipped_names(model) == []


class Wrapped(LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net, self.start = net, None

    def on_fit_start(self):
        self.start = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in self.net.state_dict().items()
        }

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.ones(4, 8)), batch_size=2)

    val_dataloader = train_dataloader


def _trainer(stage):
    return Trainer(
        strategy=ZeroStrategy(stage=stage),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
    )


def _trainer_worker(rank, world_size):
    trainer = _trainer(3)
    torch.manual_seed(0)
    with trainer.init_module(empty_init=True):
        net = FeedForward()
    module = Wrapped(net)
    trainer.fit(module)
    assert_equal(module.start, reset_reference(seed=0).state_dict(), "Trainer.init_module(empty_init=True) at 3")
    for stage, run in ((1, "validate"), (3, "fit")):  # an evaluation at stages 0-1 calls its steps directly
        trainer = _trainer(stage)
        with trainer.init_module(empty_init=True):
            net = Gated()
        for sub in net.ff.modules():
            if callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()
        with pytest.raises(RuntimeError, match=r"^net\.gate\.scale hold memory that nothing wrote"):
            getattr(trainer, run)(Wrapped(net))


def test_trainer_init_module_empty_init_resets_at_stage_3_and_refuses_what_nothing_wrote():
    run_distributed(_trainer_worker, 2)
