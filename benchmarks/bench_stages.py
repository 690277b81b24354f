"""Step time and per-rank peak memory: ZeroStrategy vs DeepSpeed and Lightning's strategies, over a model matrix.

    python benchmarks/bench_stages.py                                  # the whole matrix (long: hours on 2 CPUs)
    python benchmarks/bench_stages.py --model mlp llama --precision bf16 --stages 2 3 --repeat 5
    python benchmarks/bench_stages.py --quick --model mlp --stages 0   # tiny shapes, 1 repeat: 8 cells, minutes
    python benchmarks/bench_stages.py --model gpt --plot               # also docs/img/bench_stages.png
    python benchmarks/bench_stages.py --load results.json --plot       # re-render a saved --json run
    python benchmarks/bench_stages.py --device cuda --nproc 1          # on a GPU
    python benchmarks/bench_stages.py --model gpt2 --peers deepspeed --batch 1 --warmup 1 --steps 2  # GPT-2 small

Cells are model (``gpt``: examples/gpt.py's GPT; ``mlp``: flat Linear+GELU; ``llama``: a tiny Hugging Face Llama,
see ``_bench_models.py``; opt-in ``gpt2``: GPT-2 small's shape, 124M parameters) x precision (``fp32``:
``precision="32-true"``; ``bf16``: ``"bf16-mixed"``; opt-in ``bf16t``: ``"bf16-true"``; DeepSpeed runs
``bf16.enabled`` for both bf16 columns, whose all-bf16 forward over fp32 masters is what our ``bf16-true`` computes
at stages 2-3) x ZeRO configuration (stage 0-3, ``2+cpu``/``3+cpu`` offload). Each cell runs ZeroStrategy and its
peers: DeepSpeed at the same stage/precision/offload, Lightning's DDPStrategy for stage 0 and Lightning's
ModelParallelStrategy (FSDP2, the blocks sharded by hand, bf16 compute copies under bf16) for stages 2 and 3, and,
opt-in, the compute floor (``--peers floor``: the same computation with no collectives and no framework, see
``_bench_workers.run_floor``): ``floor / peer`` is the lowest step-time ratio to that peer any implementation can
reach; ``--peers sync``: the floor plus one synchronisation of the ranks per step, which every data-parallel step
has, so a tighter lower bound; ``--peers minimal`` (stages 0-2): a framework-free loop with the stage's least
communication over flat buffers (``_bench_workers.run_minimal``), what the collectives cost without any engine;
``--peers engine`` (stages 0-2): torch's own engine for the stage (DDP, ZeroRedundancyOptimizer, FSDP2 at the root)
in a bare loop (``_bench_workers.run_engine``), so ``ours / engine`` is what the Trainer and lightning_zero add.

Method. Every configuration runs in fresh spawned processes with the same model, seed, batches and optimizer (AdamW).
Time is the median wall time of a full training step (forward, backward, optimizer step) after warm-up; memory is
the growth of the peak resident set (``VmHWM``, reset after the same set of imports on every side, see
``_bench_workers._PRELOAD``) on CPU, the CUDA allocator's peak on GPU;
both are the maximum over ranks. Within a cell the runs alternate, ours then each peer, ``--repeat`` times
(A B C A B C ...), so slow drift of a shared machine hits every side alike; each repeat gives one ratio ours/peer
and the table prints the median ratio and its range over the repeats. Ratios below 1 mean ZeroStrategy is faster
(or smaller). Absolute times on a loaded machine mean little; the paired ratios are the figures to read.

``--count DIR`` writes deterministic per-step counts of every run (Python calls by area, DTensor dispatches, aten
ops, tensor allocations: ``_bench_counts.py``), the evidence that survives a loaded machine.

``--profile DIR`` records the torch profiler's CPU ops on rank 0 over the measured steps of every run and writes
the top ops by self CPU time share as JSON into DIR (profiled runs are slower: do not read their timings).

[Note: CPU peak RSS at stages 2-3 and glibc]
FSDP2 allocates and frees per-unit all-gather and reduce-scatter buffers every step; with glibc's dynamic mmap
threshold those end up on the heap and fragment it (a stage-2 run's RSS used to climb for ~7 steps and settle
~2.6x above what the tensors need). ``apply_zero`` now pools those buffers on CPU
(``lightning_zero.distributed.comm_buffers``), which removes part of the climb; the gathered parameters and autograd's
unsharded gradients still go through glibc. ``MALLOC_MMAP_THRESHOLD_=1048576`` (a fixed threshold: large blocks are
mmapped and returned) shows the allocator-neutral figure for both sides, at the price of page faults on every step.
On CUDA the caching allocator makes the question moot.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import statistics
import sys

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401

from benchmarks import _bench_models as models  # noqa: E402
from benchmarks.common import dated_results  # noqa: E402

STAGES = ("0", "1", "2", "3", "1+cpu", "2+cpu", "3+cpu")
PEERS = ("deepspeed", "ddp", "modelparallel", "fsdp", "floor", "sync", "minimal", "engine", "before")
LIGHTNING_PEERS = ("ddp", "modelparallel", "fsdp")  # what --no-lightning drops
BF16_MIXED_ONLY = ("minimal", "engine")  # bare loops computing bf16 as autocast over fp32 weights: no bf16t
LABELS = {
    "deepspeed": "DeepSpeed",
    "ddp": "Lightning DDP",
    "modelparallel": "Lightning ModelParallel (FSDP2)",
    "fsdp": "Lightning FSDP (FSDP1)",
    "floor": "compute floor (no collectives)",
    "sync": "compute floor + one sync per step",
    "minimal": "minimal loop (no framework, flat collectives)",
    "engine": "torch's engine, bare loop (DDP, ZeroRedundancyOptimizer, FSDP2)",
    "before": "ZeroStrategy of --before-src (before a change)",
}
DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "img", "bench_stages.png")


def peer_kinds(stage: str, peers) -> list[tuple[str, str]]:
    """(peer, job kind) pairs that compare with ZeroStrategy at ``stage``: DeepSpeed everywhere, DDP at stage 0,
    Lightning's sharded strategies at stages 2 (no reshard after forward) and 3 (reshard)."""
    out = []
    for peer in peers:
        if peer == "deepspeed":
            out.append((peer, f"deepspeed:{stage}"))
        elif peer == "ddp" and stage == "0":
            out.append((peer, "ddp"))
        elif peer == "modelparallel" and stage in ("2", "3"):
            out.append((peer, f"modelparallel:{stage}"))
        elif peer == "fsdp" and stage in ("2", "3"):
            out.append((peer, "fsdp:" + ("SHARD_GRAD_OP" if stage == "2" else "FULL_SHARD")))
        elif peer in ("floor", "sync"):
            out.append((peer, f"{peer}:{stage}"))
        elif peer in ("minimal", "engine") and stage in ("0", "1", "2"):
            out.append((peer, f"{peer}:{stage}"))
        elif peer == "before":
            out.append((peer, f"zero:{stage}"))
    return out


