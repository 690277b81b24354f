"""Checkpoint save / load / consolidate at scale: a >= 500M-parameter fp32 model with AdamW states, on CPU.

    python benchmarks/bench_checkpoint.py                      # 504M parameters (30 x 4096^2), 2 ranks
    python benchmarks/bench_checkpoint.py --layers 4 --width 1024  # quick

What is measured, in one run:

* save: 2 ranks at ZeRO stage 3 write the layout ZeroStrategy writes (module weights + AdamW states, sharded DTensors)
  with ``save_sharded_checkpoint`` (atomic), synchronous and asynchronous (time until training may continue);
* load: the same checkpoint into 2 ranks at stage 3, and resharded into 1 process with plain tensors;
* consolidate: ``lightning-zero consolidate`` to safetensors (streaming) against Lightning's own
  ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` on the same directory, each in a fresh process,
  wall time and peak RSS (``ru_maxrss`` of the child). Lightning's tool loads the whole DCP checkpoint (weights and
  optimizer states) into memory and writes one ``torch.save`` file; ours streams the model tensors one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401


def build(width: int, layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))


def _sharded(args, rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (args.nproc,))
    with torch.device("meta"):
        model = build(args.width, args.layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02, generator=torch.Generator().manual_seed(rank))
    return model


def _state(model, optimizer):
    from lightning_zero.checkpoint.states import optimizer_state_dict

    tensors = {
        "state_dict": model.state_dict(),
        "optimizer_states": {"0": {"state": optimizer_state_dict(model, optimizer)["state"]}},
    }
    groups = optimizer_state_dict(model, optimizer)["param_groups"]
    return tensors, {"global_step": 1, "optimizer_param_groups": [groups]}


def _worker(rank, args, path, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE=str(args.nproc))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    from lightning_zero.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint, wait_for_pending_saves

    model = _sharded(args, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates exp_avg / exp_avg_sq: the checkpoint holds 3 x the weights
    tensors, meta = _state(model, optimizer)
    results = {}
    dist.barrier()
    start = time.perf_counter()
    save_sharded_checkpoint(path, tensors, meta)
    results["save_sync"] = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    save_sharded_checkpoint(path + ".async", tensors, meta, async_save=True)
    results["save_async_blocking"] = time.perf_counter() - start
    wait_for_pending_saves()
    results["save_async_total"] = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    load_sharded_checkpoint(path, tensors)
    results["load_same_layout"] = time.perf_counter() - start
    if rank == 0:
        json.dump(results, open(out, "w"))
    dist.destroy_process_group()


def _load_one_process(args, path):
    from lightning_zero.checkpoint import load_sharded_checkpoint

    model = build(args.width, args.layers)
    start = time.perf_counter()
    load_sharded_checkpoint(path, {"state_dict": model.state_dict()}, strict=False)
    return time.perf_counter() - start


_MEASURE = (
    "import resource, subprocess, sys, time; start = time.perf_counter(); "
    "proc = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
    "print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
    "proc.returncode); sys.stderr.write(proc.stderr[-2000:])"
)


_LIGHTNING_CONSOLIDATE = (
    "import sys, torch; from pathlib import Path; "
    "from lightning.fabric.utilities.load import _load_distributed_checkpoint; "
    "torch.save(_load_distributed_checkpoint(Path(sys.argv[1])), sys.argv[2])"
)


def _child(command):
    """Run ``command`` under a fresh measuring process whose only child it is: (seconds, peak RSS bytes, error)."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *command], capture_output=True, text=True)
    seconds, peak_kib, code = proc.stdout.split()
    if int(code) != 0:
        lines = proc.stderr.strip().splitlines()
        return float(seconds), None, lines[-1] if lines else f"exit {code}"
    return float(seconds), int(peak_kib) * 1024, None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    from benchmarks.common import free_port

    args.port = free_port()
    params = args.width * args.width * args.layers
    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    path = os.path.join(root, "model.ckpt")
    out = os.path.join(root, "results.json")
    try:
        mp.start_processes(_worker, args=(args, path, out), nprocs=args.nproc, start_method="spawn")
        results = json.load(open(out))
        results["load_resharded_1_process"] = _load_one_process(args, path)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        python = sys.executable
        ours = _child(
            [
                python,
                "-c",
                "import sys; from lightning_zero.cli import main; sys.exit(main())",
                "consolidate",
                path,
                os.path.join(root, "ours.safetensors"),
            ]
        )
        # Lightning's CLI (`python -m lightning.pytorch.utilities.consolidate_checkpoint`) is its DCP loader plus a
        # rename of the top-level "model" key its FSDPStrategy writes; our layout names it "state_dict", so the
        # same two steps run here without the rename: load every tensor of the directory, then one torch.save.
        lightning = _child([python, "-c", _LIGHTNING_CONSOLIDATE, path, os.path.join(root, "lightning.ckpt")])
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{params / 1e6:.0f}M fp32 parameters ({params * 4 / 2**30:.2f} GiB of weights), AdamW states, "
        f"{args.nproc} ranks at ZeRO-3, checkpoint {size / 2**30:.2f} GiB on disk"
    )
    print("| operation | seconds | GiB/s |")
    print("|---|---|---|")
    for key in ("save_sync", "save_async_blocking", "save_async_total", "load_same_layout"):
        print(f"| {key} | {results[key]:.2f} | {size / 2**30 / results[key]:.2f} |")
    weights = params * 4 / 2**30
    print(
        f"| load_resharded_1_process (weights only) | {results['load_resharded_1_process']:.2f} | "
        f"{weights / results['load_resharded_1_process']:.2f} |"
    )
    print("\n| consolidation | seconds | peak RSS GiB | RSS / weights |")
    print("|---|---|---|---|")
    for label, (seconds, peak, error) in (
        ("lightning-zero consolidate (streaming, safetensors)", ours),
        ("Lightning consolidate_checkpoint (its DCP loader + torch.save)", lightning),
    ):
        if error:
            print(f"| {label} | failed: {error[:100]} | - | - |")
        else:
            print(f"| {label} | {seconds:.1f} | {peak / 2**30:.2f} | {peak / 2**30 / weights:.2f} |")
    if not ours[2] and not lightning[2]:
        print(
            f"\nratios (Lightning / ours): time {lightning[0] / ours[0]:.2f}, peak memory {lightning[1] / ours[1]:.2f}"
        )


if __name__ == "__main__":
    main()
