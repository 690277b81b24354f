"""NVMe offload benchmark: swap bandwidth next to the disk's raw bandwidth, and a bigger-than-memory run.

    python benchmarks/bench_nvme.py --nvme-path /mnt/nvme                      # every section
    python benchmarks/bench_nvme.py --sections raw,step --params 64e6 --sub-group-size 8e6
    python benchmarks/bench_nvme.py --sections capped --capped-params 600e6 --cap-gib 2.95 --sub-group-size 1e6
    python benchmarks/bench_nvme.py --sections capped3 --capped-params 1.5e9 --width 2048 --cap-gib 3.72 \
        --sub-group-size 1e6 --capped-steps 2 --block-size 4194304

Sections (``--sections``):
  * ``raw``: the disk's raw bandwidth on ``nvme_path``: ``dd`` with ``oflag=direct``/``iflag=direct`` (1 MiB
    blocks, one request at a time), and the same O_DIRECT pattern at depth (``--threads`` x ``--queue-depth``
    requests of ``--block-size`` in flight, which is what the engine does), both in this run;
  * ``step``: an AdamW step over ``--params`` fp32 parameters with its states swapped (sub-groups of
    ``--sub-group-size``): the engine's read and write throughput *during the step* (bytes over the time at least
    one transfer of that kind was in flight, :meth:`AsyncFileIO.throughput`), next to raw; reads of sub-group i+1
    and writes of i-1 share the disk at the same time, so the row that compares with the disk is read+write
    (bytes of both over the time either was in flight, next to raw read and write done one after the other, i.e.
    their harmonic mean); and the step's wall time
    next to the same step in memory (how well the pipeline hides the I/O);
  * ``capped``: bigger than memory. A rank process (world size 1, see below) caps its own memory with
    ``RLIMIT_DATA`` and trains a bf16 model with stage-1 ``offload_optimizer="nvme"`` for ``--capped-steps``
    steps, printing its peak RSS; then the same model with ``offload="cpu"`` under the same cap, which fails.
  * ``capped3``: bigger than memory at stage 3, 2 ranks (``_bench_nvme_stage3.py``): two rank processes, each capped
    with ``RLIMIT_DATA``, train fp32 residual blocks with ``offload_params="nvme", offload_optimizer="nvme"``,
    printing their peak RSS; then the same model with ``offload="cpu"`` under the same cap, which fails. The model
    is built under a deferred build (no rank holds it whole) with the framework-free core. Sizing: each rank keeps
    its fp32 sharded gradients (4 bytes per parameter / 2) plus about 0.6 GiB of imports and buffers, against
    16 / 2 bytes per parameter of model states, so 3x the cap needs about 1.5e9 parameters (``--cap-gib`` =
    8 x params / 3 / 2**30);
  * ``deepspeed``: whether DeepSpeed's async-I/O op builds here, and its own swap bandwidth through
    ``deepspeed.ops.aio`` on the same file sizes (its ZeRO-3 NVMe offload cannot run on this CPU-only machine:
    the reason is printed).

[Note: why RLIMIT_DATA]
``RLIMIT_AS`` caps *virtual* address space: torch maps its shared libraries and reserves allocator arenas, so a cap
of a few GiB fails at ``import torch`` and measures mappings, not memory. ``RLIMIT_DATA`` (Linux >= 4.7) caps the
private writable mappings, i.e. the heap and every anonymous ``mmap`` (each tensor's storage), which is the memory
the process can fill; file-backed code is not counted. It needs no root and applies per process, so it caps one rank
exactly. A cgroup's ``memory.max`` would also count the page cache (buffered file I/O), which O_DIRECT avoids anyway,
and needs root. The cap is set after ``import torch`` (those mappings are counted in it all the same: the limit is
checked against the total at each allocation). I/O threads get 1 MiB stacks here (a thread's stack is a private
writable mapping, 8 MiB each by default) so that the cap measures tensors rather than idle stack reservations, and
the rank process runs with ``MALLOC_MMAP_THRESHOLD_=65536`` (both offloads alike): without it glibc keeps freed
multi-MiB tensors in its heap (its mmap threshold grows to the largest freed block), and the resident set climbs to
the high-water mark of everything transient (measured at 100M parameters: +380 MiB after the masters are written,
+620 MiB after the first step, versus +15 and +38 MiB with the fixed threshold).

[Note: why stage 1, bf16 and one rank]
The cap must hold what stays in memory. With the optimizer on NVMe, stage 1 swaps the fp32 masters and Adam's
moments (12 bytes per parameter) and keeps only the module's parameters and gradients (here bf16: 4 bytes per
parameter) plus ``buffer_count`` sub-group buffers; DeepSpeed's model-state count is 2 + 2 + 12 = 16 bytes per
parameter, so up to 4x the resident bytes. With fp32 module parameters the resident part is 8 of 20 bytes (at most
2.5x), and at more ranks each rank keeps the whole bf16 model but only its share of the 12 (at 2 ranks 4 of 10):
3x needs one rank, or parameter swapping (stage 3 ``offload_params="nvme"``): the ``capped3`` section.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401

from benchmarks import _bench_nvme_stage3  # noqa: E402
from benchmarks.common import deepspeed_init_distributed  # noqa: E402
from lightning_zero.offload.aio import AioSettings, AsyncFileIO, aligned_buffer  # noqa: E402
from lightning_zero.offload.nvme_config import NvmeConfig  # noqa: E402
from lightning_zero.offload.optimizer_swapper import attach_swapper, detach_swapper  # noqa: E402

GB = 1e9
GIB = 1 << 30


# ---------------------------------------------------------------- raw
def raw_bandwidth(folder: str, mib: int) -> tuple[float, float]:
    """(write, read) GB/s of ``dd`` with O_DIRECT, 1 MiB requests, one at a time."""
    path = os.path.join(folder, "raw-dd.bin")
    try:
        write = _dd(["if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"])
        read = _dd([f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])
        return write, read
    finally:
        if os.path.exists(path):
            os.remove(path)


def _dd(args: list[str]) -> float:
    start = time.perf_counter()
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - start
    return int(re.search(r"^(\d+) bytes", out.stderr, re.M).group(1)) / elapsed / GB


def raw_at_depth(folder: str, mib: int, aio: AioSettings) -> tuple[float, float]:
    """(write, read) GB/s of one O_DIRECT transfer of ``mib`` MiB with ``aio``'s requests in flight (no swapper)."""
    path = os.path.join(folder, "raw-depth.bin")
    buf = aligned_buffer(mib << 20)
    buf.fill_(1)
    io = AsyncFileIO(aio)
    try:
        io.open(path)
        io.write(path, buf).result()  # warm-up: file allocated, threads started
        io.reset_stats()
        io.write(path, buf).result()
        os.fsync(io._fds[path][0])
        io.read(path, buf).result()
        return io.throughput("write") / GB, io.throughput("read") / GB
    finally:
        io.close()
        if os.path.exists(path):
            os.remove(path)


