"""Capacity per memory rung: the deepest GPT each ZeRO configuration trains under the same per-rank memory cap.

    python benchmarks/bench_capacity.py                                    # the whole ladder (about an hour on 2 CPUs)
    python benchmarks/bench_capacity.py --rungs 3 3+nvme --peers ours deepspeed --cap-gib 1.5
    python benchmarks/bench_capacity.py --json capacity.json --load --plot  # redraw table and chart from the cache

For every rung of the ladder (stages ``0 1 2 3``, ``2+cpu``, ``3+cpu``, ``3+nvme``, and ``3+ac``: stage 3 with
activation checkpointing of every block) and every peer (``ours``: ZeroStrategy with its defaults;
``ours-tuned``: with its memory knob, ``OURS_TUNED``, stages 2-3 only; ``deepspeed``: DeepSpeed 0.19 with the
default ``zero_optimization`` section; ``deepspeed-tuned``: the same with the memory knobs turned down, see
``TUNED``), the depth (number of transformer blocks) of a GPT of fixed width is searched: the largest depth
whose 2 ranks each train ``--steps`` AdamW steps (fp32) without exceeding the cap. One try is one fresh launch
of the ranks (``_capacity_rank.py``; what the cap bounds is explained there: the rank's whole resident memory, so
on a CPU-only machine only NVMe takes model states out of it).

The search (``search_depth``): doubling from ``--start`` until a try fails, then a bisection between the deepest
success and the shallowest failure, each probe placed where a straight line through the successes' peak memory
meets the cap (memory grows linearly with depth), falling back to the midpoint whenever a guided probe did not halve
the bracket, until the bracket is one block wide. Every try is cached in ``--json`` under its full configuration, so
an interrupted run resumes where it stopped and ``--load`` redraws the table and the chart from the cached tries
(the bracket they show per rung and peer, whatever order of searches made them) without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401

# DeepSpeed's side of a try, defined where the rank builds its engine
from benchmarks._capacity_rank import TUNED, TUNED_AIO_BUFFER, deepspeed_config  # noqa: E402, F401
from benchmarks.common import dated_results  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))

RUNGS = ("0", "1", "2", "3", "2+cpu", "3+cpu", "3+nvme", "3+ac")
PEERS = ("ours", "ours-tuned", "deepspeed", "deepspeed-tuned")
LABELS = {
    "ours": "ZeroStrategy",
    "ours-tuned": "ZeroStrategy (memory-tuned)",
    "deepspeed": "DeepSpeed (default)",
    "deepspeed-tuned": "DeepSpeed (memory-tuned)",
}
JUDGED = ("ours", "deepspeed", "deepspeed-tuned")  # the targets compare ZeroStrategy's defaults with both DeepSpeeds'
# ZeroStrategy's memory knob, the counterpart of TUNED's smaller buckets: one FSDP2 unit per block at stages 2-3
# instead of blocks grouped up to 8 MiB, so the per-unit communication buffers are a block's size (no effect at
# stages 0-1, which have no units).
OURS_TUNED = {"unit_bytes": 0}
DEFAULT_JSON = os.path.join(_HERE, os.pardir, "docs", "img", "bench_capacity.json")
DEFAULT_PLOT = os.path.join(_HERE, os.pardir, "docs", "img", "bench_capacity.png")


def unavailable(peer: str, rung: str) -> str | None:
    """Why ``peer`` cannot run ``rung`` on this machine (shown in the table), or None."""
    if peer == "ours-tuned":
        from lightning_zero.distributed.units import check_unit_knobs

        knobs = {"unit_bytes": None, "param_persistence_threshold": None, "prefetch_bytes": None, **OURS_TUNED}
        try:  # ZeroStrategy's own rule (stages 0-1 have no FSDP2 units), asked rather than restated here
            check_unit_knobs(int(rung.partition("+")[0]), **knobs)
        except ValueError:
            return "stages 0-1 have no units to tune: the ZeroStrategy row"
    if peer.startswith("deepspeed") and rung.endswith("+nvme"):
        try:
            from deepspeed.ops.op_builder import AsyncIOBuilder

            if not AsyncIOBuilder().is_compatible(verbose=False):
                return "DeepSpeed's async_io op does not build here (libaio headers missing)"
        except Exception as err:  # noqa: BLE001 - any failure to load the op builder means the same
            return f"DeepSpeed's async_io op is unavailable ({type(err).__name__})"
    return None


def search_depth(probe, start: int, limit: int, cap: float, grow: float = 2.0, resolution: float = 0.0) -> dict:
    """The largest depth in ``[1, limit]`` for which ``probe(depth)`` succeeds, assuming success is monotone.

    From ``start`` the depth is multiplied (or, after a failure, divided) by ``grow`` until the boundary is
    bracketed; a search started from a neighbouring rung's answer passes a small ``grow``. The bisection stops when
    the bracket is one block wide, or ``resolution`` of the deepest success (a coarser answer in fewer tries).

    ``probe(depth)`` returns a dict with ``outcome`` (``"ok"`` or a failure) and, on success, ``peak`` (bytes, the
    figure the cap bounds). Returns ``{"depth": largest success or 0, "fail": shallowest failure or None (limit
    reached), "tries": [(depth, outcome), ...]}``."""
    tries, peaks = [], {}
    lo, hi = 0, None

    def run(depth):
        nonlocal lo, hi
        result = probe(depth)
        tries.append((depth, result["outcome"]))
        if result["outcome"] == "ok":
            lo = max(lo, depth)
            if result.get("peak"):
                peaks[depth] = result["peak"]
        else:
            hi = depth if hi is None else min(hi, depth)

    depth = max(1, min(start, limit))
    while hi is None and lo < limit:  # grow until a failure (or the limit)
        run(depth)
        if hi is None:
            guess = _guess(peaks, cap)
            # never more than 4x per step: a line through nearly flat peaks points far past the boundary
            depth = min(limit, max(depth + 1, int(grow * depth), min(guess + 1, 4 * depth) if guess else 0))
    if lo == 0 and hi is not None:  # the first try failed: shrink until one succeeds (or depth 1 fails)
        while lo == 0 and hi > 1:
            run(max(1, min(hi - 1, int(hi / grow))))
    halved = True
    while hi is not None and hi - lo > max(1, int(lo * resolution)):
        guess = _guess(peaks, cap) if halved else None
        middle = (lo + hi) // 2
        # a line saying that the failing depth fits is wrong near the boundary: bisect instead
        depth = min(hi - 1, max(lo + 1, guess)) if guess and guess < hi else middle
        width = hi - lo
        run(depth)
        halved = (hi - lo) * 2 <= width
    return {"depth": lo, "fail": hi, "tries": tries}


def _guess(peaks: dict, cap: float) -> int | None:
    """Where a line through the two deepest successes' peaks meets ``cap`` (None with fewer points or no slope)."""
    if len(peaks) < 2:
        return None
    (d1, p1), (d2, p2) = sorted(peaks.items())[-2:]
    slope = (p2 - p1) / (d2 - d1)
    if slope <= 0:
        return None
    return int(d2 + (cap - p2) / slope)


