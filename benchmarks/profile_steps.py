"""Per-optimizer-step operation counts and time shares of a ZeroStrategy training step, from the torch profiler.

    python benchmarks/profile_steps.py --model llama --precision bf16-mixed --stage 2 --accumulate 4
    python benchmarks/profile_steps.py --model mlp --stage 3 --top 25

Two CPU ranks (fork, gloo) train with the Trainer and ``ZeroStrategy``; rank 0 profiles ``--steps`` optimizer steps
after a warm-up and prints, per optimizer step, how many collectives (all-gathers, reduce-scatters, all-reduces,
broadcasts) and casts/copies (``aten::_to_copy``, ``aten::copy_``) ran, plus the top operators by self CPU time.
The counts do not depend on machine load, so they are the evidence for changes that remove work
(``docs/performance_notes_lowprec.md``); the time shares are indicative only on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401

from benchmarks.common import free_port  # noqa: E402

# Profiler event names (substrings, lower case) grouped into the counts we report.
COUNTED = {
    "all_gather": ("allgather", "all_gather"),
    # on CPU the pooled reduce-scatter is an all-to-all (lightning_zero/distributed/comm_buffers.py)
    "reduce_scatter": ("reduce_scatter", "reducescatter", "alltoall", "all_to_all"),
    "all_reduce": ("allreduce", "all_reduce"),
    "broadcast": ("broadcast",),
}


def build_model(name: str) -> nn.Module:
    """``mlp``: 24 x (Linear(1024, 1024) + GELU); ``llama``: a ~3M-parameter Llama with tied embeddings; ``gpt``:
    the GPT of ``examples/gpt.py`` at ``bench_stages.py``'s shape (4 layers, width 128, 64 tokens)."""
    if name == "gpt":
        import argparse as _argparse

        from benchmarks import _bench_models

        return _bench_models.build("gpt", _argparse.Namespace(quick=False))
    if name == "mlp":
        layers = []
        for _ in range(24):
            layers += [nn.Linear(1024, 1024), nn.GELU()]
        return nn.Sequential(*layers)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def lightning_module(name: str, nested: bool = False):
    from lightning.pytorch import LightningModule

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(name)

        def forward(self, *args, **kwargs):
            return self.model(*args, **kwargs)

        def training_step(self, batch, batch_idx):
            run = self if nested else self.model  # self(...) calls the FSDP2 root inside its own forward
            if name == "mlp":
                (x,) = batch
                return run(x).float().pow(2).mean()
            if name == "gpt":
                (ids,) = batch
                logits = run(ids[:, :-1])
                return nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
            (ids,) = batch
            return run(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Module()


def data(name: str, batches: int):
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(0)
    if name == "mlp":
        tensors = torch.randn(batches * 8, 1024, generator=gen)
    elif name == "gpt":
        tensors = torch.randint(0, 65, (batches * 8, 65), generator=gen)
    else:
        tensors = torch.randint(0, 1000, (batches * 8, 64), generator=gen)
    return DataLoader(TensorDataset(tensors), batch_size=8)


def classify(name: str) -> str | None:
    lower = name.lower()
    if lower in ("aten::_to_copy", "aten::copy_"):
        return lower
    if not lower.startswith("c10d::"):  # the backend's own event (gloo:, nccl:) would count each one twice
        return None
    for key, needles in COUNTED.items():
        if any(needle in lower for needle in needles):
            return key
    return None


def count_events(events) -> Counter:
    """Counts of collectives (c10d ops, once each) and casts/copies among the profiler's events."""
    counts: Counter = Counter()
    for event in events:
        kind = classify(event.name)
        if kind is not None:
            counts[kind] += 1
    return counts


CALLERS: Counter = Counter()


def _trace_collectives() -> None:
    """Record which caller (outside torch.distributed) issues each all-reduce/broadcast/all-gather."""
    import traceback

    for name in (
        "all_reduce",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_to_all_single",
    ):
        original = getattr(dist, name)

        def traced(*a, _original=original, _name=name, **k):
            frames = [f for f in traceback.extract_stack()[:-1] if "torch/distributed" not in f.filename]
            where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames[-3:][::-1])
            CALLERS[(_name, where)] += 1
            return _original(*a, **k)

        setattr(dist, name, traced)


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning.pytorch import Callback, Trainer

    from lightning_zero import ZeroStrategy

    warm = 2
    total = (warm + args.steps) * args.accumulate

    class Profile(Callback):
        def __init__(self):
            self.prof = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == warm * args.accumulate:
                self.prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=args.casts
                )
                if args.stacks:
                    _trace_collectives()
                self.prof.__enter__()
                self.start = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            self.seconds = time.perf_counter() - self.start

    torch.manual_seed(0)
    callback = Profile()
    trainer = Trainer(
        strategy=ZeroStrategy(stage=args.stage, offload=args.offload),
        accelerator="cpu",
        devices=world,
        precision=args.precision,
        max_steps=warm + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=args.accumulate,
        callbacks=[callback],
        gradient_clip_val=args.clip,
    )
    trainer.fit(lightning_module(args.model, args.nested), data(args.model, total * world))
    callback.prof.__exit__(None, None, None)
    if rank == 0:
        events = callback.prof.events()
        counts = count_events(events)
        label = (
            f"{args.model} {args.precision} stage {args.stage} offload={args.offload} "
            f"accumulate={args.accumulate} nested={args.nested}"
        )
        print(
            f"== {label}: per optimizer step ({args.steps} profiled; wall {callback.seconds / args.steps:.3f} s "
            "under the profiler)"
        )
        for key in ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "aten::_to_copy", "aten::copy_"):
            print(f"   {key:16s} {counts.get(key, 0) / args.steps:8.1f}")
        names = Counter(e.name for e in events if classify(e.name) not in (None, "aten::_to_copy", "aten::copy_"))
        for name, n in sorted(names.items()):
            print(f"   {name:40s} {n / args.steps:8.1f}")
        if args.casts:
            origins: Counter = Counter()
            for event in events:
                if event.name == "aten::_to_copy":
                    chain, parent = [], event.cpu_parent
                    while parent is not None:
                        chain.append(parent.name)
                        parent = parent.cpu_parent
                    near = [c for c in chain if c not in ("aten::to", "aten::_to_copy")][:1]
                    far = [c for c in chain if c.startswith(("FSDP::", "Optimizer", "autograd::engine"))][:1]
                    origins[(" ".join(near), " ".join(far))] += 1
            for (near, far), n in origins.most_common(25):
                print(f"   {n / args.steps:6.1f} casts in {near[:60]:60s} under {far[:70]}")
        for (name, where), n in sorted(CALLERS.items()):
            print(f"   {n / args.steps:5.1f} x {name} from {where}")
        if args.top:
            print(callback.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("mlp", "llama", "gpt"), default="llama")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--offload", default=None)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--nested", action="store_true", help="training_step calls self(...), not self.model(...)")
    parser.add_argument("--stacks", action="store_true", help="print where each non-all-gather collective ran")
    parser.add_argument("--casts", action="store_true", help="group the casts (aten::_to_copy) by origin")
    parser.add_argument("--top", type=int, default=0, help="print the N operators with the most self CPU time")
    args = parser.parse_args()
    mp.start_processes(_worker, args=(2, free_port(), args), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
