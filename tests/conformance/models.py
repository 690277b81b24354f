"""Helpers shared by the conformance suite: Trainer factory, tiny models, a tiny Hugging Face Llama, comparisons.

Everything here is module level so forked ranks (``tests.distributed.run_distributed``) can use it. Trainer-level
tests run inside ``run_distributed``: the ranks are started by the harness the way ``torchrun`` would start them,
so Lightning sees an external launcher and no per-rank script re-launch (popen) is paid.
"""

from __future__ import annotations

import torch
import torchmetrics
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_zero import ZeroStrategy
from tests.lightning_models import RegressionModule, dataset, full_state  # noqa: F401  (re-exported)

# (stage, offload) pairs: every ZeRO stage, plus stage 3 with CPU offload (DeepSpeed's "zero_stage_3_offload").
ALL_STAGES = [(0, None), (1, None), (2, None), (3, None), (3, "cpu")]
STAGE_IDS = ["s0", "s1", "s2", "s3", "s3-offload"]


def trainer(strategy, world_size=2, root=None, **kwargs) -> Trainer:
    """A quiet CPU Trainer: nothing written unless the test asks for it."""
    defaults = dict(
        accelerator="cpu",
        devices=world_size,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
    )
    defaults.update(kwargs)
    return Trainer(strategy=strategy, **defaults)


def zero(stage, offload=None, **kwargs) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, offload=offload, **kwargs)


def max_abs_diff(got: dict, expected: dict) -> float:
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    return max((got[k].float() - expected[k].float()).abs().max().item() for k in expected)


# ---------------------------------------------------------------------------------------------- tiny HF Llama
VOCAB, SEQ = 64, 8


def llama_config(tie: bool) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=tie,
        attention_dropout=0.0,
    )


def token_dataset(n=16, seed=3) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=gen))


class LlamaModule(LightningModule):
    """A causal LM from ``LlamaConfig`` (no download), built in ``__init__`` or in ``configure_model``."""

    def __init__(self, tie: bool, build_in_configure_model: bool, batch_size: int = 2):
        super().__init__()
        self.tie, self.batch_size = tie, batch_size
        self.model = None if build_in_configure_model else LlamaForCausalLM(llama_config(tie))

    def configure_model(self):
        if self.model is None:
            self.model = LlamaForCausalLM(llama_config(self.tie))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def train_dataloader(self):
        return DataLoader(token_dataset(), batch_size=self.batch_size)


# ---------------------------------------------------------------------------------------------- torchmetrics
class MetricsModule(LightningModule):
    """A classifier whose torchmetrics (MSE over probabilities, accuracy) are built in ``configure_model``."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(6, 3)
        self.mse = self.acc = None
        self.computed = {}

    def configure_model(self):
        if self.mse is None:
            self.mse = torchmetrics.MeanSquaredError()
            self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

    def forward(self, x):
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        probs = self(x).softmax(-1)
        self.mse.update(probs, nn.functional.one_hot(y, 3).float())
        self.acc.update(probs, y)
        self.log("val_mse", self.mse, on_epoch=True, sync_dist=True)
        self.log("val_acc", self.acc, on_epoch=True, sync_dist=True)

    def val_dataloader(self):
        return DataLoader(class_dataset(), batch_size=4)


def class_dataset(n=24, seed=5) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen))