# ---------------------------------------------------------------------------------------------------------------------
# Tries, cached.


def count_params(width: int, heads: int, seq: int, vocab: int, depth: int) -> int:
    """Parameters of the benchmark GPT at ``depth`` (built on the meta device: nothing allocated)."""
    from types import SimpleNamespace

    import torch

    from benchmarks import _bench_models as models

    args = SimpleNamespace(
        quick=False, gpt={"n_layer": depth, "n_embd": width, "n_head": heads, "block_size": seq, "vocab": vocab}
    )
    with torch.device("meta"):
        return sum(p.numel() for p in models.build("gpt", args).parameters())


def try_key(job: dict, args) -> str:
    return (
        f"v2|{job['side']}|{job['rung']}|d{job['depth']}|w{args.width}h{args.heads}s{args.seq}v{args.vocab}"
        f"b{args.batch}|steps{args.steps}|cap{args.cap_gib}|{args.nproc}ranks"
    )


def make_probe(peer: str, rung: str, args, cache: dict, save):
    """``probe(depth)`` for ``search_depth``: a cached try, or a fresh launch (one retry of a non-memory error:
    DeepSpeed on CPU aborts now and then at teardown in runs that pass on the next launch)."""
    from benchmarks._capacity_rank import launch

    def probe(depth):
        job = {
            "side": peer,
            "rung": rung,
            "depth": depth,
            "width": args.width,
            "heads": args.heads,
            "seq": args.seq,
            "vocab": args.vocab,
            "batch": args.batch,
            "steps": args.steps,
        }
        if peer == "ours-tuned":
            job["options"] = dict(OURS_TUNED)
        key = try_key(job, args)
        if key not in cache:
            for _ in range(2):
                result = launch(job, args)
                if result["outcome"] != "error":
                    break
            cache[key] = dict(result, depth=depth, peer=peer, rung=rung)
            save()
        result = cache[key]
        print(
            f"  {rung:7} {peer:16} depth {depth:4}: {result['outcome']:7} "
            f"peak {_mib(result.get('cgroup_peak') or result.get('peak_rss'))} MiB  {result.get('detail', '')}",
            file=sys.stderr,
            flush=True,
        )
        return {"outcome": result["outcome"], "peak": result.get("cgroup_peak") or result.get("peak_rss")}

    return probe


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def ladder(args, cache: dict, make) -> list[dict]:
    """Search every (rung, peer) with the probes ``make(peer, rung, args, cache)`` gives; one row each. Each search
    after the first starts from the answer before it (the same rung's previous peer, or the previous rung), the
    likeliest place of the next boundary, growing by a quarter: about half the tries of a cold start."""
    rows, start, grow = [], args.start, 2.0
    for rung in args.rungs:
        for peer in args.peers:
            reason = unavailable(peer, rung)
            if reason:
                rows.append({"rung": rung, "peer": peer, "depth": None, "reason": reason})
                continue
            if args.load:  # what the cached tries show, whichever order of searches produced them
                found = bracket(peer, rung, cache, args)
                if not found["tries"]:
                    rows.append({"rung": rung, "peer": peer, "depth": None, "reason": "not run (run cut short)"})
                    continue
            else:
                found = search_depth(
                    make(peer, rung, args, cache),
                    start,
                    args.max_depth,
                    args.cap_gib * (1 << 30),
                    grow,
                    args.resolution,
                )
            rows.append(row_for(rung, peer, found, args, cache))
            if found["depth"]:
                start, grow = found["depth"], 1.25
    return rows


