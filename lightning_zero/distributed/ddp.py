"""``DistributedDataParallel`` for ZeRO stages 0-1: its options as Lightning's ``DDPStrategy`` takes them, ZeRO's
defaults, and the low-precision all-reduce hook.

``ZeroStrategy(find_unused_parameters=True)`` (or ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``)
is passed to the ``DistributedDataParallel`` that stages 0-1 run on, exactly as ``DDPStrategy(**kwargs)`` would, so
a model that skips parameters in some steps (a GAN's two optimizers, a conditional branch) trains at stage 0/1 as it
does under Lightning's ``ddp_find_unused_parameters_true``.

A ds_config's ``zero_optimization.reduce_bucket_size`` (DeepSpeed's gradient bucket, counted in elements) becomes
DDP's ``bucket_cap_mb`` (counted in MiB) at stages 0-1, converted with the gradients' element size; an explicit
``bucket_cap_mb`` wins.

Unlike ``DDPStrategy``, stages 0-1 default to ``gradient_as_bucket_view=True`` (one gradient buffer per rank, as
DeepSpeed keeps; see :func:`lightning_zero.distributed.apply_zero.ddp_defaults`); an explicit False wins.

Stages 2-3 run FSDP2, which has none of these knobs (it reduce-scatters per unit and tolerates parameters a step
does not use), so setting any of them there is refused rather than ignored.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_zero.torch_compat import prepare_ddp_backward, rebuild_ddp_buckets

_MIB = 1024 * 1024


@dataclass(frozen=True)
class DDPOptions:
    """Validated DDP keyword arguments; ``None`` leaves torch's default.

    Args:
        find_unused_parameters: let DDP's reducer mark parameters the forward did not use as ready (required when a
            step leaves parameters without gradients: DDP otherwise errors at the next step).
        static_graph: the set of used parameters and the graph do not change between steps (DDP can then skip the
            unused-parameter search and supports re-entrant activation checkpointing).
        gradient_as_bucket_view: gradients are views into DDP's buckets (saves one gradient-sized copy). ``None``
            means ZeRO's default, True (unlike DDP's False; see
            :func:`lightning_zero.distributed.apply_zero.ddp_defaults`); pass False
            for DDP's separate ``.grad`` tensors.
        bucket_cap_mb: DDP's gradient bucket size in MiB (torch's default: 25).
    """

    find_unused_parameters: Optional[bool] = None
    static_graph: Optional[bool] = None
    gradient_as_bucket_view: Optional[bool] = None
    bucket_cap_mb: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be True, False or None, got {value!r}")
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {cap!r}")

    def given(self) -> dict:
        """The options set to something other than ``None``."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    def check_stage(self, stage: int, pipeline: bool = False) -> None:
        """Refuse DDP options where no DDP runs (stages 2-3, pipelines): they would be silently ignored."""
        given = ", ".join(f"{k}={v!r}" for k, v in self.given().items())
        if given and pipeline:
            raise ValueError(
                f"{given}: DDP options do not apply with pipeline_parallel_size > 1, whose schedule "
                "reduces the data-parallel gradients itself. Remove them."
            )
        if given and stage >= 2:
            raise ValueError(
                f"{given}: DDP options apply at stages 0-1 only; stage {stage} runs FSDP2, which reduce-scatters per "
                "sharded unit and handles parameters a step does not use by itself. Remove them, or use stage=0/1."
            )

    def ddp_kwargs(self, reduce_bucket_size: Optional[int] = None, grad_element_size: int = 4) -> dict:
        """Keyword arguments for ``DistributedDataParallel``.

        Args:
            reduce_bucket_size: a ds_config ``zero_optimization.reduce_bucket_size`` (elements) the config set;
                used as ``bucket_cap_mb`` when that is not given.
            grad_element_size: bytes per gradient element (DDP buckets by bytes).
        """
        kwargs = self.given()
        if "bucket_cap_mb" not in kwargs and reduce_bucket_size is not None:
            kwargs["bucket_cap_mb"] = reduce_bucket_size * grad_element_size / _MIB
        return kwargs


def grad_element_size(module) -> int:
    """Bytes per gradient element of ``module`` (its parameters' dtype: DDP's gradients have it)."""
    for param in module.parameters():
        if param.requires_grad:
            return param.element_size()
    return 4