def raw_concurrent(folder: str, mib: int, aio: AioSettings) -> float:
    """GB/s of reads and writes together: one O_DIRECT transfer of ``mib`` MiB written to one file while another
    of the same size is read from a second file, each with ``aio``'s requests in flight (no swapper). This is the
    swapped step's pattern (read sub-group i+1 while writing i-1) on the bare disk: a disk that serves reads and
    writes in parallel beats their harmonic mean, so this is the raw figure the step's read+write compares with."""
    paths = [os.path.join(folder, f"raw-mixed-{i}.bin") for i in range(2)]
    bufs = [aligned_buffer(mib << 20) for _ in paths]
    for buf in bufs:
        buf.fill_(1)
    io = AsyncFileIO(aio)
    try:
        for path, buf in zip(paths, bufs):
            io.open(path)
            io.write(path, buf).result()  # the file to read exists; the file to write is allocated
        os.fsync(io._fds[paths[0]][0])
        io.reset_stats()
        futures = [io.read(paths[0], bufs[0]), io.write(paths[1], bufs[1])]
        for future in futures:
            future.result()
        return io.throughput("any") / GB
    finally:
        io.close()
        for path in paths:
            if os.path.exists(path):
                os.remove(path)


# ---------------------------------------------------------------- the swapped step
def step_bandwidth(params: list[torch.Tensor], steps: int, nvme, io_only: bool = False, fused: bool = False):
    """Time ``steps`` AdamW steps over ``params`` with the states swapped (``nvme``) or in memory (``None``).
    ``io_only``: the timed steps run the swapper's pipeline (the same reads, writes, buffers and order) with the
    optimizer's own update replaced by nothing: the I/O side of the step without the CPU Adam compute.
    ``fused``: ``torch.optim.AdamW(fused=True)`` (torch's one-pass CPU kernel) instead of the default."""
    opt = torch.optim.AdamW(params, lr=1e-3, fused=fused)
    swapper = attach_swapper(opt, nvme) if nvme is not None else None
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # creates the states (and, swapped, writes them once)
    opt.step()  # buffers allocated and touched
    result = {"step_s": [], "read": [], "write": [], "any": []}
    for _ in range(steps):
        if swapper is not None:
            swapper.io.reset_stats()
        start = time.perf_counter()
        if io_only:
            with torch.no_grad():
                swapper.step(lambda optimizer: None)
        else:
            opt.step()
        result["step_s"].append(time.perf_counter() - start)
        if swapper is not None:
            result["read"].append(swapper.io.throughput("read") / GB)
            result["write"].append(swapper.io.throughput("write") / GB)
            result["any"].append(swapper.io.throughput("any") / GB)
            result["bytes"] = swapper.io.stats["read"][0] + swapper.io.stats["write"][0]
    if swapper is not None:
        result["peak_buffers"], result["peak_buffer_bytes"] = swapper.peak_buffers, swapper.peak_buffer_bytes
        detach_swapper(opt, restore=False)
    return result