def bracket(peer: str, rung: str, cache: dict, args) -> dict:
    """What the cached tries of one (peer, rung) at ``args``' shape and cap show: the deepest success and the
    shallowest failure, ``incomplete`` where that bracket is wider than the search's stopping point."""
    prefix = try_key({"side": peer, "rung": rung, "depth": 0}, args).split("|d0|")
    tries = [
        (v["depth"], v["outcome"])
        for key, v in cache.items()
        if key.startswith(prefix[0] + "|d") and key.endswith("|" + prefix[1])
    ]
    ok = [d for d, outcome in tries if outcome == "ok"]
    failed = [d for d, outcome in tries if outcome != "ok"]
    depth, fail = max(ok, default=0), min(failed, default=None)
    done = (fail is None and depth >= args.max_depth) or (
        fail is not None and fail - depth <= max(1, int(depth * args.resolution))
    )
    return {"depth": depth, "fail": fail, "tries": tries, "incomplete": not done}


def row_for(rung, peer, found, args, cache) -> dict:
    """The table row of one search: the deepest success's figures, and why the next depth failed."""
    depth, fail = found["depth"], found["fail"]
    job = {
        "side": peer,
        "rung": rung,
        "width": args.width,
        "heads": args.heads,
        "seq": args.seq,
        "vocab": args.vocab,
        "batch": args.batch,
        "steps": args.steps,
    }
    best = cache.get(try_key(dict(job, depth=depth), args), {}) if depth else {}
    failed = cache.get(try_key(dict(job, depth=fail), args), {}) if fail else {}
    return {
        "rung": rung,
        "peer": peer,
        "depth": depth,
        "fail": fail,
        "fail_outcome": failed.get("outcome"),
        "fail_detail": failed.get("detail", ""),
        "params": count_params(args.width, args.heads, args.seq, args.vocab, depth) if depth else 0,
        "peak_rss": best.get("peak_rss"),
        "cgroup_peak": best.get("cgroup_peak"),
        "step_time": best.get("step_time"),
        "tries": len(found["tries"]),
        "cap": best.get("cap"),
        "incomplete": found.get("incomplete", False),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Output: the table, the targets, the chart.


def render(rows: list[dict], header: str, out=None) -> str:
    """The markdown of the ladder table and the targets table; printed to ``out`` (default: ``sys.stdout`` as it is
    at the call, so a redirection made after the import counts) and returned."""
    lines = [
        header,
        "",
        "| rung | peer | largest depth | parameters | peak RSS growth/rank (MiB) | "
        "cgroup peak/rank (MiB) | step time (s) | next depth | tries |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("depth") is None:
            lines.append(f"| {r['rung']} | {LABELS[r['peer']]} | n/a | | | | | {r['reason']} | 0 |")
            continue
        fail = "≥ limit" if r["fail"] is None else f"{r['fail']}: {r['fail_outcome']}"
        if r.get("incomplete"):
            fail = "search cut short" if r["fail"] is None else fail + " (search cut short)"
        step = "-" if r["step_time"] is None else f"{r['step_time']:.2f}"
        lines.append(
            f"| {r['rung']} | {LABELS[r['peer']]} | {r['depth']} | {r['params'] / 1e6:.1f}M | "
            f"{_mib(r['peak_rss'])} | {_mib(r['cgroup_peak'])} | {step} | {fail} | {r['tries']} |"
        )
    lines += [
        "",
        "| rung | ours / DeepSpeed default (parameters) | ours / DeepSpeed tuned | target | met |",
        "|---|---|---|---|---|",
    ]
    for rung, ratio, tuned, target, met in targets(rows):
        lines.append(f"| {rung} | {_fmt(ratio)} | {_fmt(tuned)} | {target} | {met} |")
    text = "\n".join(lines)
    print(text, file=out or sys.stdout)
    return text


def _fmt(value) -> str:
    return "n/a" if value is None else ("∞" if value == float("inf") else f"{value:.2f}")


def targets(rows: list[dict]) -> list[tuple]:
    """Per rung: ours/DeepSpeed default and ours/DeepSpeed tuned (parameters), the issue's target, and whether it
    is met (``n/a`` where a peer did not run): ≥ 1.0 and ≥ 0.9 everywhere, ≥ 1.2 over the default at 3+cpu/3+nvme."""
    by = {(r["rung"], r["peer"]): r.get("params") if r.get("depth") is not None else None for r in rows}
    cut = {(r["rung"], r["peer"]): r.get("incomplete") for r in rows}
    out = []
    for rung in dict.fromkeys(r["rung"] for r in rows):
        ours, default, tuned = (by.get((rung, p)) for p in JUDGED)
        ratio = None if ours is None or default is None else (ours / default if default else float("inf"))
        tuned_ratio = None if ours is None or tuned is None else (ours / tuned if tuned else float("inf"))
        need = 1.2 if rung in ("3+cpu", "3+nvme") else 1.0
        target = f"≥ {need} default, ≥ 0.9 tuned"
        checks = [ok for ok in (ratio is None or ratio >= need, tuned_ratio is None or tuned_ratio >= 0.9)]
        met = "n/a" if ratio is None and tuned_ratio is None else ("yes" if all(checks) else "no")
        if met != "n/a" and any(cut.get((rung, p)) for p in JUDGED):
            met += " (a search cut short: bounds, not answers)"
        out.append((rung, ratio, tuned_ratio, target, met))
    return out


def plot(rows: list[dict], path: str, title: str) -> bool:
    """Grouped bars: the largest model (millions of parameters) per rung and peer; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib, or the bench extra)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rungs = list(dict.fromkeys(r["rung"] for r in rows))
    peers = [p for p in PEERS if any(r["peer"] == p for r in rows)]
    by = {(r["rung"], r["peer"]): r for r in rows}
    colors = {"ours": "tab:green", "ours-tuned": "#98df8a", "deepspeed": "tab:blue", "deepspeed-tuned": "tab:cyan"}
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(rungs)), 4.5))
    width = 0.8 / max(1, len(peers))
    for i, peer in enumerate(peers):
        xs = [k + (i - (len(peers) - 1) / 2) * width for k in range(len(rungs))]
        values = [(by.get((rung, peer)) or {}).get("params") or 0 for rung in rungs]
        bars = ax.bar(xs, [v / 1e6 for v in values], width, label=LABELS[peer], color=colors[peer])
        for bar, rung in zip(bars, rungs):
            row = by.get((rung, peer)) or {}
            if row.get("depth") is None:  # not available to that peer, or never reached before the run stopped
                text = "not run" if "not run" in row.get("reason", "") else "n/a"
            else:  # a search cut short: its deepest success so far, a lower bound
                text = ("≥" if row.get("incomplete") else "") + str(row["depth"])
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 1),
                textcoords="offset points",
                rotation=90 if row.get("depth") is None else 0,
            )
    ax.set_xticks(range(len(rungs)), rungs)
    ax.set_xlabel(
        "rung (ZeRO stage, +offload, +ac = activation checkpointing); on a bar: depth in blocks (≥: search cut short)"
    )
    ax.set_ylabel("largest model trained (M parameters)")
    ax.set_title(title, fontsize=9)
    top = max([(r.get("params") or 0) / 1e6 for r in rows] + [1.0])
    ax.set_ylim(0, top * 1.3)  # room above the bars for the legend, so it hides no bar's label
    ax.legend(fontsize=8, ncol=len(peers), loc="upper center")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"chart saved to {path}", file=sys.stderr)
    return True


# ---------------------------------------------------------------------------------------------------------------------
# Command line.


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rungs", nargs="+", default=list(RUNGS), choices=RUNGS)
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--cap-gib", type=float, default=1.0, help="memory cap per rank, GiB (default 1.0)")
    parser.add_argument(
        "--cap-method",
        choices=["cgroup", "rlimit"],
        default="cgroup",
        help="cgroup (default; RLIMIT_DATA where none can be made) or RLIMIT_DATA",
    )
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    parser.add_argument("--steps", type=int, default=2, help="training steps per try (the last one is timed)")
    parser.add_argument("--start", type=int, default=8, help="first depth tried")
    parser.add_argument("--max-depth", type=int, default=256, help="deepest model tried")
    parser.add_argument(
        "--resolution",
        type=float,
        default=0.0,
        help="stop a search when its bracket is this fraction of the depth (default 0: one block)",
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per try before it counts as failed")
    parser.add_argument("--json", default=DEFAULT_JSON, help="the cache of every try (read, then extended)")
    parser.add_argument("--load", action="store_true", help="only render what --json holds; launch nothing")
    parser.add_argument("--markdown", default=None, help="also write the tables here")
    parser.add_argument(
        "--results",
        default=None,
        metavar="DIR",
        help="where a run that launched tries writes its dated record, "
        "<DIR>/bench_capacity-<date>.md (the tables) and .json (the rows); default "
        "benchmarks/results",
    )
    parser.add_argument("--no-results", action="store_true", help="write no dated record")
    parser.add_argument(
        "--plot",
        nargs="?",
        const=DEFAULT_PLOT,
        default=None,
        help="save the chart (default docs/img/bench_capacity.png)",
    )
    args = parser.parse_args(argv)
    if args.no_results and args.results:
        parser.error("--results and --no-results contradict each other: pass one")
    for key in ("width", "heads", "seq", "vocab", "batch", "steps", "start", "max_depth", "nproc"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.width % args.heads:
        parser.error("--width must be a multiple of --heads")
    if args.cap_gib <= 0:
        parser.error("--cap-gib must be > 0")
    return args


def header_line(args, caps=("a memory cgroup",)) -> str:
    """The table's first line; ``caps``: how the ranks were capped (``cgroup v1``, ``RLIMIT_DATA``...)."""
    return (
        f"Capacity per rung: {args.nproc} CPU ranks, each capped at {args.cap_gib:g} GiB by {' / '.join(caps)} "
        f"(what training adds to the imports both sides share); GPT width {args.width}, {args.heads} heads, "
        f"sequence {args.seq}, vocabulary {args.vocab}, micro-batch {args.batch}/rank, fp32, AdamW, "
        f"{args.steps} steps per try."
    )


def main(argv=None) -> list[dict]:
    args = parse(argv)
    cache = {}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            cache = json.load(f).get("tries", {})

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"header": header_line(args), "tries": cache}, f, indent=1, sort_keys=True)

    rows = ladder(args, cache, lambda peer, rung, a, c: make_probe(peer, rung, a, c, save))
    caps = sorted({r["cap"] for r in rows if r.get("cap")}) or ["a memory cgroup"]
    text = render(rows, header_line(args, caps))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if not args.load and not args.no_results:
        argv = sys.argv[1:] if argv is None else argv
        path = dated_results(
            "bench_capacity",
            args.results,
            {"header": header_line(args, caps), "rows": rows},
            f"{text}\n\nCommand: `python -m benchmarks.bench_capacity {' '.join(argv)}`",
        )
        print(f"results written to {path} (and its .json)", file=sys.stderr)
    if args.plot:
        plot(rows, args.plot, header_line(args, caps).replace("; ", ";\n", 1))
    return rows


if __name__ == "__main__":
    main()