def ddp_kwargs_for(options: DDPOptions, module, reduce_bucket_size: Optional[int] = None) -> dict:
    """The ``DistributedDataParallel`` keyword arguments for ``module`` (see :meth:`DDPOptions.ddp_kwargs`;
    ``reduce_bucket_size``: a ds_config's, :func:`lightning_zero.ds_config.binding.config_reduce_bucket_size`).

    Under manual optimization a step usually back-propagates through part of the model only (a GAN's discriminator
    loss never reaches the generator; ``toggle_optimizer`` freezes the other optimizer's parameters), and DDP would
    fail on the next step ("Expected to have finished reduction"). So there ``find_unused_parameters`` defaults to
    True, as Lightning's ``ddp_find_unused_parameters_true`` would be chosen; an explicit value always wins.
    """
    kwargs = options.ddp_kwargs(reduce_bucket_size, grad_element_size(module))
    if options.find_unused_parameters is None and not getattr(module, "automatic_optimization", True):
        kwargs["find_unused_parameters"] = True
    return kwargs


_UNUSED_PARAMETERS_ERROR = "Expected to have finished reduction in the prior iteration"


def explain_unused_parameters(exception: BaseException, stage: int) -> None:
    """Put ZeroStrategy's remedy in front of DDP's unused-parameter error (its own text, which names the
    parameters, is kept), as ``DDPStrategy`` points at ``ddp_find_unused_parameters_true``."""
    if (
        stage > 1
        or not exception.args
        or not isinstance(exception.args[0], str)
        or _UNUSED_PARAMETERS_ERROR not in exception.args[0]
    ):
        return
    hint = (
        f"Your LightningModule has parameters that were not used in producing the loss returned by "
        f"training_step. If this is intentional, let DDP (ZeRO stage {stage}) look for them: "
        f"ZeroStrategy(stage={stage}, find_unused_parameters=True). DDP's message follows.\n\n"
    )
    exception.args = (hint + exception.args[0], *exception.args[1:])


class EarlyBucketRebuild:
    """Rebuild ``module``'s DDP buckets right after its first synchronised backward, before the first optimizer
    step, instead of at the start of the second forward where DDP does it.

    [Note: DDP's bucket rebuild and Lightning's step order]
    After its first backward, DDP re-orders its gradient buckets by the order the gradients became ready, once: at
    the start of the next forward it allocates new buckets, copies each gradient into its new bucket and points the
    gradient there, and only then are the old buckets freed (``gradient_as_bucket_view=True``: the gradients are
    views of them). A loop that zeroes the gradients before its forward holds no gradient then, but Lightning's
    automatic optimization runs ``training_step`` first and ``zero_grad`` after it, so at that forward the old
    buckets (one gradient's worth of memory), the new ones, the parameters and the optimizer states are all alive
    at once: a peak one gradient copy above the steps that follow, under Lightning's own ``DDPStrategy`` too.
    Rebuilding right after the first synchronised backward moves that transient to a point where the activations are
    freed and the optimizer has no state yet, below every later step (the bench MLP's figures: ``docs/performance.md``,
    "A second find: DDP's bucket rebuild"). ``reducer._rebuild_buckets()`` is what DDP's forward calls (and torch's
    ``Join`` hook outside a forward); a collective of the DDP group (rank 0's bucket order is broadcast), so it runs at
    the same backward on every rank, and it does nothing when DDP will not rebuild (``find_unused_parameters=True``),
    already did, or has not learnt the order yet (``static_graph=True`` learns it in the second backward: the rebuild
    then comes before the second step). The gradients keep their values (copied into the new buckets). Used by the
    Trainer's automatic optimization, whose step order makes the transient; a Fabric loop is the user's own, and one
    that zeroes before its forward has no transient to move (there, rebuilding early would hold both bucket sets at once
    where DDP's own rebuild frees them bucket by bucket).
    """

    # DDP learns the bucket order in its first synchronised backward, or with static_graph=True in its second (the
    # first one marks every gradient ready at its end); a try that finds no order returns False on every rank
    # without a collective, and after two the module is let go (find_unused_parameters=True never rebuilds).
    TRIES = 2

    def __init__(self, module):
        self.module = module if isinstance(module, DistributedDataParallel) else None
        self.tries = 0

    def after_backward(self, loss: Tensor) -> Tensor:
        """Call after each backward (returns ``loss``, the backward's result, for the caller to return); acts after
        the synchronised backwards (one under ``no_sync``, a micro-step of gradient accumulation, leaves DDP
        nothing to rebuild from) until DDP rebuilt or :attr:`TRIES` found nothing to rebuild."""
        module = self.module
        if module is None or not module.require_backward_grad_sync:
            return loss
        self.tries += 1
        rebuilt = rebuild_ddp_buckets(module)
        if rebuilt:
            self.module = None
        elif rebuilt is None or self.tries >= self.TRIES:
            self.module = None
        return loss


