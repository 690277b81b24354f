"""NVMe optimizer-state swapping bandwidth: the disk's raw O_DIRECT bandwidth next to what the swapper achieves.

    python benchmarks/bench_nvme.py --nvme-path /mnt/nvme --params 64e6 --sub-group-size 8e6 --steps 3

Prints, for the same ``nvme_path``:
  * raw: ``dd`` with ``oflag=direct``/``iflag=direct`` (1 MiB blocks), or the same pattern in Python if ``dd`` is
    missing;
  * engine: the swapper's own read-all / write-all (``make_resident`` / ``swap_out``) through the I/O engine;
  * step: bytes read + written per swapped optimizer step over its wall time (reads and writes overlap the CPU
    step, so this is a lower bound on the I/O bandwidth), next to the same step without swapping.
Also reports whether DeepSpeed's async-I/O op can build here (it needs libaio).

Not done yet (see docs/offload.md): the bigger-than-memory run under a per-process memory cap.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time

import torch

from lightning_zero.offload.config import NvmeConfig
from lightning_zero.offload.optimizer_swapper import attach_swapper, detach_swapper

GB = 1e9


def raw_bandwidth(folder: str, mib: int) -> tuple[float, float]:
    """(write, read) GB/s with O_DIRECT, 1 MiB requests, queue depth 1 (as dd does)."""
    path = os.path.join(folder, "raw.bin")
    try:
        if shutil.which("dd"):
            write = _dd(["if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"])
            read = _dd([f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])
            return write, read
        return _python_raw(path, mib)
    finally:
        if os.path.exists(path):
            os.remove(path)


def _dd(args: list[str]) -> float:
    start = time.perf_counter()
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - start
    copied = re.search(r"^(\d+) bytes", out.stderr, re.M)
    return int(copied.group(1)) / elapsed / GB


def _python_raw(path: str, mib: int) -> tuple[float, float]:
    from lightning_zero.offload.aio import aligned_buffer

    buf = aligned_buffer(1 << 20)
    view = memoryview(buf.numpy())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        start = time.perf_counter()
        for i in range(mib):
            os.pwritev(fd, [view], i << 20)
        os.fsync(fd)
        write = mib * (1 << 20) / (time.perf_counter() - start) / GB
        start = time.perf_counter()
        for i in range(mib):
            os.preadv(fd, [view], i << 20)
        read = mib * (1 << 20) / (time.perf_counter() - start) / GB
    finally:
        os.close(fd)
    return write, read


def deepspeed_aio_available() -> str:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return "yes" if AsyncIOBuilder().is_compatible(verbose=False) else "no (libaio is missing)"
    except Exception as error:  # deepspeed absent or broken
        return f"no ({type(error).__name__})"


def step_time(params: list[torch.Tensor], steps: int, nvme: NvmeConfig | None):
    opt = torch.optim.AdamW(params, lr=1e-3)
    swapper = attach_swapper(opt, nvme) if nvme is not None else None
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # creates the states (and, swapped, writes them once)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    result = {"step_s": min(times)}
    if swapper is not None:
        read0, written0 = swapper.bytes_read, swapper.bytes_written
        opt.step()
        result["step_bytes"] = (swapper.bytes_read - read0) + (swapper.bytes_written - written0)
        # After a step every state is on disk: read them all back, then write them all out.
        read0, start = swapper.bytes_read, time.perf_counter()
        swapper.make_resident()
        result["engine_read_gbs"] = (swapper.bytes_read - read0) / (time.perf_counter() - start) / GB
        written0, start = swapper.bytes_written, time.perf_counter()
        swapper.swap_out()
        result["engine_write_gbs"] = (swapper.bytes_written - written0) / (time.perf_counter() - start) / GB
        result["peak_buffers"] = swapper.peak_buffers
        result["peak_buffer_bytes"] = swapper.peak_buffer_bytes
        detach_swapper(opt, restore=False)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--params", type=float, default=16e6)
    parser.add_argument("--sub-group-size", type=float, default=2e6)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=1 << 20)
    args = parser.parse_args()
    numel = int(args.params) // args.tensors
    params = [torch.zeros(numel) for _ in range(args.tensors)]
    state_mib = int(args.params) * 8 >> 20
    write, read = raw_bandwidth(args.nvme_path, max(64, state_mib))
    print(f"raw O_DIRECT ({'dd' if shutil.which('dd') else 'python'}, 1 MiB, {max(64, state_mib)} MiB): "
          f"write {write:.2f} GB/s, read {read:.2f} GB/s")
    plain = step_time(params, args.steps, None)
    nvme = NvmeConfig(args.nvme_path, sub_group_size=int(args.sub_group_size), buffer_count=4,
                      aio=dict(queue_depth=args.queue_depth, thread_count=args.threads, block_size=args.block_size))
    swapped = step_time(params, args.steps, nvme)
    print(f"optimizer states: {state_mib} MiB ({int(args.params):.3g} fp32 params, AdamW), sub-groups of "
          f"{int(args.sub_group_size):.3g} elements, peak {swapped['peak_buffers']} buffers of "
          f"{swapped['peak_buffer_bytes'] >> 20} MiB")
    print(f"engine (read-all / write-all): read {swapped['engine_read_gbs']:.2f} GB/s "
          f"({swapped['engine_read_gbs'] / read:.0%} of raw), write {swapped['engine_write_gbs']:.2f} GB/s "
          f"({swapped['engine_write_gbs'] / write:.0%} of raw)")
    step_gbs = swapped["step_bytes"] / swapped["step_s"] / GB
    print(f"step: in memory {plain['step_s'] * 1e3:.1f} ms, swapped {swapped['step_s'] * 1e3:.1f} ms, "
          f"{step_gbs:.2f} GB/s read+write during the step")
    print(f"DeepSpeed async-I/O op available: {deepspeed_aio_available()}")


if __name__ == "__main__":
    main()
