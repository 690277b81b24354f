"""``nn.Module`` and ``Optimizer`` hook tables, and the module classes of an FSDP wrap policy.

The package briefly replaces or reads hooks torch keeps in private ordered dicts (no public API lists, suspends or
swaps a hook in place). A rename fails the feature that reads it with ``AttributeError``; its test in
``tests/test_torch_compat.py`` reads the tables of a real module and optimizer.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


def forward_hook_tables(module) -> tuple[dict, dict, dict]:
    """``(hooks, with_kwargs, always_called)``: the dict of ``module``'s forward hooks by handle id
    (``Module._forward_hooks``, ordered as they run) and the two dicts that mark which of those ids take kwargs or
    run also on an exception (empty where this torch has no such table)."""
    return (
        module._forward_hooks,
        getattr(module, "_forward_hooks_with_kwargs", {}),
        getattr(module, "_forward_hooks_always_called", {}),
    )


@contextmanager
def optimizer_step_hooks_suspended(optimizer) -> Iterator[None]:
    """Run ``optimizer.step()`` inside this without its pre- and post-step hooks
    (``Optimizer._optimizer_step_pre_hooks`` / ``_optimizer_step_post_hooks``), which are put back, in order, on
    leaving, also on an error. The global hooks of ``register_optimizer_step_pre_hook`` still run."""
    pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = type(pre)(), type(post)()
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = pre, post


def wrap_policy_module_classes(policy) -> tuple:
    """The module classes a ``torch.distributed.fsdp.wrap.ModuleWrapPolicy`` wraps (``_module_classes``; the
    policy has no public reader)."""
    return tuple(policy._module_classes)


# [Note: torch's LR-scheduler step contract] ``LRScheduler.__init__`` (``patch_track_step_called`` in
# ``torch/optim/lr_scheduler.py``) wraps ``optimizer.step`` on the instance unless the step there already carries
# ``_wrapped_by_lr_sched``; the wrapper sets ``optimizer._opt_called``, and ``LRScheduler.step`` warns on its first
# call when either is missing. A step the package puts on an instance must speak the same two names, or every
# scheduler warns (and a second one wraps it again). If torch renames them, the warning comes back (not a failure).


def is_scheduler_step_wrapper(step) -> bool:
    """Whether ``step`` (an instance's ``step``) is flagged as an LR scheduler's wrapper (``_wrapped_by_lr_sched``)."""
    return bool(getattr(step, "_wrapped_by_lr_sched", False))


def flag_scheduler_step_wrapper(step) -> None:
    """Flag ``step`` as an LR scheduler's wrapper, so no scheduler wraps it again (see the note above)."""
    step._wrapped_by_lr_sched = True


def record_optimizer_step(optimizer) -> None:
    """Record that ``optimizer.step()`` ran, as the scheduler's wrapper does (``optimizer._opt_called``)."""
    optimizer._opt_called = True
