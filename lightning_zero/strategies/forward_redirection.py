"""The Trainer's forward redirection at stages 2-3: ``training_step`` (and the evaluation steps) through the FSDP2
root's ``__call__``. :func:`forward_redirection_for` chooses, at setup, between Lightning's own
``_ForwardRedirection`` (``lightning/pytorch/strategies/strategy.py``: the method runs as the root's ``forward``, its
hooks untouched) and :class:`RootForwardRedirection`, with nested ``self(x)`` calls that do not end the root's
forward (:mod:`lightning_zero.distributed.root_reentry`): under manual optimization on every device, which needs it
to be right, else only where the CPU tuning is on (:mod:`lightning_zero.distributed.cpu_tuning`). With Lightning's,
a nested ``self(x)`` reshards the root when ``training_step`` returns and its backward gathers it again, as FSDP2
does for any module called twice in one forward."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies.strategy import _ForwardRedirection

from lightning_zero.distributed.cpu_tuning import suspend_nested_root_forward
from lightning_zero.distributed.root_reentry import root_post_forward_suspended


class RootForwardRedirection(_ForwardRedirection):
    """Lightning's redirection; the redirected method runs with the root's post-forward hook suspended.

    With manual optimization too: :class:`~lightning_zero.distributed.manual_backward.ManualBackward` closes the
    root's forward before each ``manual_backward`` and re-opens it when a module owning root parameters runs next,
    which it can only do if the forward is still open at the backward. A nested ``self(z)`` whose post-forward hook
    ran would have closed it already (the GAN of Lightning's manual-optimization guide, generator through
    ``self(z)``): the backward would then reshard the root and leave it closed, and the next direct submodule call
    would compute with sharded parameters.
    """

    def __call__(self, wrapper_module, original_module, method_name: str, *args: Any, **kwargs: Any) -> Any:
        real_forward = original_module.forward

        def redirected(*_args: Any, **_kwargs: Any) -> Any:
            original_module.forward = real_forward  # a nested self(x) reaches the model's own forward
            with root_post_forward_suspended(wrapper_module):
                output = getattr(original_module, method_name)(*_args, **_kwargs)
            self.on_after_inner_forward(wrapper_module, original_module)
            return output

        original_module.forward = redirected  # the root's __call__ (and its FSDP2 hooks) runs the method
        output = wrapper_module(*args, **kwargs)
        self.on_after_outer_forward(wrapper_module, original_module)
        return output


def forward_redirection_for(device: torch.device, manual_optimization: bool) -> _ForwardRedirection:
    """The redirection of a stage 2-3 module computing on ``device`` (see the module docstring)."""
    if suspend_nested_root_forward(device, manual_optimization):
        return RootForwardRedirection()
    return _ForwardRedirection()
