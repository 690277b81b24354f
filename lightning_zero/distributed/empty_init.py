"""``empty_init=True``: what it skips, what setup initialises, and the refusal of memory nothing wrote.

[Note: empty_init at each stage]
``fabric.init_module(empty_init=True)`` and ``Trainer.init_module(empty_init=True)`` skip the weight init of
torch's layers (:class:`SkipTorchInit`: the ``torch.nn.init`` calls that reach ``__torch_function__``, the rule of
Lightning's ``_EmptyInit`` in ``lightning/fabric/utilities/init.py``). What happens next is what Lightning's strategy
for the same memory layout does:

* **stages 0-1** are Lightning's DDP (``Strategy.module_init_context`` in ``lightning/fabric/strategies/strategy.py``,
  which ``DDPStrategy`` inherits, enters ``_EmptyInit``): nothing initialises the skipped tensors at setup; the
  script does (LitGPT's pretraining calls every module's ``reset_parameters()`` after the build) or loads them.
* **stages 2-3** are Lightning's ``FSDPStrategy``/``ModelParallelStrategy``: their ``module_init_context`` builds on
  the meta device and setup gives every module its values from ``reset_parameters()`` (``setup_module`` and
  ``module_init_context`` in ``lightning/fabric/strategies/fsdp.py`` and ``model_parallel.py``; the latter through
  ``_materialize_distributed_module`` in ``lightning/fabric/utilities/init.py``). Here the build is recorded
  (:mod:`.deferred_init`, which follows the memory nothing wrote), and :func:`reset_unwritten_modules` calls, at
  setup and in ``modules()`` order, ``reset_parameters()`` of each module that holds such memory and whose tensors
  the script left alone, recorded like the build: ``apply_zero`` then replays one FSDP unit at a time, so no rank
  holds the whole model. A module the script wrote after the build (LitGPT's init before ``fabric.setup``) keeps
  what the script wrote, so that flow still starts bitwise where DDP does.

Under every setting no step runs on memory that nothing wrote. Such memory is NaN instead of garbage (the skipped
tensors are filled with NaN at stages 0-1; the recorder replays ``empty`` as NaN at stages 2-3), and
:func:`guard_first_forward` checks the floating parameters and buffers that may still hold it right before the first
forward, after any load that followed setup: one that does is refused with an error naming it and ``empty_init``.
At stages 2-3 the recorder says exactly which tensors these are, and after the resets they are those of modules
without ``reset_parameters()``; at stages 0-1 they are the skipped tensors that still hold NaN at setup. Integer
tensors have no NaN and are not checked.

This module is framework-free: it never imports Lightning.
"""

from __future__ import annotations

import weakref
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_zero.distributed.deferred_init import is_deferred, recording_into, undefined_state
from lightning_zero.distributed.meta_init import direct_tensors
from lightning_zero.torch_compat import local_tensor

# Parameters and buffers whose init an empty_init build on real memory skipped (filled with NaN): id -> the tensor.
# (Not a WeakSet: a lookup there compares tensors with ``==``.)
_SKIPPED: dict[int, weakref.ref] = {}


def _is_skipped(tensor: torch.Tensor) -> bool:
    ref = _SKIPPED.get(id(tensor))
    return ref is not None and ref() is tensor


class SkipTorchInit(TorchFunctionMode):
    """A ``torch.nn.init`` function that reaches ``__torch_function__`` hands its tensor back unwritten (Lightning's
    ``_EmptyInit`` rule). With ``fill_nan`` (a build on real memory) the tensor is filled with NaN instead of keeping
    garbage and its storage remembered, so :meth:`mark` can tell the parameters and buffers it belongs to."""

    def __init__(self, fill_nan: bool) -> None:
        super().__init__()
        self.fill_nan = fill_nan
        self.storages: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) != "torch.nn.init":
            return func(*args, **kwargs)
        tensor = kwargs["tensor"] if "tensor" in kwargs else args[0]
        if self.fill_nan and isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not tensor.is_meta:
            with torch.no_grad():
                tensor.fill_(float("nan"))
            self.storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    def mark(self, modules: Iterator[nn.Module]) -> None:
        """Remember the parameters and buffers of ``modules`` whose storage a skipped call was given."""
        for key in [key for key, ref in _SKIPPED.items() if ref() is None]:
            del _SKIPPED[key]
        for module in modules:
            for _, _, tensor in direct_tensors(module):
                if not is_deferred(tensor) and tensor.untyped_storage().data_ptr() in self.storages:
                    _SKIPPED[id(tensor)] = weakref.ref(tensor)