def run_cell(model: str, precision: str, stage: str, args, measure) -> dict:
    """Every run of one cell, alternating ours and the peers ``args.repeat`` times; a failed run records None.

    DeepSpeed on CPU aborts now and then ("terminate called without an active exception") in configurations that
    pass on the next launch: one retry, then the failure is reported on stderr and in the table, never hidden."""
    sides = [("ours", f"zero:{stage}")] + peer_kinds(stage, args.peers)
    runs = {side: [] for side, _ in sides}
    for repeat in range(args.repeat):
        for side, kind in sides:
            job = {"model": model, "precision": precision, "kind": kind}
            if side == "before":
                job["src"] = args.before_src
            result = None
            for attempt in range(2 if side == "deepspeed" else 1):
                try:
                    result = measure(job, args)
                    break
                except Exception as err:
                    print(
                        f"{model} {precision} {kind} repeat {repeat + 1} attempt {attempt + 1}: failed "
                        f"({type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1][:160]})",
                        file=sys.stderr,
                        flush=True,
                    )
            runs[side].append(result)
            print(
                f"{model} {precision} {kind} repeat {repeat + 1}/{args.repeat}: {result}", file=sys.stderr, flush=True
            )
    return {"model": model, "precision": precision, "stage": stage, "runs": runs}


def _stats(values):
    return (statistics.median(values), min(values), max(values)) if values else None


