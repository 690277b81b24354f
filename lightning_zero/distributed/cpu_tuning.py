"""What only helps work that runs on the CPU, switched on in one place: :func:`cpu_tuning_enabled`.

[Note: the plain path on CUDA]
A stage 2-3 run computing on CUDA uses torch's engine as torch ships it: FSDP2's own all-gather, reduce-scatter and
caching allocator, the user's optimizer stepping the DTensor shards with torch's own ``step`` (on CUDA torch's
``_default_to_fused_or_foreach`` in ``torch/optim/optimizer.py`` picks ``foreach`` for DTensors, which
``torch/distributed/tensor/__init__.py`` adds to its supported types), no change of the optimizer's class, and
Lightning's own forward
redirection (``_ForwardRedirection`` in ``lightning/pytorch/strategies/strategy.py``). Everything written to make a
CPU run fast is decided here, once, at setup, and nothing of it runs in a CUDA step:

==============================================  ==========================================  =====================
tuning                                          why only on the CPU                         where it lives
==============================================  ==========================================  =====================
pooled communication buffers and the pairwise   torch has no caching allocator for CPU      ``comm_buffers.py``
reduce-scatter (FSDP2's custom collectives)     memory; gloo's reduce-scatter clones its
                                                input
the local-shard optimizer step                  torch picks the per-parameter for-loop on   ``local_step.py``
(Adam, AdamW, SGD on DTensor local shards)      CPU, where each op pays DTensor's Python
                                                dispatch; on CUDA it picks ``foreach``
torch's fused Adam/AdamW kernel for fp32 CPU    the same for-loop, several times slower     ``ops/cpu_fused.py``
groups that left the choice to torch            the kernel on CPU
the root's post-forward hook suspended around   saves the second all-gather of the root a   ``root_reentry.py``
``training_step`` (automatic optimization)      nested ``self(x)`` causes; edits FSDP2's
                                                private hook table
the glibc heap advice of the environment        a CPU heap's top returned to the OS and     ``diagnostics/
audit                                           faulted in again every step                 env_audit.py``
==============================================  ==========================================  =====================

The optimizer's tuning follows where the optimizer steps, not the compute device: an optimizer offloaded to the CPU
(``offload_optimizer``, or stage 3's ``offload_params`` shards) steps CPU tensors on a CUDA run too, and keeps the
local step and the fused kernel there (DeepSpeed's CPU offload likewise insists on its own CPU Adam). The heap advice
is a warning of the audit (never part of a step), which applies its own test of a CPU run
(``cpu_heap_warnings``'s ``computes_on_cpu``; the diagnostics layer sits below this one).

One piece runs on CUDA too, because the result depends on it, not the speed: under manual optimization the root's
post-forward hook is suspended on every device (:mod:`.manual_backward`'s note: a nested ``self(z)`` would close
the forward that ``manual_backward`` must close itself). Without the suspension, automatic optimization on CUDA
pays what FSDP2 as shipped pays for a module called twice in one forward: a ``training_step`` calling ``self(x)``
reshards the root when it returns, and backward gathers the root again.
``tests/distributed/test_cuda_step_path.py`` traces a stage-2 step with :func:`cpu_tuning_enabled` answering
``False`` and checks which files of the package it runs.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from lightning_zero.distributed.comm_buffers import CommBufferPool, install_comm_buffer_pool
from lightning_zero.distributed.local_step import use_local_step
from lightning_zero.ops.cpu_fused import FusedOnCpu, prefer_fused_on_cpu
from lightning_zero.torch_compat import local_tensor


def cpu_tuning_enabled(device) -> bool:
    """Whether work on ``device`` gets the CPU-only tuning of the module note: on the CPU, and nowhere else. The
    package's one switch for it (tests flip it to see the path a CUDA run takes)."""
    return torch.device(device).type == "cpu"


def tune_sharded_module(
    module: nn.Module, device: torch.device, pool: Optional[CommBufferPool] = None
) -> Optional[CommBufferPool]:
    """On a CPU run, route the communication buffers of ``module``'s FSDP2 units through one pool (``pool`` when
    given: the stages of one pipeline rank share it) and reduce-scatter by pairwise exchanges (:mod:`.comm_buffers`).
    Returns the pool, or ``None`` where FSDP2's own collectives and allocator stay (CUDA, or a torch without the
    hook)."""
    if not cpu_tuning_enabled(device):
        return None
    return install_comm_buffer_pool(module, pool)


def tune_stage_modules(modules: Iterable[nn.Module], device: torch.device) -> None:
    """:func:`tune_sharded_module` for the FSDP2-sharded stage modules of one pipeline rank, one pool for all."""
    if not cpu_tuning_enabled(device):
        return
    pool = CommBufferPool()
    for module in modules:
        install_comm_buffer_pool(module, pool)


def steps_on(optimizer: torch.optim.Optimizer, device: Optional[torch.device]) -> torch.device:
    """Where ``optimizer`` steps: the CPU when every tensor its groups hold is there (a CPU run, or CPU masters of an
    offloaded optimizer), else the compute ``device`` (the CPU when none is given)."""
    tensors = [local_tensor(p) for group in optimizer.param_groups for p in group["params"]]
    if tensors and all(t.device.type == "cpu" for t in tensors):
        return torch.device("cpu")
    return torch.device("cpu") if device is None else torch.device(device)


def tune_optimizer(
    optimizer: torch.optim.Optimizer, device: Optional[torch.device]
) -> tuple[Optional[FusedOnCpu], bool]:
    """Where ``optimizer`` steps on the CPU (:func:`steps_on`): torch's fused kernel for its fp32 groups that left
    the choice to torch (:mod:`lightning_zero.ops.cpu_fused`), then the local-shard step over DTensor parameters
    (:mod:`.local_step`). Returns the fused kernel's handle (``remove()`` puts the flags back; ``None`` when not
    attached) and whether the local step was switched on (undo with ``local_step.restore_step``). The caller fixes
    the order against its own hooks and step overrides (``distributed/optimizer.py``)."""
    if not cpu_tuning_enabled(steps_on(optimizer, device)):
        return None, False
    fused = prefer_fused_on_cpu(optimizer)
    return fused, use_local_step(optimizer)


def suspend_nested_root_forward(device: torch.device, manual_optimization: bool) -> bool:
    """Whether the Trainer's redirection suspends the FSDP2 root's post-forward hook while ``training_step`` runs
    (:mod:`.root_reentry`): always under manual optimization, which is wrong without it (:mod:`.manual_backward`),
    else only where the CPU tuning is on."""
    return manual_optimization or cpu_tuning_enabled(device)
