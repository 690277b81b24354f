"""A GPU machine's whole check in one command: the GPU tests, ZeroStrategy against DeepSpeed on a ~1.2B GPT, the
largest GPT that trains with CPU offload, one markdown report (``gpu_report.md``, with ``gpu_report.json``).

    bash benchmarks/gpu_wheels.sh          # once, here (network): deepspeed and what it lacks there, into .whl/
    # on the GPU machine, from the repository root, .whl carried, within a 540 s limit: the one line that
    # gpu_wheels.sh prints and docs/gpu.md ("How to run") holds, here split:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && set -o pipefail && \
        python3 benchmarks/gpu_suite.py --out $OUT 2>&1 | tee $OUT/gpu_suite.log
    python benchmarks/gpu_suite.py --dry-run                       # the plan, its estimates and budgets; runs nothing
    python benchmarks/gpu_suite.py --device cpu --tiny --out /tmp/gs   # the whole pipeline at a tiny size on CPU

Phases, in order, each with a time budget inside one global deadline (``--deadline``, default 420 s, counted from
the start: imports included); the default budgets (120 + 170 + 110 s) leave 20 s of it for the start-up and the last
report. A phase the deadline leaves too little time for is skipped and the report says so, a run that outlasts its
share is killed; the report is written before the first phase and after each:

1. ``tests``: ``python -m pytest tests/gpu -q``; the counts and the output's tail.
2. ``throughput``: examples/gpt.py's GPT (width 2048, 20 layers, 16 heads, vocabulary 50304, 1024 tokens: 1.22B
   parameters), micro-batch 8, bf16 (ours ``bf16-mixed``, DeepSpeed ``bf16.enabled``), AdamW (lr 1e-4) from
   ``torch.optim`` on both sides (DeepSpeed ``torch_adam``; its offloaded step ``zero_force_ds_cpu_optimizer:
   false``, so no op is JIT-built), at ZeRO 0, 3 and 3 + CPU offload. Each run is a fresh process on the same
   seeded model and batches: tokens/s from the median step time after warm-up (the GPU synchronised at both edges
   of every step on both sides), MFU from ``flops_per_token`` over the device's dense bf16 peak
   (``lightning_zero.estimate.flops``), the CUDA allocator's ``max_memory_allocated`` and the process's peak RSS.
3. ``capacity``: the largest depth of that GPT which trains 2 steps at stage 3 + CPU offload: the first probe is
   the depth ``lightning_zero.estimate_memory`` says fits the GPU, then bisection, never above what the host
   memory holds (``--ram-fraction``: every state lives there) nor above the depth whose probe is estimated to end
   within the phase's time (the throughput phase's 3 + CPU offload run's wall time, scaled by the parameter count).
4. ``ds_cpu_adam`` (opt-in, ``--ds-cpu-adam``): JIT-build DeepSpeed's ``DeepSpeedCPUAdam`` within the phase's
   time, then stage 3 + CPU offload with each side's own CPU optimizer (DeepSpeedCPUAdam, lightning_zero's CPUAdam).

Process groups: one process, world size 1, NCCL on the GPU (what a GPU job runs: FSDP2's reduce-scatter of CUDA
tensors needs it, and a one-rank communicator costs nothing), gloo on CPU. The runs reuse ``bench_stages.py``'s
workers (``_bench_workers.run_lightning``/``run_deepspeed``) so both benchmarks measure the same way.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401

from benchmarks import _gpu_suite_parts as parts  # noqa: E402
from benchmarks.common import ROOT  # noqa: E402

GIB = parts.GIB
FULL = {"n_layer": 20, "n_embd": 2048, "n_head": 16, "block_size": 1024, "vocab": 50304}
TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16, "vocab": 64}
PRECISION_FLAGS = {"bf16": "bf16-mixed", "bf16t": "bf16-true"}  # as _bench_workers.PRECISIONS
MIN_RUN_S = 20.0  # a run given less than this is not started: it could not even import its modules
# The deadline counts from main()'s start: it also holds the start-up (importing torch, asking nvidia-smi, a few
# seconds) and the report written after the last phase; the default budgets leave this much of it for those.
STARTUP_S = 15.0
# A capacity probe is planned to take at most this share of the time it may have: its time is an estimate.
PROBE_TIME_SHARE = 0.8


# --- arguments --------------------------------------------------------------------------------------------------


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="report folder (default: $OUT, else a new temporary folder)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when torch sees one")
    p.add_argument("--tiny", action="store_true", help="a tiny GPT and few steps: the pipeline's smoke test")
    p.add_argument("--dry-run", action="store_true", help="write the plan and its estimates; run nothing")
    p.add_argument(
        "--deadline",
        type=float,
        default=420.0,
        help="global wall-clock budget in s from the start, imports included (default 420)",
    )
    p.add_argument(
        "--phases",
        nargs="+",
        default=["tests", "throughput", "capacity"],
        choices=["tests", "throughput", "capacity"],
        help="phases to run (default: all three)",
    )
    p.add_argument("--ds-cpu-adam", action="store_true", help="also the ds_cpu_adam phase (a JIT build: minutes)")
    p.add_argument("--tests", default="tests/gpu", help="what pytest runs in the tests phase")
    # tests + throughput + capacity + STARTUP_S + the last report's reserve = the 420 s deadline (tests/
    # test_gpu_suite.py checks it): the device call's 540 s limit then still holds the machine's start-up.
    for phase, seconds in (("tests", 120), ("throughput", 170), ("capacity", 110), ("ds-cpu-adam", 160)):
        p.add_argument(f"--budget-{phase}", type=float, default=seconds, help=f"s (default {seconds})")
    p.add_argument("--configs", nargs="+", default=["0", "3", "3+cpu"], choices=["0", "1", "2", "3", "2+cpu", "3+cpu"])
    p.add_argument("--no-deepspeed", action="store_true", help="ours alone (DeepSpeed rows say why they are empty)")
    for key, value in FULL.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"GPT shape (default {value})")
    p.add_argument("--batch", type=int, default=None, help="micro-batch (default 8; tiny 2)")
    p.add_argument("--precision", choices=list(PRECISION_FLAGS), default="bf16")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5; tiny 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 3; tiny 1)")
    p.add_argument("--offload-steps", type=int, default=None, help="timed steps with offload (default 2; tiny 1)")
    p.add_argument("--offload-warmup", type=int, default=None, help="warm-up with offload (default 1)")
    p.add_argument("--run-timeout", type=float, default=90.0, help="cap per throughput run, s (offload: 1.5x)")
    p.add_argument("--probe-timeout", type=float, default=150.0, help="cap per capacity probe, s")
    p.add_argument("--capacity-probes", type=int, default=None, help="probe limit (default 3; tiny 2)")
    p.add_argument("--capacity-max-layers", type=int, default=None, help="the search's ceiling (default: host RAM)")
    p.add_argument("--ram-fraction", type=float, default=0.8, help="host memory the capacity probes may plan on")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU (default: looked up)")
    p.add_argument(
        "--assume",
        default=None,
        metavar="NAME,GPU_GIB,RAM_GIB",
        help="plan for this machine instead of the one here (with --dry-run), e.g. 'NVIDIA H100 80GB HBM3,79.2,125'",
    )
    args = p.parse_args(argv)
    tiny = {
        "batch": 2,
        "steps": 1,
        "warmup": 1,
        "offload_steps": 1,
        "offload_warmup": 1,
        "capacity_probes": 2,
        "capacity_max_layers": 4,
    }
    full = {"batch": 8, "steps": 5, "warmup": 3, "offload_steps": 2, "offload_warmup": 1, "capacity_probes": 3}
    for key, value in {**(TINY if args.tiny else FULL), **(tiny if args.tiny else full)}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("batch", "steps", "offload_steps", "capacity_probes", *FULL):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd ({args.n_embd}) must be divisible by --n-head ({args.n_head})")
    if not 0 < args.ram_fraction <= 1:
        p.error(f"--ram-fraction must be in (0, 1], got {args.ram_fraction}")
    if args.assume is not None:
        try:
            name, gpu, ram = args.assume.rsplit(",", 2)
            args.assume = {
                "name": name.strip(),
                "memory_bytes": int(float(gpu) * GIB),
                "ram_bytes": int(float(ram) * GIB),
            }
        except ValueError:
            p.error(f"--assume takes NAME,GPU_GIB,RAM_GIB, got {args.assume!r}")
        if not args.dry_run:
            p.error("--assume plans for another machine: it needs --dry-run")
        args.device = args.device or "cuda"
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out = args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_suite_")
    return args


def model_shape(args, n_layer: int | None = None) -> dict:
    shape = {key: getattr(args, key) for key in FULL}
    return {**shape, "n_layer": n_layer or shape["n_layer"]}


# --- the machine ------------------------------------------------------------------------------------------------


def _host_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_info(args) -> dict:
    """The device without creating a CUDA context in this process (it would hold GPU memory through every run):
    nvidia-smi's answer, else a child's."""
    info = {
        "cpus": os.cpu_count(),
        "ram_bytes": _host_ram(),
        "backend": f"{'NCCL' if args.device == 'cuda' else 'gloo'}, one process (world size 1)",
    }
    if args.device != "cuda":
        name, memory, capability = f"CPU ({platform.machine()})", _host_ram(), None
    elif args.assume:
        name, memory, capability = args.assume["name"], args.assume["memory_bytes"], "assumed (--assume)"
        info.update(ram_bytes=args.assume["ram_bytes"], cpus="assumed (--assume)")
    else:
        name, memory, capability = _query_gpu()
    from lightning_zero.estimate.flops import peak_flops_for

    peak = (
        args.peak_tflops * 1e12
        if args.peak_tflops
        else (peak_flops_for(name, "bf16") if args.device == "cuda" else None)
    )
    return {
        **info,
        "ram_gib": round(info["ram_bytes"] / GIB, 1),
        "name": name,
        "memory_bytes": memory,
        "memory_gib": round(memory / GIB, 1),
        "capability": capability,
        "peak_tflops_bf16": None if peak is None else round(peak / 1e12, 1),
    }


def _query_gpu() -> tuple[str, int, str]:
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        name, mib, capability = (part.strip() for part in line.split(","))
        memory = int(float(mib)) * 2**20
    except (OSError, ValueError, subprocess.SubprocessError):
        code = (
            "import json, torch; p = torch.cuda.get_device_properties(0); "
            "print(json.dumps([p.name, p.total_memory, f'{p.major}.{p.minor}']))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
        name, memory, capability = json.loads(out.strip().splitlines()[-1])
    return name, memory, capability


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "lightning", "pytorch-lightning", "deepspeed", "pydantic", "transformers"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    try:
        head = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        out["lightning_zero"] = head.stdout.strip() if head.returncode == 0 else "working tree (no git metadata)"
    except (OSError, subprocess.SubprocessError):
        out["lightning_zero"] = "working tree (no git)"
    return out


# --- child processes --------------------------------------------------------------------------------------------


def _run_child(cmd: list[str], timeout: float, log_path: str, title: str, env=None) -> tuple[int, bool, str, float]:
    """Run ``cmd`` in its own process group, killed (the group) at ``timeout``; its output is appended to
    ``log_path`` under ``title``. Returns (exit code, timed out, output, wall s)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    try:
        output, _ = proc.communicate(timeout=max(1.0, timeout))
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    wall = time.monotonic() - start
    with open(log_path, "a") as f:
        tail = output.splitlines()[-300:]
        f.write(f"==== {title}: exit {proc.returncode}{' (timed out)' if timed_out else ''}, {wall:.1f} s\n")
        f.write("\n".join(tail) + "\n")
    return proc.returncode, timed_out, output, wall


