"""Run one optimizer's ``step`` through our code by giving it a generated subclass, and undo that exactly.

The DTensor local-shard step (``lightning_zero.distributed.local_step``), optimizer-state swapping
(``optimizer_swapper``) and parameter swapping (``param_swapper``) each make ``optimizer.step`` run their code while
the optimizer keeps its identity (the Trainer, the user and LR schedulers hold it), ``param_groups``, ``state``,
hooks and the name of its class (checkpoints record it). :func:`override_step` swaps ``optimizer.__class__`` for a
subclass with the same ``__name__``/``__module__``/``__qualname__`` whose ``step`` is wrapped by torch's hook
machinery (pre/post step hooks run once around the whole overridden step); :func:`restore_step_override` puts the
class below back. Overrides stack (each one's step receives the class below's unhooked step) and are undone in
reverse order; undoing one that another override sits on is refused.

Why hand-written: torch has no API that replaces the step of one optimizer instance, and an instance attribute
``optimizer.step`` would be taken for an LR scheduler's wrapper by torch (see the note).

[Note: an LR scheduler's step wrapper]
Building a torch ``LRScheduler`` puts a wrapper on the optimizer *instance* (``optimizer.step``, flagged
``_wrapped_by_lr_sched``; none is added when one is there) that records ``optimizer._opt_called`` and calls the
step function of the optimizer's class *at that moment* (its ``__wrapped__``); ``scheduler.step()`` warns when the
wrapper is gone. Swapping the class changes what ``optimizer.step`` finds on the class, not what such a wrapper
calls, so the instance attribute is kept consistent with the class:

- override: a scheduler wrapper already on the instance is kept aside (on the generated class) and replaced by a
  *tracking* wrapper that records the same flag and calls ``type(optimizer).step``, whatever the class is then; a
  later scheduler finds it and adds none. A scheduler built while overridden that finds no wrapper wraps the
  generated class's step (torch's own wrapper).
- restore: the tracking wrapper this override installed gives way to the wrapper kept aside (which calls the class
  below's step); a wrapper of this generated class's step is replaced by one of the class below's step (what
  torch would have made there); a tracking wrapper installed by an override still below stays (it follows the
  class).

So while overridden every scheduler's wrapper runs the current class's step, and once every override is undone
the optimizer is what a plain torch optimizer of its class with the same schedulers would be. Any other
instance ``step`` (a user's replacement of the method) could not be routed through the override: it is refused.

Framework-free: imports only torch.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import torch

from lightning_zero.torch_compat import flag_scheduler_step_wrapper, is_scheduler_step_wrapper, record_optimizer_step

_MARKER = "_lightning_zero_override"  # on a generated class: the override's marker
_BASE = "_lightning_zero_override_base"  # the class it derives from
_REPLACED = "_lightning_zero_override_saved"  # the scheduler wrapper found on the instance (or None)
_TRACKS = "_lightning_zero_tracks"  # on a tracking wrapper: a weak reference to its optimizer

StepFn = Callable[[torch.optim.Optimizer, Callable, Optional[Callable]], Any]


def _unhooked(step: Callable) -> Callable:
    """A class's step without torch's hook wrapper (the overridden step has its own, so hooks run once)."""
    return step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step


def _scheduler_step(optimizer: torch.optim.Optimizer, func: Optional[Callable] = None) -> Callable:
    """An instance ``step`` honouring torch's scheduler contract: records ``_opt_called`` and calls ``func`` (a
    class's step function), or with ``func=None`` (a tracking wrapper) the optimizer's class's step at call time.
    Holds the optimizer weakly, as torch's does: the instance attribute must not keep its owner alive."""
    ref = weakref.ref(optimizer)

    def step(*args, **kwargs):
        opt = ref()
        record_optimizer_step(opt)
        target = type(opt).step if func is None else func
        return target(opt, *args, **kwargs)

    if func is None:
        setattr(step, _TRACKS, ref)
    else:
        step = functools.wraps(func)(step)  # its __wrapped__ names the step it calls (see restore_step_override)
    flag_scheduler_step_wrapper(step)
    return step


