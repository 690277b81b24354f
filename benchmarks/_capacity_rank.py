"""One try of ``bench_capacity.py``: two rank processes, each under its own memory cap, train a GPT of one depth.

``launch(job, args)`` imports, once, every module either side needs (``_bench_workers._PRELOAD``: DeepSpeed's lazy
imports are not charged to it, nor Lightning's to us), then forks the ``world`` rank processes from that state, so a
try costs the model and its training, not the imports. Each rank copies the pages it shares with the parent
(``_own_private_pages``), then joins its own memory cgroup (made under this process's cgroup, so its usage still
counts against everything above it; the kernel's OOM killer ends a rank over its cap with SIGKILL and counts an
``oom_kill``), builds the model the way each side documents for models larger than one process (ours in
``configure_model``, replayed one unit at a time at stages 2-3; DeepSpeed's ``zero.Init`` at stage 3), trains
``steps`` AdamW steps in fp32 and writes the growth of its resident set (``VmHWM`` after joining minus ``VmRSS`` at
joining) and the last step's wall time. The parent watches the ranks: the first one to die ends the try, and its
peers, blocked in a collective that will never complete, are killed by their process id. The outcome is ``ok``,
``oom`` (the cgroup's OOM kill count rose, or a rank raised ``MemoryError``/an allocator error under
``RLIMIT_DATA``), ``error`` (any other failure, with its last line) or ``timeout``.

Why a cgroup rather than ``RLIMIT_AS``/``RLIMIT_DATA``: the cgroup charges pages actually touched (resident
memory), the figure a machine runs out of; ``RLIMIT_AS`` counts address space reserved and never touched (glibc
arenas, 8 MiB thread stacks, torch's reservations) and ``RLIMIT_DATA`` still counts every private writable
reservation, so either would measure how much each side *reserves*. ``RLIMIT_DATA`` is the fallback where no
cgroup can be made (no root, no writable memory controller), named in the table.

[Note: what the cap bounds]
Everything the rank adds to the imports both sides share: parameters, gradients, optimizer states, activations,
communication buffers and the allocator's retained heap. On a CPU-only machine "offload to CPU" moves the optimizer
(and at stage 3 the parameters) from the device's memory to the host's, which is the same memory here, so under a
cap on the rank's total the CPU rungs can only show what the offload machinery itself costs or saves; only NVMe
takes model states out of the capped memory. On a GPU the cap that matters for ``+cpu`` is the device's memory
(``gpu_suite.py``), and the host memory is a separate, usually larger, budget.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time

from benchmarks.common import deepspeed_init_distributed, free_port

GIB = 1 << 30

# DeepSpeed's memory knobs turned down from their defaults (elements): the buckets of its gradient reduction and
# parameter all-gather (default 5e8 each), stage 3's prefetch bucket (5e7), live-parameter budget and reuse distance
# (1e9), its persistence threshold (1e5: parameters below it stay gathered) and the optimizer's sub-group (1e9), the
# overlap of reduction with backward turned off (its extra buffers), and the NVMe staging buffers (1e8 x 5).
TUNED = {
    "reduce_bucket_size": 2e6,
    "allgather_bucket_size": 2e6,
    "overlap_comm": False,
    "stage3_prefetch_bucket_size": 1e6,
    "stage3_max_live_parameters": 1e6,
    "stage3_max_reuse_distance": 1e6,
    "stage3_param_persistence_threshold": 1e4,
    "sub_group_size": 1e7,
}
TUNED_AIO_BUFFER = {"buffer_count": 4, "buffer_size": 1e7}


def deepspeed_config(rung: str, side: str, batch: int, nvme_path: str) -> dict:
    """DeepSpeed's config for one rung: default ``zero_optimization`` plus, for ``deepspeed-tuned``, ``TUNED``."""
    stage, _, extra = rung.partition("+")
    zero = {"stage": int(stage)}
    if extra in ("cpu", "nvme"):
        where = {"device": extra, "pin_memory": False}
        if extra == "nvme":
            where["nvme_path"] = nvme_path
        zero["offload_optimizer"] = dict(where)
        if stage == "3":
            zero["offload_param"] = dict(
                where, **(TUNED_AIO_BUFFER if side.endswith("tuned") and extra == "nvme" else {})
            )
    if side.endswith("tuned"):
        zero.update({k: v for k, v in TUNED.items() if int(stage) == 3 or not k.startswith("stage3_")})
        if int(stage) != 3 or extra != "nvme":
            zero.pop("sub_group_size")
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }


