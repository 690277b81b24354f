"""Exact model initialisation for every ZeRO stage: run the model's own init, take rank 0's values, then shard.

[Note: exact initialisation]
For the same seed, the initial weights and buffers of a model must be bitwise identical at stages 0, 1, 2, 3 (with
or without offload) and identical to building the model normally on CPU. That holds only if the model's own init
code runs and consumes the RNG stream exactly as a plain CPU build does: Hugging Face's
``post_init``/``_init_weights``, torchmetrics' ``add_state`` defaults, custom code in ``__init__``, non-persistent
buffers such as rotary ``inv_freq``. Building on the meta device and re-initialising with ``reset_parameters()``
cannot: modules without it (``LlamaRMSNorm``, metric states, buffers) keep uninitialised memory, modules with it get
torch's default init instead of the model's. So the strategy never builds on the meta device itself; a model the
user builds there (written for ``reset_parameters()``, as torchtitan's) is materialised that way by
:mod:`.meta_init`.

So, at every stage:

1. :func:`exact_init` runs the build (Lightning's ``configure_model`` and ``Trainer.init_module`` both run under
   it) with every tensor landing on CPU, whatever the default device.

   * Stages 0-1 (``InitConfig.deferred=False``; DDP keeps full replicas anyway): on real memory. A guard counts the
     bytes of every parameter and buffer as it is registered and raises :class:`~.deferred_init.InitMemoryError`,
     naming the module, before the build exceeds this rank's share of the host memory (every local rank builds at
     once).
   * Stages 2-3 (``deferred=True``, what ``ZeroStrategy`` passes): the build is *recorded*, not run on real
     memory (:mod:`.deferred_init`): every parameter and buffer is a deferred tensor whose value is defined by a
     per-tensor log of the aten ops that made it, with the RNG state saved before each random op. No rank holds
     the model. The budget then bounds the real values the log must keep (ops without a meta kernel).

2. :func:`~lightning_zero.distributed.apply_zero.apply_zero` replays, for one FSDP unit at a time (children first), the
   part of the log that unit's tensors depend on, so the unit holds exactly what a plain build would have given
   it; then :func:`broadcast_module_states` makes the unit hold rank 0's values, as DDP does at stage 0 (ranks
   need not have drawn the same numbers), and ``fully_shard`` keeps this rank's chunk and frees the rest. The peak
   is one unit (plus the temporaries its init code made, such as ``orthogonal_``'s QR) and the shards so far.
   torchmetrics states are not module buffers: they are plain attributes, made real when construction ends and,
   like DDP, left as each rank built them (their defaults are deterministic).

``$LIGHTNING_ZERO_DEFERRED_INIT=0`` makes ``ZeroStrategy`` build on real memory at stages 2-3 too, for a model whose
construction the recorder refuses (its error says which op). A model built on the meta device is materialised by its
modules' ``reset_parameters()`` (:mod:`.meta_init`), as Lightning's FSDP strategies do.

[Note: empty_init and the script's own init]
``empty_init=True`` (``fabric.init_module(empty_init=True)``, ``Trainer.init_module(empty_init=True)``) skips the
weight init of torch's layers, as Lightning's strategies do, because the script initialises the weights itself
(LitGPT's pretraining calls its own ``reset_parameters`` on every module after the build) or loads a checkpoint:
:class:`~.empty_init.SkipTorchInit` skips exactly the calls Lightning's ``_EmptyInit`` skips (the ``torch.nn.init``
functions that reach ``__torch_function__``: ``uniform_``, ``normal_``, ``constant_``, ``kaiming_uniform_``, i.e.
the init of ``nn.Linear``, ``nn.Embedding``, convolutions); everything else in the constructors runs as under DDP.
``empty_init=None``/``False`` runs the model's own init, as above. What initialises the skipped tensors depends on
the stage, as under Lightning's DDP (stages 0-1: the script) and FSDP/ModelParallel (stages 2-3: each module's
``reset_parameters()`` at setup, for the modules the script left alone), and no step runs on memory nothing wrote:
``[Note: empty_init at each stage]`` in :mod:`.empty_init`.

The invariant that makes the weights after the script's init bitwise those of a DDP run with the same seed (on a
CPU-built model; DDP on a GPU builds on the GPU and draws from the CUDA generator, which ZeRO never does):

* the build consumes the CPU random stream exactly as DDP's build does (both skip the same calls, and the recorder
  advances the generator of every random op it logs by running it once on scratch memory of the same layout), so
  the script's init starts from DDP's generator state;
* the script's init must run *before* setup, on the full (deferred) tensors, as LitGPT does for every strategy but
  Lightning's ``FSDPStrategy``: each random op then draws the very numbers DDP's full tensor draws, and the log keeps
  the generator state it started from. Replaying a unit sets that state before each op and restores the caller's
  state after, so a unit's values do not depend on which units were replayed before it, and the stream the training
  loop sees (dropout) is the one DDP leaves. Init *after* setup, on the shards, cannot be bitwise DDP's on CPU:
  each rank would draw the first numbers of its own stream for its slice (the CPU generator cannot skip ahead to
  where the slice starts in the full tensor). For that pattern build on the meta device: ``reset_parameters()``
  then runs through this same record and replay (:mod:`.meta_init`);
* every unit then takes rank 0's values (:func:`broadcast_module_states`), as DDP does when it wraps the model.

[Note: the build under bf16-true]
Lightning's ``HalfPrecision`` (``lightning/fabric/plugins/precision/half.py``: ``module_init_context`` returns
``tensor_init_context``, a ``_DtypeContextManager`` of the low dtype; ``Strategy.module_init_context`` enters it
around the build) makes ``bf16-true`` and ``16-true`` build under that default dtype: torch's layer init draws in bf16
(fp16), which is not the fp32 draw rounded (``normal_`` and ``uniform_`` in bf16 draw other numbers), and so does a
script's own init after the build (LitGPT's). ZeroStrategy keeps fp32 masters under every flag and its stages 0-1
compute on bf16 replicas of them: building in fp32 started stages 0-1 from rounded values (the replicas) and stages
2-3 from the exact fp32 ones. So ``init_dtype`` (the low dtype of a ``*-true`` flag; not under a pipeline, which
builds its stages at setup) builds under that default dtype as Lightning does; the parameters stay in it until
setup, where :func:`to_fp32_masters` makes the ones the build made fp32 (exactly: fp32 holds every bf16/fp16 value),
after the stage 2-3 ``reset_parameters()`` calls of ``empty_init=True``, which draw in that dtype as on Lightning's
meta build. Every stage then starts from the same values, those of Lightning's DDP under the flag, and the fp32
masters hold them. Buffers keep the dtype the build gave them, as under Lightning. A state dict loaded between the
build and setup is rounded to the low dtype, as under Lightning and as DeepSpeed's bf16 engine rounds the module it
is given; loaded after setup it reaches the fp32 masters whole.

This module is framework-free: it never imports Lightning.
"""