def summarize(cell: dict) -> list[dict]:
    """One row per peer: median and range over repeats of the paired ratios ours/peer (time and memory)."""
    rows, ours = [], cell["runs"]["ours"]
    for peer, theirs in cell["runs"].items():
        if peer == "ours":
            continue
        pairs = [(a, b) for a, b in zip(ours, theirs) if a and b and b[0] > 0 and b[1] > 0]
        rows.append(
            {
                "model": cell["model"],
                "precision": cell["precision"],
                "stage": cell["stage"],
                "peer": peer,
                "time_ratio": _stats([a[0] / b[0] for a, b in pairs]),
                "mem_ratio": _stats([a[1] / b[1] for a, b in pairs]),
                "ours": _stats([a[0] for a in ours if a]),
                "theirs": _stats([b[0] for b in theirs if b]),
                "ours_mib": _stats([a[1] / 2**20 for a in ours if a]),
                "theirs_mib": _stats([b[1] / 2**20 for b in theirs if b]),
                "pairs": len(pairs),
                "repeats": len(ours),
            }
        )
    return rows


def _ratio(stats) -> str:
    if stats is None:
        return "failed"
    median, low, high = stats
    return f"{median:.2f} [{low:.2f}–{high:.2f}]" if high > low else f"{median:.2f}"


def _value(stats, fmt) -> str:
    return "failed" if stats is None else format(stats[0], fmt)


def render(cells: list[dict], out=None) -> list[dict]:
    """Print the markdown tables to ``out`` (default: ``sys.stdout`` as it is at the call); return the summary
    rows."""
    out = out or sys.stdout
    rows = [row for cell in cells for row in summarize(cell)]
    print(
        "| model | precision | ZeRO | peer | step time ratio | peak RSS/rank ratio | ours step (s) | "
        "peer step (s) | ours MiB/rank | peer MiB/rank |",
        file=out,
    )
    print("|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        print(
            f"| {r['model']} | {r['precision']} | {r['stage']} | {LABELS[r['peer']]} | {_ratio(r['time_ratio'])} | "
            f"{_ratio(r['mem_ratio'])} | {_value(r['ours'], '.3f')} | {_value(r['theirs'], '.3f')} | "
            f"{_value(r['ours_mib'], '.0f')} | {_value(r['theirs_mib'], '.0f')} |",
            file=out,
        )
    _render_engine_split(cells, rows, out)
    # bf16 against fp32 for ZeroStrategy itself: medians of separate cells (not paired runs), so read it loosely.
    ours = {(c["model"], c["precision"], c["stage"]): _stats([a[0] for a in c["runs"]["ours"] if a]) for c in cells}
    pairs = [(m, p, s, ours[(m, p, s)], ours.get((m, "fp32", s))) for m, p, s in ours if p != "fp32"]
    pairs = [(m, p, s, b[0] / f[0]) for m, p, s, b, f in pairs if b and f]
    if pairs:
        print("\n| ZeroStrategy bf16 / fp32 step time (medians of separate cells) | ratio |\n|---|---|", file=out)
        for model, precision, stage, ratio in pairs:
            print(f"| {model} {precision} stage {stage} | {ratio:.2f} |", file=out)
    return rows


def _render_engine_split(cells: list[dict], rows: list[dict], out) -> None:
    """Where both yardsticks ran, ``ours / minimal`` split into the adapter's tax (``ours / engine``: the Trainer and
    lightning-zero over torch's engine run bare) and the engine's price (``engine / minimal``: DDP, its ZeRO-1 and
    FSDP2 against flat buffers), each paired within its repeat as :func:`summarize` pairs them (the first two are
    its rows; the third is :func:`summarize` with the engine in ours' place)."""
    split = [c for c in cells if all(p in c["runs"] for p in ("ours", "engine", "minimal"))]
    if not split:
        return
    time_ratio = {(r["model"], r["precision"], r["stage"], r["peer"]): r["time_ratio"] for r in rows}
    print(
        "\n| model | precision | ZeRO | ours / minimal | ours / engine (the adapter over torch's engine) | "
        "engine / minimal (torch's engine against flat buffers) |\n|---|---|---|---|---|---|",
        file=out,
    )
    for cell in split:
        key = (cell["model"], cell["precision"], cell["stage"])
        engine = summarize(dict(cell, runs={"ours": cell["runs"]["engine"], "minimal": cell["runs"]["minimal"]}))
        ratios = [time_ratio[(*key, "minimal")], time_ratio[(*key, "engine")], engine[0]["time_ratio"]]
        print(f"| {' | '.join(key)} | {' | '.join(_ratio(r) for r in ratios)} |", file=out)


