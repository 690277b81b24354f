"""Optimizer step throughput against the memory-bandwidth floor, measured side by side in one run.

CPU: ``CPUAdam`` (fp32 master + bf16 copy) vs ``torch.optim.AdamW(fused=True)`` vs ``AdamW(foreach=True)``.
GPU (when CUDA is present): ``FusedAdam`` and ``FusedLamb`` vs torch AdamW fused/foreach.

The floor: an elementwise optimizer step cannot be faster than moving its bytes once. Adam reads p, g, m, v and writes
p, m, v (28 bytes per fp32 parameter; +2 for CPUAdam's bf16 copy; LAMB reads p, m, v again in its second pass: +12).
Bandwidth is measured here with a large ``tensor.copy_`` and an in-place ``mul_`` (bytes read + written / time,
the faster of the two). Tensors are large (default 32M params, 128 MB each) so that caches do not flatter the ratio.
Reported: params/s and
``floor fraction`` = floor time / measured time (1.0 = at the floor; >1 means the kernel streams better than copy_).

Usage: ``python benchmarks/bench_optimizers.py [--numel 32000000] [--repeats 10] [--threads N]`` (default < 1 min).
"""

from __future__ import annotations

import argparse
import time

import torch

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401

from lightning_zero.ops import CPUAdam, FusedAdam, FusedLamb  # noqa: E402


def timed(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(numel: int, device: str, repeats: int, sync) -> float:
    """Bytes read + written per second by the faster of ``dst.copy_(src)`` and an in-place ``src.mul_`` (the
    faster one makes the floor stricter)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    copy_seconds = timed(lambda: dst.copy_(src), repeats, sync)
    scale_seconds = timed(lambda: src.mul_(1.0), repeats, sync)
    return 2 * 4 * numel / min(copy_seconds, scale_seconds)


def make_optimizer_step(factory, numel: int, device: str, low_precision: bool = False):
    param = torch.randn(numel, device=device).requires_grad_()
    param.grad = torch.randn(numel, device=device)
    opt = factory([param])
    if low_precision:
        copy = torch.empty(numel, dtype=torch.bfloat16, device=device)
        return lambda: opt.step(low_precision_params=[copy])
    return opt.step


def report(title: str, rows: list[tuple[str, float, float]], numel: int) -> None:
    print(f"\n{title}")
    print("| optimizer | bytes/param | params/s | floor fraction |")
    print("|---|---|---|---|")
    for name, bytes_per_param, seconds, bandwidth in rows:
        floor = numel * bytes_per_param / bandwidth
        print(f"| {name} | {bytes_per_param} | {numel / seconds:.3e} | {floor / seconds:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=32_000_000)  # 4 x 128 MB: beyond any L3
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, r = args.numel, args.repeats

    bandwidth = copy_bandwidth(n, "cpu", r, lambda: None)
    print(f"CPU: {n} fp32 params, {args.threads} threads, copy bandwidth {bandwidth / 1e9:.2f} GB/s")
    cpu_cases = [
        ("CPUAdam + bf16 copy", 30, lambda ps: CPUAdam(ps, weight_decay=0.01), True),
        ("CPUAdam", 28, lambda ps: CPUAdam(ps, weight_decay=0.01), False),
        ("torch AdamW fused", 28, lambda ps: torch.optim.AdamW(ps, weight_decay=0.01, fused=True), False),
        ("torch AdamW foreach", 28, lambda ps: torch.optim.AdamW(ps, weight_decay=0.01, foreach=True), False),
    ]
    rows = []
    for name, nbytes, factory, low in cpu_cases:
        rows.append((name, nbytes, timed(make_optimizer_step(factory, n, "cpu", low), r), bandwidth))
    report("CPU optimizer step", rows, n)

    if torch.cuda.is_available():
        sync = torch.cuda.synchronize
        gpu_n = max(n, 64_000_000)
        hbm = copy_bandwidth(gpu_n, "cuda", r, sync)
        print(f"\nGPU {torch.cuda.get_device_name()}: {gpu_n} fp32 params, copy bandwidth {hbm / 1e9:.0f} GB/s")
        gpu_cases = [
            ("FusedAdam", 28, lambda ps: FusedAdam(ps, weight_decay=0.01)),
            ("torch AdamW fused", 28, lambda ps: torch.optim.AdamW(ps, weight_decay=0.01, fused=True)),
            ("torch AdamW foreach", 28, lambda ps: torch.optim.AdamW(ps, weight_decay=0.01, foreach=True)),
            ("FusedLamb (triton)", 40, lambda ps: FusedLamb(ps, weight_decay=0.01, implementation="triton")),
            ("FusedLamb (torch)", 40, lambda ps: FusedLamb(ps, weight_decay=0.01, implementation="torch")),
        ]
        rows = [
            (name, nbytes, timed(make_optimizer_step(f, gpu_n, "cuda"), r, sync), hbm) for name, nbytes, f in gpu_cases
        ]
        report("GPU optimizer step", rows, gpu_n)
    else:
        print("\nGPU: no CUDA device, GPU rows skipped")


if __name__ == "__main__":
    main()