# ---------------------------------------------------------------------------------------------------------------------
# The cap: a cgroup per rank (v1 memory controller or v2), RLIMIT_DATA where no cgroup can be made.


def _own_cgroup() -> tuple[str, str] | None:
    """(version, directory) of this process's memory cgroup, if we may create children in it; else None."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):
            root = "/sys/fs/cgroup/memory"
            if os.path.isfile(os.path.join(root, path.lstrip("/"), "memory.limit_in_bytes")):
                return "v1", os.path.join(root, path.lstrip("/"))
    for _, controllers, path in lines:
        if controllers == "":
            for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                directory = os.path.join(root, path.lstrip("/"))
                try:
                    with open(os.path.join(directory, "cgroup.subtree_control")) as f:
                        if "memory" in f.read().split():
                            return "v2", directory
                except OSError:
                    continue
    return None


class Cap:
    """The per-rank cap: ``make(rank)`` before a rank starts, ``read(rank)`` after it ended, ``remove()`` at the end.

    ``kind`` is ``"cgroup v1"``/``"cgroup v2"`` or ``"RLIMIT_DATA"`` (the fallback, applied by the rank itself)."""

    def __init__(self, limit: int, prefer: str = "cgroup"):
        self.limit, self.dirs = limit, {}
        found = _own_cgroup() if prefer == "cgroup" else None
        self.version, self.parent = found if found else (None, None)
        if self.parent is not None and not os.access(self.parent, os.W_OK):
            self.version = self.parent = None
        self.kind = f"cgroup {self.version}" if self.version else "RLIMIT_DATA"

    def make(self, rank: int) -> str | None:
        if self.version is None:
            return None
        directory = os.path.join(self.parent, f"lz-capacity-{os.getpid()}-{rank}")
        if os.path.isdir(directory):
            os.rmdir(directory)
        os.mkdir(directory)
        name = "memory.limit_in_bytes" if self.version == "v1" else "memory.max"
        with open(os.path.join(directory, name), "w") as f:
            f.write(str(self.limit))
        if self.version == "v2":  # no swap here, and none should hide an over-cap rank where there is some
            with open(os.path.join(directory, "memory.swap.max"), "w") as f:
                f.write("0")
        self.dirs[rank] = directory
        return directory

    def read(self, rank: int) -> dict:
        """The cgroup's peak charge (bytes) and OOM kills of one rank; empty under RLIMIT_DATA."""
        directory = self.dirs.get(rank)
        if directory is None:
            return {}
        if self.version == "v1":
            with open(os.path.join(directory, "memory.oom_control")) as f:
                kills = dict(line.split() for line in f).get("oom_kill", "0")
            with open(os.path.join(directory, "memory.max_usage_in_bytes")) as f:
                return {"cgroup_peak": int(f.read()), "oom_kills": int(kills)}
        with open(os.path.join(directory, "memory.events")) as f:
            kills = dict(line.split() for line in f).get("oom_kill", "0")
        peak = os.path.join(directory, "memory.peak")
        result = {"oom_kills": int(kills)}
        if os.path.exists(peak):
            with open(peak) as f:
                result["cgroup_peak"] = int(f.read())
        return result

    def remove(self) -> None:
        for directory in self.dirs.values():
            for _ in range(50):  # the kernel frees a killed task's cgroup membership a moment after reaping it
                try:
                    os.rmdir(directory)
                    break
                except OSError:
                    time.sleep(0.1)
        self.dirs = {}


# ---------------------------------------------------------------------------------------------------------------------
# The parent: start the ranks, watch them, classify the outcome.