def plot(rows: list[dict], path: str) -> bool:
    """Bar chart of the median ratios (time and memory) with range whiskers; False with a message without
    matplotlib, which stays optional (``pip install matplotlib`` or the ``bench`` extra)."""
    if importlib.util.find_spec("matplotlib") is None:
        print("--plot needs matplotlib (pip install matplotlib); the table above has the same figures", file=sys.stderr)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["time_ratio"]]
    if not rows:
        print("--plot: no cell has a ratio to draw", file=sys.stderr)
        return False
    labels = [
        f"{r['model']} {r['precision']} stage {r['stage']}\nvs {LABELS[r['peer']].replace('Lightning ', 'L. ')}"
        for r in rows
    ]
    colors = {
        "deepspeed": "tab:blue",
        "ddp": "tab:orange",
        "modelparallel": "tab:green",
        "fsdp": "tab:gray",
        "floor": "tab:purple",
        "sync": "tab:pink",
        "minimal": "tab:brown",
        "engine": "tab:cyan",
        "before": "tab:olive",
    }
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.55 * len(rows)), 8), sharex=True)
    for ax, key, title in (
        (axes[0], "time_ratio", "step time, ours / peer"),
        (axes[1], "mem_ratio", "peak RSS per rank, ours / peer"),
    ):
        values = [r[key] or (float("nan"),) * 3 for r in rows]
        heights = [v[0] for v in values]
        errors = [[v[0] - v[1] for v in values], [v[2] - v[0] for v in values]]
        ax.bar(range(len(rows)), heights, yerr=errors, capsize=3, color=[colors[r["peer"]] for r in rows])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(title)
    axes[0].axhline(0.8, color="red", linewidth=0.8, linestyle="--")  # the step-time target against DeepSpeed
    axes[0].set_title(
        "ZeroStrategy / peer: median over repeats, whiskers the range\n"
        "(below 1: ours is faster or smaller; dashed: the 0.8 step-time target)",
        fontsize=10,
    )
    axes[1].set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"chart saved to {path}", file=sys.stderr)
    return True


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        nargs="+",
        default=["all"],
        choices=[*models.MODELS, *models.LARGE, "all"],
        help="models to run (default: all, the small matrix gpt mlp llama; gpt2, GPT-2 small's "
        "124M parameters, is opt-in: run it with --batch 1 and few steps on CPU)",
    )
    parser.add_argument(
        "--precision",
        nargs="+",
        default=["fp32", "bf16"],
        choices=["fp32", "bf16", "bf16t"],
        help="fp32: 32-true; bf16: bf16-mixed; bf16t: bf16-true (opt-in), at stages 2-3 the "
        "numerics of DeepSpeed's bf16 engine (every op in bf16, fp32 masters)",
    )
    parser.add_argument(
        "--stages",
        nargs="+",
        default=["0", "1", "2", "3", "2+cpu", "3+cpu"],
        choices=STAGES,
        help="ZeRO configurations (default: 0 1 2 3 2+cpu 3+cpu)",
    )
    parser.add_argument(
        "--peers",
        nargs="+",
        default=["deepspeed", "ddp", "modelparallel"],
        choices=PEERS,
        help="peers to compare with (default: deepspeed ddp modelparallel; fsdp, floor, sync, "
        "minimal and engine are opt-in; floor: the computation alone, no collectives; sync: the "
        "floor plus one synchronisation per step, a lower bound for any data-parallel step; "
        "minimal: a framework-free loop with the stage's least communication, stages 0-2; "
        "engine: torch's DDP, ZeroRedundancyOptimizer or FSDP2 in a bare loop, stages 0-2; see "
        "_bench_workers.run_floor, run_minimal and run_engine)",
    )
    parser.add_argument("--no-deepspeed", action="store_true", help="drop the DeepSpeed peer")
    parser.add_argument(
        "--no-lightning", action="store_true", help="drop Lightning's strategies (ddp, modelparallel, fsdp) as peers"
    )
    parser.add_argument("--repeat", type=int, default=None, help="alternated runs per cell (default 3; quick: 1)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 8; quick: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured first steps (default 3; quick: 1)")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch per rank (default 8; quick: 2)")
    parser.add_argument("--width", type=int, default=None, help="MLP width (default 1024)")
    parser.add_argument("--depth", type=int, default=None, help="MLP depth, Linear+GELU pairs (default 24)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 repeat, few steps (for tests)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", default=None, help="also write every run's raw figures here")
    parser.add_argument(
        "--results",
        default=None,
        metavar="DIR",
        help="where a measured run's dated record goes, <DIR>/bench_stages-<date>.md (the tables) "
        "and .json (the raw figures, for --load); default benchmarks/results, except --quick "
        "runs, which write one only when given --results",
    )
    parser.add_argument("--no-results", action="store_true", help="write no dated record")
    parser.add_argument("--load", default=None, help="render a saved --json file instead of measuring")
    parser.add_argument(
        "--plot",
        nargs="?",
        const=DEFAULT_PLOT,
        default=None,
        help="save a bar chart of the ratios (default path docs/img/bench_stages.png)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write the torch profiler's top ops (rank 0, measured steps) of every run into DIR",
    )
    parser.add_argument("--profile-top", type=int, default=10)
    parser.add_argument(
        "--before-src",
        default=None,
        metavar="DIR",
        help="with --peers before: a directory holding another version's lightning_zero package "
        "(e.g. `git archive <commit> lightning_zero | tar -x -C DIR`), run as a peer alternated "
        "with this one: a change's before and after in one run",
    )
    parser.add_argument(
        "--steady-heap",
        action="store_true",
        help="start every side's ranks with glibc's mmap threshold at 32 MiB and its trim threshold "
        "at 128 MiB (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), so that no rank hands its "
        "per-step buffers back to the OS and faults them in again the next step, which otherwise "
        "happens to one rank or another by its heap's layout (docs/performance.md)",
    )
    parser.add_argument(
        "--empty-model",
        action="store_true",
        help="instead of the matrix: Lightning's own per-step cost, a Trainer (and ZeroStrategy at "
        "stages 0-2) around a one-element model without optimizer work, against a bare loop "
        "(_bench_empty.py); --repeat alternated repeats",
    )
    parser.add_argument(
        "--empty-kinds",
        nargs="+",
        default=None,
        metavar="KIND",
        help="--empty-model: only these loops (bare trainer bare-dp ddp zero0-2 deepspeed0-2; default all)",
    )
    parser.add_argument("--empty-steps", type=int, default=200, help="timed steps of --empty-model (default 200)")
    parser.add_argument(
        "--empty-counted",
        type=int,
        default=20,
        help="steps of --empty-model whose Python calls are counted, after the timed ones",
    )
    parser.add_argument(
        "--count",
        default=None,
        metavar="DIR",
        help="write per-step counts (Python calls by area, DTensor dispatches, aten ops, tensor "
        "allocations; rank 0, full loop cycles after warm-up) of every run into DIR as JSON and "
        "print them as a table (_bench_counts.py; counted runs are slower: do not read their "
        "timings)",
    )
    return parser


