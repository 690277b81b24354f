"""The parts of ``gpu_suite.py`` that need no GPU: the time budget, the FLOP and MFU arithmetic, the capacity
search, the classification of a run's outcome, the pytest summary, and the report.
``tests/benchmarks/test_gpu_suite.py`` tests them on CPU.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

GIB = 1024**3

# Host bytes per parameter of ZeroStrategy stage 3 + CPU offload at the peak: the fp32 sharded parameters (they are
# the masters), their fp32 gradients and AdamW's two states (estimate_memory's cpu_peak: 16 bytes) plus the fp32
# model the benchmark module builds before it is sharded (4 bytes; freed once sharded).
INIT_COPY_BYTES = 4
# What a training process holds in host memory besides the model states: CUDA context, torch and Lightning, pinned
# staging. A guess on the safe side; it only lowers the capacity search's ceiling.
HOST_OVERHEAD = 8 * GIB


class Deadline:
    """A wall-clock budget: ``left()`` seconds remain; ``sub(want)`` is a nested budget of at most ``want`` seconds
    that never outlasts this one (minus ``reserve``, kept for what must run after it, the report)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        return max(0.0, self.end - self.clock())

    def sub(self, want: float, reserve: float = 0.0) -> "Deadline":
        return Deadline(min(want, max(0.0, self.left() - reserve)), self.clock)


@dataclass
class Phase:
    """One phase of the suite: ``run(deadline)`` returns its section of the report; it is skipped, with the reason
    in the report, when less than ``minimum`` seconds of the global deadline remain."""

    name: str
    budget: float
    minimum: float
    run: Callable[[Deadline], dict]
    enabled: bool = True
    disabled_reason: str = ""


# What the global deadline keeps back from each phase, for the report written after it.
REPORT_RESERVE_S = 5.0


def run_phases(
    phases: list[Phase],
    deadline: Deadline,
    reserve: float = REPORT_RESERVE_S,
    sections: Optional[dict] = None,
    after: Optional[Callable[[dict, list], None]] = None,
) -> tuple[dict, list[dict]]:
    """Run the phases in order within ``deadline``: each gets ``min(budget, what is left - reserve)`` seconds.

    Returns ``({name: section}, skipped)`` (``sections``, when given, is filled in place, so a later phase can read
    an earlier one's). A phase that is disabled, or that the deadline leaves too little time for, is listed in
    ``skipped`` with why, never run partly; one that raises gets a section with its error, and the next phases still
    run. ``after(sections, skipped)`` is called after each phase: a report written there survives a run cut off
    later."""
    sections = {} if sections is None else sections
    skipped: list[dict] = []
    for phase in phases:
        if not phase.enabled:
            skipped.append({"phase": phase.name, "reason": phase.disabled_reason})
            continue
        budget = deadline.sub(phase.budget, reserve)
        if budget.left() < phase.minimum:
            skipped.append(
                {
                    "phase": phase.name,
                    "reason": f"{deadline.left():.0f} s of the global deadline left, "
                    f"the phase needs at least {phase.minimum:.0f} s",
                }
            )
            continue
        start = deadline.clock()
        try:
            sections[phase.name] = phase.run(budget)
        except Exception as err:  # one broken phase must not lose the others' figures
            sections[phase.name] = {"status": "error", "error": f"{type(err).__name__}: {err}"}
        sections[phase.name]["duration_s"] = round(deadline.clock() - start, 1)
        if after is not None:
            after(sections, skipped)
    if after is not None:
        after(sections, skipped)
    return sections, skipped


# --- the model and its arithmetic -------------------------------------------------------------------------------


def gpt_params(shape: dict) -> dict:
    """Parameter counts of examples/gpt.py's GPT: ``total``, ``embedding`` (token and position tables, looked up,
    not multiplied) and ``matmul`` (the rest: blocks, final LayerNorm, LM head), and ``block`` (one block)."""
    h, layers, vocab, seq = shape["n_embd"], shape["n_layer"], shape["vocab"], shape["block_size"]
    block = 12 * h * h + 13 * h  # qkv 3h^2+3h, proj h^2+h, MLP 8h^2+5h, two LayerNorms 4h
    embedding = vocab * h + seq * h
    matmul = layers * block + 2 * h + vocab * h  # + final LayerNorm and the untied head
    return {"total": embedding + matmul, "embedding": embedding, "matmul": matmul, "block": block}