def worker_args(args, shape: dict, offload: bool, steps=None, warmup=None, optimizer="adamw") -> dict:
    """The namespace ``_bench_workers``' runners read, as JSON."""
    return {
        "quick": False,
        "gpt": shape,
        "batch": args.batch,
        "device": args.device,
        "steps": steps or (args.offload_steps if offload else args.steps),
        "warmup": warmup if warmup is not None else (args.offload_warmup if offload else args.warmup),
        "profile": None,
        "profile_top": 10,
        "width": None,
        "depth": None,
        "optimizer": optimizer,
        "init_device": "cuda" if args.device == "cuda" else None,
    }


def run_job(job: dict, job_args: dict, timeout: float, out_dir: str) -> dict:
    """One measured run in a fresh process (``--worker``): the runner's figures plus ``outcome``, ``reason`` and
    ``wall_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"job": job, "args": job_args, "out": os.path.join(tmp, "result")}
        code, timed_out, output, wall = _run_child(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
            timeout,
            os.path.join(out_dir, "gpu_suite_runs.log"),
            f"{job['kind']} {job_args['gpt']}",
        )
        outcome = parts.classify(code, timed_out, output)
        figures = {}
        if os.path.exists(spec["out"] + ".0"):
            with open(spec["out"] + ".0") as f:
                figures = json.load(f)
            if outcome["outcome"] != "ok" and not timed_out:  # measured, then failed at teardown: keep the figures
                outcome = {"outcome": "ok", "reason": f"exit {code} after writing its figures"}
    return {**figures, **outcome, "wall_s": round(wall, 1)}


def worker(spec: dict) -> None:
    """A child process: one job of ``_bench_workers`` at world size 1, then this process's peaks added."""
    import torch

    from benchmarks import _bench_workers as workers
    from benchmarks.common import free_port

    args, job, out = argparse.Namespace(**spec["args"]), spec["job"], spec["out"]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        BENCH_DEVICE=args.device,
    )
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.device == "cuda" else "cpu")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    runner = workers.run_deepspeed if job["kind"].startswith("deepspeed:") else workers.run_lightning
    runner(0, 1, args, job, out)
    workers._end_process_group()
    with open(out + ".0") as f:
        result = json.load(f)
    with open("/proc/self/status") as f:
        result["host_peak"] = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    if args.device == "cuda":
        result.update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved())
    with open(out + ".0", "w") as f:
        json.dump(result, f)


