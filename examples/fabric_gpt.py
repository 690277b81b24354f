"""Train the small GPT of ``examples/gpt.py`` with Lightning Fabric and the Fabric ``ZeroStrategy``.

    python examples/fabric_gpt.py                          # 2 CPU processes, ZeRO stage 3, offline
    python examples/fabric_gpt.py --stage 2 --offload cpu --accumulate 2
    python -m lightning_zero.fabric run --accelerator cpu --devices 2 --strategy zero_stage_3 examples/fabric_gpt.py

The last form is ``fabric run`` with the ZeRO names known to its ``--strategy`` option (plain ``fabric run`` cannot
know them: see ``lightning_zero/fabric/__main__.py``); the command line then chooses the accelerator, devices and
strategy, and ``--stage``/``--offload`` are refused there rather than silently overridden.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from lightning.fabric import Fabric, seed_everything
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, CharDataset, corpus  # noqa: E402  (the one model definition, shared with gpt.py)

from lightning_zero.fabric import ZeroStrategy  # noqa: E402  (importing lightning_zero registers the zero_* names)


def make_fabric(args) -> Fabric:
    if os.environ.get("LT_CLI_USED"):  # `fabric run ...` chose these already
        if args.stage is not None or args.offload is not None:
            raise SystemExit("under `fabric run` the strategy comes from --strategy; drop --stage/--offload")
        # --strategy (or LT_STRATEGY) names the strategy; without one this example still uses ZeRO stage 3
        return Fabric(
            strategy="auto" if os.environ.get("LT_STRATEGY") else ZeroStrategy(stage=3), precision=args.precision
        )
    strategy = ZeroStrategy(stage=3 if args.stage is None else args.stage, offload=args.offload)
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    return fabric


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=None, help="ZeRO stage (default 3)")
    parser.add_argument("--offload", choices=["cpu"], default=None)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save", default=None, help="write a sharded checkpoint directory here at the end")
    args = parser.parse_args(argv)

    fabric = make_fabric(args)
    seed_everything(0)
    data = CharDataset(corpus(), args.block_size)
    with fabric.init_module():  # every rank builds on CPU with the model's own init; setup shards rank 0's values
        model = GPT(len(data.chars), args.block_size, args.n_layer, args.n_head, args.n_embd)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
    )
    warmup = max(1, args.max_steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, args.max_steps) / args.max_steps))
        ),
    )
    model, optimizer = fabric.setup(model, optimizer)  # the optimizer follows the sharded parameters
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=0))

    step, loss = 0, torch.tensor(float("nan"))
    batches = iter(loader)
    while step < args.max_steps:
        for micro in range(args.accumulate):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):  # no communication
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
                fabric.backward(loss / args.accumulate)
        if args.clip:
            fabric.clip_gradients(model, optimizer, max_norm=args.clip)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        step += 1
        if step % 10 == 0 or step == args.max_steps:
            fabric.print(f"step {step}: loss {fabric.all_reduce(loss.detach()).item():.3f}")
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": optimizer, "scheduler": schedule, "step": step})
    return float(fabric.all_reduce(loss.detach()))


if __name__ == "__main__":
    main()