def _is_tracking(step, optimizer) -> bool:
    ref = getattr(step, _TRACKS, None)
    return ref is not None and ref() is optimizer


def base_class(optimizer: torch.optim.Optimizer) -> type:
    """The optimizer's class below every active override (the class it was built as)."""
    cls = type(optimizer)
    while _MARKER in cls.__dict__:
        cls = cls.__dict__[_BASE]
    return cls


def is_overridden(optimizer: torch.optim.Optimizer, marker: str) -> bool:
    """Whether an override with ``marker`` is active on ``optimizer`` (anywhere in the stack)."""
    return any(c.__dict__.get(_MARKER) == marker for c in type(optimizer).__mro__)


def override_step(
    optimizer: torch.optim.Optimizer, step_fn: StepFn, *, marker: str, extra: Optional[dict[str, Callable]] = None
) -> type:
    """Make ``optimizer.step(closure)`` call ``step_fn(optimizer, base_step, closure)``, where ``base_step`` is the
    current class's step without torch's hook wrapper (call ``base_step(optimizer)``); ``extra`` adds or replaces
    other methods (e.g. ``state_dict``). Returns the generated class; undo with :func:`restore_step_override`.
    ``marker`` names the override in errors. See the module notes."""
    if is_overridden(optimizer, marker):
        raise RuntimeError(f"the {marker!r} step override is already applied to this optimizer")
    extra = dict(extra or {})
    clash = sorted(set(extra) & {"step", _MARKER, _BASE, _REPLACED})
    if clash:
        raise ValueError(f"extra methods may not replace {clash}: the step goes through step_fn")
    instance_step = optimizer.__dict__.get("step")
    saved = None
    if instance_step is not None and not _is_tracking(instance_step, optimizer):
        if not is_scheduler_step_wrapper(instance_step):
            raise RuntimeError(
                f"this optimizer's step was replaced on the instance (optimizer.step = "
                f"{instance_step!r}), not by an LR scheduler: the {marker!r} step override cannot run "
                "through it. Remove the instance attribute (del optimizer.step) first."
            )
        saved = instance_step
    base_cls = type(optimizer)
    base_step = _unhooked(base_cls.step)

    def step(self, closure=None):
        return step_fn(self, base_step, closure)

    hooked = torch.optim.Optimizer.profile_hook_step(step)
    hooked.hooked = True  # torch's marker: Optimizer.__init__/__setstate__ must not wrap it again
    cls = type(
        base_cls.__name__, (base_cls,), {**extra, "step": hooked, _MARKER: marker, _BASE: base_cls, _REPLACED: saved}
    )
    cls.__module__, cls.__qualname__ = base_cls.__module__, base_cls.__qualname__
    optimizer.__class__ = cls
    if saved is not None:
        optimizer.step = _scheduler_step(optimizer)
    return cls


def restore_step_override(optimizer: torch.optim.Optimizer, marker: str) -> bool:
    """Undo the :func:`override_step` with ``marker``; returns whether it was applied (no-op when not). Raises
    when another override was applied after it and is still active (undo that one first)."""
    cls = type(optimizer)
    if cls.__dict__.get(_MARKER) != marker:
        if not is_overridden(optimizer, marker):
            return False
        later = cls.__dict__.get(_MARKER, f"class {cls.__qualname__}")
        raise RuntimeError(
            f"cannot undo the {marker!r} step override of this optimizer: the {later!r} override was "
            "applied after it and is still active; undo overrides in reverse order"
        )
    base_cls, saved = cls.__dict__[_BASE], cls.__dict__[_REPLACED]
    optimizer.__class__ = base_cls
    instance_step = optimizer.__dict__.get("step")
    if instance_step is None:
        return True
    if _is_tracking(instance_step, optimizer):
        if saved is not None:  # this override installed it; else an override still below did, and it stays
            optimizer.step = saved
    elif (
        is_scheduler_step_wrapper(instance_step) and getattr(instance_step, "__wrapped__", None) is cls.__dict__["step"]
    ):
        optimizer.step = _scheduler_step(optimizer, base_cls.step)  # a scheduler built while overridden
    return True