def preload() -> None:
    """Import, once in the parent, every module a rank of either side needs: the ranks are forked from it, so a try
    costs the model and its training, not 20 s of imports per rank. Nothing here starts a thread (checked: forking
    a process with threads could copy a held lock), and the parent runs no torch computation before forking."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["OMP_NUM_THREADS"] = "1"
    import threading

    from benchmarks import _bench_workers as workers

    workers._preload()
    if threading.active_count() != 1:
        raise RuntimeError(f"{threading.active_count()} threads after the imports: the ranks cannot be forked")


def launch(job: dict, args) -> dict:
    """One try of ``job`` (``side``, ``rung``, ``depth`` and the shape) on ``args.nproc`` capped ranks.

    Returns ``{"outcome", "cap", "peak_rss", "cgroup_peak", "step_time", "detail"}``, figures the maximum over
    ranks (``None`` where no rank reported them)."""
    preload()
    cap = Cap(int(args.cap_gib * GIB), prefer=args.cap_method)
    port, pids = free_port(), []
    with tempfile.TemporaryDirectory(prefix="lz-capacity-") as tmp:
        try:
            for rank in range(args.nproc):
                cgroup = cap.make(rank)
                spec = dict(
                    job,
                    cgroup=cgroup,
                    rlimit=None if cgroup else cap.limit,
                    out=os.path.join(tmp, "r"),
                    nvme_path=tmp,
                    rank=rank,
                    world=args.nproc,
                    port=port,
                    log=os.path.join(tmp, f"log{rank}"),
                )
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(spec)  # never returns
                pids.append(pid)
            codes = _watch(pids, args.timeout)
            stats = [cap.read(rank) for rank in range(args.nproc)]
            reports, tails = [], []
            for rank in range(args.nproc):
                path = os.path.join(tmp, f"r.{rank}")
                if os.path.exists(path):
                    with open(path) as f:
                        reports.append(json.load(f))
                with open(os.path.join(tmp, f"log{rank}"), errors="replace") as f:
                    tails.append(f.read()[-4000:])
        finally:
            for pid in pids:
                _reap(pid, kill=True)
            cap.remove()
    return _classify(codes, stats, reports, tails, cap.kind)


def _reap(pid: int, kill: bool = False):
    """The exit code of child ``pid`` if it has ended (killing it first with ``kill``), else None."""
    try:
        if kill:
            os.kill(pid, signal.SIGKILL)
        done, status = os.waitpid(pid, 0 if kill else os.WNOHANG)
    except (ChildProcessError, ProcessLookupError):
        return None
    return os.waitstatus_to_exitcode(status) if done else None


def _watch(pids, timeout: float) -> list:
    """Exit codes of every rank; once one fails (or time runs out) the others are killed by pid and marked None."""
    deadline, codes = time.monotonic() + timeout, [None] * len(pids)
    while True:
        codes = [code if code is not None else _reap(pid) for pid, code in zip(pids, codes)]
        if all(code is not None for code in codes):
            return codes
        late = time.monotonic() > deadline
        if any(code not in (None, 0) for code in codes) or late:
            for pid, code in zip(pids, codes):
                if code is None:
                    _reap(pid, kill=True)
            return ["timeout" if late and c is None else c for c in codes]
        time.sleep(0.2)


def _child(spec: dict) -> None:
    """The forked rank: its output to its log, then ``rank_main``; exits without running the parent's handlers."""
    code = 1
    try:
        fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(
            RANK=str(spec["rank"]),
            LOCAL_RANK=str(spec["rank"]),
            WORLD_SIZE=str(spec["world"]),
            LOCAL_WORLD_SIZE=str(spec["world"]),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(spec["port"]),
        )
        rank_main(spec)
        code = 0
    except BaseException:  # noqa: BLE001 - the rank's failure goes to its log, the parent classifies it
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


_OOM_WORDS = (
    "MemoryError",
    "can't allocate memory",
    "Cannot allocate memory",
    "std::bad_alloc",
    "DefaultCPUAllocator: not enough memory",
)


def _classify(codes, stats, reports, tails, cap_kind) -> dict:
    ok = all(code == 0 for code in codes) and len(reports) == len(codes)
    oom = any(s.get("oom_kills", 0) > 0 for s in stats) or any(w in t for t in tails for w in _OOM_WORDS)
    if ok:
        outcome = "ok"
    elif oom:
        outcome = "oom"
    elif "timeout" in codes:
        outcome = "timeout"
    else:
        outcome = "error"
    detail = ""
    if outcome != "ok":
        failed = [i for i, c in enumerate(codes) if c not in (0, None)] or [0]
        lines = [line for line in tails[failed[0]].splitlines() if line.strip()]
        detail = f"rank {failed[0]} exit {codes[failed[0]]}: " + (lines[-1][:200] if lines else "(no output)")
    peak = [r["peak_rss"] for r in reports]
    return {
        "outcome": outcome,
        "cap": cap_kind,
        "detail": detail,
        "peak_rss": max(peak) if peak else None,
        "cgroup_peak": max((s["cgroup_peak"] for s in stats if "cgroup_peak" in s), default=None),
        "step_time": max(r["step_time"] for r in reports) if ok else None,
    }


# ---------------------------------------------------------------------------------------------------------------------
# A rank process.


def _vm_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _model_args(job):
    from types import SimpleNamespace

    gpt = {
        "n_layer": job["depth"],
        "n_embd": job["width"],
        "n_head": job["heads"],
        "block_size": job["seq"],
        "vocab": job["vocab"],
    }
    return SimpleNamespace(quick=False, gpt=gpt, batch=job["batch"], warmup=0, steps=job["steps"])