def flops_per_token(shape: dict) -> int:
    """Training FLOPs per token, as the MFU literature counts them (PaLM, appendix B): ``6 N`` for the forward and
    backward matmuls over the ``N`` non-embedding parameters, plus ``12 L h s`` for attention's two score matmuls
    (``QK^T`` and ``PV``, forward and backward, all of the ``s x s`` square though causal attention needs half)."""
    n = gpt_params(shape)["matmul"]
    return 6 * n + 12 * shape["n_layer"] * shape["n_embd"] * shape["block_size"]


def throughput(step_s: Optional[float], tokens_per_step: int, flops_token: int, peak_flops: Optional[float]) -> dict:
    """Tokens/s, achieved TFLOP/s and MFU of one step time; None where it cannot be computed (no step time, or no
    known peak for the device)."""
    if not step_s or step_s <= 0:
        return {"tokens_per_s": None, "tflops": None, "mfu": None}
    from lightning_zero.estimate.flops import mfu

    tokens = tokens_per_step / step_s
    achieved = tokens * flops_token
    return {"tokens_per_s": tokens, "tflops": achieved / 1e12, "mfu": mfu(achieved, peak_flops) if peak_flops else None}


# --- the capacity search ----------------------------------------------------------------------------------------


def host_bytes(shape: dict, precision: str) -> int:
    """Host bytes ZeroStrategy stage 3 + CPU offload needs at its peak for ``shape`` (the model states as
    ``lightning_zero.estimate_memory`` counts them, the benchmark's fp32 init copy, the process overhead)."""
    from lightning_zero.estimate.model_states import estimate_memory

    p = gpt_params(shape)
    states = estimate_memory(p["total"], 3, 1, "cpu", precision, largest_unit_params=p["block"])
    return states.cpu_peak + INIT_COPY_BYTES * p["total"] + HOST_OVERHEAD


def device_bytes(shape: dict, precision: str, micro_batch: int) -> int:
    """Accelerator bytes at the peak of ZeroStrategy stage 3 + CPU offload for ``shape`` (``estimate_memory``:
    two gathered blocks and one micro-batch's activations)."""
    from lightning_zero.estimate.activations import TransformerShape
    from lightning_zero.estimate.model_states import estimate_memory

    p = gpt_params(shape)
    transformer = TransformerShape(
        hidden=shape["n_embd"],
        layers=shape["n_layer"],
        heads=shape["n_head"],
        seq_len=shape["block_size"],
        micro_batch=micro_batch,
        vocab=shape["vocab"],
    )
    return estimate_memory(
        p["total"], 3, 1, "cpu", precision, shape=transformer, largest_unit_params=p["block"]
    ).accelerator_peak