def prepare_manual_backward(module, loss: Tensor) -> None:
    """Under manual optimization, tell a DDP ``module``'s reducer which tensors the backward of ``loss`` starts
    from, as Lightning's ``DDPStrategy.pre_backward`` does (DDP's forward does it only for its own output)."""
    if isinstance(module, DistributedDataParallel) and module.require_backward_grad_sync:
        prepare_ddp_backward(module, loss)


def low_precision_allreduce_hook(dtype: torch.dtype):
    """A DDP communication hook that all-reduces gradient buckets in ``dtype`` (any backend; torch's bf16 hook
    refuses gloo) and writes the averaged result back into the bucket: a low-precision reduction of fp32 gradients
    (``communication_data_type``), or an fp32 reduction of bf16 replicas' gradients (:mod:`.replicas`)."""

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return future.then(decompress)

    return hook


# [Note: parameters DDP does not reduce] torch's DistributedDataParallel builds its reducer from the parameters that
# require gradients when it is constructed (``_build_params_for_reducer`` in ``torch/nn/parallel/distributed.py``);
# one frozen then and unfrozen later (``requires_grad_(True)`` in a hook, Lightning's ``BackboneFinetuning``) gets
# each rank's own gradient, never averaged: under Lightning's DDPStrategy the ranks drift apart, and at stage 1 each
# owner steps the parameters it owns with its own rank's gradient. The strategies average those gradients where DDP
# would have (the Trainer before its optimizer step, Fabric after each synced backward, so that clip_gradients sees
# them averaged); a no-op while nothing frozen at setup requires gradients.
_FROZEN_AT_SETUP: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[list, object]]" = weakref.WeakKeyDictionary()


def record_frozen_parameters(module: torch.nn.Module, group) -> None:
    """Remember ``module``'s parameters that do not require gradients as DDP wraps it (see the note above)."""
    frozen = [p for p in module.parameters() if not p.requires_grad]
    if frozen:
        _FROZEN_AT_SETUP[module] = (frozen, group)


def average_unfrozen_gradients_after_backward(wrapper) -> None:
    """Fabric's backward: :func:`average_unfrozen_gradients` of a ``DistributedDataParallel`` ``wrapper``'s module,
    where DDP itself reduced (not inside ``no_sync``, whose accumulated gradients the synced backward averages)."""
    if isinstance(wrapper, DistributedDataParallel) and wrapper.require_backward_grad_sync:
        average_unfrozen_gradients(wrapper.module)


def average_unfrozen_gradients(module: torch.nn.Module) -> None:
    """Average over the data-parallel ranks the gradients of the parameters that were frozen when DDP wrapped
    ``module`` and require gradients now; a parameter without a gradient on every rank keeps ``None``."""
    frozen, group = _FROZEN_AT_SETUP.get(module, ((), None))
    unfrozen = [p for p in frozen if p.requires_grad]
    if not unfrozen:
        return
    present = torch.tensor([p.grad is not None for p in unfrozen], dtype=torch.int32, device=unfrozen[0].device)
    dist.all_reduce(present, group=group)  # the same parameters on every rank, in the same order
    world = dist.get_world_size(group)
    for param, count in zip(unfrozen, present.tolist()):
        if count == 0:
            continue
        if param.grad is None:  # unused on this rank: its share is zero, as DDP counts an unused parameter
            param.grad = torch.zeros_like(param)
        param.grad.div_(world)
        dist.all_reduce(param.grad, group=group)
