"""The GPT example driven by LightningCLI: every ZeroStrategy setting lives in a YAML file.

    python examples/train_gpt.py fit --config examples/configs/zero3_offload.yaml
    python examples/train_gpt.py fit --config examples/configs/ds_config.yaml      # a DeepSpeed ds_config.json
    python examples/train_gpt.py fit --config examples/configs/zero2.yaml --trainer.max_steps 100

The model, data and training step are those of ``examples/gpt.py``; this file only adds the data module the CLI
needs. Each YAML under ``examples/configs/`` trains 30 steps (ds_config: 15) on 2 CPU processes, offline, in
minutes, not seconds: ``zero2_fp16``, the slowest (fp16 on CPU), took 178 s on a 2-CPU machine.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import CharDataset, GPTModule, corpus  # noqa: E402  (the one model definition, shared with gpt.py)

import lightning_zero  # noqa: E402,F401  (registers the zero_* strategy names for `strategy: zero_stage_3`)


class CharDataModule(LightningDataModule):
    """The offline character corpus of ``examples/gpt.py``; ``vocab_size`` feeds the model's (linked in the CLI)."""

    def __init__(self, block_size: int = 64, batch_size: int = 16):
        super().__init__()
        self.dataset = CharDataset(corpus(), block_size)
        self.batch_size = batch_size

    @property
    def vocab_size(self) -> int:
        return len(self.dataset.chars)

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, num_workers=0)


class GPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.block_size", "model.block_size")
        parser.link_arguments("data.batch_size", "model.batch_size")


def main(args=None):
    return GPTCLI(
        GPTModule, CharDataModule, seed_everything_default=0, args=args, save_config_kwargs={"overwrite": True}
    )


if __name__ == "__main__":
    main()