# --- phases -----------------------------------------------------------------------------------------------------


def tests_phase(args, deadline: parts.Deadline) -> dict:
    # --durations: the slowest tests in the log and the report's tail, to size tests/gpu against its budget
    command = [sys.executable, "-m", "pytest", args.tests, "-q", "-p", "no:cacheprovider", "--durations=10"]
    code, timed_out, output, _ = _run_child(command, deadline.left(), os.path.join(args.out, "gpu_tests.log"), "pytest")
    counts = parts.pytest_counts(output)
    status = "timeout" if timed_out else ("passed" if code == 0 else ("no tests" if code == 5 else "failed"))
    return {
        "status": status,
        "returncode": code,
        "counts": counts,
        "command": " ".join(["python"] + command[1:]),
        "tail": "\n".join(output.splitlines()[-25:]),
    }


def _row(side: str, config: str, run: dict, args, flops_token: int, peak: float | None) -> dict:
    row = {
        "side": side,
        "label": "ZeroStrategy" if side == "ours" else "DeepSpeed",
        "config": config,
        "status": run["outcome"],
        "reason": run.get("reason", ""),
        "wall_s": run.get("wall_s"),
    }
    for key in ("peak_allocated", "peak_reserved", "host_peak", "times"):
        row[key] = run.get(key)
    row["step_s"] = run.get("time")
    row.update(parts.throughput(row["step_s"], args.batch * args.block_size, flops_token, peak))
    return row


