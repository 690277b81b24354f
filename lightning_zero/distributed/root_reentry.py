"""A call of the FSDP2 root *inside* the root's own forward must not end the root's forward.

[Note: nested calls of the root]
At stages 2-3 the LightningModule is the FSDP2 root and ``training_step`` runs inside the root's ``__call__`` (see
:mod:`.apply_zero`'s ``[Note: the root unit]``). The idiomatic ``self(x)`` in ``training_step`` calls the root a second
time, nested in the first. FSDP2's post-forward hook of that inner call marks the root idle, so the *outer* post-forward
no longer recognises the end of a forward and reshards the root's parameters, although the root (like every stage-2
unit) is meant to keep them from forward to backward; backward then all-gathers them again. A stage-2 step would gather
the root twice, not once; the root usually holds the embeddings and the head, the largest tensors of a language model
(counts: ``docs/performance_notes_lowprec.md``, section 2). Stage 3 keeps the root gathered from forward to backward
too, unless ``reshard_after_forward`` is given: see
``[Note: the two units stage 3 does not reshard after forward]`` in :mod:`.apply_zero`.

:func:`root_post_forward_suspended` therefore turns the root's own post-forward hook into a pass-through while the
outer forward runs: the nested calls still go through the pre-forward hook (inputs cast to the compute dtype,
parameters already gathered), and the outer call's post-forward hook closes the forward once, with the outer
output, exactly as without nesting. FSDP2 has no public switch for this; the hook is found through the handle the
root's FSDP state keeps for it, and anything unexpected (grouped units, another torch layout) leaves the hooks as
they are: the extra all-gather, never a wrong result. Where it is used (under manual optimization, and in
automatic optimization only where the CPU tuning is on): :mod:`lightning_zero.distributed.cpu_tuning`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Generator

from torch import nn

from lightning_zero.torch_compat import forward_hook_tables, fsdp_state, post_forward_hook_id


def _pass_through(module, args, output):
    return None  # a forward hook returning None leaves the output as it is


@contextmanager
def root_post_forward_suspended(root: nn.Module) -> Generator[None, None, None]:
    """While inside, calls of ``root`` skip its FSDP2 post-forward hook; the hook is back before the block exits, so
    the call that encloses the block (the redirected ``training_step``) still runs it. See the module note."""
    hooks, key = _post_forward_entry(root)
    if hooks is None:
        yield
        return
    original = hooks[key]
    hooks[key] = _pass_through  # same key, same position: hooks the user added after FSDP's keep their order
    try:
        yield
    finally:
        hooks[key] = original


def _post_forward_entry(root: nn.Module):
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(root, FSDPModule):
        return None, None
    key = post_forward_hook_id(fsdp_state(root))
    hooks, *extra = forward_hook_tables(root)
    if key is None or key not in hooks or any(key in table for table in extra):
        return None, None  # grouped units (one handle for many hooks) or a hook flavour this does not expect
    return hooks, key