from __future__ import annotations

import logging
import os
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Generator, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.distributed.deferred_init import BUDGET_ENV, InitMemoryError, deferred_build, is_deferred
from lightning_zero.distributed.empty_init import SkipTorchInit, mark_skipped
from lightning_zero.torch_compat import backend_serving

log = logging.getLogger(__name__)

_GIB = 1024**3
DEFERRED_ENV = "LIGHTNING_ZERO_DEFERRED_INIT"


@dataclass(frozen=True)
class InitConfig:
    """How :func:`exact_init` guards host memory.

    Args:
        local_world_size: processes on this host that build the model at the same time (Trainer ``devices``).
        host_memory_budget: bytes one rank may allocate for the model's parameters and buffers. ``None`` measures
            the available host memory (``MemAvailable``, capped by the cgroup limit) when the build starts and
            divides it by ``local_world_size``. ``0`` turns the guard off.
        deferred: record the construction instead of building on real memory, and let ``apply_zero`` replay it
            unit by unit right before sharding (stages 2-3: no rank holds the full model; see
            :mod:`lightning_zero.distributed.deferred_init`). The budget then bounds the real values the record
            keeps. ``$LIGHTNING_ZERO_DEFERRED_INIT=0`` turns it off in :meth:`from_env`.
    """

    local_world_size: int = 1
    host_memory_budget: Optional[int] = None
    deferred: bool = False

    def __post_init__(self) -> None:
        if (
            isinstance(self.local_world_size, bool)
            or not isinstance(self.local_world_size, int)
            or self.local_world_size < 1
        ):
            raise ValueError(f"local_world_size must be a positive int, got {self.local_world_size!r}")
        budget = self.host_memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(
                f"host_memory_budget must be None, 0 (no guard) or a positive number of bytes, got {budget!r}"
            )
        if not isinstance(self.deferred, bool):
            raise ValueError(f"deferred must be a bool, got {self.deferred!r}")

    @classmethod
    def from_env(cls, local_world_size: int = 1, deferred: bool = False) -> "InitConfig":
        """The config for ``local_world_size`` ranks, with the budget from ``$LIGHTNING_ZERO_INIT_MEMORY_BUDGET``
        (bytes; ``0`` turns the guard off) when set: the knob for runs whose model is built by a strategy.
        ``deferred`` (the strategy passes ``True`` at stages 2-3) is turned off by ``$LIGHTNING_ZERO_DEFERRED_INIT=0``
        for models the recorder refuses."""
        switch = os.environ.get(DEFERRED_ENV, "").strip()
        if switch not in ("", "0", "1"):
            raise ValueError(f"${DEFERRED_ENV} must be 0 (build on real memory) or 1, got {switch!r}")
        deferred = deferred and switch != "0"
        raw = os.environ.get(BUDGET_ENV)
        if raw is None or not raw.strip():
            return cls(local_world_size=local_world_size, deferred=deferred)
        try:
            budget = int(raw)
        except ValueError:
            raise ValueError(f"${BUDGET_ENV} must be a number of bytes (0: no guard), got {raw!r}") from None
        return cls(local_world_size=local_world_size, host_memory_budget=budget, deferred=deferred)