def _ratios(rows: list[dict]) -> list[dict]:
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        ours = next((r for r in rows if r["config"] == config and r["side"] == "ours"), None)
        theirs = next((r for r in rows if r["config"] == config and r["side"] == "deepspeed"), None)
        if ours and theirs and ours.get("tokens_per_s") and theirs.get("tokens_per_s"):
            memory = (
                ours["peak_allocated"] / theirs["peak_allocated"]
                if ours.get("peak_allocated") and theirs.get("peak_allocated")
                else None
            )
            out.append({"config": config, "tokens": ours["tokens_per_s"] / theirs["tokens_per_s"], "memory": memory})
    return out


def describe_model(args, device: dict) -> list[str]:
    shape, p = model_shape(args), parts.gpt_params(model_shape(args))
    peak = device.get("peak_tflops_bf16")
    return [
        f"Model: examples/gpt.py's GPT, {shape['n_layer']} layers, width {shape['n_embd']}, {shape['n_head']} "
        f"heads, vocabulary {shape['vocab']}, {shape['block_size']} tokens: {p['total'] / 1e9:.3f}B parameters "
        f"({p['matmul'] / 1e9:.3f}B outside the embedding tables). Micro-batch {args.batch} "
        f"({args.batch * args.block_size} tokens/step), {args.precision} (ours `{PRECISION_FLAGS[args.precision]}`"
        f", DeepSpeed `bf16.enabled`), AdamW lr 1e-4; median of {args.steps} steps after {args.warmup} (with "
        f"offload {args.offload_steps} after {args.offload_warmup}).",
        f"FLOPs per token {parts.flops_per_token(shape) / 1e9:.2f} G (6 N + 12 L h s); MFU against "
        f"{'%s TFLOP/s' % peak if peak else 'no known peak for this device (pass --peak-tflops)'}.",
    ]