def _named_floating(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        if tensor.is_floating_point():
            yield name, tensor


def _undefined(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` may hold memory nothing wrote: exactly, for a recorded build; for a real one, a skipped
    tensor that still holds a NaN."""
    if is_deferred(tensor):
        return undefined_state(tensor)[0]
    return _is_skipped(tensor) and bool(torch.isnan(tensor).any())


def _untouched(tensor: torch.Tensor) -> bool:
    """Whether nothing wrote ``tensor`` after its build skipped its init: its module may reset it."""
    if is_deferred(tensor):
        undefined, written_after = undefined_state(tensor)
        return undefined and not written_after
    return _is_skipped(tensor) and bool(torch.isnan(tensor).all())


def _touched_after_build(tensor: torch.Tensor) -> bool:
    if is_deferred(tensor):
        return undefined_state(tensor)[1]
    return _is_skipped(tensor) and not bool(torch.isnan(tensor).all())


def skipped_names(module: nn.Module) -> list[str]:
    """The floating parameters and buffers of ``module`` that may hold memory nothing wrote (see :func:`_undefined`),
    by name: what :func:`guard_first_forward` checks."""
    return [name for name, tensor in _named_floating(module) if _undefined(tensor)]


def reset_unwritten_modules(module: nn.Module) -> list[str]:
    """Stages 2-3 (``[Note: empty_init at each stage]``): call ``reset_parameters()`` of every module (in
    ``modules()`` order) that directly holds a tensor its ``empty_init`` build left unwritten and the script did not
    touch since, recorded into the build's log for a recorded build. Returns the names of the floating parameters and
    buffers that may still hold memory nothing wrote (for :func:`guard_first_forward`)."""
    for sub in module.modules():
        direct = [t for _, _, t in direct_tensors(sub) if t.is_floating_point()]
        fresh = [t for t in direct if _untouched(t)]
        if not fresh or any(_touched_after_build(t) for t in direct):
            continue
        reset = getattr(sub, "reset_parameters", None)
        if not callable(reset):
            continue
        if is_deferred(fresh[0]):
            with recording_into(fresh[0]):
                reset()
        else:
            with torch.no_grad():
                reset()
    return skipped_names(module)


class _FirstForwardCheck:
    """Forward pre-hooks that check, once, that the named tensors hold no NaN; removed after the first check passes."""

    def __init__(self, root: nn.Module, names: list[str], device: torch.device, stage: int) -> None:
        self.root, self.names, self.device, self.stage = weakref.ref(root), names, device, stage
        self.handles = []

    def __call__(self, *_) -> None:
        root = self.root()
        if root is None or not self.handles:
            return
        from lightning_zero.offload.param_swapper import get_param_swapper

        if (swapper := get_param_swapper(root)) is not None:
            swapper.make_resident()  # the shards swapped to disk are read before their values are checked
        tensors = dict((*root.named_parameters(), *root.named_buffers()))
        flags = torch.tensor(
            [bool(torch.isnan(local_tensor(tensors[n].detach())).any()) if n in tensors else False for n in self.names],
            dtype=torch.float32,
        )
        if dist.is_initialized() and dist.get_world_size() > 1:  # a shard's NaN is every rank's refusal
            flags = flags.to(self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad = [name for name, flag in zip(self.names, flags.tolist()) if flag]
        if bad:
            raise RuntimeError(_refusal(bad, self.stage))
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _refusal(names: list[str], stage: int) -> str:
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    setup = (
        "at stages 2-3 setup calls reset_parameters() of each module the script left alone; these modules have none, "
        if stage >= 2
        else "at stages 0-1 nothing initialises them at setup (as under Lightning's DDP strategy), "
    )
    return (
        f"{shown} hold memory that nothing wrote: the model was built under empty_init=True, which skips their "
        f"initialisation; {setup}and neither the script nor a checkpoint load wrote them before this first "
        "forward. Initialise them (call the modules' reset_parameters() after building, or give those modules "
        "one), load a checkpoint before the first forward, or build without empty_init=True."
    )


def guard_first_forward(module: nn.Module, names: list[str], device: torch.device, stage: int) -> None:
    """Refuse the first forward of ``module`` if a tensor of ``names`` then holds memory nothing wrote
    (``[Note: empty_init at each stage]``). The hooks go on ``module`` (before FSDP2's own, so the parameters are
    still the sharded ones) and on the modules owning those tensors (a method called directly, as an evaluation at
    stages 0-1 does); the first one to run checks every tensor. No hook when ``names`` is empty."""
    if not names:
        return
    check = _FirstForwardCheck(module, list(names), device, stage)
    owners = {module} | {module.get_submodule(name.rpartition(".")[0]) for name in names} if stage <= 1 else {module}
    check.handles = [owner.register_forward_pre_hook(check, prepend=True) for owner in owners]


def mark_skipped(skip: Optional[SkipTorchInit], modules: Iterator[nn.Module]) -> None:
    """After an ``empty_init`` build on real memory: remember which parameters and buffers were skipped."""
    if skip is not None and skip.fill_nan:
        skip.mark(modules)