def available_host_memory() -> Optional[int]:
    """Bytes this process can still allocate on the host: ``MemAvailable``, capped by a cgroup v2/v1 limit."""
    candidates = []
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as limit_file, open(usage_path) as usage_file:
                limit = limit_file.read().strip()
                if limit != "max" and int(limit) < 1 << 60:  # v1 reports "no limit" as a huge number
                    candidates.append(max(0, int(limit) - int(usage_file.read().strip())))
            break
        except (OSError, ValueError):
            continue
    return min(candidates) if candidates else None


class _BuildGuard:
    """Counts the bytes of every parameter and buffer registered during the build against a budget."""

    def __init__(self, config: InitConfig) -> None:
        self.local_world_size = config.local_world_size
        self.available: Optional[int] = None
        if config.host_memory_budget is None:
            self.available = available_host_memory()
            self.budget = None if self.available is None else self.available // config.local_world_size
            if self.budget is None:
                log.warning("exact_init: cannot read the available host memory; building without a memory guard")
        else:
            self.budget = config.host_memory_budget or None
        self.counted = 0
        # Allocation address -> a tensor counted there: tied weights and views share one allocation and count once;
        # once that tensor is gone the address may be reused by a new allocation, which then counts again.
        self._counted_at: dict[int, weakref.ref] = {}

    def __call__(self, module: nn.Module, name: str, tensor: Optional[torch.Tensor]) -> None:
        if tensor is None or tensor.is_meta or tensor.device.type != "cpu" or is_deferred(tensor):
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        seen = self._counted_at.get(key)
        if (seen is not None and seen() is not None) or storage.nbytes() == 0:
            return
        self._counted_at[key] = weakref.ref(tensor)
        self.counted += storage.nbytes()
        if self.budget is not None and self.counted > self.budget:
            if self.available is not None:
                where = (
                    f"{self.available / _GIB:.2f} GiB available on this host / {self.local_world_size} local "
                    "ranks building at once"
                )
            else:
                where = "host_memory_budget"
            raise InitMemoryError(
                f"Building the model needs more host memory than this rank may use: "
                f"{self.counted / _GIB:.2f} GiB of parameters and buffers so far, at {type(module).__name__}.{name}, "
                f"over the budget of {self.budget / _GIB:.2f} GiB ({where}). Every rank builds the full model on "
                "CPU so that its own init code runs exactly, then shards it (see "
                "lightning_zero.distributed.exact_init). "
                "Use fewer processes per host (Trainer devices=) or a host with more memory; if you know the "
                f"memory is there, raise the budget (InitConfig.host_memory_budget, or ${BUDGET_ENV} in bytes for "
                "ZeroStrategy; 0 turns the guard off)."
            )


@contextmanager
def _default_dtype(dtype: Optional[torch.dtype]) -> Generator[None, None, None]:
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# Parameters a build made in its init_dtype, which setup makes fp32 (id -> the parameter).
_BUILT_LOW: dict[int, weakref.ref] = {}


def _remember_low(modules: list[nn.Module], dtype: torch.dtype) -> None:
    for key in [key for key, ref in _BUILT_LOW.items() if ref() is None]:
        del _BUILT_LOW[key]
    for module in modules:
        for param in module.parameters(recurse=False):
            if param.dtype == dtype:
                _BUILT_LOW[id(param)] = weakref.ref(param)


def to_fp32_masters(module: nn.Module) -> None:
    """Make fp32, in place, the parameters of ``module`` that a build under ``init_dtype`` made in that dtype
    (``[Note: the build under bf16-true]``): exact, fp32 holds every bf16/fp16 value; a recorded build records it.
    Setup calls it before wrapping (after the stage 2-3 ``reset_parameters()`` calls, which draw in that dtype)."""
    with torch.no_grad():
        for param in module.parameters():
            ref = _BUILT_LOW.pop(id(param), None)
            if ref is not None and ref() is param and param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)


