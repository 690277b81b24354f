"""torch's fused Adam/AdamW kernel for fp32 CPU tensors whose optimizer left the kernel choice to torch.

[Note: why the fused kernel when the choice was left to torch]
``torch.optim.Adam``/``AdamW`` built without ``foreach`` or ``fused`` (both ``None``) let torch pick an
implementation per step: the multi-tensor ``foreach`` one when every tensor is on CUDA, else the for-loop one, which
runs seven or eight ATen ops per parameter from Python. On CPU that is every run of this package without a GPU, and
every offloaded optimizer step (``offload_optimizer="cpu"``: fp32 masters in CPU memory). torch's fused kernel (one
C++ call for a list of tensors, vectorised, no temporaries; on CPU since torch 2.4) computes the same update: it
differs from the for-loop only in fp32 rounding (at most a few units in the last place per step, where the for-loop
rounds each op and the kernel each element's expression). It is several times faster than the for-loop on the
bench models' shards (the step times and their command: ``docs/ops.md``), and it is what DeepSpeed users get there:
DeepSpeed steps one flat fp32 partition at stages 1-2 and under bf16, and its CPU offload insists on its own fused
``DeepSpeedCPUAdam``.
torch does not make fused its default yet only to let the kernel bake in (its comment in ``torch/optim/adam.py``).

So :func:`prefer_fused_on_cpu` makes such an optimizer step its fp32 CPU groups with ``fused=True``. What it never
changes: a group whose ``foreach`` or ``fused`` the user set (``foreach=False`` keeps the for-loop), a group with
any tensor off the CPU (torch's own choice stands, e.g. ``foreach`` on CUDA) or not fp32 (for bf16/fp16 tensors the
kernel computes in fp32 and rounds once, so its result is not the for-loop's up to rounding), a group with a
non-contiguous parameter, gradient or state (the kernel walks them as flat memory: a strided view would be stepped
wrongly and the memory beside it written), ``differentiable`` or ``capturable`` groups, tensor subclasses other than
DTensor, optimizers not built as exactly Adam/AdamW (a subclass's step may add math of its own; this package's own
step overrides count as the class they derive from). The flag is set by a step pre-hook and put back to ``None`` by
the post-hook; a state dict taken while it is set (after a step that raised) shows ``None``, and ``remove()`` puts
every flag back, so ``param_groups`` after teardown, ``state_dict()`` and every checkpoint show the user's settings.
CPU-only: ``lightning_zero.distributed.cpu_tuning`` attaches it where the optimizer steps on the CPU.

Framework-free: imports only torch and the step-override helper.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from lightning_zero.ops.step_override import base_class
from lightning_zero.torch_compat import dtensor_local

__all__ = ["FusedOnCpu", "prefer_fused_on_cpu", "steps_fused_on_cpu"]

log = logging.getLogger(__name__)

FUSED_CPU_CLASSES = (torch.optim.Adam, torch.optim.AdamW)


def _left_to_torch(group: dict) -> bool:
    return (
        group.get("foreach") is None
        and group.get("fused") is None
        and not group.get("differentiable", False)
        and not group.get("capturable", False)
    )


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _flat_fp32_on_cpu(tensor: Optional[torch.Tensor]) -> bool:
    """A plain, contiguous fp32 CPU tensor (a DTensor's local shard counts). The fused kernel walks a parameter and
    its states as ``numel`` elements of flat memory, where the for-loop follows strides: a strided view or a state
    laid out otherwise would be stepped wrongly, or memory beside it written. Any other tensor subclass may not
    dispatch the kernel, or dispatch it differently.

    This runs for every parameter, gradient and state of every step, so it reads the DTensor's field and the
    tensor's properties directly (the cheapest checks first)."""
    if tensor is None:
        return True
    local = dtensor_local(tensor) if type(tensor) is DTensor else tensor
    return (
        type(local) in _PLAIN
        and local.dtype is torch.float32
        and local.is_cpu
        and local.layout is torch.strided
        and local.is_contiguous()
    )


def _eligible(group: dict, state: Optional[dict]) -> bool:
    """Whether ``group`` steps fused now. Adam/AdamW's per-element states (``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``) are read by the kernel as flat memory like their parameter; ``state`` None skips them (known
    to be flat)."""
    if not group["params"] or not _left_to_torch(group):
        return False
    flat = _flat_fp32_on_cpu
    for param in group["params"]:
        if not (flat(param) and flat(param.grad)):
            return False
        held = state.get(param) if state is not None else None
        if held and not (
            flat(held.get("exp_avg")) and flat(held.get("exp_avg_sq")) and flat(held.get("max_exp_avg_sq"))
        ):
            return False
    return True


def _adam_class(optimizer: torch.optim.Optimizer) -> bool:
    # The class it was built as: this package's step overrides (local step, NVMe swappers) derive from it.
    return base_class(optimizer) in FUSED_CPU_CLASSES


def steps_fused_on_cpu(optimizer: torch.optim.Optimizer) -> list[int]:
    """The indices of ``optimizer``'s groups that :func:`prefer_fused_on_cpu` would step fused now."""
    if not _adam_class(optimizer):
        return []
    return [index for index, group in enumerate(optimizer.param_groups) if _eligible(group, optimizer.state)]


class FusedOnCpu:
    """What :func:`prefer_fused_on_cpu` attached: ``remove()`` detaches it and puts every flag back.

    The per-element states change layout only where they are made: torch's first step (like their parameter) and
    ``load_state_dict`` (the saved tensors' strides). So they are checked at the first step and after each load, and
    the steps between check only parameters and gradients (39 against 86 µs per step on the bench GPT's 53
    parameters)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.flipped: list[tuple[int, dict]] = []  # (index in param_groups, group) of the groups set fused
        self.states_seen = -1  # how many parameters had states when those were last checked (-1: check them)
        self.handles = [
            optimizer.register_step_pre_hook(self._flip),
            optimizer.register_step_post_hook(self._put_back),
            optimizer.register_state_dict_post_hook(self._clean_state_dict),
            optimizer.register_load_state_dict_post_hook(self._states_loaded),
        ]

    def _flip(self, optimizer, args, kwargs) -> None:
        self._put_back()  # a step that raised left its flags set
        state = optimizer.state if len(optimizer.state) != self.states_seen else None
        for index, group in enumerate(optimizer.param_groups):
            if _eligible(group, state):
                group["fused"] = True
                self.flipped.append((index, group))
        self.states_seen = len(optimizer.state)

    def _states_loaded(self, optimizer) -> None:
        self.states_seen = -1

    def _put_back(self, *_) -> None:
        for _, group in self.flipped:
            group["fused"] = None
        self.flipped.clear()

    def _clean_state_dict(self, optimizer, state_dict: dict) -> dict:
        # A state dict taken while a flag is set (from inside a step, or after one that raised) shows the user's None.
        for index, _ in self.flipped:
            state_dict["param_groups"][index]["fused"] = None
        return state_dict

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._put_back()


def prefer_fused_on_cpu(optimizer: torch.optim.Optimizer) -> Optional[FusedOnCpu]:
    """Step ``optimizer``'s fp32 CPU groups whose kernel choice was left to torch with torch's fused kernel (see the
    module note). Returns what was attached (``.remove()`` undoes it), or ``None`` when ``optimizer`` was not built as
    exactly ``torch.optim.Adam`` or ``AdamW``. Eligibility is decided at every step, after the step pre-hooks
    registered before this one (e.g. the offload hooks that give the CPU masters their gradients)."""
    if not _adam_class(optimizer):
        return None
    groups = steps_fused_on_cpu(optimizer)
    if groups:
        log.info(
            "%s: groups %s leave foreach/fused to torch and hold fp32 CPU tensors: they step with torch's fused "
            "kernel (pass foreach=False to keep torch's for-loop)",
            type(optimizer).__name__,
            groups,
        )
    return FusedOnCpu(optimizer)
