"""The job the preemption trials signal: ``python -m tests.reliability.preempt_trial_job ROOT [CKPT [ROOT CKPT ...]]``.

Two CPU ranks train ``RegressionModule`` at stage 2 for ``STEPS`` steps with ``async_save=True``, saving every
``SAVE_EVERY`` steps (top-2 by step, plus ``last.ckpt``). ``CKPT`` (``last`` or a path) resumes (see :func:`main`).

What makes a trial meaningful:
- Each phase a SIGTERM should be able to land in is stretched to tens of milliseconds with a sleep *inside* it:
  forward (in a forward pre-hook of the first block), backward (in a gradient hook on that block's output, inside
  autograd), the optimizer step (in an optimizer
  step pre-hook, inside ``optimizer.step``), the async save's background write (in the DCP writer) and its rename
  (in ``swap_into_place``, between its renames). A random instant then lands in each with a useful probability.
- Each rank writes its current phase to ``ROOT/phase-r<rank>`` (the training thread) and ``ROOT/bg-r<rank>`` (the
  save's background thread), which the trials poll to aim, and a SIGTERM handler installed before the fit (the
  strategy's own handler calls it) records where the signal landed in ``ROOT/landed-r<rank>.json``.
- Each step's batch is drawn from the global step and rank, not from the loader's position: a plain ``DataLoader``
  restarts its epoch on a mid-epoch resume (``docs/reliability.md``), so only then can a resumed run be compared
  bit for bit with one never interrupted.

Each rank writes ``ROOT/pid-r<rank>``; rank 0 writes ``ROOT/started.json`` (the step the fit starts from) and, at
the end of training, ``ROOT/final.pt``: full weights, full optimizer state and the LR scheduler's state.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import atomic, io
from tests.lightning_models import RegressionModule, full_state

STEPS, SAVE_EVERY = 10, 2
STRETCH_S = {"forward": 0.04, "backward": 0.04, "optimizer_step": 0.04, "write": 0.15, "rename": 0.08}
_state = {"root": None, "rank": 0, "main": "setup", "bg": "idle", "step": 0}


def _mark(kind: str, phase: str) -> None:
    _state[kind] = phase
    path = _state["root"] / f"{'phase' if kind == 'main' else 'bg'}-r{_state['rank']}"
    path.write_text(f"{phase} {_state['step']}")


def _stretch(kind: str, phase: str) -> None:
    _mark(kind, phase)
    time.sleep(STRETCH_S[phase])  # a signal arriving now runs its handler here, in this phase


class _Writer(io.FileSystemWriter):
    def write_data(self, plan, planner):
        _stretch("bg", "write")
        try:
            return super().write_data(plan, planner)
        finally:
            _mark("bg", "idle")


def _instrument_saves() -> None:
    io.FileSystemWriter = _Writer  # the save's writer (test instrumentation of this job only)
    original_swap = atomic.swap_into_place

    def swap_into_place(partial, path):
        _mark("bg", "rename")
        try:
            return original_swap(partial, path)
        finally:
            _mark("bg", "idle")

    atomic.swap_into_place = swap_into_place
    atomic.FAULT_HOOK = lambda step: _stretch("bg", "rename") if step == "mid_swap" else None


def _stretch_its_backward(module, args, output) -> None:
    if output.requires_grad:  # inside autograd, half-way through the backward
        output.register_hook(lambda grad: _stretch("main", "backward"))


class StepDataModule(RegressionModule):
    """Each step's batch comes from the global step and the rank (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.net.blocks[0].register_forward_pre_hook(lambda module, args: _stretch("main", "forward"))
        self.net.blocks[0].register_forward_hook(_stretch_its_backward)

    def training_step(self, batch, batch_idx):
        _state["step"] = self.global_step
        _mark("main", "training_step")
        generator = torch.Generator().manual_seed(1000 + 10 * self.global_step + self.global_rank)
        x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
        return torch.nn.functional.mse_loss(self(x), y)

    def on_after_backward(self):
        _mark("main", "after_backward")

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(4 * STEPS * 4, 1)), batch_size=4)  # one long epoch


class _Report(Callback):
    def __init__(self, root: Path):
        self.root = root
        self.hooks = []

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            (self.root / "started.json").write_text(json.dumps({"step": trainer.global_step}))
        self.hooks = [
            register_optimizer_step_pre_hook(lambda *args: _stretch("main", "optimizer_step")),
            register_optimizer_step_post_hook(lambda *args: _mark("main", "after_step")),
        ]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _mark("main", "batch_start")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _mark("main", "batch_end")  # ModelCheckpoint's save and the preemption agreement run here

    def on_train_end(self, trainer, pl_module):
        for hook in self.hooks:
            hook.remove()
        _mark("main", "train_end")
        final = {"weights": full_state(pl_module), "global_step": trainer.global_step}
        optimizer = trainer.optimizers[0]
        state = trainer.strategy.optimizer_state(optimizer)  # every rank: full_tensor() below is collective
        for name in sorted(state["state"]):
            for key, value in sorted(state["state"][name].items()):
                value = value.full_tensor() if hasattr(value, "full_tensor") else value
                final["weights"][f"optim/{name}/{key}"] = torch.as_tensor(value).detach().clone()
        final["lrs"] = [group["lr"] for group in state["param_groups"]]
        final["scheduler"] = {
            k: v
            for k, v in trainer.lr_scheduler_configs[0].scheduler.state_dict().items()
            if isinstance(v, (int, float))
        }
        if trainer.global_rank == 0:
            torch.save(final, self.root / "final.pt")


def _record_landing(signum, frame) -> None:
    """Called by the strategy's handler (it keeps a handler installed before the fit): where did the signal land?"""
    record = {
        "signal": signum,
        "main": _state["main"],
        "bg": _state["bg"],
        "step": _state["step"],
        "threads": threading.active_count(),
    }
    with open(_state["root"] / f"landed-r{_state['rank']}.json", "a") as out:
        out.write(json.dumps(record) + "\n")


def fit(root: str, ckpt_path=None) -> None:
    torch.manual_seed(0)
    root_path = Path(root)
    _state.update(root=root_path, rank=int(os.environ.get("LOCAL_RANK", 0)), main="setup", bg="idle", step=0)
    (root_path / f"pid-r{_state['rank']}").write_text(str(os.getpid()))
    checkpoints = ModelCheckpoint(
        dirpath=root_path / "checkpoints",
        filename="{step}",
        every_n_train_steps=SAVE_EVERY,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2, async_save=True),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[checkpoints, _Report(root_path)],
        default_root_dir=root,
    )
    trainer.fit(StepDataModule(), ckpt_path=ckpt_path)
    _mark("main", "done")


def main(arguments: list) -> None:
    """``ROOT`` (a fresh run), or ``ROOT CKPT [ROOT CKPT ...]``: fits one after the other in one process (each job
    start costs tens of seconds on a loaded machine); ``CKPT`` ``-`` is a fresh run. A fit that fails writes its
    error to ``ROOT/error.txt`` and the next one runs."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _record_landing)
    _instrument_saves()
    if len(arguments) == 1:
        fit(arguments[0])
    for root, ckpt_path in zip(arguments[::2], arguments[1::2]):
        try:
            fit(root, None if ckpt_path == "-" else ckpt_path)
        except Exception as error:  # the next fits are other trials' resumes
            Path(root, "error.txt").write_text(f"{type(error).__name__}: {error}")


if __name__ == "__main__":
    main(sys.argv[1:])
