"""Endurance tier: long runs and many fits in one process, watched for slow leaks.

    python -m tests.reliability.endurance [--steps 10000] [--save-every 50] [--fits 50] [--configs NAME ...]

Each configuration runs on 2 CPU ranks (gloo, forked by ``tests.distributed.run_distributed``):

* ``s{0,1,2,3}-{sync,async}`` and ``s3-nvme-{sync,async}``: one ``Trainer.fit`` of a tiny model for ``--steps``
  steps, ``ModelCheckpoint(every_n_train_steps=--save-every, save_top_k=3, monitor="step", mode="max",
  save_last=True)``, so every save rotates one checkpoint out. ``s3-nvme`` offloads parameters and optimizer states
  to NVMe swap files in a temporary ``nvme_path``.
* ``fits-trainer``: ``--fits`` consecutive ``fit`` + ``validate`` calls in one process, a new Trainer and module each
  time, stages 0-3 in turn, sync saves every few steps with the same rotation.
* ``fits-fabric``: ``--fits`` consecutive Fabric set-ups in one process (new Fabric, ``launch``, ``setup``, a few
  steps, four async ``fabric.save`` calls onto three fixed names, ``fabric.load``), stages 0-3 in turn.

Every rank samples its resident memory (``VmRSS``), open file descriptors (``/proc/self/fd``), Python threads,
native threads (``/proc/self/task``), the process groups ``torch.distributed`` holds, and the files under the
checkpoint directory and ``nvme_path``: every ``--save-every`` steps just before that step's save (the previous save
has long finished), or after each fit. The bounds (:func:`verdict`), after a warm-up of the first 10 % of the
samples (at least 2; whole stage cycles for the fit loops):

* RSS drift: the median of the last 10 % of samples is at most 2 % above the median of the first 10 % after the
  warm-up (``--rss-bound``), for the resident set and for its anonymous part (``RssAnon``: the kernel drops file-backed
  pages under memory pressure, which lowers RSS and can hide a leak);
* fds, threads, native threads, process groups, files: the smallest value over the last 10 % of samples is no larger
  than the largest over the baseline window (zero growth: a leak raises every later sample, a socket still being
  closed at one sample raises only that one), and the checkpoint directory never shows more than ``save_top_k``
  checkpoints + ``last.ckpt`` (three fixed names in the Fabric loop; hidden ``.partial`` directories of async saves
  still being written count among the files only).

It prints a markdown table, one row per configuration and rank, and exits 1 if any bound is exceeded. ``--json``
keeps every sample; ``--report FILE...`` prints the table again from such files.
``tests/reliability/test_endurance.py`` runs the same machinery briefly.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from tests.lightning_models import RegressionModule, dataset
from tests.ranks import run_distributed

WORLD = 2
TOP_K = 3
FIT_STEPS = 12  # per fit in the fit loops: saves at steps 3, 6, 9, 12, so each fit rotates one out
FIT_SAVE_EVERY = 3


@dataclass(frozen=True)
class Config:
    """One endurance configuration. ``kind``: ``"steps"`` (one long fit at ``stage``), ``"fits"`` or ``"fabric"``
    (loops whose fits go through ``stages`` in turn)."""

    name: str
    kind: str
    stage: int = 2
    nvme: bool = False
    async_save: bool = False
    stages: tuple = (0, 1, 2, 3)

    def __post_init__(self):
        if self.kind not in ("steps", "fits", "fabric"):
            raise ValueError(f"Config.kind must be 'steps', 'fits' or 'fabric', got {self.kind!r}")
        if self.stage not in (0, 1, 2, 3) or not self.stages or not set(self.stages) <= {0, 1, 2, 3}:
            raise ValueError(f"Config.stage and Config.stages must be 0-3, got {self.stage!r} and {self.stages!r}")
        if self.nvme and self.stage != 3:
            raise ValueError("Config.nvme offloads parameters, which needs stage 3")


CONFIGS = {
    c.name: c
    for c in [
        *(
            Config(f"s{stage}-{mode}", "steps", stage, async_save=mode == "async")
            for stage in (0, 1, 2, 3)
            for mode in ("sync", "async")
        ),
        Config("s3-nvme-sync", "steps", 3, nvme=True),
        Config("s3-nvme-async", "steps", 3, nvme=True, async_save=True),
        Config("fits-trainer", "fits"),
        Config("fits-fabric", "fabric", async_save=True),
    ]
}


# ---------------------------------------------------------------------------------------------------- sampling
def memory() -> dict:
    """``{"rss": VmRSS, "anon": RssAnon}`` in bytes. RSS also counts file-backed pages (torch's libraries), which the
    kernel drops and reads back as other processes need memory; a leak grows the anonymous part."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key = {"VmRSS:": "rss", "RssAnon:": "anon"}.get(line.split(":")[0] + ":")
            if key:
                found[key] = int(line.split()[1]) * 1024
    if "rss" not in found:
        raise RuntimeError("no VmRSS in /proc/self/status")
    return found


def live_process_groups() -> int:
    """The process groups ``torch.distributed`` still holds (the default one included): ``_world.pg_map`` on torch
    2.x (torch keeps every group there until ``destroy_process_group``), the older module-level ``_pg_map`` else."""
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None) if world is not None else getattr(c10d, "_pg_map", None)
    if pg_map is None:
        raise RuntimeError("this torch keeps its process groups somewhere the endurance sampler does not know")
    return len(pg_map)