def largest_depth(shape: dict, fits: Callable[[dict], bool], limit: int) -> int:
    """The largest ``n_layer`` in ``[1, limit]`` whose shape ``fits`` (monotone in depth); 0 if none."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits({**shape, "n_layer": mid}):
            lo = mid
        else:
            hi = mid - 1
    return lo


TOO_BIG = ("gpu-oom", "host-oom", "too-slow")


@dataclass
class Search:
    """The state of :func:`find_largest`: the largest size known to train, the smallest known not to (None: none
    found), the probes in order, and why the search stopped."""

    good: int
    bad: Optional[int]
    probes: list = field(default_factory=list)
    stopped: str = ""


def find_largest(
    lo: int,
    hi: int,
    trains: Callable[[int, float], dict],
    deadline: Deadline,
    *,
    first: Optional[int] = None,
    known_good: bool = False,
    max_probes: int = 4,
    min_probe_s: float = 30.0,
) -> Search:
    """Bisect the largest size in ``[lo, hi]`` that trains, sizes being monotone (bigger never fits better).

    ``trains(size, timeout_s)`` returns ``{"outcome": ..., ...}``: ``ok``; ``gpu-oom``, ``host-oom`` or ``too-slow``
    (did not finish within the probe's own time limit), which all mean "too big" and lower the upper bound; or
    ``timeout`` (cut short by the deadline, not by its own limit) or ``error``, which stop the search (they say
    nothing about the size). ``lo`` is taken to train when
    ``known_good`` (measured before), else it may be probed. ``first`` is the first size tried (an estimate of the
    limit; default ``hi``); then the search halves the bracket. It stops after ``max_probes`` probes or when less
    than ``min_probe_s`` seconds of ``deadline`` remain, and says so in ``stopped``."""
    search = Search(good=lo if known_good else lo - 1, bad=None)
    nxt = min(max(first if first is not None else hi, lo), hi)
    while True:
        upper = hi if search.bad is None else search.bad - 1
        if search.good >= upper:
            search.stopped = "bracket closed" if search.bad is not None else f"the search's ceiling ({hi}) trains"
            return search
        if len(search.probes) >= max_probes:
            search.stopped = f"probe limit ({max_probes}) reached"
            return search
        if deadline.left() < min_probe_s:
            search.stopped = f"time budget spent ({deadline.left():.0f} s left)"
            return search
        outcome = trains(nxt, deadline.left())
        search.probes.append({"size": nxt, **outcome})
        if outcome["outcome"] == "ok":
            search.good = nxt
        elif outcome["outcome"] in TOO_BIG:
            search.bad = nxt
        else:
            search.stopped = f"probe at {nxt} ended in {outcome['outcome']}: search stopped"
            return search
        upper = hi if search.bad is None else search.bad - 1
        nxt = (search.good + upper + 1) // 2


# --- outcomes of child processes --------------------------------------------------------------------------------

_GPU_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED")
_HOST_OOM = re.compile(
    r"DefaultCPUAllocator: can't allocate memory|std::bad_alloc|Cannot allocate memory|"
    r"MemoryError"
)


def classify(returncode: Optional[int], timed_out: bool, output: str) -> dict:
    """The outcome of a child run from its exit and its output: ``ok``, ``timeout``, ``gpu-oom``, ``host-oom``
    (an allocation refused, or the process killed by SIGKILL, which is what the kernel's OOM killer sends) or
    ``error``, with the last meaningful line of the output as ``reason``."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    last = lines[-1][:300] if lines else ""
    if timed_out:
        return {"outcome": "timeout", "reason": "killed at its time limit"}
    if returncode == 0:
        return {"outcome": "ok", "reason": ""}
    if _GPU_OOM.search(output):
        return {"outcome": "gpu-oom", "reason": next((ln[:300] for ln in lines if _GPU_OOM.search(ln)), last)}
    if _HOST_OOM.search(output) or returncode in (-9, 137):
        return {"outcome": "host-oom", "reason": last or f"killed by signal 9 (exit {returncode})"}
    return {"outcome": "error", "reason": last or f"exit {returncode}"}


_PROGRESS = re.compile(r"^([.sFExX]+)\s*(\[\s*\d+%\])?$")
_PROGRESS_KEYS = {".": "passed", "s": "skipped", "F": "failed", "E": "errors", "x": "xfailed", "X": "xpassed"}


def pytest_counts(output: str) -> dict:
    """The counts of pytest's last summary line (``3 passed, 1 skipped, 2 warnings in 4.2s``); without one (a run
    killed at its time limit), the counts of ``-q``'s progress characters so far, with ``"partial": 1``."""
    lines = [
        line
        for line in output.splitlines()
        if re.search(
            r"\d+ (passed|failed|skipped|errors?|deselected|"
            r"xfailed|xpassed|no tests ran)",
            line,
        )
    ]
    counts: dict = {}
    if not lines:
        for line in output.splitlines():
            match = _PROGRESS.match(line.strip())
            for char in match.group(1) if match else "":
                counts[_PROGRESS_KEYS[char]] = counts.get(_PROGRESS_KEYS[char], 0) + 1
        return {**counts, "partial": 1} if counts else {}
    for number, word in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)", lines[-1]
    ):
        key = {"error": "errors", "warning": "warnings"}.get(word, word)
        counts[key] = counts.get(key, 0) + int(number)
    return counts


# --- the report -------------------------------------------------------------------------------------------------


def _fmt(value, spec: str, missing: str = "–") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _gib(value) -> str:
    return _fmt(None if value is None else value / GIB, ".1f")


def render_header(result: dict) -> list[str]:
    device, versions = result.get("device", {}), result.get("versions", {})
    lines = [
        "# GPU suite report",
        "",
        f"Written by `benchmarks/gpu_suite.py` on {result.get('started', '?')}"
        f"{' (dry run: nothing was measured)' if result.get('dry_run') else ''}; "
        f"{_fmt(result.get('wall_s'), '.0f')} s of a {result.get('deadline_s', '?')} s deadline.",
        "",
        "| | |",
        "|---|---|",
    ]
    for key, label in (
        ("name", "device"),
        ("memory_gib", "device memory (GiB)"),
        ("capability", "compute capability"),
        ("peak_tflops_bf16", "bf16 dense peak used for MFU (TFLOP/s)"),
        ("cpus", "CPU cores"),
        ("ram_gib", "host memory (GiB)"),
        ("backend", "process group"),
    ):
        if device.get(key) is not None:
            lines.append(f"| {label} | {device[key]} |")
    for key, value in versions.items():
        lines.append(f"| {key} | {value} |")
    return lines + [""]


