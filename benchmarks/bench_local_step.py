"""Side-by-side step time of ZeroStrategy with and without the local-shard optimizer step, alternated in one run.

    python benchmarks/bench_local_step.py --model gpt --precision 32-true --stages 2 --repeat 7
    python benchmarks/bench_local_step.py --model llama gpt --precision 32-true bf16-mixed --stages 1 2 3

Each run trains ``bench_stages.py``'s model (``_bench_models``: same shapes, batches and loss) with the Trainer and
``ZeroStrategy`` on 2 CPU ranks (fork, gloo, 1 thread each), AdamW, and reports the slowest rank's median step time
over ``--steps`` steps after ``--warmup``, and the CPU time per step (``time.process_time``, all threads, summed over
the
ranks): on a loaded machine the CPU time is the steadier figure, since time spent descheduled is not counted. Arms:
``local`` (the default: Adam/AdamW/SGD step the DTensor shards'
local tensors, ``lightning_zero.distributed.local_step``) and ``dtensor`` (torch's DTensor path, as before that
change), alternated within each repeat so a shared machine's drift hits both; the ratio local/dtensor is taken per
repeat and printed as median [min-max]. Stage 1 holds no DTensors: both arms are the same code there (a control).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401

from benchmarks import _bench_models as models  # noqa: E402
from benchmarks.common import free_port  # noqa: E402


def _worker(rank, world, port, job, out) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    import lightning.pytorch as pl

    import lightning_zero.distributed.cpu_tuning as cpu_tuning
    from lightning_zero import ZeroStrategy

    if job["arm"] == "dtensor":
        cpu_tuning.use_local_step = lambda optimizer: False  # torch's own step on the DTensor parameters
    args = argparse.Namespace(quick=False, width=None, depth=None, batch=8, warmup=job["warmup"], steps=job["steps"])
    name, times, cpu = job["model"], [], []

    Module = models.lightning_module(name, args)

    class Timer(pl.Callback):
        def on_train_batch_start(self, *a):
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, *a):
            times.append(time.perf_counter() - self.t)
            cpu.append(time.process_time() - self.c)

    data = models.batches(name, args, rank)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ZeroStrategy(stage=job["stage"]),
        precision=job["precision"],
        max_steps=len(data),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timer()],
        use_distributed_sampler=False,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=None))
    with open(f"{out}.{rank}", "w") as f:
        json.dump([statistics.median(times[job["warmup"] :]), statistics.median(cpu[job["warmup"] :])], f)


def run(job: dict) -> tuple[float, float]:
    """(wall, CPU) seconds per step: the slowest rank's median wall time, the ranks' summed median CPU time."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "median")
        mp.start_processes(_worker, args=(2, port, job, out), nprocs=2, start_method="fork")
        medians = []
        for rank in range(2):
            with open(f"{out}.{rank}") as f:
                medians.append(json.load(f))
    return max(m[0] for m in medians), sum(m[1] for m in medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["gpt"], choices=models.MODELS)
    parser.add_argument("--precision", nargs="+", default=["32-true"])
    parser.add_argument("--stages", nargs="+", type=int, default=[2])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}, cores: {os.cpu_count()}")
    for name in args.model:
        for precision in args.precision:
            for stage in args.stages:
                arms: dict[str, list[tuple[float, float]]] = {"dtensor": [], "local": []}
                for _ in range(args.repeat):
                    for arm in arms:
                        job = dict(
                            model=name, precision=precision, stage=stage, arm=arm, steps=args.steps, warmup=args.warmup
                        )
                        arms[arm].append(run(job))
                for index, what in ((0, "wall"), (1, "CPU")):
                    local = [r[index] for r in arms["local"]]
                    base = [r[index] for r in arms["dtensor"]]
                    ratios = [a / b for a, b in zip(local, base)]
                    print(
                        f"{name} {precision} stage {stage} {what}: local {statistics.median(local):.4f} s, dtensor "
                        f"{statistics.median(base):.4f} s, local/dtensor {statistics.median(ratios):.2f} "
                        f"[{min(ratios):.2f}-{max(ratios):.2f}] over {args.repeat} alternated repeats; load "
                        f"{os.getloadavg()[0]:.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