def _files_under(path: Optional[str]) -> int:
    if not path or not os.path.isdir(path):
        return 0
    return sum(len(files) for _, _, files in os.walk(path))


def sample(ckpt_dir: Optional[str], nvme_path: Optional[str], at: int) -> dict:
    # visible entries: checkpoints and last.ckpt; a hidden .X.partial is an async save still being written (steps
    # can outpace it), and what such saves leave behind shows in the file count
    entries = [e for e in os.listdir(ckpt_dir) if not e.startswith(".")] if ckpt_dir and os.path.isdir(ckpt_dir) else []
    return {
        "at": at,
        **memory(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "groups": live_process_groups() if dist.is_initialized() else 0,
        "ckpt_files": _files_under(ckpt_dir),
        "ckpt_entries": len(entries),
        "nvme_files": _files_under(nvme_path),
        "pyobjs": len(gc.get_objects()),
        "time": time.monotonic(),
    }


# ---------------------------------------------------------------------------------------------------- workloads
class EnduranceModule(RegressionModule):
    """The tests' tiny regression model with a constant learning rate (a per-step decay would reach denormals within
    a few thousand steps) and 128 batches per epoch, so epochs end now and then as in a real run."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(dataset(1024), batch_size=self.hparams.batch_size)


class _Sampler(Callback):
    """Samples every ``every`` steps in ``on_train_batch_end``, before ``ModelCheckpoint`` saves that step (Lightning
    runs checkpoint callbacks last). With ``minutes``, stops the fit once that much time has passed (rank 0's clock,
    broadcast, so the ranks stop at the same step): the table then says how many steps ran."""

    def __init__(self, every: int, ckpt_dir: str, nvme_path: Optional[str], minutes: Optional[float] = None):
        self.every, self.ckpt_dir, self.nvme_path, self.samples = every, ckpt_dir, nvme_path, []
        self.deadline = time.monotonic() + minutes * 60 if minutes else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            self.samples.append(sample(self.ckpt_dir, self.nvme_path, trainer.global_step))
            if self.deadline is not None and trainer.strategy.broadcast(time.monotonic() > self.deadline, src=0):
                trainer.should_stop = True


def _strategy(config: Config, stage: int, nvme_path: Optional[str], fabric: bool = False):
    if fabric:
        from lightning_zero.fabric import ZeroStrategy
    else:
        from lightning_zero import ZeroStrategy
    offload = dict(offload_optimizer="nvme", offload_params="nvme", nvme_path=nvme_path) if config.nvme else {}
    return ZeroStrategy(stage=stage, async_save=config.async_save, **offload)


def _trainer(strategy, ckpt_dir: str, max_steps: int, save_every: int, callbacks: list) -> Trainer:
    rotating = ModelCheckpoint(
        dirpath=ckpt_dir,
        filename="{step}",
        every_n_train_steps=save_every,
        save_top_k=TOP_K,
        monitor="step",
        mode="max",
        save_last=True,
        enable_version_counter=False,
    )
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=WORLD,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[*callbacks, rotating],
    )


def _paths(root: str, rank: int) -> tuple:
    ckpt_dir = os.path.join(root, "checkpoints")
    nvme_path = os.path.join(root, f"nvme-r{rank}")
    os.makedirs(nvme_path, exist_ok=True)
    return ckpt_dir, nvme_path


def _steps_worker(
    rank: int, world_size: int, config: dict, root: str, steps: int, save_every: int, minutes: Optional[float]
) -> None:
    config = Config(**config)
    torch.manual_seed(0)
    ckpt_dir, nvme_path = _paths(root, rank)
    sampler = _Sampler(save_every, ckpt_dir, nvme_path, minutes)
    trainer = _trainer(_strategy(config, config.stage, nvme_path), ckpt_dir, steps, save_every, [sampler])
    trainer.fit(EnduranceModule())
    sampler.samples.append(sample(ckpt_dir, nvme_path, trainer.global_step))  # after teardown
    Path(root, f"samples-r{rank}.json").write_text(json.dumps(sampler.samples))


def _fits_worker(rank: int, world_size: int, config: dict, root: str, fits: int) -> None:
    config = Config(**config)
    ckpt_dir, nvme_path = _paths(root, rank)
    samples = []
    for index in range(fits):
        torch.manual_seed(index)
        module = EnduranceModule()
        stage = config.stages[index % len(config.stages)]
        trainer = _trainer(_strategy(config, stage, nvme_path), ckpt_dir, FIT_STEPS, FIT_SAVE_EVERY, [])
        trainer.fit(module)
        trainer.validate(module, dataloaders=DataLoader(dataset(16, seed=8), batch_size=4), verbose=False)
        samples.append(sample(ckpt_dir, nvme_path, index + 1))
    Path(root, f"samples-r{rank}.json").write_text(json.dumps(samples))


def _fabric_worker(rank: int, world_size: int, config: dict, root: str, fits: int) -> None:
    from lightning.fabric import Fabric

    config = Config(**config)
    ckpt_dir, nvme_path = _paths(root, rank)
    x, y = dataset(FIT_STEPS * 4 * world_size).tensors
    samples = []
    for index in range(fits):
        stage = config.stages[index % len(config.stages)]
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=_strategy(config, stage, None, True))
        fabric.launch()  # the ranks exist already: sets up the (existing) process group and the mesh
        torch.manual_seed(index)
        with fabric.init_module():
            module = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
        for step in range(FIT_STEPS):
            rows = slice((step * world_size + rank) * 4, (step * world_size + rank + 1) * 4)
            fabric.backward(nn.functional.mse_loss(model(x[rows]), y[rows]))
            optimizer.step()
            optimizer.zero_grad()
            if (step + 1) % FIT_SAVE_EVERY == 0:  # onto fixed names: each save replaces a complete checkpoint
                name = f"slot{(step + 1) // FIT_SAVE_EVERY % TOP_K}.ckpt"
                fabric.save(os.path.join(ckpt_dir, name), {"model": model, "optimizer": optimizer, "step": step})
        fabric.load(os.path.join(ckpt_dir, "slot1.ckpt"), {"model": model, "optimizer": optimizer})
        fabric.barrier()
        samples.append(sample(ckpt_dir, nvme_path, index + 1))
    Path(root, f"samples-r{rank}.json").write_text(json.dumps(samples))


def run_config(
    config: Config, root: Path, steps: int, save_every: int, fits: int, minutes: Optional[float] = None
) -> dict:
    """Run one configuration in ``root`` (a long run stops after ``minutes`` if given); returns ``{"seconds": ...,
    "ranks": [samples of rank 0, of rank 1]}``."""
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if config.kind == "steps":
        run_distributed(_steps_worker, WORLD, asdict(config), str(root), steps, save_every, minutes)
    else:
        worker = _fits_worker if config.kind == "fits" else _fabric_worker
        run_distributed(worker, WORLD, asdict(config), str(root), fits)
    seconds = time.perf_counter() - start
    ranks = [json.loads((root / f"samples-r{rank}.json").read_text()) for rank in range(WORLD)]
    return {"seconds": seconds, "ranks": ranks}


# ---------------------------------------------------------------------------------------------------- bounds
COUNTS = ("fds", "threads", "tasks", "groups", "ckpt_files", "nvme_files")


def windows(samples: list, cycle: int = 1) -> tuple:
    """``(baseline, last)``: the samples right after the warm-up and the last ones, each 10 % of the samples (at
    least 2, rounded up to whole ``cycle``s: the fit loops go through the stages in turn)."""

    def whole(n: int) -> int:
        return max(cycle, -(-n // cycle) * cycle)

    width = whole(max(2, len(samples) // 10))
    warm = whole(max(2, len(samples) // 10))
    if len(samples) < warm + 2 * width:
        raise ValueError(f"{len(samples)} samples are too few for a warm-up and two windows of {width}")
    return samples[warm : warm + width], samples[-width:]


def verdict(samples: list, rss_bound: float = 0.02, cycle: int = 1, max_entries: Optional[int] = None) -> dict:
    """The figures of one rank's samples and the bounds they exceed (``failures``, empty when all hold)."""
    baseline, last = windows(samples, cycle)
    base_rss = statistics.median(s["rss"] for s in baseline)
    end_rss = statistics.median(s["rss"] for s in last)
    figures = {
        "samples": len(samples),
        "rss_base": base_rss,
        "rss_end": end_rss,
        "drift": (end_rss - base_rss) / base_rss,
        "failures": [],
    }
    if figures["drift"] > rss_bound:
        figures["failures"].append(f"RSS drift {figures['drift']:+.2%} > {rss_bound:.0%}")
    if all("anon" in s for s in samples):  # (samples taken before RssAnon was sampled have none)
        base_anon = statistics.median(s["anon"] for s in baseline)
        figures["anon_drift"] = (statistics.median(s["anon"] for s in last) - base_anon) / base_anon
        if figures["anon_drift"] > rss_bound:
            figures["failures"].append(f"anonymous RSS drift {figures['anon_drift']:+.2%} > {rss_bound:.0%}")
    for key in COUNTS:
        # A leak raises every later sample; a socket or thread that is still being closed when a sample is taken
        # raises one. So the fewest over the last window is held to the most over the baseline window.
        base, end = max(s[key] for s in baseline), min(s[key] for s in last)
        figures[key] = (base, end)
        if end > base:
            figures["failures"].append(f"{key} grew {base} -> {end}")
    # Python objects the collector tracks: shown, not bounded (caches fill at their own pace), they tell a Python-level
    # leak from allocator growth when RSS drifts
    figures["pyobjs"] = (statistics.median(s["pyobjs"] for s in baseline), statistics.median(s["pyobjs"] for s in last))
    most = max(s["ckpt_entries"] for s in samples)
    figures["ckpt_entries"] = most
    if max_entries is not None and most > max_entries:
        figures["failures"].append(f"{most} entries in the checkpoint directory > {max_entries}")
    return figures


def judge(config: Config, result: dict, rss_bound: float) -> list:
    """One :func:`verdict` per rank. The long runs' last sample (after teardown) is left out of the windows: the
    Trainer then no longer holds the model; the loops' samples are all taken between fits."""
    cycle = len(config.stages) if config.kind != "steps" else 1
    # top-k + last.ckpt; the Fabric loop saves onto TOP_K fixed names
    entries = TOP_K + (1 if config.kind != "fabric" else 0)
    return [
        verdict(samples[:-1] if config.kind == "steps" else samples, rss_bound, cycle, entries)
        for samples in result["ranks"]
    ]


def table(rows: list) -> str:
    """``rows``: ``(config name, run length, seconds, [figures per rank])``."""

    def pair(values: tuple) -> str:
        return str(values[0]) if values[0] == values[1] else f"{values[0]} -> {values[1]}"

    lines = [
        "| config | run | rank | samples | RSS base -> end (MiB) | drift | anon drift | fds | threads "
        "| native threads | groups | ckpt files | ckpt entries (max) | nvme files | Python objects | time (s) "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, length, seconds, ranks in rows:
        for rank, f in enumerate(ranks):
            if "error" in f:
                lines.append(f"| {name} | {length} | all | | | | | | | | | | | | | | FAILED: {f['error']} |")
                continue
            anon = f"{f['anon_drift']:+.2%}" if "anon_drift" in f else "n/a"
            lines.append(
                f"| {name} | {length} | {rank} | {f['samples']} | {f['rss_base'] / 2**20:.1f} -> "
                f"{f['rss_end'] / 2**20:.1f} | {f['drift']:+.2%} | {anon} | {pair(f['fds'])} | {pair(f['threads'])} | "
                f"{pair(f['tasks'])} | {pair(f['groups'])} | {pair(f['ckpt_files'])} | {f['ckpt_entries']} | "
                f"{pair(f['nvme_files'])} | {f['pyobjs'][0]:.0f} -> {f['pyobjs'][1]:.0f} | {seconds:.0f} | "
                f"{'; '.join(f['failures']) or 'ok'} |"
            )
    return "\n".join(lines)


def rows_of(raw: dict, rss_bound: float) -> list:
    """The table's rows for ``{config name: run_config's result, or {"error": message}}``."""
    rows = []
    for name, result in raw.items():
        config = CONFIGS[name]
        length = result.get("length") or (
            f"{result['ranks'][0][-1]['at']} steps" if config.kind == "steps" else f"{len(result['ranks'][0])} fits"
        )
        if "error" in result:
            rows.append((name, length, 0.0, [{"error": result["error"]}]))
            continue
        try:
            figures = judge(config, result, rss_bound)
        except ValueError as error:  # too few samples for the windows
            figures = [{"error": str(error)}]
        rows.append((name, length, result["seconds"], figures))
    return rows


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--fits", type=int, default=50)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="stop each long run after this many minutes (the table says how many steps ran)",
    )
    parser.add_argument("--rss-bound", type=float, default=0.02, help="largest RSS drift after warm-up (0.02 = 2%%)")
    parser.add_argument("--root", type=Path, default=None, help="where to run (default: a new temporary directory)")
    parser.add_argument("--json", type=Path, default=None, help="also write every sample here")
    parser.add_argument("--report", type=Path, nargs="+", default=None, help="print the table of --json files")
    args = parser.parse_args(argv)
    if args.report:
        raw = {name: result for path in args.report for name, result in json.loads(path.read_text()).items()}
    else:
        raw = _run_all(args)
    rows = rows_of(raw, args.rss_bound)
    print(table(rows))
    return 0 if all(not f.get("failures", True) for row in rows for f in row[3]) else 1


def _run_all(args) -> dict:
    base = Path(args.root or tempfile.mkdtemp(prefix="lz-endurance-"))
    raw = {}
    for name in args.configs:
        config = CONFIGS[name]
        length = f"{args.steps} steps" if config.kind == "steps" else f"{args.fits} fits"
        try:
            result = run_config(config, base / name, args.steps, args.save_every, args.fits, args.minutes)
        except Exception as error:  # a failed run is a row of the table too; the other configurations still run
            message = str(error).strip().splitlines()[-1][:200] if str(error).strip() else type(error).__name__
            print(f"{name} failed:\n{error}", file=sys.stderr)
            result = {"error": message}
        else:
            ran = result["ranks"][0][-1]["at"]
            if config.kind == "steps" and ran < args.steps:
                length = f"{ran} of {args.steps} steps (--minutes {args.minutes:g})"
        raw[name] = {**result, "length": length}
        print("\n".join(table(rows_of({name: raw[name]}, args.rss_bound)).splitlines()[2:]), flush=True)
        if args.json:  # after each configuration, so a run cut short keeps what it measured
            args.json.write_text(json.dumps(raw))
    return raw


if __name__ == "__main__":
    sys.exit(main())
