"""Train a small GPT with ZeroStrategy: the whole example in one file.

    python examples/gpt.py                         # 2 CPU processes, ZeRO stage 3, offline
    python examples/gpt.py --stage 2 --offload cpu
    torchrun --nproc-per-node 8 examples/gpt.py --accelerator gpu --devices 8 --n-layer 24 --n-embd 1024

The data is a character-level corpus made of module docstrings that ship with Python, so nothing is downloaded.
The model is built in ``configure_model``: at stages 2-3 its construction is recorded, not run, and setup replays
it one FSDP unit at a time before sharding, so each rank keeps only its own shards and the model may be larger than
one process's memory.
"""

from __future__ import annotations

import argparse
import argparse as _argparse_docs
import json
import math
import unittest
import warnings

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_zero import ZeroStrategy

# Lightning 2.6's own pytree helper builds torch's LeafSpec, which torch 2.13 deprecates: nothing a user can act on.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


def corpus() -> str:
    docs = "\n".join(m.__doc__ for m in (_argparse_docs, json, unittest, math) if m.__doc__)
    return (docs + "\n") * 8


class CharDataset(Dataset):
    """Every window of ``block_size + 1`` characters: the input and the next-character targets."""

    def __init__(self, text: str, block_size: int):
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size - 1

    def __getitem__(self, i):
        chunk = self.data[i : i + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))  # detected as FSDP units
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTModule(LightningModule):
    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        lr: float = 3e-3,
        batch_size: int = 16,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = None

    def configure_model(self):
        if self.model is None:  # under ZeroStrategy stages 2-3 this is recorded, replayed per unit at setup
            h = self.hparams
            self.model = GPT(h.vocab_size, h.block_size, h.n_layer, h.n_head, h.n_embd)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams.lr
        )
        total = self.trainer.estimated_stepping_batches
        warmup = max(1, total // 10)

        def schedule(step):  # linear warm-up, then cosine decay to 0
            return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, schedule), "interval": "step"},
        }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--offload", choices=["cpu"], default=None)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=1.0)
    args = parser.parse_args(argv)

    seed_everything(0)
    data = CharDataset(corpus(), args.block_size)
    module = GPTModule(
        len(data.chars), args.block_size, args.n_layer, args.n_head, args.n_embd, batch_size=args.batch_size
    )
    # Training ends at max_steps. Telling the Trainer how many epochs (and, within one epoch, how many batches) those
    # steps span gives the progress bar a real "Epoch 0/0 60/60" instead of "Epoch 0/-2 60/1869" (max_epochs=-1).
    batches_needed = args.max_steps * args.accumulate
    batches_per_epoch = math.ceil(math.ceil(len(data) / (args.devices * args.num_nodes)) / args.batch_size)
    max_epochs = math.ceil(batches_needed / batches_per_epoch)
    limit_train_batches = batches_needed if max_epochs == 1 else None
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=ZeroStrategy(stage=args.stage, offload=args.offload),
        max_steps=args.max_steps,
        max_epochs=max_epochs,
        limit_train_batches=limit_train_batches,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        log_every_n_steps=10,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=0))
    loss = trainer.callback_metrics["train_loss"].item()
    if trainer.is_global_zero:
        print(
            f"final train_loss {loss:.3f} after {trainer.global_step} steps "
            f"(stage {args.stage}, offload {args.offload}, {trainer.world_size} processes)"
        )
    return loss


if __name__ == "__main__":
    main()
