"""Pipeline gradients inside a Trainer fit (:class:`PipelineGradients`, see its note).

[Note: the strategy's backward is skipped]
Lightning calls ``backward`` on what ``training_step`` returns. Under a pipeline that loss is already
back-propagated (detached), so :meth:`ZeroStrategy.backward` runs only the ``on_before_backward`` /
``on_after_backward`` hooks. Lightning divides the loss by ``accumulate_grad_batches`` before that backward; the
runner's ``grad_scale`` applies the same factor inside the schedule, so accumulation stays exact.
"""

from __future__ import annotations

from typing import Optional


class PipelineGradients:
    """[Note: pipeline gradients and Lightning's zero_grad]
    The schedule back-propagates inside ``training_step``, but Lightning zeroes gradients *after* ``training_step``
    (before its backward) on the first batch of an accumulation window. So gradients are zeroed before that first
    batch (:meth:`training_step`), moved aside after the schedule, and put back by :meth:`restore` from the
    strategy's ``backward``."""

    def __init__(self) -> None:
        self._moved: Optional[list] = None

    def training_step(self, module, run_step):
        """Run ``run_step()`` (the schedule inside ``training_step``) and move its gradients aside."""
        params = list(module.parameters())
        trainer = module.trainer
        if (
            module.automatic_optimization
            and trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        ):
            for param in params:
                param.grad = None
        output = run_step()
        self._moved = [(param, param.grad) for param in params]
        for param in params:
            param.grad = None
        return output

    def restore(self) -> None:
        """Put the schedule's gradients back (added to what accumulation already holds)."""
        for param, grad in self._moved or ():
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
        self._moved = None