def _why_not(side: str, args, has_deepspeed: bool, deadline) -> str | None:
    """Why a throughput run is not started (its row says so), or None."""
    if side == "deepspeed" and args.no_deepspeed:
        return "--no-deepspeed"
    if side == "deepspeed" and not has_deepspeed:
        return "deepspeed is not installed (benchmarks/gpu_wheels.sh)"
    if deadline.left() < MIN_RUN_S:
        return f"phase budget spent ({deadline.left():.0f} s left)"
    return None


def throughput_phase(
    args, deadline, device: dict, configs=None, optimizer="adamw", ds_cpu_adam=False, title=None
) -> dict:
    import importlib.util

    shape, flops_token = model_shape(args), parts.flops_per_token(model_shape(args))
    peak = device["peak_tflops_bf16"] * 1e12 if device.get("peak_tflops_bf16") else None
    has_ds = importlib.util.find_spec("deepspeed") is not None
    rows = []
    for config in configs or args.configs:
        offload = config.endswith("+cpu")
        for side in ("ours", "deepspeed"):
            kind = f"{'zero' if side == 'ours' else 'deepspeed'}:{config}"
            why = _why_not(side, args, has_ds, deadline)
            if why:
                rows.append(
                    {
                        "side": side,
                        "label": "ZeroStrategy" if side == "ours" else "DeepSpeed",
                        "config": config,
                        "status": "not run",
                        "reason": why,
                    }
                )
                continue
            job = {"model": "gpt", "precision": args.precision, "kind": kind, "ds_cpu_adam": ds_cpu_adam}
            timeout = min(args.run_timeout * (1.5 if offload else 1.0), deadline.left())
            run = run_job(job, worker_args(args, shape, offload, optimizer=optimizer), timeout, args.out)
            rows.append(_row(side, config, run, args, flops_token, peak))
            if side == "ours":  # the estimator's figure next to the measured one
                rows[-1]["estimate"] = estimate(args, config).accelerator_peak
            print(f"throughput {kind}: {rows[-1]['status']} {rows[-1].get('tokens_per_s')}", flush=True)
    notes = [
        "Both sides step torch.optim.AdamW (DeepSpeed: `torch_adam`; offloaded: "
        "`zero_force_ds_cpu_optimizer: false`); offloaded, ZeroStrategy steps its fp32 CPU masters with "
        "torch's fused kernel (docs/ops.md) and DeepSpeed its flat partition with torch's for-loop. "
        "DeepSpeedCPUAdam is not measured here (a JIT build; `--ds-cpu-adam` measures it)."
        if not ds_cpu_adam
        else "Each side's own CPU optimizer: DeepSpeedCPUAdam (JIT-built above) and lightning_zero.ops.CPUAdam."
    ]
    return {
        "status": "ok",
        "title": title or "Throughput: ZeroStrategy against DeepSpeed",
        "description": describe_model(args, device),
        "rows": rows,
        "ratios": _ratios(rows),
        "notes": notes,
    }


