"""Which files of the package a training step runs: stage-2 steps through the Trainer's ``ZeroStrategy``, traced.

:func:`trace_steps` fits a tiny model on gloo ranks and records, on rank 0, every ``lightning_zero`` file whose code
is entered (``sys.setprofile``'s ``call`` events) between the start and the end of each training batch after the
first (forward, backward, optimizer step; setup and the first step's lazy initialisation are not counted). With
``cuda_decisions=True`` the run makes the decisions a CUDA run makes: the package's one switch for CPU-only tuning,
:func:`lightning_zero.distributed.cpu_tuning.cpu_tuning_enabled`, answers ``False`` (the run still computes on CPU;
the work each decision hands to torch runs on a GPU in ``tests/gpu``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback

import lightning_zero
from tests.ranks import run_distributed

PACKAGE_DIR = str(Path(lightning_zero.__file__).resolve().parent)


class StepFiles(Callback):
    """Collects the package files entered during the training batches after the first ``skip``, and what the step
    ran with (the optimizer's class, the CPU buffer pool, the forward redirection)."""

    def __init__(self, skip: int = 1, functions: bool = False):
        self.skip, self.functions, self.files, self.batches = skip, functions, set(), 0
        self.seen: dict = {}

    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(PACKAGE_DIR):
                where = str(Path(name).relative_to(PACKAGE_DIR))
                self.files.add(f"{where}:{frame.f_code.co_name}" if self.functions else where)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx < self.skip:
            return
        from lightning_zero.distributed.comm_buffers import comm_buffer_pool

        strategy = trainer.strategy
        self.seen = {
            "optimizer_class": f"{type(strategy.optimizers[0]).__module__}.{type(strategy.optimizers[0]).__qualname__}",
            "optimizer_class_is_users": type(strategy.optimizers[0]) is torch.optim.AdamW,
            "buffer_pool": comm_buffer_pool(pl_module) is not None,
            "redirection": type(strategy._forward_redirection).__name__,
        }
        self.batches += 1
        sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sys.setprofile(None)


def _fit_worker(rank, world_size, out: str, precision: str, cuda_decisions: bool, steps: int, functions: bool):
    from lightning_zero import ZeroStrategy
    from lightning_zero.distributed import cpu_tuning
    from tests.lightning_models import RegressionModule, full_state, quiet_trainer, reference_weights

    if cuda_decisions:  # this forked rank only: the parent's module is untouched
        cpu_tuning.cpu_tuning_enabled = lambda device: False
    torch.manual_seed(0)
    tracer = StepFiles(functions=functions)
    trainer = quiet_trainer(ZeroStrategy(stage=2), world_size, max_steps=steps, precision=precision, callbacks=[tracer])
    module = RegressionModule(batch_size=BATCH)
    trainer.fit(module)
    got = full_state(module)  # every rank: gathers the shards
    if rank == 0:
        expected = reference_weights(steps, BATCH * world_size)
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        found = {"files": sorted(tracer.files), "batches": tracer.batches, "max_diff": worst, **tracer.seen}
        Path(out).write_text(json.dumps(found))


BATCH = 2


def trace_steps(
    tmp_path: Path,
    *,
    precision: str = "32-true",
    cuda_decisions: bool = False,
    world_size: int = 2,
    steps: int = 3,
    functions: bool = False,
) -> dict:
    """Fit ``RegressionModule`` at stage 2 on ``world_size`` gloo ranks and return what rank 0 saw: ``files``, the
    package files (relative to ``lightning_zero/``) that the training steps after the first entered, sorted
    (``functions``: ``file:function`` entries instead); ``max_diff`` from a one-process reference; and the
    ``optimizer_class``, ``buffer_pool`` and ``redirection`` the steps ran with (see the module docstring)."""
    out = tmp_path / f"step_files_{precision}_{cuda_decisions}.json"
    run_distributed(_fit_worker, world_size, str(out), precision, cuda_decisions, steps, functions)
    found = json.loads(out.read_text())
    assert found["batches"] == steps - 1, found
    return found


if __name__ == "__main__":  # python -m tests.distributed.step_files [--functions]: print the lists
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("32-true", "bf16-mixed"):
            for cuda in (False, True):
                found = trace_steps(
                    Path(tmp), precision=precision, cuda_decisions=cuda, functions="--functions" in sys.argv
                )
                files = found.pop("files")
                print(f"{precision} cuda_decisions={cuda}: {len(files)} {found}", *files, sep="\n  ")