def parse(argv=None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.no_results and args.results:
        parser.error("--results and --no-results contradict each other: pass one")
    quick = {"repeat": 1, "steps": 2, "warmup": 1, "batch": 2}
    full = {"repeat": 3, "steps": 8, "warmup": 3, "batch": 8}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("repeat", "steps", "warmup", "batch", "nproc"):
        if getattr(args, key) < (0 if key == "warmup" else 1):
            parser.error(f"--{key} must be {'>= 0' if key == 'warmup' else '>= 1'}, got {getattr(args, key)}")
    args.model = list(models.MODELS) if "all" in args.model else list(dict.fromkeys(args.model))
    args.peers = [
        p
        for p in dict.fromkeys(args.peers)
        if not (args.no_deepspeed and p == "deepspeed") and not (args.no_lightning and p in LIGHTNING_PEERS)
    ]
    unlike = [p for p in args.peers if p in BF16_MIXED_ONLY]
    if "bf16t" in args.precision and unlike and not args.load:
        parser.error(
            f"--peers {' '.join(unlike)} compute bf16 as bf16-mixed (autocast over fp32 weights), not "
            "bf16-true: run them with --precision fp32 bf16, and bf16t in a separate run without them"
        )
    for peer in args.peers if not args.load else []:
        if not any(peer_kinds(stage, [peer]) for stage in args.stages):  # said, never dropped silently
            print(
                f"--peers {peer}: no cell at --stages {' '.join(args.stages)} compares with it "
                f"(ddp: stage 0; modelparallel and fsdp: 2-3; minimal and engine: 0-2), so it does not run",
                file=sys.stderr,
            )
    if (
        "before" in args.peers
        and not args.load
        and not (args.before_src and os.path.isdir(os.path.join(args.before_src, "lightning_zero")))
    ):
        parser.error("--peers before needs --before-src DIR with a lightning_zero package in DIR")
    if "deepspeed" in args.peers and not args.load and importlib.util.find_spec("deepspeed") is None:
        parser.error("the DeepSpeed peer needs deepspeed (pip install -e '.[bench]'), or pass --no-deepspeed")
    return args


def _save(path, header, cells) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"header": header, "cells": cells}, f, indent=1)