def capacity_bounds(args, device: dict, timed: dict | None = None, seconds: float | None = None) -> dict:
    """The capacity search's bounds, in layers.

    ``ceiling``: what host memory holds (every state lives there; ``--capacity-max-layers`` lowers it). ``guess``:
    the depth whose estimated accelerator peak fits 95% of the device's memory. Given the phase's ``seconds``,
    ``in_time``: the largest depth whose probe is estimated to end within ``PROBE_TIME_SHARE`` of the time it may
    take (``--probe-timeout``, at most ``seconds``), its wall time scaled by the parameter count from ``timed``,
    the throughput phase's ZeroStrategy 3 + CPU offload run (``{"n_layer", "wall_s"}``); without that run, the
    throughput depth itself. The search goes up to ``top`` (the smaller of ``ceiling`` and ``in_time``) and
    starts at ``first`` (the smaller of ``guess`` and ``top``)."""
    flag, base = PRECISION_FLAGS[args.precision], model_shape(args)
    ceiling = parts.largest_depth(
        base,
        lambda s: parts.host_bytes(s, flag) <= args.ram_fraction * device["ram_bytes"],
        args.capacity_max_layers or 4096,
    )
    guess = parts.largest_depth(
        base, lambda s: parts.device_bytes(s, flag, args.batch) <= 0.95 * device["memory_bytes"], max(ceiling, 1)
    )
    bounds = {"ceiling": ceiling, "guess": guess, "in_time": None, "top": ceiling, "first": min(guess, ceiling)}
    if seconds is None:
        return bounds
    if timed:
        per_param = timed["wall_s"] / parts.gpt_params(model_shape(args, timed["n_layer"]))["total"]
        allowed = PROBE_TIME_SHARE * min(args.probe_timeout, seconds)
        in_time = parts.largest_depth(
            base, lambda s: per_param * parts.gpt_params(s)["total"] <= allowed, max(ceiling, 1)
        )
    else:
        in_time = args.n_layer
    return {**bounds, "in_time": in_time, "top": min(ceiling, in_time), "first": min(guess, ceiling, in_time)}


def offload_run(args, throughput: dict | None) -> dict | None:
    """The throughput phase's ZeroStrategy 3 + CPU offload run, when it trained: its depth and wall time."""
    row = next(
        (
            r
            for r in (throughput or {}).get("rows", [])
            if r["config"] == "3+cpu" and r["side"] == "ours" and r["status"] == "ok" and r.get("wall_s")
        ),
        None,
    )
    return None if row is None else {"n_layer": args.n_layer, "wall_s": row["wall_s"]}


def capacity_phase(args, deadline, device: dict, throughput: dict | None) -> dict:
    timed = offload_run(args, throughput)
    bounds = capacity_bounds(args, device, timed, deadline.left())
    lo = min(args.n_layer, max(bounds["ceiling"], 1))

    def trains(depth: int, left: float) -> dict:
        shape, timeout = model_shape(args, depth), min(args.probe_timeout, left)
        run = run_job(
            {"model": "gpt", "precision": args.precision, "kind": "zero:3+cpu"},
            worker_args(args, shape, True, steps=1, warmup=1),
            timeout,
            args.out,
        )
        if run["outcome"] == "timeout" and timeout >= args.probe_timeout:  # its own limit: too big to train in time
            run.update(outcome="too-slow", reason=f"not done within --probe-timeout {args.probe_timeout:.0f} s")
        print(f"capacity {depth} layers: {run['outcome']}", flush=True)
        return {
            "outcome": run["outcome"],
            "reason": run.get("reason", ""),
            "wall_s": run.get("wall_s"),
            "params_b": parts.gpt_params(shape)["total"] / 1e9,
            "peak_allocated": run.get("peak_allocated"),
            "host_peak": run.get("host_peak"),
        }

    if timed and bounds["top"] <= lo:  # nothing above the depth already trained fits the phase's time
        search = parts.Search(
            good=lo,
            bad=None,
            stopped=f"no depth above {lo} layers is estimated to train within the phase's {deadline.left():.0f} s",
        )
    else:
        search = parts.find_largest(
            lo,
            max(bounds["top"], lo),
            trains,
            deadline,
            first=bounds["first"],
            known_good=timed is not None and lo == args.n_layer,
            max_probes=args.capacity_probes,
            min_probe_s=MIN_RUN_S,
        )
    good = parts.gpt_params(model_shape(args, search.good))["total"] / 1e9 if search.good >= 1 else 0.0
    result = f"{search.good} layers ({good:.2f}B parameters) train" if search.good >= 1 else "no depth trained"
    result += (f"; {search.bad} layers do not" if search.bad else "") + f" ({search.stopped})."
    return {
        "status": "ok",
        "probes": search.probes,
        "good": search.good,
        "bad": search.bad,
        "stopped": search.stopped,
        "result": result,
        **bounds,
        "description": [_capacity_text(args, device, bounds, timed)],
    }


