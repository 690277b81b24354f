"""Pipeline parallelism under Fabric: ``fabric.setup_module`` splits a ``PipelineModule``, ``pipeline_step`` trains.

The Fabric counterpart of DeepSpeed's ``engine.train_batch()``, on the pieces the Trainer strategy uses
(:mod:`lightning_zero.pipeline.zero_pipeline`): the same ``("pp", "dp")`` mesh, the same split
(:func:`~lightning_zero.pipeline.zero_pipeline.setup_pipeline`), the ZeRO stage on ``dp``, the same global-norm
clipping.

.. code-block:: python

    fabric = Fabric(devices=4, strategy=ZeroStrategy(stage=1, pipeline_parallel_size=2, micro_batches=4))
    model = fabric.setup_module(PipelineModule(layers, loss_fn=F.cross_entropy))  # this rank's stages only
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))    # created after setup
    for i, (x, y) in enumerate(loader):  # every rank of a pipeline reads the same batch (sampler: dp replicas)
        with fabric.no_backward_sync(model, enabled=(i + 1) % k != 0):
            loss = fabric.strategy.pipeline_step(model, x, y, grad_scale=1 / k)   # forward + backward
        if (i + 1) % k == 0:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()

[Note: pipeline accumulation under Fabric]
The schedule runs backward itself, so there is no loss to divide before ``fabric.backward`` (which is refused:
it would back-propagate twice, or fail on the detached loss). ``grad_scale`` takes that place: each call adds
``grad_scale`` times the gradient of the batch's mean loss, so ``k`` calls with ``grad_scale=1/k`` accumulate the
gradient of the mean over the ``k`` batches, as ``fabric.backward(loss / k)`` does without a pipeline. Inside
``fabric.no_backward_sync`` the data-parallel and tied-weight reductions are skipped; the call that leaves it
reduces the accumulated gradients once. ``model(x, y)`` in training mode is ``pipeline_step`` with ``grad_scale=1``;
in eval mode (or under ``torch.no_grad()``) it runs the forward-only schedule and returns the loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.pipeline.zero_pipeline import clip_by_global_norm, find_pipeline_module, setup_pipeline


def setup(module: nn.Module, settings, meshes, device: torch.device, precision, runner: Any = None):
    """``fabric.setup_module`` under a pipeline: build this rank's stages of ``module``'s ``PipelineModule`` over the
    ``("pp", "dp")`` ``meshes`` (:func:`~lightning_zero.pipeline.zero_pipeline.setup_pipeline`) with the strategy's
    ``settings`` (``ZeroSettings``); ``runner``: the one built by an earlier call (refused: one pipelined module per
    strategy)."""
    if runner is not None:
        raise ValueError(
            "with pipeline_parallel_size > 1 a ZeroStrategy runs one pipelined module; it already has "
            "one (put every trainable layer in that PipelineModule)"
        )
    find_pipeline_module(module)  # exactly one PipelineModule, holding every parameter (clear error otherwise)
    return setup_pipeline(
        module,
        settings.pipeline,
        meshes.pipeline,
        meshes.data_parallel,
        settings.zero_config.stage,
        device,
        precision,
        settings.activation_checkpoint_config,
    )


def step(runner, model: nn.Module, inputs: Any, targets: Any, grad_scale: float) -> Tensor:
    """See ``ZeroStrategy.pipeline_step`` and the accumulation note above."""
    if runner is None:
        raise RuntimeError(
            "pipeline_step needs ZeroStrategy(pipeline_parallel_size > 1) and a model set up with "
            "fabric.setup_module(...)"
        )
    if (
        isinstance(grad_scale, bool)
        or not isinstance(grad_scale, (int, float))
        or not math.isfinite(grad_scale)
        or grad_scale <= 0
    ):
        raise ValueError(
            f"grad_scale must be a positive finite number (1/k to accumulate k batches), got {grad_scale!r}"
        )
    module = getattr(model, "_forward_module", model)  # Fabric's wrapper
    if find_pipeline_module(module).runner is not runner:
        raise ValueError("pipeline_step got a module other than the one fabric.setup_module split for the pipeline")
    if not module.training or not torch.is_grad_enabled():
        raise RuntimeError(
            "pipeline_step trains (forward and backward), but the model is in eval mode or gradients "
            "are disabled: call model.train(), or model(inputs, targets) for an evaluation loss"
        )
    runner.grad_scale = float(grad_scale)
    try:
        loss = model(inputs, targets)
    finally:
        runner.grad_scale = 1.0
    return loss / grad_scale  # the schedule's loss includes the factor; the caller gets the batch's mean loss


def clip(runner, params, max_norm, norm_type, error_if_nonfinite: bool) -> Tensor:
    """``fabric.clip_gradients`` under a pipeline: the L2 norm over every stage and shard (tied weights once)."""
    if float(norm_type) != 2.0:
        raise NotImplementedError(
            f"clipping a pipeline computes the global L2 norm; norm_type={norm_type} is not supported (use norm_type=2)"
        )
    norm = clip_by_global_norm(runner, params, max_norm)
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(
            f"the total norm of the pipeline's gradients is {norm}: not clipping (pass "
            "error_if_nonfinite=False to clip anyway)"
        )
    return torch.tensor(norm)


def refuse_backward() -> None:
    raise RuntimeError(
        "with pipeline_parallel_size > 1 the schedule runs backward itself: use "
        "loss = fabric.strategy.pipeline_step(model, inputs, targets, grad_scale=1/k) instead of "
        "fabric.backward (see lightning_zero.fabric.fabric_pipeline)"
    )


def refuse_optimizers_before_setup() -> None:
    raise ValueError(
        "with pipeline_parallel_size > 1 create the optimizer after fabric.setup_module(model): setup "
        "builds and keeps only this rank's pipeline stages, so an optimizer made before holds parameters "
        "the model no longer has (docs/fabric.md, Pipeline parallelism)"
    )