def _median(values):
    return sorted(values)[len(values) // 2]


# ---------------------------------------------------------------- the capped rank process
def capped_rank(args) -> None:
    """One rank process: cap RLIMIT_DATA, build a bf16 model, train it a few steps with stage-1 offload."""
    from torch import nn

    from lightning_zero.distributed.config import ZeroConfig
    from lightning_zero.distributed.optimizer import shard_optimizer

    threading.stack_size(1 << 20)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    cap = int(args.cap_gib * GIB)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    width = args.width
    layers = max(1, int(args.capped_params) // (width * width))
    steps_done, begin = 0, time.perf_counter()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width, bias=False, dtype=torch.bfloat16) for _ in range(layers)])
        numel = sum(p.numel() for p in model.parameters())
        print(
            f"  model: {layers} x Linear({width}, {width}) bf16 = {numel / 1e6:.0f}M parameters; model states "
            f"(2+2+12 bytes/param) {16 * numel / GIB:.2f} GiB = {16 * numel / cap:.1f}x the cap; fp32 part "
            f"(masters + Adam, 12 bytes/param) {12 * numel / GIB:.2f} GiB",
            flush=True,
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if args.mode == "nvme":
            nvme = NvmeConfig(
                args.nvme_path,
                sub_group_size=int(args.sub_group_size),
                buffer_count=3,
                aio=dict(thread_count=args.threads, queue_depth=args.queue_depth, block_size=args.block_size),
            )
            sharding = shard_optimizer(opt, ZeroConfig(stage=1, offload_optimizer="nvme", nvme=nvme))
        else:
            sharding = shard_optimizer(opt, ZeroConfig(stage=1, offload="cpu"))
        for _ in range(args.capped_steps):
            x = torch.randn(4, width, dtype=torch.bfloat16)
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps_done += 1
            print(f"  step {steps_done}: loss {loss.item():.4f} ({time.perf_counter() - begin:.0f} s)", flush=True)
        if sharding.swapper is not None:
            sw = sharding.swapper
            print(
                f"  swap: peak {sw.peak_buffers} buffers of {sw.peak_buffer_bytes / 2**20:.0f} MiB, "
                f"read {sw.io.throughput('read') / GB:.2f} GB/s, write {sw.io.throughput('write') / GB:.2f} GB/s"
            )
        sharding.remove() if args.mode == "cpu" else sharding.swapper.close(restore=False)
        outcome = "ok"
    except (MemoryError, RuntimeError) as error:  # the allocator's refusal under the cap
        outcome = f"FAILED: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(
        f"  RESULT mode={args.mode} cap={args.cap_gib:.2f}GiB peak_rss={peak:.2f}GiB steps={steps_done} {outcome}",
        flush=True,
    )


