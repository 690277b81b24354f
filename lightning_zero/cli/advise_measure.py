"""``lightning-zero advise --measure``: a few real training steps of one rung, in a short-lived process.

The parent (``measure_rung``) starts ``python -m lightning_zero.cli.advise_measure SPEC.json``; that process starts
one process per rank (fork on CPU, spawn on CUDA), each builds a ``Trainer`` with the rung's ``ZeroStrategy`` and
runs ``warmup + steps`` steps on random token batches ``(inputs, targets)`` of shape ``(micro_batch, seq_len)``:
the batch the GPT example's ``training_step`` takes. Each rank reports its median step time, the bytes the
formulas predict (tensors saved for backward plus model states at rest, ``tensors``) and its peak memory:
``torch.cuda.max_memory_allocated`` on CUDA, the growth of the resident set's high-water mark (``VmHWM``, reset
after imports) on CPU. An out-of-memory error, a ``MemoryError`` or a rank killed by a signal (the kernel's
OOM killer) is "does not fit"; any other failure is reported with its last line, never as a fit.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

OOM_MARKERS = ("out of memory", "MemoryError", "OutOfMemoryError", "CUDA error: out of memory")


def measure_rung(spec: dict, timeout: float = 600.0) -> dict:
    """Run one rung; returns ``{"status": "ok", "peak": bytes, "time": s}``, ``{"status": "oom", ...}`` or
    ``{"status": "error", "message": ...}``. ``spec``: model_class, init_args, data_class, data_args, strategy
    (ZeroStrategy kwargs), precision, accelerator, devices, micro_batch, seq_len, vocab, steps, warmup."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, out=os.path.join(tmp, "result"))
        path = os.path.join(tmp, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "lightning_zero.cli.advise_measure", path],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=_child_env(),
            )
        except subprocess.TimeoutExpired:
            return {"status": "error", "message": f"timed out after {timeout:.0f} s"}
        results = []
        for rank in range(spec["devices"]):
            try:
                with open(f"{spec['out']}.{rank}") as f:
                    results.append(json.load(f))
            except (OSError, ValueError):
                pass
    if any(r.get("status") == "oom" for r in results):
        return {"status": "oom", "message": next(r["message"] for r in results if r.get("status") == "oom")}
    if proc.returncode < 0 or proc.returncode in (137, -9):
        return {"status": "oom", "message": f"killed by signal {-proc.returncode if proc.returncode < 0 else 9}"}
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()
    if proc.returncode != 0 or len(results) != spec["devices"]:
        text = "\n".join(tail[-30:])
        if any(marker in text for marker in OOM_MARKERS):
            return {"status": "oom", "message": _last_error(tail)}
        return {"status": "error", "message": _last_error(tail) or f"exit code {proc.returncode}"}
    return {
        "status": "ok",
        "peak": max(r["peak"] for r in results),
        "time": max(r["time"] for r in results),
        "tensors": max(r["tensors"] for r in results),
    }


def _last_error(lines: list) -> str:
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line.strip()[:200]
    return lines[-1].strip()[:200] if lines else ""


def _child_env() -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak(cuda: bool) -> int:
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    return _proc_kib("VmRSS") * 1024


def _peak(cuda: bool, baseline: int) -> int:
    import torch

    if cuda:
        return torch.cuda.max_memory_allocated() - baseline
    return _proc_kib("VmHWM") * 1024 - baseline


def _run_rank(rank: int, world: int, port: int, spec: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        NODE_RANK="0",
    )
    import torch

    cuda = spec["accelerator"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    try:
        result = _train(rank, world, spec, cuda)
    except (MemoryError, torch.OutOfMemoryError) as err:
        result = {"status": "oom", "message": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    with open(f"{spec['out']}.{rank}", "w") as f:
        json.dump(result, f)
    if result.get("status") == "oom":
        os._exit(0)  # the other ranks may be stuck in a collective: the parent reads the files


def measuring_callback(cuda: bool = False):
    """A Lightning callback recording each step's time (``times``) and ``tensors``: the bytes the formulas predict,
    measured. That is the model states at rest (between backward and the optimizer step) plus the tensors saved for
    backward: those autograd saves during forward, the inputs checkpointed blocks keep (also when ``save_on_cpu``
    holds them) and the largest checkpointed block's rebuilt activations, measured once after the first step
    (``lightning_zero.estimate.checkpointed_activations``)."""
    import lightning.pytorch as pl
    import torch

    from lightning_zero import model_state_memory
    from lightning_zero.estimate.checkpointed_activations import checkpointed_activation_bytes, recomputed_block_bytes

    class Measure(pl.Callback):
        def __init__(self) -> None:
            self.times: list = []
            self.at_rest: list = []  # per step: states + activations saved in forward
            self.recomputed = 0

        @property
        def tensors(self) -> int:
            return max(self.at_rest, default=0) + self.recomputed

        def on_train_batch_start(self, trainer, pl_module, *args):
            self.saved = checkpointed_activation_bytes(pl_module)
            self.activations = self.saved.__enter__()
            self.start = time.perf_counter()

        def on_before_backward(self, *args):
            self.saved.__exit__(None, None, None)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            states = model_state_memory(pl_module, trainer.optimizers).total.total
            self.at_rest.append(states + self.activations.total)

        def on_train_batch_end(self, trainer, pl_module, *args):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)
            if len(self.times) == 1:  # after the first (warm-up) step: outside the timed ones, FSDP2 initialised
                self.recomputed = recomputed_block_bytes(
                    pl_module, self.activations, trainer.precision_plugin.forward_context
                )

    return Measure()


def _train(rank: int, world: int, spec: dict, cuda: bool) -> dict:
    import lightning.pytorch as pl
    import torch

    from lightning_zero import ZeroStrategy
    from lightning_zero.cli.advise_model import ModelSpec, instantiate

    baseline = _reset_peak(cuda)
    timer = measuring_callback(cuda)
    model = instantiate(
        ModelSpec(spec["model_class"], spec["init_args"], spec.get("data_class"), spec.get("data_args") or {}),
        device=None,
    )
    gen = torch.Generator().manual_seed(rank)
    shape = (spec["micro_batch"], spec["seq_len"])
    batches = [
        (torch.randint(0, spec["vocab"], shape, generator=gen), torch.randint(0, spec["vocab"], shape, generator=gen))
        for _ in range(spec["warmup"] + spec["steps"])
    ]
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=world,
        strategy=ZeroStrategy(**spec["strategy"]),
        precision=spec["precision"],
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        use_distributed_sampler=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    measured = timer.times[spec["warmup"] :] or timer.times
    return {
        "status": "ok",
        "time": statistics.median(measured),
        "peak": _peak(cuda, baseline),
        "tensors": timer.tensors,
    }


def main(argv: Optional[list] = None) -> int:
    import torch.multiprocessing as mp

    from lightning_zero.cli.advise_model import load_object
    from lightning_zero.diagnostics.network import free_port

    with open((argv or sys.argv[1:])[0]) as f:
        spec = json.load(f)
    load_object(spec["model_class"])  # import the user's module once, before the ranks fork
    # Fork shares the imports (seconds per rank on a small CPU machine); CUDA cannot be forked.
    method = "spawn" if spec["accelerator"] == "cuda" else "fork"
    mp.start_processes(
        _run_rank, args=(spec["devices"], free_port(), spec), nprocs=spec["devices"], start_method=method
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
