"""Step time and per-rank peak memory: ZeroStrategy stages 0-3 vs Lightning's strategies vs DeepSpeed, on CPU + gloo.

    python benchmarks/bench_stages.py                 # 2 ranks, ~50M-parameter MLP, fp32 AdamW
    python benchmarks/bench_stages.py --width 512 --depth 4 --steps 5   # quick
    python benchmarks/bench_stages.py --device cuda --nproc 1           # on a GPU: stages 0-3 and offload

Every configuration runs in fresh spawned processes with the same model, seed, batch and optimizer (AdamW, fp32).
Time is the median wall time of a full training step (forward, backward, optimizer step) after warm-up. Memory is
the growth of the process's peak resident set (``VmHWM``, reset after imports) on CPU, and the CUDA allocator's
peak on GPU, maximum over ranks. Everything is printed as ratios to DeepSpeed measured in the same run.

[Note: CPU peak RSS at stages 2-3 and glibc]
FSDP2 allocates and frees per-unit all-gather and reduce-scatter buffers every step; with glibc's dynamic mmap
threshold those end up on the heap and fragment it (a stage-2 run's RSS used to climb for ~7 steps and settle
~2.6x above what the tensors need). ``apply_zero`` now pools those buffers on CPU
(``lightning_zero.distributed.buffers``), which removes part of the climb; the gathered parameters and autograd's
unsharded gradients still go through glibc. ``MALLOC_MMAP_THRESHOLD_=1048576`` (a fixed threshold: large blocks are
mmapped and returned) shows the allocator-neutral figure for both sides, at the price of page faults on every step.
On CUDA the caching allocator makes the question moot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
from torch import nn


def build_model(width: int, depth: int) -> nn.Module:
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(depth))
            self.head = nn.Linear(width, 1)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Net()


def _reset_peak() -> int:
    if torch.cuda.is_available() and os.environ.get("BENCH_DEVICE") == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _proc_kib("VmRSS") * 1024


def _peak(baseline: int) -> int:
    if torch.cuda.is_available() and os.environ.get("BENCH_DEVICE") == "cuda":
        return torch.cuda.max_memory_allocated() - baseline
    return _proc_kib("VmHWM") * 1024 - baseline


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _batches(args, rank, world):
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(args.batch, args.width, generator=gen), torch.randn(args.batch, 1, generator=gen))
            for _ in range(args.warmup + args.steps)]


def run_lightning(rank, world, args, kind, out):
    import lightning.pytorch as pl

    import lightning_zero  # noqa: F401
    from lightning_zero import ZeroStrategy

    baseline = _reset_peak()
    times = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = build_model(args.width, args.depth)

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_model(self):
            if name != "modelparallel":
                return
            # Lightning's FSDP2 path: the user shards the model themselves, here the way apply_zero would.
            from torch.distributed.fsdp import fully_shard

            mesh, reshard = self.device_mesh["data_parallel"], option == "3"
            for block in self.net.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(self.net, mesh=mesh, reshard_after_forward=reshard)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timer(pl.Callback):
        def on_train_batch_start(self, *a):
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a):
            times.append(time.perf_counter() - self.t)

    name, _, option = kind.partition(":")
    if name == "zero":
        stage, _, offload = option.partition("+")
        strategy = ZeroStrategy(stage=int(stage), offload=offload or None)
    elif name == "ddp":
        strategy = pl.strategies.DDPStrategy()
    elif name == "fsdp":
        strategy = pl.strategies.FSDPStrategy(sharding_strategy=option or "FULL_SHARD")
    elif name == "modelparallel":
        strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        raise ValueError(kind)
    data = _batches(args, rank, world)
    trainer = pl.Trainer(accelerator="gpu" if args.device == "cuda" else "cpu", devices=world, strategy=strategy,
                         max_steps=len(data), logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Timer()], use_distributed_sampler=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=None))
    _write(out, rank, times[args.warmup:], _peak(baseline))


def run_deepspeed(rank, world, args, kind, out):
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.device == "cuda" else "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    baseline = _reset_peak()
    stage, _, offload = kind.partition(":")[2].partition("+")
    zero = {"stage": int(stage)}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": args.device == "cuda"}
        if int(stage) == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": args.device == "cuda"}
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10 ** 9}
    torch.manual_seed(0)
    model = build_model(args.width, args.depth)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    device = engine.device
    times = []
    for x, y in _batches(args, rank, world):
        start = time.perf_counter()
        loss = nn.functional.mse_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    _write(out, rank, times[args.warmup:], _peak(baseline))


def _write(out, rank, times, peak):
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"time": statistics.median(times), "peak": peak}, f)


def _entry(rank, world, port, args, kind, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), BENCH_DEVICE=args.device)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    (run_deepspeed if kind.startswith("deepspeed") else run_lightning)(rank, world, args, kind, out)


def measure(kind, args):
    from tests_free_port import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(_entry, args=(args.nproc, free_port(), args, kind, out), nprocs=args.nproc,
                           start_method="spawn")
        results = [json.load(open(f"{out}.{r}")) for r in range(args.nproc)]
    return max(r["time"] for r in results), max(r["peak"] for r in results)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed peer")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--stages", nargs="+", default=["0", "1", "2", "3", "1+cpu", "2+cpu", "3+cpu"],
                        help="which ZeRO configurations to run (default: all)")
    parser.add_argument("--no-lightning", action="store_true", help="skip Lightning's own strategies")
    args = parser.parse_args(argv)

    stages = args.stages
    have_ds = not args.no_deepspeed and _has_deepspeed()
    rows, raw = [], {}
    for stage in stages:
        ours = measure(f"zero:{stage}", args)
        peer = None
        # DeepSpeed on CPU aborts now and then ("terminate called without an active exception", SIGABRT) at stages
        # that pass on the next launch: one retry, then the crash is reported and the row keeps our figures.
        for attempt in range(2 if have_ds else 0):
            try:
                peer = measure(f"deepspeed:{stage}", args)
                break
            except Exception as err:
                print(f"DeepSpeed stage {stage}, attempt {attempt + 1}: failed ({type(err).__name__}: "
                      f"{str(err).splitlines()[-1][:120]})", file=sys.stderr)
        raw[f"zero:{stage}"], raw[f"deepspeed:{stage}"] = ours, peer
        rows.append((f"ZeroStrategy stage {stage}", ours, peer))
        print(f"measured stage {stage}: ours {ours}, deepspeed {peer}", file=sys.stderr, flush=True)
    peers = () if args.no_lightning else (("ddp", "Lightning DDPStrategy", "0"), ("fsdp:SHARD_GRAD_OP",
                                          "Lightning FSDPStrategy SHARD_GRAD_OP", "2"), ("fsdp:FULL_SHARD",
                                          "Lightning FSDPStrategy FULL_SHARD", "3"),
                                          ("modelparallel:2", "Lightning ModelParallelStrategy, FSDP2 no reshard", "2"),
                                          ("modelparallel:3", "Lightning ModelParallelStrategy, FSDP2 reshard", "3"))
    lightning_rows = []
    for kind, label, compare in peers:
        try:
            raw[kind] = measure(kind, args)
        except Exception as err:  # report, do not hide: e.g. a Lightning strategy that refuses CPU
            print(f"{label}: failed ({type(err).__name__}: {str(err).splitlines()[-1][:120]})", file=sys.stderr)
            continue
        rows.append((f"{label} (vs stage {compare})", raw[kind], raw.get(f"deepspeed:{compare}")))
        if raw.get(f"zero:{compare}"):
            lightning_rows.append((f"ZeroStrategy stage {compare} vs {label}", raw[f"zero:{compare}"], raw[kind]))
    print(f"\n{args.nproc} ranks, {args.device}, MLP width {args.width} depth {args.depth} "
          f"({sum(p.numel() for p in build_model(args.width, args.depth).parameters()) / 1e6:.1f}M params), "
          f"batch {args.batch}/rank, fp32 AdamW, median of {args.steps} steps")
    print("| configuration | step time (s) | DeepSpeed step (s) | time ratio | peak MiB/rank | DeepSpeed MiB | "
          "memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for label, (t, m), peer in rows:
        if peer:
            print(f"| {label} | {t:.3f} | {peer[0]:.3f} | {t / peer[0]:.2f} | {m / 2**20:.0f} | "
                  f"{peer[1] / 2**20:.0f} | {m / peer[1]:.2f} |")
        else:
            print(f"| {label} | {t:.3f} | failed | - | {m / 2**20:.0f} | failed | - |" if have_ds else
                  f"| {label} | {t:.3f} | - | - | {m / 2**20:.0f} | - | - |")
    if lightning_rows:
        print("\n| ZeroStrategy vs Lightning | time ratio | memory ratio |\n|---|---|---|")
        for label, (t, m), (peer_t, peer_m) in lightning_rows:
            print(f"| {label} | {t / peer_t:.2f} | {m / peer_m:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


def _has_deepspeed() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("deepspeed") is not None
    except Exception:
        return False


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
