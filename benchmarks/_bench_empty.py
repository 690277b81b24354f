"""Lightning's own per-step cost, measured with an empty model (``bench_stages.py --empty-model``).

The model is one parameter of one element and a step is ``(w * x).sum()`` plus its backward: no optimizer, nothing
to compute, so what a loop around it spends per step is the loop's own cost. Kinds (``job["kind"]``):

- ``empty:bare``: one process, a plain ``for`` loop over the batches doing that forward and backward and dropping
  the gradient: the floor;
- ``empty:trainer``: one process, Lightning's ``Trainer`` (CPU, default single-device strategy, no logger,
  checkpointing, progress bar or model summary) running the same step; ``configure_optimizers`` returns None, so
  Lightning steps its mock optimizer;
- ``empty:bare-dp``: two ranks, the bare loop plus one all-reduce of the gradient per step: a data-parallel floor;
- ``empty:ddp``: two ranks, the Trainer with Lightning's own ``DDPStrategy`` and an SGD at ``lr=0``: what Lightning
  costs per step on two ranks before any ZeroStrategy code runs, so ``zero<stage> - ddp`` is ZeroStrategy's own;
- ``empty:zero<stage>``: two ranks, the Trainer with ``ZeroStrategy(stage)``, with an SGD at ``lr=0`` so the
  strategy's optimizer path runs;
- ``empty:deepspeed<stage>``: two ranks, DeepSpeed's engine at that ZeRO stage in its own loop (``engine(x)``,
  ``engine.backward``, ``engine.step``, as ``bench_stages.py``'s DeepSpeed peer runs), with the same SGD at
  ``lr=0``: DeepSpeed's fixed cost per step, the counterpart of ``zero<stage>``'s (which includes Lightning's).

Each run reports the time per loop cycle (step ``warmup`` to the last step's start, the work between steps
included, median of the per-cycle times) and Python calls per cycle (``cProfile`` in a separate, uncounted-time
pass over the same cycles would double the run: the calls are counted in the same run, after the timed cycles).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import time

import torch

from benchmarks.common import deepspeed_init_distributed

KINDS = (
    "empty:bare",
    "empty:trainer",
    "empty:bare-dp",
    "empty:ddp",
    "empty:zero0",
    "empty:zero1",
    "empty:zero2",
    "empty:deepspeed0",
    "empty:deepspeed1",
    "empty:deepspeed2",
)
LABELS = {
    "empty:bare": "bare loop, 1 process",
    "empty:trainer": "Trainer, 1 process",
    "empty:bare-dp": "bare loop + 1 all-reduce, 2 ranks",
    "empty:ddp": "Trainer + Lightning's DDPStrategy, 2 ranks",
    "empty:zero0": "Trainer + ZeroStrategy(0), 2 ranks",
    "empty:zero1": "Trainer + ZeroStrategy(1), 2 ranks",
    "empty:zero2": "Trainer + ZeroStrategy(2), 2 ranks",
    **{f"empty:deepspeed{s}": f"DeepSpeed engine, ZeRO {s}, 2 ranks" for s in range(3)},
}


def world_of(kind: str) -> int:
    return 1 if kind in ("empty:bare", "empty:trainer") else 2


class _Clock:
    """Per-cycle times over ``timed`` cycles from step ``warmup``, then Python calls over ``counted`` more."""

    def __init__(self, warmup: int, timed: int, counted: int):
        self.warmup, self.timed, self.counted = warmup, timed, counted
        self.starts: list[float] = []
        self.profile = cProfile.Profile()
        self.calls = 0.0

    def tick(self, index: int) -> None:
        first_count = self.warmup + self.timed
        if self.warmup <= index <= first_count:
            self.starts.append(time.perf_counter())
        if index == first_count:
            self.profile.enable()
        elif index == first_count + self.counted:
            self.profile.disable()
            self.calls = sum(s[1] for s in pstats.Stats(self.profile).stats.values()) / self.counted

    def result(self) -> dict:
        cycles = [b - a for a, b in zip(self.starts, self.starts[1:])]
        return {"time": statistics.median(cycles), "calls": self.calls}


def steps_needed(warmup: int, timed: int, counted: int) -> int:
    return warmup + timed + counted + 1


def run_empty(rank, world, args, job, out, write):
    kind = job["kind"]
    total = steps_needed(args.warmup, args.steps, args.empty_counted)
    clock = _Clock(args.warmup, args.steps, args.empty_counted)
    data = [torch.ones(1) for _ in range(total)]
    torch.manual_seed(0)
    if kind.startswith("empty:bare"):
        import torch.distributed as dist

        if world > 1:
            dist.init_process_group("gloo")
        w = torch.nn.Parameter(torch.ones(1))
        for index, x in enumerate(data):
            clock.tick(index)
            (w * x).sum().backward()
            if world > 1:
                dist.all_reduce(w.grad)
            w.grad = None
    elif kind.startswith("empty:deepspeed"):
        _run_deepspeed(int(kind.removeprefix("empty:deepspeed")), data, clock)
    else:
        _run_trainer(kind, world, data, clock)
    write(out, rank, [clock.result()["time"]], 0, calls=clock.result()["calls"])


def _run_trainer(kind: str, world: int, data, clock: _Clock) -> None:
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy

    stage = kind.removeprefix("empty:zero") if kind.startswith("empty:zero") else None
    ddp = kind == "empty:ddp"

    class Empty(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch, batch_idx):
            return (self.w * batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0) if stage is not None or ddp else None

    class Tick(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            clock.tick(batch_idx)

    strategy = ZeroStrategy(stage=int(stage)) if stage is not None else pl.strategies.DDPStrategy() if ddp else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=len(data),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Tick()],
        use_distributed_sampler=False,
    )
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    trainer.fit(Empty(), torch.utils.data.DataLoader(data, batch_size=None))


def _run_deepspeed(stage: int, data, clock: _Clock) -> None:
    deepspeed = deepspeed_init_distributed("cpu")

    class Empty(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return (self.w * x).sum()

    model = Empty()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    for index, x in enumerate(data):
        clock.tick(index)
        engine.backward(engine(x))
        engine.step()


def _paired_extra(runs, base) -> str:
    """Median [range] in µs of ``runs`` minus ``base``, repeat by repeat (both alternated in the same run)."""
    pairs = [(a[0] - b[0]) * 1e6 for a, b in zip(runs, base or []) if a and b]
    return f"{statistics.median(pairs):.0f} [{min(pairs):.0f}–{max(pairs):.0f}]" if pairs else ""


def table(results: dict, out) -> None:
    """``results``: kind -> list of (time per cycle, Python calls per cycle), one per repeat. ZeroStrategy's rows
    also show what they cost over Lightning's own ``DDPStrategy`` on the same two ranks, and over DeepSpeed's engine
    at the same stage, when those ran."""
    bare = {1: results.get("empty:bare"), 2: results.get("empty:bare-dp")}
    print(
        "| loop | time per step (µs), median [range] | Python calls per step | over the bare loop (µs) "
        "| over Lightning's DDP (µs) | over DeepSpeed, same stage (µs) |",
        file=out,
    )
    print("|---|---|---|---|---|---|", file=out)
    for kind, runs in results.items():
        runs = [r for r in runs if r]
        if not runs:
            print(f"| {LABELS[kind]} | failed | | | | |", file=out)
            continue
        times = [t * 1e6 for t, _ in runs]
        over_bare = "" if kind in ("empty:bare", "empty:bare-dp") else _paired_extra(runs, bare[world_of(kind)])
        zero = kind.startswith("empty:zero")
        over_ddp = _paired_extra(runs, results.get("empty:ddp")) if zero else ""
        over_ds = _paired_extra(runs, results.get(kind.replace("zero", "deepspeed"))) if zero else ""
        print(
            f"| {LABELS[kind]} | {statistics.median(times):.0f} [{min(times):.0f}–{max(times):.0f}] | "
            f"{statistics.median(c for _, c in runs):.0f} | {over_bare} | {over_ddp} | {over_ds} |",
            file=out,
        )