def empty_model(args) -> dict:
    """``--empty-model``: every loop of ``_bench_empty.KINDS`` alternated ``--repeat`` times; prints the table."""
    from benchmarks import _bench_empty
    from benchmarks._bench_workers import spawn

    args.steps = args.empty_steps
    kinds = [f"empty:{k}" for k in args.empty_kinds] if args.empty_kinds else list(_bench_empty.KINDS)
    unknown = [k for k in kinds if k not in _bench_empty.KINDS]
    if unknown:
        raise SystemExit(f"--empty-kinds: unknown {unknown}; choose from {[k[6:] for k in _bench_empty.KINDS]}")
    results: dict = {kind: [] for kind in kinds}
    for repeat in range(args.repeat):
        for kind in kinds:
            job = {"model": "empty", "precision": "fp32", "kind": kind, "nproc": _bench_empty.world_of(kind)}
            try:
                ranks = spawn(job, args)
                result = (max(r["time"] for r in ranks), ranks[0]["calls"])
            except Exception as err:
                print(f"{kind} repeat {repeat + 1}: failed ({type(err).__name__}: {err})", file=sys.stderr)
                result = None
            results[kind].append(result)
            print(f"{kind} repeat {repeat + 1}/{args.repeat}: {result}", file=sys.stderr, flush=True)
    print(
        f"\nEmpty model: {args.steps} timed steps after {args.warmup} warm-up, Python calls over "
        f"{args.empty_counted} more; {args.repeat} alternated repeat(s)"
    )
    _bench_empty.table(results, sys.stdout)
    _save(args.json, "empty model", [{"empty": results}])
    return results


def record(args, header: str, cells: list[dict]) -> str | None:
    """The dated record of a measured run (``--results``): the header and tables as markdown, the raw figures as
    JSON beside them (``--load`` renders it again); the markdown's path, or None where no record is asked for."""
    if args.no_results or (args.quick and not args.results):
        return None
    out = io.StringIO()
    render(cells, out)
    path = dated_results(
        "bench_stages",
        args.results,
        {"header": header, "cells": cells},
        f"{header}\n\nCommand: `python -m benchmarks.bench_stages {' '.join(args.argv)}`\n\n" + out.getvalue(),
    )
    print(f"results written to {path} (and its .json)", file=sys.stderr)
    return path


def main(argv=None) -> list[dict]:
    args = parse(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.empty_model:
        return empty_model(args)
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        cells = saved["cells"]
        print(saved.get("header", ""))
    else:
        from benchmarks._bench_workers import measure

        cells, header = [], []
        for model in args.model:
            reason = models.unavailable(model)
            if reason:
                print(reason, file=sys.stderr)
                header.append(f"({reason})")
                continue
            header.append(models.describe(model, args))
            for precision in args.precision:
                for stage in args.stages:
                    cells.append(run_cell(model, precision, stage, args, measure))
                    _save(args.json, "partial run: " + "; ".join(header), cells)  # a cut-off run keeps its cells
        header = (
            f"{args.nproc} ranks, {args.device}, AdamW, batch {args.batch}/rank, median of {args.steps} steps "
            f"after {args.warmup} warm-up, {args.repeat} alternated repeat(s) per cell"
            f"{', steady heap (--steady-heap)' if args.steady_heap else ''}; models: " + "; ".join(header)
        )
        print("\n" + header)
        _save(args.json, header, cells)
    rows = render(cells)
    if not args.load:
        record(args, header, cells)
    if args.count and not args.load:
        from benchmarks._bench_counts import table

        print("\nPer-step counts (rank 0):\n" + table(args.count))
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