def _capacity_text(args, device: dict, bounds: dict, timed: dict | None) -> str:
    if timed:
        time_bound = (
            f"the throughput phase's 3 + CPU offload run ({timed['n_layer']} layers, "
            f"{timed['wall_s']:.0f} s), its time scaled by the parameter count, puts {bounds['in_time']} "
            f"layers within {PROBE_TIME_SHARE:.0%} of a probe's time."
        )
        time_bound += f" {timed['n_layer']} layers trained in the throughput phase."
    else:
        time_bound = (
            f"with no 3 + CPU offload run measured in the throughput phase, the search stays at its "
            f"{args.n_layer} layers."
        )
    return (
        f"Width {args.n_embd}, {args.n_head} heads, {args.block_size} tokens, micro-batch {args.batch}, "
        f"{args.precision}, ZeroStrategy(stage=3, offload='cpu'), torch.optim.AdamW; 2 steps per probe within "
        f"{args.probe_timeout:.0f} s. Host memory: {bounds['ceiling']} layers (what {args.ram_fraction:.0%} of "
        f"the host's {device['ram_bytes'] / GIB:.0f} GiB holds: `lightning_zero.estimate_memory`'s CPU peak + "
        f"the fp32 init copy + {parts.HOST_OVERHEAD / GIB:.0f} GiB); GPU memory: `estimate_memory` puts the "
        f"limit at {bounds['guess']} layers; time: {time_bound} The search goes up to {bounds['top']} layers, "
        f"from {bounds['first']}."
    )


def ds_cpu_adam_phase(args, deadline, device: dict) -> dict:
    """Build DeepSpeedCPUAdam (JIT, in a child, within the phase's time), then 3 + CPU offload with each side's
    own CPU optimizer."""
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('built')"
    env = {**os.environ, "DS_ACCELERATOR": "cuda" if args.device == "cuda" else "cpu"}
    rc, timed_out, output, wall = _run_child(
        [sys.executable, "-c", code],
        deadline.left() - 2 * MIN_RUN_S,
        os.path.join(args.out, "gpu_suite_runs.log"),
        "DeepSpeedCPUAdam build",
        env=env,
    )
    if rc != 0 or timed_out:
        reason = parts.classify(rc, timed_out, output)["reason"]
        return {
            "status": "not measured: JIT build",
            "title": "DeepSpeedCPUAdam against lightning_zero's CPUAdam",
            "description": [f"DeepSpeedCPUAdam did not build in {wall:.0f} s: {reason}"],
            "rows": [],
        }
    section = throughput_phase(
        args,
        deadline,
        device,
        configs=["3+cpu"],
        optimizer="cpu_adam",
        ds_cpu_adam=True,
        title="DeepSpeedCPUAdam against lightning_zero's CPUAdam (3 + CPU offload)",
    )
    section["description"].append(f"DeepSpeedCPUAdam built (JIT) in {wall:.0f} s.")
    return section


# --- main -------------------------------------------------------------------------------------------------------


def estimate(args, config: str):
    """``lightning_zero.estimate_memory`` of ZeroStrategy at ``config`` for the throughput runs' model and batch."""
    from lightning_zero.estimate.activations import TransformerShape
    from lightning_zero.estimate.model_states import estimate_memory

    p, (stage, _, offload) = parts.gpt_params(model_shape(args)), config.partition("+")
    transformer = TransformerShape(
        hidden=args.n_embd,
        layers=args.n_layer,
        heads=args.n_head,
        seq_len=args.block_size,
        micro_batch=args.batch,
        vocab=args.vocab,
    )
    return estimate_memory(
        p["total"],
        int(stage),
        1,
        offload or None,
        PRECISION_FLAGS[args.precision],
        shape=transformer,
        largest_unit_params=p["block"],
    )