def _rung(rung: str) -> tuple[int, str | None, bool]:
    """(stage, offload device or None, activation checkpointing) of a rung such as ``3+nvme`` or ``3+ac``."""
    stage, _, extra = rung.partition("+")
    return int(stage), (extra if extra in ("cpu", "nvme") else None), extra == "ac"


def run_ours(job, rank, world) -> float:
    import lightning.pytorch as pl
    import torch

    from benchmarks import _bench_models as models
    from lightning_zero import ZeroStrategy

    margs = _model_args(job)
    stage, offload, checkpointing = _rung(job["rung"])
    times = []

    class Module(models.lightning_module("gpt", margs)):
        def __init__(self):
            pl.LightningModule.__init__(self)  # the model is built in configure_model (deferred at stages 2-3)

        def configure_model(self):
            if not hasattr(self, "net"):
                self.net = models.build("gpt", margs)

    class Timer(pl.Callback):
        def on_train_batch_start(self, *a):
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a):
            times.append(time.perf_counter() - self.t)

    # "options": extra ZeroStrategy arguments, for a side-by-side look at one knob (not used by the ladder)
    options = dict(job.get("options", {}), **({"nvme_path": job["nvme_path"]} if offload == "nvme" else {}))
    strategy = ZeroStrategy(stage=stage, offload=offload, activation_checkpointing=checkpointing or None, **options)
    data = models.batches("gpt", margs, rank)
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="32-true",
        max_steps=len(data),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timer()],
        use_distributed_sampler=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    return times[-1]


def run_deepspeed(job, rank, world) -> float:
    import contextlib

    from benchmarks import _bench_models as models

    deepspeed = deepspeed_init_distributed("cpu")
    margs = _model_args(job)
    stage, _, checkpointing = _rung(job["rung"])
    config = deepspeed_config(job["rung"], job["side"], job["batch"], job["nvme_path"])
    init = deepspeed.zero.Init(config_dict_or_path=config) if stage == 3 else contextlib.nullcontext()
    with init:
        model = models.build("gpt", margs)
    if checkpointing:  # what a DeepSpeed user does for Hugging Face models: torch's checkpoint around each block
        from torch.utils.checkpoint import checkpoint

        for block in model.blocks:
            block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    times = []
    for x, y in models.batches("gpt", margs, rank):
        start = time.perf_counter()
        engine.backward(models.loss("gpt", engine, x, y))
        engine.step()
        times.append(time.perf_counter() - start)
    return times[-1]


def _own_private_pages() -> None:
    """Copy now every page this forked rank shares copy-on-write with its parent (``MADV_POPULATE_WRITE`` on each
    private writable mapping, contents unchanged), so that the copies are charged before the rank joins its cgroup.

    Without it a page of the parent's imports is charged to the rank that first writes it (a reference count
    changing is enough): the side that touches more Python objects (Lightning's Trainer) would pay for imports
    both sides hold, which a rank that imported them itself holds privately from the start on either side."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    populate_write = 23  # MADV_POPULATE_WRITE, Linux >= 5.14; older kernels refuse it and the step is skipped
    with open("/proc/self/maps") as f:
        regions = [line.split()[:2] for line in f]
    for span, perms in regions:
        if perms.startswith("rw") and perms.endswith("p"):
            start, end = (int(x, 16) for x in span.split("-"))
            libc.madvise(start, end - start, populate_write)


def rank_main(spec: dict) -> None:
    """Join the cgroup (or set RLIMIT_DATA), train, write this rank's report."""
    _own_private_pages()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here: the peak the rank's training adds shows as VmHWM - this VmRSS
    base = _vm_bytes("VmRSS")
    if spec.get("cgroup"):
        with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    if spec.get("rlimit"):
        resource.setrlimit(resource.RLIMIT_DATA, (spec["rlimit"], spec["rlimit"]))
    import threading

    import torch

    from benchmarks import _bench_workers as workers

    threading.stack_size(1 << 20)  # under RLIMIT_DATA a thread's 8 MiB stack reservation would count in full
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank, world = spec["rank"], spec["world"]
    runner = run_deepspeed if spec["side"].startswith("deepspeed") else run_ours
    step_time = runner(spec, rank, world)
    with open(f"{spec['out']}.{rank}", "w") as f:
        json.dump({"step_time": step_time, "peak_rss": _vm_bytes("VmHWM") - base}, f)
    workers._end_process_group()
