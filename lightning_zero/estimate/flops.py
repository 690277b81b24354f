"""FLOP counting and device peak throughput, for model FLOPs utilisation (MFU).

``measure_flops`` counts the floating-point operations of a piece of work with torch's own
``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions, attention; elementwise ops count zero, as in
the MFU literature). ``peak_flops_for`` looks up a device's dense (no structured sparsity) tensor-core peak for a
compute dtype in a hand-written table: no maintained library exposes vendor peak numbers, so they are copied by
hand from the vendors' datasheets and kept small; pass ``peak_flops`` explicitly for anything not listed (CPUs,
other GPUs, locked clocks).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

TERA = 1e12

# (pattern on torch.cuda.get_device_name(), {compute dtype: dense peak FLOP/s}). Order matters: the first match
# wins, so the specific variants (H100 NVL, H100 PCIe) come before the generic name (H100 = SXM).
_PEAK_TABLE: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H200 NVL", {"bf16": 835.5 * TERA, "fp16": 835.5 * TERA, "tf32": 417.5 * TERA, "fp32": 60.0 * TERA}),
    (r"GH200|H200", {"bf16": 989.4 * TERA, "fp16": 989.4 * TERA, "tf32": 494.7 * TERA, "fp32": 66.9 * TERA}),
    (r"H100 NVL", {"bf16": 835.5 * TERA, "fp16": 835.5 * TERA, "tf32": 417.5 * TERA, "fp32": 60.0 * TERA}),
    (r"H100 PCIe", {"bf16": 756.5 * TERA, "fp16": 756.5 * TERA, "tf32": 378.0 * TERA, "fp32": 51.2 * TERA}),
    (r"H100|H800", {"bf16": 989.4 * TERA, "fp16": 989.4 * TERA, "tf32": 494.7 * TERA, "fp32": 66.9 * TERA}),
    (r"A100|A800", {"bf16": 312.0 * TERA, "fp16": 312.0 * TERA, "tf32": 156.0 * TERA, "fp32": 19.5 * TERA}),
    (r"L40S", {"bf16": 362.05 * TERA, "fp16": 362.05 * TERA, "tf32": 183.0 * TERA, "fp32": 91.6 * TERA}),
    (r"L40\b", {"bf16": 181.0 * TERA, "fp16": 181.0 * TERA, "tf32": 90.5 * TERA, "fp32": 90.5 * TERA}),
    (r"\bL4\b", {"bf16": 121.0 * TERA, "fp16": 121.0 * TERA, "tf32": 60.0 * TERA, "fp32": 30.3 * TERA}),
    (r"\bA10\b", {"bf16": 125.0 * TERA, "fp16": 125.0 * TERA, "tf32": 62.5 * TERA, "fp32": 31.2 * TERA}),
    (r"V100", {"fp16": 125.0 * TERA, "fp32": 15.7 * TERA}),
    (r"\bT4\b", {"fp16": 65.0 * TERA, "fp32": 8.1 * TERA}),
)

COMPUTE_DTYPES = ("bf16", "fp16", "tf32", "fp32")


def peak_flops_for(device_name: str, compute_dtype: str) -> Optional[float]:
    """Dense peak FLOP/s of ``device_name`` (as ``torch.cuda.get_device_name`` spells it) for ``compute_dtype``.

    Returns None when the device or the dtype is not in the table (e.g. bf16 on a V100, any CPU): callers must
    then ask the user for ``peak_flops`` instead of guessing.
    """
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
    for pattern, peaks in _PEAK_TABLE:
        if re.search(pattern, device_name):
            return peaks.get(compute_dtype)
    return None


def compute_dtype_for_precision(precision: str) -> Optional[str]:
    """Map a Lightning precision string ("bf16-mixed", "16-true", "32-true", ...) to the tensor-core dtype.

    fp32 matmuls run on TF32 tensor cores when ``torch.get_float32_matmul_precision()`` is "high" (and on bf16
    passes when "medium"), so the peak to compare against follows that setting. Returns None for precisions with
    no entry in the peak table (64-bit, transformer-engine fp8).
    """
    precision = str(precision)
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("32"):
        matmul = torch.get_float32_matmul_precision()
        return {"highest": "fp32", "high": "tf32", "medium": "bf16"}[matmul]
    return None


def measure_flops(work: Callable[[], Any]) -> int:
    """FLOPs executed by ``work()`` (forward, backward, whatever it runs), counted by ``FlopCounterMode``."""
    counter = FlopCounterMode(display=False)
    with counter:
        work()
    return int(counter.get_total_flops())


def mfu(achieved_flops_per_sec: float, peak_flops_per_sec: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s of one device over that device's peak."""
    if peak_flops_per_sec <= 0:
        raise ValueError(f"peak_flops_per_sec must be positive, got {peak_flops_per_sec}")
    return achieved_flops_per_sec / peak_flops_per_sec
