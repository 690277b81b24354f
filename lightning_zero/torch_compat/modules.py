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