def plan(args, device: dict) -> list[str]:
    """What the run would do, with ``lightning_zero.estimate``'s figures: the dry run's report."""
    shape, lines = model_shape(args), describe_model(args, device)
    for config in args.configs:
        figures = estimate(args, config)
        lines.append(
            f"ZeRO {config}: estimated accelerator peak {figures.accelerator_peak / GIB:.1f} GiB, "
            f"CPU {figures.cpu_peak / GIB:.1f} GiB (ours)."
        )
    bounds = capacity_bounds(args, device)
    lines.append(
        f"Capacity: ceiling {bounds['ceiling']} layers (host memory), {bounds['guess']} layers by the GPU's "
        f"memory estimate; at run time the probes are also kept to depths estimated to train within "
        f"{PROBE_TIME_SHARE:.0%} of a probe's time, scaled from the throughput phase's 3 + CPU offload run."
    )
    budgets = {"tests": args.budget_tests, "throughput": args.budget_throughput, "capacity": args.budget_capacity}
    if args.ds_cpu_adam:
        budgets["ds_cpu_adam"] = args.budget_ds_cpu_adam
    total = sum(budgets[p] for p in args.phases + (["ds_cpu_adam"] if args.ds_cpu_adam else []))
    total += STARTUP_S + parts.REPORT_RESERVE_S
    lines.append(
        f"Budgets (s): deadline {args.deadline:.0f} from the start; "
        + ", ".join(f"{name} {seconds:.0f}" for name, seconds in budgets.items())
        + f"; the chosen phases, start-up and last report {total:.0f}"
        + ("." if total <= args.deadline else ": over the deadline, the last phases get less.")
    )
    return lines + [
        f"Phases: {' '.join(args.phases + (['ds_cpu_adam'] if args.ds_cpu_adam else []))}; shape {json.dumps(shape)}."
    ]


def build_phases(args, device: dict, sections: dict) -> list[parts.Phase]:
    chosen = set(args.phases)
    return [
        parts.Phase(
            "tests", args.budget_tests, 20.0, lambda d: tests_phase(args, d), "tests" in chosen, "not chosen (--phases)"
        ),
        parts.Phase(
            "throughput",
            args.budget_throughput,
            2 * MIN_RUN_S,
            lambda d: throughput_phase(args, d, device),
            "throughput" in chosen,
            "not chosen (--phases)",
        ),
        parts.Phase(
            "capacity",
            args.budget_capacity,
            2 * MIN_RUN_S,
            lambda d: capacity_phase(args, d, device, sections.get("throughput")),
            "capacity" in chosen,
            "not chosen (--phases)",
        ),
        parts.Phase(
            "ds_cpu_adam",
            args.budget_ds_cpu_adam,
            90.0,
            lambda d: ds_cpu_adam_phase(args, d, device),
            args.ds_cpu_adam,
            "opt-in (--ds-cpu-adam): DeepSpeedCPUAdam is a JIT build of about a minute",
        ),
    ]


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        worker(json.loads(argv[1]))
        return {}
    start = time.monotonic()  # the deadline holds the start-up too: parsing imports torch
    args = parse(argv)
    deadline = parts.Deadline(args.deadline - (time.monotonic() - start))
    os.makedirs(args.out, exist_ok=True)
    device = device_info(args)
    result = {
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "deadline_s": args.deadline,
        "dry_run": args.dry_run,
        "args": vars(args),
        "device": device,
        "versions": versions(),
        "plan": plan(args, device),
        "phases": {},
        "skipped": [],
    }

    def save(sections: dict, skipped: list) -> None:
        result.update(phases=sections, skipped=skipped, wall_s=round(time.monotonic() - start, 1))
        parts.write_report(result, args.out)

    sections: dict = {}
    phases = build_phases(args, device, sections)
    if args.dry_run:
        for phase in phases:
            phase.enabled, phase.disabled_reason = (
                False,
                "dry run" + ("" if phase.enabled else f"; {phase.disabled_reason}"),
            )
    save(sections, [])  # the plan, before any phase: a call cut off in the first phase still returns a report
    parts.run_phases(phases, deadline, sections=sections, after=save)
    md, _ = parts.write_report(result, args.out)
    print(f"report: {md}\n\n" + parts.render_report(result), flush=True)
    return result


if __name__ == "__main__":
    main()