@contextmanager
def exact_init(
    config: InitConfig = InitConfig(), empty_init: Optional[bool] = None, init_dtype: Optional[torch.dtype] = None
) -> Generator[None, None, None]:
    """Build modules running their own init code exactly, on CPU, with a host-memory guard.

    Everything created inside lands on CPU whatever the default device is, so the RNG stream is consumed exactly as
    by a plain CPU build; shard the result with :func:`~lightning_zero.distributed.apply_zero.apply_zero`, which takes
    rank 0's values. Raises :class:`~.deferred_init.InitMemoryError` naming the module whose tensor crosses the
    budget. With ``config.deferred`` the build is recorded instead (see the Note above): the parameters and buffers
    hold no memory until ``apply_zero`` (or :func:`~lightning_zero.distributed.deferred_init.materialize_module`)
    replays them. ``empty_init=True`` skips the init of torch's layers as Lightning's strategies do
    (``[Note: empty_init and the script's own init]``). ``init_dtype``: build under that default dtype; setup makes
    the parameters fp32 (:func:`to_fp32_masters`, ``[Note: the build under bf16-true]``).
    """
    from torch.nn.modules.module import (
        register_module_buffer_registration_hook,
        register_module_parameter_registration_hook,
    )

    guard = _BuildGuard(config)
    skip = SkipTorchInit(fill_nan=not config.deferred) if empty_init else None
    built: dict[int, nn.Module] = {}  # the modules that registered a tensor during the build

    def collect(module: nn.Module, name: str, tensor: Optional[torch.Tensor]) -> None:
        built.setdefault(id(module), module)

    hooks = [register_module_parameter_registration_hook(collect), register_module_buffer_registration_hook(collect)]
    if not config.deferred:
        hooks += [register_module_parameter_registration_hook(guard), register_module_buffer_registration_hook(guard)]
    try:
        with (
            torch.device("cpu"),
            deferred_build(guard.budget, track_undefined=bool(empty_init)) if config.deferred else nullcontext(),
        ):
            with skip or nullcontext(), _default_dtype(init_dtype):
                yield
            mark_skipped(skip, iter(built.values()))
            if init_dtype is not None:
                _remember_low(list(built.values()), init_dtype)
    finally:
        for handle in hooks:
            handle.remove()
    if not config.deferred:
        log.debug("exact_init: built %.3f GiB of parameters and buffers on CPU", guard.counted / _GIB)


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=True)
    yield from module.named_buffers(remove_duplicate=True)


def refuse_meta_tensors(module: nn.Module, stage: int) -> None:
    """Raise naming the parameters/buffers of ``module`` that still live on the meta device (no values to shard):
    :func:`~lightning_zero.distributed.meta_init.materialize_meta_tensors` gave the others theirs."""
    meta = [name for name, tensor in _named_tensors(module) if tensor.is_meta]
    if not meta:
        return
    owners = sorted({type(module.get_submodule(name.rpartition(".")[0])).__name__ for name in meta})
    shown = ", ".join(meta[:6]) + (f" and {len(meta) - 6} more" if len(meta) > 6 else "")
    raise ValueError(
        f"ZeRO stage {stage} got tensors on the meta device after their modules' reset_parameters() ran: {shown} "
        f"(in modules {', '.join(owners)}). They hold no values: make reset_parameters() give them real ones, or "
        "build the model on real CPU memory inside lightning_zero.distributed.exact_init.exact_init() (ZeroStrategy "
        "does so for configure_model and Trainer.init_module), and apply_zero shards it."
    )


def broadcast_module_states(module: nn.Module, group, device: torch.device) -> None:
    """Give every parameter and buffer of ``module`` the values of the group's rank 0, in place.

    DDP does the same at stage 0; FSDP2's ``fully_shard`` does not (it has no ``sync_module_states`` like FSDP1,
    and torch's helper for it is private), and would otherwise keep each rank's chunk of its own build. Tensors
    already sharded (DTensors) are skipped. CPU tensors travel through ``device`` when the
    group carries CUDA tensors over NCCL (the only way on an NCCL-only group, and faster than the gloo beside it
    in a ``"cpu:gloo,cuda:nccl"`` group), one tensor at a time.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    from torch.distributed.tensor import DTensor

    through_device = backend_serving("cuda", group) == "nccl"
    with torch.no_grad():
        for _, tensor in _named_tensors(module):
            if isinstance(tensor, DTensor):
                continue
            data = tensor.detach()
            if (through_device and data.device != device) or not data.is_contiguous():
                staged = data.to(device if through_device else data.device).contiguous()
                dist.broadcast(staged, group_src=0, group=group)
                data.copy_(staged)
            else:
                dist.broadcast(data, group_src=0, group=group)