def run_capped(args) -> None:
    for mode in ("nvme", "cpu"):
        print(f"capped rank process, offload={mode!r}, RLIMIT_DATA {args.cap_gib:.2f} GiB:", flush=True)
        command = _bench_nvme_stage3.capped_child_command(os.path.abspath(__file__), "--rank-child", mode, args)
        # glibc's dynamic mmap threshold would keep freed multi-MiB tensors (a sub-group's fp32 gradients, the
        # optimizer's temporaries) in the heap: a fixed threshold returns them (see docs/offload.md)
        env = {"MALLOC_MMAP_THRESHOLD_": "65536", **os.environ, "PYTHONWARNINGS": "ignore"}
        child = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [line for line in child.stdout.splitlines() if line.startswith("  ")]
        print("\n".join(lines) if lines else "  (no output)")
        if child.returncode != 0:  # killed outright (e.g. a failed allocation outside torch's allocator)
            print(f"  exit code {child.returncode}: {child.stderr.strip().splitlines()[-1:] or ''}")


# ---------------------------------------------------------------- DeepSpeed
def deepspeed_aio(folder: str, mib: int, args) -> None:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            print("DeepSpeed async-I/O op: not compatible here (libaio missing)")
            return False
        aio_module = AsyncIOBuilder().load(verbose=False)
    except Exception as error:
        print(f"DeepSpeed async-I/O op: does not build: {type(error).__name__}: {error}")
        return False
    path = os.path.join(folder, "ds-aio.bin")
    buf = torch.empty(mib << 20, dtype=torch.uint8)
    buf.fill_(1)
    # aio_handle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
    handle = aio_module.aio_handle(args.block_size, args.queue_depth, False, True, args.threads)
    try:
        handle.sync_pwrite(buf, path)  # warm-up: file allocated
        start = time.perf_counter()
        handle.sync_pwrite(buf, path)
        write = buf.numel() / (time.perf_counter() - start) / GB
        start = time.perf_counter()
        handle.sync_pread(buf, path)
        read = buf.numel() / (time.perf_counter() - start) / GB
    finally:
        if os.path.exists(path):
            os.remove(path)
    print(
        f"DeepSpeed aio_handle (block {args.block_size >> 10} KiB, queue_depth {args.queue_depth}, "
        f"intra_op_parallelism {args.threads}), {mib} MiB: write {write:.2f} GB/s, read {read:.2f} GB/s"
    )
    return True


