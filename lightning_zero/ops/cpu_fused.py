"""torch's fused Adam/AdamW kernel for fp32 CPU tensors whose optimizer left the kernel choice to torch.

[Note: why the fused kernel when the choice was left to torch]
``torch.optim.Adam``/``AdamW`` built without ``foreach`` or ``fused`` (both ``None``) let torch pick an
implementation per step: the multi-tensor ``foreach`` one when every tensor is on CUDA, else the for-loop one, which
runs seven or eight ATen ops per parameter from Python. On CPU that is every run of this package without a GPU, and
every offloaded optimizer step (``offload_optimizer="cpu"``: fp32 masters in CPU memory). torch's fused kernel (one
C++ call for a list of tensors, vectorised, no temporaries; on CPU since torch 2.4) computes the same update: it
differs from the for-loop only in fp32 rounding (at most a few units in the last place per step, where the for-loop
rounds each op and the kernel each element's expression). It is 2.7-3.2x faster than the for-loop on the
bench models' shards (``docs/performance.md``, stop 43), and it is what DeepSpeed users get there: DeepSpeed steps
one flat fp32 partition at stages 1-2 and under bf16, and its CPU offload insists on its own fused ``DeepSpeedCPUAdam``.
torch does not make fused its default yet only to let the kernel bake in (its comment in ``torch/optim/adam.py``).

So :func:`prefer_fused_on_cpu` makes such an optimizer step its fp32 CPU groups with ``fused=True``. What it never
changes: a group whose ``foreach`` or ``fused`` the user set (``foreach=False`` keeps the for-loop), a group with
any tensor off the CPU (torch's own choice stands, e.g. ``foreach`` on CUDA) or not fp32 (for bf16/fp16 tensors the
kernel computes in fp32 and rounds once, so its result is not the for-loop's up to rounding), ``differentiable``
or ``capturable`` groups, tensor subclasses other than DTensor, subclasses of Adam/AdamW (their step may add math
of its own). The flag is set by a step pre-hook and put back to ``None`` by the post-hook, so ``param_groups``,
``state_dict()`` and every checkpoint show the user's settings; a step that raised has its flags put back before
the next one.

Framework-free: imports only torch and :mod:`lightning_zero.torch_compat`.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch.utils.hooks import RemovableHandle

from lightning_zero.torch_compat import local_tensor

__all__ = ["prefer_fused_on_cpu", "steps_fused_on_cpu"]

log = logging.getLogger(__name__)

FUSED_CPU_CLASSES = (torch.optim.Adam, torch.optim.AdamW)


def _left_to_torch(group: dict) -> bool:
    return (group.get("foreach") is None and group.get("fused") is None and not group.get("differentiable", False)
            and not group.get("capturable", False))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _fp32_on_cpu(tensor: Optional[torch.Tensor]) -> bool:
    """A plain fp32 CPU tensor (a DTensor's local shard counts): any other tensor subclass may not dispatch the fused
    kernel, or dispatch it differently."""
    if tensor is None:
        return True
    local = local_tensor(tensor)
    return (type(local) in _PLAIN and local.dtype == torch.float32 and local.device.type == "cpu"
            and local.layout == torch.strided)


def _eligible(group: dict) -> bool:
    return bool(group["params"]) and _left_to_torch(group) and all(
        _fp32_on_cpu(param) and _fp32_on_cpu(param.grad) for param in group["params"])


def steps_fused_on_cpu(optimizer: torch.optim.Optimizer) -> list[int]:
    """The indices of ``optimizer``'s groups that :func:`prefer_fused_on_cpu` would step fused now."""
    if type(optimizer) not in FUSED_CPU_CLASSES:
        return []
    return [index for index, group in enumerate(optimizer.param_groups) if _eligible(group)]


def prefer_fused_on_cpu(optimizer: torch.optim.Optimizer) -> list[RemovableHandle]:
    """Step ``optimizer``'s fp32 CPU groups whose kernel choice was left to torch with torch's fused kernel (see the
    module note). Returns the two step-hook handles (``handle.remove()`` undoes it), or ``[]`` when ``optimizer`` is
    not exactly ``torch.optim.Adam`` or ``AdamW``. Eligibility is decided at every step, after the hooks registered
    before these (e.g. the offload hooks that give the CPU masters their gradients)."""
    if type(optimizer) not in FUSED_CPU_CLASSES:
        return []
    flipped: list[dict] = []

    def put_back(*_):
        for group in flipped:
            group["fused"] = None
        flipped.clear()

    def flip(opt, args, kwargs):
        put_back()
        for group in opt.param_groups:
            if _eligible(group):
                group["fused"] = True
                flipped.append(group)

    groups = steps_fused_on_cpu(optimizer)
    if groups:
        log.info("%s: groups %s leave foreach/fused to torch and hold fp32 CPU tensors: they step with torch's fused "
                 "kernel (pass foreach=False to keep torch's for-loop)", type(optimizer).__name__, groups)
    return [optimizer.register_step_pre_hook(flip), optimizer.register_step_post_hook(put_back)]
