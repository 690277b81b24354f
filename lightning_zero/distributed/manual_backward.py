"""Backward passes that run *inside* the FSDP2 root's forward: manual optimization at stages 2-3.

[Note: backward inside the root's forward]
At stages 2-3 the LightningModule is the FSDP2 root unit (see :mod:`.apply_zero`'s ``[Note: the root unit]``), and the
strategy routes ``training_step`` through the root's ``__call__`` so the root's pre-forward hook gathers the parameters
the root owns. FSDP2 arms gradient reduction in the root's *post*-forward hook: it registers a pre-backward hook on the
forward's outputs, and that hook queues the end-of-backward callback which reduce-scatters every unit's gradients into
the sharded parameters. With manual optimization the user calls ``manual_backward`` inside ``training_step``, i.e.
before the root's forward has returned, so nothing is armed: when the model has no sub-unit (or the loss flows through
none), no reduce-scatter runs, the sharded parameters get no gradients and the optimizers step on nothing. Calling a
submodule (``self.generator(x)``) or ``self.forward(x)`` instead of ``self(x)`` hits exactly that.

:class:`ManualBackward` therefore closes the root's forward before each such backward, exactly as the root's own
``__call__`` would on return (post-forward hook on the loss, which arms the reduction), and re-opens it (pre-forward
hook: gathers the root's parameters again) lazily, when the next module owning root parameters runs: re-opening
right after the backward would gather the values from *before* the optimizer step that usually follows, and the
rest of ``training_step`` would compute with stale weights. For the same reason every unit is resharded when
``training_step`` returns (:meth:`ManualBackward.step_finished`): at stage 2 FSDP2 keeps gathered parameters across
steps, which is only right when nothing stepped after the gather. FSDP2 has no public API for a backward inside a
forward, so this calls the root state's two forward hooks (the same functions ``__call__`` calls) and the public
``FSDPModule.reshard``, and only reads FSDP2's unit bookkeeping (which module owns which sharded parameter).

Closing before the backward needs the root's forward still open then, so a nested ``self(z)`` (the generator of the
GAN in Lightning's manual-optimization guide) must not close it on return: the Trainer's redirection suspends the
root's post-forward hook during ``training_step`` in manual optimization as in automatic (:mod:`.root_reentry`).
Otherwise that backward would reshard the root with nothing left to re-open it, and the next direct submodule call
would compute with sharded parameters.

[Note: requires_grad follows the sharded parameter]
The optimizers hold the *sharded* parameters, while forward computes with the *unsharded* ones FSDP2 registers on
the modules between a unit's all-gather and its reshard. FSDP2 copies ``requires_grad`` from the first to the second
only at the all-gather, so ``toggle_optimizer`` (which flips the sharded parameters of the other optimizers) inside
``training_step``, after the root gathered its parameters, would not reach the computation: the frozen parameters
would still collect gradients and the thawed ones would have none. :class:`ManualBackward` adds a forward
pre-hook to every module owning a sharded parameter that copies the flag across right before the module runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Generator

import torch
from torch import nn

from lightning_zero.distributed.apply_zero import reshard_gathered
from lightning_zero.torch_compat import (
    fsdp_in_forward,
    fsdp_param_groups,
    fsdp_param_module,
    fsdp_post_forward,
    fsdp_pre_forward,
    fsdp_state,
    group_fsdp_params,
    sharded_parameter,
    unsharded_param,
)


class ManualBackward:
    """Lets ``backward`` run inside the FSDP2 root's forward with the gradients reduced (see the module notes).

    Install it on the root (a module :func:`~lightning_zero.distributed.apply_zero.apply_zero` sharded at stage 2-3)
    after sharding; run every backward inside :meth:`backward`, call :meth:`step_finished` once the root's forward
    (the training step) returned, and :meth:`remove` to take the hooks off again.
    """

    def __init__(self, root: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(root, FSDPModule):
            raise TypeError(f"ManualBackward needs an FSDP2 root module, got {type(root).__name__}")
        self.root = root
        self._state = fsdp_state(root)
        root_params = {id(p) for group in fsdp_param_groups(self._state) for p in group_fsdp_params(group)}
        owned: dict[nn.Module, list] = {}
        for unit in root.modules():
            if isinstance(unit, FSDPModule):
                for group in fsdp_param_groups(fsdp_state(unit)):
                    for fsdp_param in group_fsdp_params(group):
                        owned.setdefault(fsdp_param_module(fsdp_param), []).append(fsdp_param)
        self._suspended = False
        self._backward_ran = False
        self._handles = [
            owner.register_forward_pre_hook(self._make_hook(params, any(id(p) in root_params for p in params)))
            for owner, params in owned.items()
        ]

    def _make_hook(self, fsdp_params: list, owns_root_params: bool):
        def before_forward(_module, _args):
            if owns_root_params and self._suspended:
                self._suspended = False
                fsdp_pre_forward(self._state, self.root)  # gathers the root's parameters as they are now
            for fsdp_param in fsdp_params:  # [Note: requires_grad follows the sharded parameter]
                gathered = unsharded_param(fsdp_param)
                wanted = sharded_parameter(fsdp_param).requires_grad
                if gathered is not None and gathered.requires_grad != wanted:
                    gathered.requires_grad_(wanted)

        return before_forward

    @contextmanager
    def backward(self, loss: torch.Tensor) -> Generator[None, None, None]:
        """Run the backward of ``loss`` in this context: inside the root's forward, that forward is closed first."""
        if fsdp_in_forward(self._state) and loss.requires_grad:
            # registers the pre-backward hook on ``loss`` itself; the returned copy differs only by a dtype cast
            fsdp_post_forward(self._state, self.root, loss)
            self._suspended = True
        self._backward_ran = True
        yield

    def step_finished(self) -> None:
        """The root's forward returned: drop gathered copies that an optimizer step may have made stale."""
        self._suspended = False
        if self._backward_ran:
            self._backward_ran = False
            reshard_gathered(self.root)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
