"""Deterministic per-step counts of a training loop, for ``bench_stages.py --count DIR`` (the framework tax).

On a machine shared with other work the step time moves by tens of percent between runs; what a step *does* does
not. Over ``n`` full loop cycles after warm-up (from the start of step ``warmup`` to the start of step
``warmup + n``, so the loop's own work between two steps, fetching the batch, Lightning's bookkeeping, is counted),
rank 0 records:

- ``py_calls``: Python function calls (``cProfile``), in total and per area (Lightning, lightning_zero, FSDP2, DDP,
  DTensor, torch.optim, DeepSpeed, other), and the functions called most;
- ``dtensor_dispatch``: DTensor operator dispatches (``OpDispatcher.dispatch``: one per op on a DTensor);
- ``aten_ops``: ATen operators the torch profiler saw (nested ones included);
- ``allocations``: tensor storage allocations (the profiler's memory events with a positive size).

Every figure is per step. Both recorders slow the step down: never read a time from a counted run.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
from collections import Counter

# Areas by path fragment, first match wins; the lightning_zero checkout can sit anywhere, so match its package name.
AREAS = (
    ("lightning_zero", "/lightning_zero/"),
    ("lightning", "/lightning/"),
    ("dtensor", "torch/distributed/tensor/"),
    ("fsdp2", "torch/distributed/fsdp/"),
    ("ddp", "torch/nn/parallel/"),
    ("c10d", "torch/distributed/"),
    ("optim", "torch/optim/"),
    ("autograd", "torch/autograd/"),
    ("deepspeed", "/deepspeed/"),
    ("torch_other", "/torch/"),
)


def area(filename: str) -> str:
    for name, fragment in AREAS:
        if fragment in filename:
            return name
    return "other"


def _short(filename: str) -> str:
    return filename.split("site-packages/")[-1].replace(os.path.dirname(os.path.dirname(__file__)) + "/", "")


class StepCounter:
    """Counts ``steps`` full loop cycles from step ``warmup`` on rank 0 when ``args.count`` names a directory."""

    def __init__(self, args, rank: int, job: dict):
        self.args, self.job = args, job
        self.active = bool(getattr(args, "count", None)) and rank == 0
        self.cycles = max(1, args.steps - 1)  # the last step has no next start to close its cycle
        self.python = self.torch = None

    def step_begin(self, index: int) -> None:
        if not self.active:
            return
        if index == self.args.warmup and self.python is None:
            from torch.profiler import ProfilerActivity, profile

            self.torch = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.torch.start()
            self.python = cProfile.Profile()
            self.python.enable()
        elif index == self.args.warmup + self.cycles and self.python is not None:
            self.finish()

    def finish(self) -> None:
        if self.python is None:
            return
        self.python.disable()
        self.torch.stop()
        counts = self._counts()
        self.python = self.torch = None
        self.active = False
        job = self.job
        os.makedirs(self.args.count, exist_ok=True)
        before = "_before" if job.get("src") else ""  # --peers before runs the same kind from another checkout
        name = f"{job['model']}_{job['precision']}_{job['kind'].replace(':', '_').replace('+', '_')}{before}.json"
        with open(os.path.join(self.args.count, name), "w") as f:
            json.dump({"job": job, "cycles": self.cycles, **counts}, f, indent=1)

    def _counts(self) -> dict:
        n = self.cycles
        stats = pstats.Stats(self.python).stats  # (file, line, name) -> (primitive, total calls, tt, ct, callers)
        per_area: Counter = Counter()
        per_function: Counter = Counter()
        per_file: Counter = Counter()  # calls made from each file (a built-in's calls go to its callers' files)
        dispatch = 0
        for (filename, line, function), (_, calls, _tt, _ct, callers) in stats.items():
            if function == "<module>":
                continue
            per_area[area(filename)] += calls
            per_function[f"{_short(filename)}:{line}({function})"] += calls
            for (caller_file, *_where), caller_counts in callers.items():
                per_file[_short(caller_file)] += caller_counts[1] if isinstance(caller_counts, tuple) else caller_counts
            if function == "dispatch" and filename.endswith("distributed/tensor/_dispatch.py"):
                dispatch += calls
        ops = allocations = 0
        stack = list(self.torch.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            tag = str(event.tag)
            if tag.endswith("TorchOp") and event.name.startswith("aten::"):
                ops += 1
            elif tag.endswith("Allocation") and event.extra_fields.alloc_size > 0:
                allocations += 1
        return {
            "py_calls": sum(per_area.values()) / n,
            "areas": {k: v / n for k, v in per_area.most_common()},
            "dtensor_dispatch": dispatch / n,
            "aten_ops": ops / n,
            "allocations": allocations / n,
            "top_functions": {k: v / n for k, v in per_function.most_common(200)},
            "calls_from_file": {k: v / n for k, v in per_file.most_common(60)},
        }


def table(directory: str) -> str:
    """The counts of every JSON file in ``directory`` as one markdown table."""
    rows = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                rows.append(json.load(f))
    keys = ("lightning", "lightning_zero", "fsdp2", "ddp", "dtensor", "optim")
    lines = [
        "| model | precision | run | Python calls | " + " | ".join(keys) + " | DTensor dispatches | aten ops | "
        "allocations |",
        "|---" * (7 + len(keys)) + "|",
    ]
    for r in rows:
        job = r["job"]
        run = job["kind"] + (" (before)" if job.get("src") else "")
        lines.append(
            f"| {job['model']} | {job['precision']} | {run} | {r['py_calls']:.0f} | "
            + " | ".join(f"{r['areas'].get(k, 0):.0f}" for k in keys)
            + f" | {r['dtensor_dispatch']:.0f} | {r['aten_ops']:.0f} | {r['allocations']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(table(sys.argv[1]))