def render_tests(section: dict) -> list[str]:
    lines = ["## tests/gpu", ""]
    if section.get("status") == "error":
        return lines + [f"Error: {section['error']}", ""]
    counts = ", ".join(f"{v} {k}" for k, v in section.get("counts", {}).items()) or "no summary line"
    lines += [
        f"`{section.get('command', '')}`: **{section.get('status')}** ({counts}; "
        f"{_fmt(section.get('duration_s'), '.0f')} s).",
        "",
        "```",
        section.get("tail", "").rstrip(),
        "```",
        "",
    ]
    return lines


def render_throughput(section: dict) -> list[str]:
    lines = [f"## {section.get('title', 'Throughput: ZeroStrategy against DeepSpeed')}", ""]
    if section.get("status") == "error":
        return lines + [f"Error: {section['error']}", ""]
    lines += section.get("description", []) + [
        "",
        "| side | ZeRO | status | step (s) | tokens/s | TFLOP/s | MFU | peak allocated (GiB) | "
        "peak reserved (GiB) | estimated peak (GiB) | host peak RSS (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in section.get("rows", []):
        status = row["status"] + (f": {row['reason']}" if row.get("reason") else "")
        mfu = _fmt(None if row.get("mfu") is None else 100 * row["mfu"], ".1f") + ("%" if row.get("mfu") else "")
        lines.append(
            f"| {row['label']} | {row['config']} | {status} | {_fmt(row.get('step_s'), '.3f')} | "
            f"{_fmt(row.get('tokens_per_s'), ',.0f')} | {_fmt(row.get('tflops'), '.1f')} | {mfu} | "
            f"{_gib(row.get('peak_allocated'))} | {_gib(row.get('peak_reserved'))} | "
            f"{_gib(row.get('estimate'))} | {_gib(row.get('host_peak'))} |"
        )
    ratios = section.get("ratios", [])
    if ratios:
        lines += ["", "| ZeRO | ours / DeepSpeed tokens/s | ours / DeepSpeed peak allocated |", "|---|---|---|"]
        lines += [
            f"| {r['config']} | {_fmt(r.get('tokens'), '.2f')} | {_fmt(r.get('memory'), '.2f')} |" for r in ratios
        ]
    return lines + [""] + [f"- {note}" for note in section.get("notes", [])] + [""]


def render_capacity(section: dict) -> list[str]:
    lines = ["## Capacity: the largest GPT that trains at stage 3 + CPU offload", ""]
    if section.get("status") == "error":
        return lines + [f"Error: {section['error']}", ""]
    lines += section.get("description", []) + [
        "",
        "| layers | parameters (B) | outcome | wall (s) | peak allocated (GiB) | host peak RSS (GiB) | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for probe in section.get("probes", []):
        lines.append(
            f"| {probe['size']} | {_fmt(probe.get('params_b'), '.2f')} | {probe['outcome']} | "
            f"{_fmt(probe.get('wall_s'), '.0f')} | {_gib(probe.get('peak_allocated'))} | "
            f"{_gib(probe.get('host_peak'))} | {probe.get('reason', '')} |"
        )
    return lines + ["", f"**Result**: {section.get('result', 'no result')}", ""]


def render_report(result: dict) -> str:
    """The markdown report of a suite run (``result`` as ``gpu_suite.py`` builds it, also written as JSON)."""
    lines = render_header(result)
    if result.get("plan"):
        lines += ["## Plan", ""] + [f"- {line}" for line in result["plan"]] + [""]
    phases = result.get("phases", {})
    renderers = {
        "tests": render_tests,
        "throughput": render_throughput,
        "capacity": render_capacity,
        "ds_cpu_adam": render_throughput,
    }
    for name, section in phases.items():
        lines += renderers[name](section)
    skipped = result.get("skipped", [])
    lines += ["## Skipped", ""] + ([f"- {s['phase']}: {s['reason']}" for s in skipped] or ["Nothing."]) + [""]
    if result.get("notes"):
        lines += ["## Notes", ""] + [f"- {note}" for note in result["notes"]] + [""]
    return "\n".join(lines)


def write_report(result: dict, out_dir: str) -> tuple[str, str]:
    """Write ``gpu_report.md`` and ``gpu_report.json`` into ``out_dir``; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    md, js = os.path.join(out_dir, "gpu_report.md"), os.path.join(out_dir, "gpu_report.json")
    with open(md, "w") as f:
        f.write(render_report(result))
    with open(js, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return md, js