def deepspeed_zero3_child(args) -> None:
    """One process: DeepSpeed ZeRO-3 with optimizer and parameters on NVMe (its own swapper and aio op), on the
    model of the ``step`` section's size; prints the step time and the bytes its swap files hold."""
    import deepspeed
    from torch import nn

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed_init_distributed("cpu")
    folder = tempfile.mkdtemp(prefix="ds-nvme-", dir=args.nvme_path)
    width = 1024
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(max(1, int(args.params) // width**2))])
    numel = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them away
    aio = {
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "intra_op_parallelism": args.threads,
        "single_submit": False,
        "overlap_events": True,
    }
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_force_ds_cpu_optimizer": False,
        "aio": aio,
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": int(args.sub_group_size),
            "offload_optimizer": {"device": "nvme", "nvme_path": folder, "pin_memory": False, "buffer_count": 4},
            "offload_param": {
                "device": "nvme",
                "nvme_path": folder,
                "pin_memory": False,
                "max_in_cpu": int(args.max_in_cpu),
            },
        },
    }
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.optimizer_fused)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        times, cpu = [], []
        for _ in range(args.steps + 1):
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = engine(torch.randn(4, width)).square().mean()
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        on_disk = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)
        step = _median(times[1:])
        print(
            f"  DeepSpeed ZeRO-3 NVMe (optimizer + parameters), {numel / 1e6:.0f}M "
            f"fp32 parameters: train step {step * 1e3:.0f} ms (median of {args.steps}; process CPU time "
            f"{_median(cpu[1:]) * 1e3:.0f} ms), swap files {on_disk >> 20} "
            f"MiB; at least {2 * on_disk / step / GB:.2f} GB/s if every file is read and written once per step",
            flush=True,
        )
    except Exception as error:
        print(f"  DeepSpeed ZeRO-3 NVMe does not run here: {type(error).__name__}: {str(error)[:300]}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def report_step(args, aio, raw: tuple, concurrent: float) -> None:
    """The ``step`` section: a swapped AdamW step's read and write bandwidth against the disk's raw figures."""
    numel = int(args.params) // args.tensors
    params = [torch.zeros(numel) for _ in range(args.tensors)]
    fused = args.optimizer_fused
    plain = step_bandwidth(params, args.steps, None, fused=fused)
    nvme = NvmeConfig(args.nvme_path, sub_group_size=int(args.sub_group_size), buffer_count=4, aio=aio)
    swapped = step_bandwidth(params, args.steps, nvme, fused=fused)
    read, write = _median(swapped["read"]), _median(swapped["write"])
    print(
        f"swapped AdamW{'(fused=True)' if fused else ''} step: {int(args.params) * 8 >> 20} MiB of states, "
        "sub-groups of "
        f"{int(args.sub_group_size):.3g} elements, peak {swapped['peak_buffers']} buffers of "
        f"{swapped['peak_buffer_bytes'] >> 20} MiB, {swapped['bytes'] >> 20} MiB moved per step"
    )
    io_only = step_bandwidth(params, args.steps, nvme, io_only=True)
    both = _median(swapped["any"])
    # equal bytes read and written: one after the other (their harmonic mean), or at once, whichever is faster
    mixed = max(2 / (1 / raw[0] + 1 / raw[1]), concurrent)
    print(
        f"| | raw (best) GB/s | swap during the step GB/s | ratio |\n|---|---|---|---|\n"
        f"| read | {raw[1]:.2f} | {read:.2f} | {read / raw[1]:.0%} |\n"
        f"| write | {raw[0]:.2f} | {write:.2f} | {write / raw[0]:.0%} |\n"
        "| read+write (they overlap: one disk; raw: best of one after the other and at once) "
        f"| {mixed:.2f} | {both:.2f} | {both / mixed:.0%} |"
    )
    io_read, io_write, io_both = (_median(io_only[k]) for k in ("read", "write", "any"))
    print(
        f"same swapped step, I/O only (the pipeline's reads and writes, no Adam compute): read {io_read:.2f} "
        f"({io_read / raw[1]:.0%} of raw), write {io_write:.2f} ({io_write / raw[0]:.0%}), read+write "
        f"{io_both:.2f} GB/s ({io_both / mixed:.0%}); step {_median(io_only['step_s']) * 1e3:.0f} ms"
    )
    print(
        f"step wall time: in memory {_median(plain['step_s']) * 1e3:.0f} ms, swapped "
        f"{_median(swapped['step_s']) * 1e3:.0f} ms (median of {args.steps})"
    )


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--sections", default="raw,step,capped,deepspeed")
    parser.add_argument("--params", type=float, default=32e6)
    parser.add_argument("--sub-group-size", type=float, default=4e6)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=4 << 20)
    parser.add_argument("--capped-params", type=float, default=600e6)
    parser.add_argument("--cap-gib", type=float, default=2.95)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--capped-steps", type=int, default=3)
    parser.add_argument("--max-in-cpu", type=float, default=1e9, help="deepspeed section: offload_param max_in_cpu")
    parser.add_argument(
        "--optimizer-fused",
        action="store_true",
        help="step and deepspeed sections: torch.optim.AdamW(fused=True) instead of the default",
    )
    parser.add_argument("--rank-child", choices=("nvme", "cpu"), help=argparse.SUPPRESS)
    parser.add_argument("--stage3-child", choices=("nvme", "cpu"), help=argparse.SUPPRESS)
    parser.add_argument("--ours-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ds-child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse()
    if args.ds_child:
        return deepspeed_zero3_child(args)
    if args.rank_child:
        args.mode = args.rank_child
        return capped_rank(args)
    if args.ours_child:
        return _bench_nvme_stage3.same_model_as_deepspeed(args)
    if args.stage3_child:
        args.mode = args.stage3_child
        return _bench_nvme_stage3.rank_main(args)
    sections = set(args.sections.split(","))
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} CPUs, load average {load:.1f}; nvme_path {args.nvme_path}")
    aio = AioSettings(block_size=args.block_size, queue_depth=args.queue_depth, thread_count=args.threads)
    state_mib = max(64, int(args.params) * 8 >> 20)
    raw = None
    if sections & {"raw", "step"}:
        raw = raw_bandwidth(args.nvme_path, state_mib)
        depth = raw_at_depth(args.nvme_path, state_mib, aio)
        print(
            f"raw O_DIRECT dd (1 MiB, one request at a time), {state_mib} MiB: write {raw[0]:.2f} GB/s, "
            f"read {raw[1]:.2f} GB/s"
        )
        print(
            f"raw O_DIRECT at depth ({aio.in_flight} requests of {args.block_size >> 10} KiB in flight, one "
            f"transfer): write {depth[0]:.2f} GB/s, read {depth[1]:.2f} GB/s"
        )
        concurrent = raw_concurrent(args.nvme_path, state_mib, aio)
        print(
            f"raw O_DIRECT read and write at the same time (two files, {aio.in_flight} requests in flight each): "
            f"{concurrent:.2f} GB/s"
        )
        raw = (max(raw[0], depth[0]), max(raw[1], depth[1]))  # the disk's best of the two
    if "step" in sections:
        report_step(args, aio, raw, concurrent)
    if "capped" in sections:
        run_capped(args)
    if "capped3" in sections:
        _bench_nvme_stage3.run(args, os.path.abspath(__file__))
    if "deepspeed" in sections and deepspeed_aio(args.nvme_path, state_mib, args):
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--ds-child",
            "--nvme-path",
            args.nvme_path,
            "--params",
            str(args.params),
            "--sub-group-size",
            str(args.sub_group_size),
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
            "--queue-depth",
            str(args.queue_depth),
            "--block-size",
            str(args.block_size),
            "--max-in-cpu",
            str(args.max_in_cpu),
            *(["--optimizer-fused"] if args.optimizer_fused else []),
        ]
        for label, flag in (("DeepSpeed", "--ds-child"), ("lightning-zero", "--ours-child")):  # the same model
            child = subprocess.run([*command[:2], flag, *command[3:]], capture_output=True, text=True)
            lines = [line for line in child.stdout.splitlines() if line.startswith("  ")]
            print("\n".join(lines) if lines else f"  {label} child failed: {child.stderr.strip()[-600:]}")


if __name__ == "__main__":
    main()
