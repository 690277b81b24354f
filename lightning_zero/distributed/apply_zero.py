"""ZeRO stages 0-3 as one plain function over a module: :func:`apply_zero`.

The stages map onto engines torch maintains:

==========  ==========================================  ===============================================
stage       engine                                      what each rank holds between steps
==========  ==========================================  ===============================================
0           ``DistributedDataParallel``                 all parameters, gradients, optimizer states
1           ``DistributedDataParallel`` + an optimizer  all parameters and gradients; the optimizer
            partitioned in place (:mod:`.optimizer`)    states of its own 1/N of the parameters
2           FSDP2 ``fully_shard(reshard_after_forward   1/N of parameters, gradients and optimizer
            =False)``                                   states; parameters are gathered once per step
3           FSDP2 ``fully_shard(reshard_after_forward   1/N of everything; parameters are gathered per
            =True)``                                    unit in forward and again in backward
==========  ==========================================  ===============================================

``docs/stages.md`` derives the memory formula of each stage; :mod:`.memory` measures and estimates it.

[Note: the root unit]
At stages 2-3 the module passed in (for Lightning, the LightningModule) becomes the FSDP2 root, so every
parameter belongs to exactly one unit: repeated blocks get their own unit and the root holds the rest
(embeddings, heads, norms). The root's hooks fire only when the root's ``__call__`` runs, so callers that invoke
another method (``training_step``) must route it through ``__call__``; the strategy does so with Lightning's
forward redirection. A backward *inside* that call (manual optimization) needs :mod:`.manual_backward`.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from typing import Iterable, Optional

import torch
from torch import nn

from lightning_zero.distributed import module_classes
from lightning_zero.distributed.activation_checkpointing import (
    ActivationCheckpointConfig,
    apply_activation_checkpointing,
)
from lightning_zero.distributed.buffer_sync import broadcast_buffers, install_buffer_broadcast, note_gradient_sync
from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.distributed.cpu_tuning import tune_sharded_module
from lightning_zero.distributed.ddp import record_frozen_parameters
from lightning_zero.distributed.deferred_init import has_deferred, materialize_module
from lightning_zero.distributed.empty_init import guard_first_forward, reset_unwritten_modules, skipped_names
from lightning_zero.distributed.exact_init import broadcast_module_states, refuse_meta_tensors, to_fp32_masters
from lightning_zero.distributed.full_tensor_load import accept_full_tensors
from lightning_zero.distributed.hybrid import check_mesh_matches, data_parallel_group
from lightning_zero.distributed.meta_init import init_meta_tensors
from lightning_zero.distributed.replicas import keep_fp32_values
from lightning_zero.distributed.units import param_bytes, plan_units, set_prefetch
from lightning_zero.torch_compat import ddp_buffer_sync_kwargs, tensor_has_gradient_hooks

log = logging.getLogger(__name__)

# root -> the units apply_zero sharded with reshard_after_forward=False (see _keep_gathered_between_micro_steps); a
# weak table, not a module attribute, so that pickling the module never carries it along
_KEPT_UNITS: "weakref.WeakKeyDictionary[nn.Module, list[nn.Module]]" = weakref.WeakKeyDictionary()


def _resolve_classes(module: nn.Module, spec: Optional[Iterable]) -> module_classes.ClassSelector:
    """The FSDP unit classes: detected blocks (exact types) or the user's (subclasses included); see
    ``[Note: which modules a class selects]`` in :mod:`.module_classes`."""
    if spec is None:
        return module_classes.detected(module_classes.find_repeated_blocks(module))
    return module_classes.given(module, spec, "sharded_module_classes")


def sharded_units(module: nn.Module, config: ZeroConfig) -> list[nn.Module]:
    """The submodules that get their own FSDP unit, outermost first is not required (post-order is used); a module
    sharing a parameter with one outside it is left to the enclosing unit (:func:`_keep_shared_parameters_together`)."""
    classes = _resolve_classes(module, config.sharded_module_classes)
    units = [sub for sub in module.modules() if type(sub) in classes and sub is not module]
    units = _keep_shared_parameters_together(module, units, named=config.sharded_module_classes is not None)
    log.info("ZeRO-%d: %d sharded units of classes %s", config.stage, len(units), sorted(c.__name__ for c in classes))
    return units


def refuse_sharded_modules(module: nn.Module) -> None:
    """Refuse a model the user already sharded (``fully_shard`` on submodules, as Lightning's ModelParallelStrategy
    scripts do in ``configure_model``/``parallelize_fn``, or DTensor parameters from a tensor-parallel plan), naming
    what is sharded. ZeroStrategy shards the model itself, with its own mesh, precision and offload: DDP (stages
    0-1) cannot wrap DTensors, and at stages 2-3 the user's units would keep settings of their own and leave the
    ranks out of step (seen as a hang)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    units = [name or "the model itself" for name, sub in module.named_modules() if isinstance(sub, FSDPModule)]
    distributed = [name for name, param in module.named_parameters() if isinstance(param, DTensor)]
    if not units and not distributed:
        return
    what = f"FSDP2 units {units[:6]}" if units else f"DTensor parameters {distributed[:6]}"
    raise ValueError(
        f"the model is already sharded ({what}), by fully_shard/parallelize calls or an earlier "
        "setup: ZeroStrategy applies the ZeRO stage itself. Pass the model unsharded; to choose the FSDP2 "
        "units use ZeroStrategy(sharded_module_classes={...})"
    )


def _keep_shared_parameters_together(root: nn.Module, units: list[nn.Module], *, named: bool) -> list[nn.Module]:
    """``units`` without those holding a parameter that a module outside them holds too (tied embedding and output
    head, as Llama's and GPT-2's).

    [Note: a parameter shared across units]
    ``fully_shard`` replaces each parameter of a unit by a new sharded parameter on that unit's modules only; a module
    outside the unit would keep the old tensor, so the tie would break (torch refuses it at the first forward,
    pointing to ``fully_shard([a, b])``, which the strategy's user cannot call). Such a unit is left to the unit that
    encloses it (the root at last), where both holders are. ``named``: the classes came from
    ``sharded_module_classes``, so the unit left out is warned about by name (as Lightning's FSDP warns about its
    wrap policy); detected blocks are only logged.
    """
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, sub in root.named_modules(remove_duplicate=False):
        for param_name, param in sub.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((f"{name}.{param_name}" if name else param_name, sub))
    names = {id(sub): name for name, sub in root.named_modules()}
    kept = []
    for unit in units:
        inside = {id(sub) for sub in unit.modules()}
        shared = [
            (param_name, outside)
            for param_name, param in unit.named_parameters()
            for outside, holder in holders[id(param)]
            if id(holder) not in inside
        ]
        if not shared:
            kept.append(unit)
            continue
        name = names[id(unit)]
        message = (
            f"{name} ({type(unit).__name__}) shares its parameter {name}.{shared[0][0]} with {shared[0][1]} "
            "outside it, so it is not made an FSDP unit of its own: it stays in the enclosing unit, which holds "
            "both (a tie cannot span two units)"
        )
        if named:
            warnings.warn(f"sharded_module_classes: {message}", UserWarning, stacklevel=2)
        else:
            log.info(message)
    return kept


def unit_groups(module: nn.Module, config: ZeroConfig) -> tuple[list[list[nn.Module]], bool]:
    """The FSDP2 units below the root, as groups of modules (one ``fully_shard`` call each), in the order they
    are sharded (nested blocks before the blocks holding them), and whether any block was left to the root: by
    ``param_persistence_threshold`` (:mod:`.units`), or every block of a stage-2 model smaller than one unit."""
    blocks = sharded_units(module, config)
    if whole_model_is_one_unit(module, config):
        log.info(
            "ZeRO-2: the whole model (%d blocks) fits in one unit of %d bytes: one FSDP2 unit, the root",
            len(blocks),
            config.effective_unit_bytes,
        )
        return [], bool(blocks)
    plan = plan_units(module, blocks, config.effective_unit_bytes, config.effective_param_persistence_threshold)
    order = {id(m): i for i, m in enumerate(module.modules())}
    groups = sorted(plan.groups, key=lambda group: order[id(group[0])], reverse=True)
    log.info(
        "ZeRO-%d: %d FSDP2 units below the root (unit_bytes=%d), %d blocks left to the root",
        config.stage,
        len(groups),
        config.effective_unit_bytes,
        len(plan.persistent),
    )
    return groups, bool(plan.persistent)


def whole_model_is_one_unit(module: nn.Module, config: ZeroConfig) -> bool:
    """Stage 2 with detected blocks: the whole model's parameters fit in one unit (``unit_bytes``), so it is one
    FSDP2 unit, the root (``[Note: one unit for a model smaller than a unit]`` in :mod:`.units`). Not for a deferred
    build, which was asked to become real one unit at a time."""
    return (
        config.stage == 2
        and config.sharded_module_classes is None
        and config.effective_unit_bytes > 0
        and not has_deferred(module)
        and param_bytes(module) <= config.effective_unit_bytes
    )


def _fsdp_kwargs(mesh, config: ZeroConfig, device: torch.device, mp_policy=None) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy

    reshard = config.stage == 3 if config.reshard_after_forward is None else config.reshard_after_forward
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard}
    if config.offloads_params:  # optimizer-only offload keeps the shards on the device (see ZeroConfig's note)
        pin = config.pin_memory if config.pin_memory is not None else device.type == "cuda"
        if pin and device.type != "cuda":
            raise ValueError(
                "pin_memory=True needs a CUDA device; this run computes on "
                f"{device.type!r}. Use pin_memory=None or False."
            )
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    return kwargs


def _replicate(
    module: nn.Module,
    mesh,
    device: torch.device,
    ddp_kwargs: Optional[dict],
    replica_dtype: Optional[torch.dtype],
    fp32_values: Optional[dict],
    sync_buffers: bool,
) -> nn.Module:
    """Stages 0-1: the module on ``device`` under ``DistributedDataParallel``; with ``replica_dtype`` its parameters
    cast first, their fp32 values put in ``fp32_values`` (:mod:`.replicas`). ``sync_buffers``: DDP's buffer
    broadcast before each forward (``ZeroConfig.broadcast_buffers``); without it every rank still starts from rank
    0's buffers, as at stages 2-3."""
    from torch.nn.parallel import DistributedDataParallel

    materialize_module(module)  # DDP keeps full replicas: a deferred build (see exact_init) becomes real now
    module.to(device)
    if not sync_buffers:  # DDP's broadcast_buffers=False (torch < 2.13) would skip them at construction too
        broadcast_buffers(module, data_parallel_group(mesh), device)
    if replica_dtype is not None:  # before DDP builds its buckets from the parameters' dtypes
        # rank 0's fp32 values: DDP would broadcast only the bf16 replicas, leaving each rank's own masters
        broadcast_module_states(module, data_parallel_group(mesh), device)
        fp32_values.update(keep_fp32_values(module, replica_dtype))
    accept_full_tensors(module)  # a dict of safetensors slices loads at every stage (full_tensor_load.py)
    device_ids = [device.index] if device.type == "cuda" else None
    record_frozen_parameters(module, data_parallel_group(mesh))
    kwargs = {**ddp_buffer_sync_kwargs(sync_buffers), **ddp_defaults(ddp_kwargs)}
    if any(kwargs.get(name, sync_buffers) != sync_buffers for name in ("broadcast_buffers", "forward_sync_buffers")):
        raise ValueError(
            f"ddp_kwargs {ddp_kwargs} contradict ZeroConfig(broadcast_buffers={sync_buffers}); set it "
            "in the ZeroConfig only"
        )
    return DistributedDataParallel(module, device_ids=device_ids, process_group=data_parallel_group(mesh), **kwargs)


def apply_zero(
    module: nn.Module,
    mesh,
    config: ZeroConfig,
    *,
    device: Optional[torch.device] = None,
    mp_policy=None,
    ddp_kwargs: Optional[dict] = None,
    activation_checkpointing: Optional[ActivationCheckpointConfig] = None,
    replica_dtype: Optional[torch.dtype] = None,
    fp32_values: Optional[dict] = None,
) -> nn.Module:
    """Apply ZeRO ``config.stage`` to ``module`` over the 1-D data-parallel ``mesh`` and return the module to run.

    Stages 0-1 return a ``DistributedDataParallel`` wrapper (stage 1's partitioning lives in the optimizer: see
    :func:`lightning_zero.distributed.optimizer.shard_optimizer`). Stages 2-3 shard ``module`` in place with FSDP2
    and return it. Every rank starts from rank 0's parameters and buffers (DDP broadcasts them; at stages 2-3 they
    are broadcast before sharding). A model built under
    :func:`lightning_zero.distributed.exact_init.exact_init` runs its own init; tensors on the meta device get theirs
    from their modules' ``reset_parameters()`` (:mod:`.meta_init`), and a module without one is refused. Tensors an
    ``empty_init=True`` build left unwritten get theirs from ``reset_parameters()`` at stages 2-3, and a first forward
    that would read memory nothing wrote is refused at every stage (:mod:`.empty_init`).

    Args:
        module: the model, built on real memory (CPU or the compute device), recorded (``exact_init``) or on the
            meta device.
        mesh: a 1-D ``DeviceMesh`` over the data-parallel ranks, or with ``config.hybrid_shard_size`` the 2-D
            ``("replicate", "shard")`` mesh of :func:`lightning_zero.distributed.hybrid.data_parallel_mesh` (HSDP).
        config: the validated :class:`~lightning_zero.distributed.config.ZeroConfig`.
        device: the compute device (defaults to the mesh's device type, current index).
        mp_policy: an FSDP2 ``MixedPrecisionPolicy`` (stages 2-3 only).
        ddp_kwargs: extra keyword arguments for ``DistributedDataParallel`` (stages 0-1 only); they win over
            ZeRO's default ``gradient_as_bucket_view=True`` (see :func:`ddp_defaults`).
        activation_checkpointing: recompute the selected blocks' activations in backward
            (:mod:`.activation_checkpointing`); applied before DDP/``fully_shard``, parameter names unchanged.
        replica_dtype: stages 0-1 only: cast the parameters to this dtype before DDP, filling ``fp32_values`` with
            the fp32 values of the trainable ones (:mod:`.replicas`, ``bf16-true``).
    """
    if replica_dtype is not None and (config.stage >= 2 or fp32_values is None):
        raise ValueError("replica_dtype applies to stages 0-1 and needs a dict fp32_values to fill")
    refuse_sharded_modules(module)  # before any collective: every rank refuses alike
    device = device or _mesh_device(mesh)
    refuse_fsdp1_modules(module)
    if config.stage >= 2:
        refuse_parameter_gradient_hooks(module)
    init_meta_tensors(module)  # a meta-device build: reset_parameters(), recorded, replayed per unit below
    refuse_meta_tensors(module, config.stage)
    unwritten = reset_unwritten_modules(module) if config.stage >= 2 else []  # empty_init: FSDP's, recorded
    to_fp32_masters(module)  # a bf16-true build's parameters (see lightning_zero.distributed.exact_init)
    check_mesh_matches(mesh, config.hybrid_shard_size)
    if activation_checkpointing is not None:
        _checkpoint_activations(module, activation_checkpointing, config)
    if config.stage <= 1:
        if mp_policy is not None:
            raise ValueError("mp_policy is an FSDP2 policy and applies to stages 2-3 only")
        wrapped = _replicate(module, mesh, device, ddp_kwargs, replica_dtype, fp32_values, config.broadcast_buffers)
        guard_first_forward(module, skipped_names(module), device, config.stage)  # after DDP broadcast rank 0's
        return wrapped
    if ddp_kwargs:
        raise ValueError(f"ddp_kwargs apply to stages 0-1 only; stage {config.stage} uses FSDP2")
    groups = _shard_units(module, mesh, config, device, _fsdp_kwargs(mesh, config, device, mp_policy))
    if config.prefetch_bytes:
        set_prefetch(list(reversed(groups)), config.prefetch_bytes)
    tune_sharded_module(module, device)  # CPU only: pooled buffers, pairwise reduce-scatter (cpu_tuning.py)
    if not config.offloads_params:
        module.to(device)
    swap_parameters(module, config, device)
    accept_full_tensors(module)  # model.load_state_dict(full_state_dict) after setup, as at stages 0-1
    if config.broadcast_buffers:  # DDP's broadcast_buffers, which FSDP2 lacks (see buffer_sync's note)
        install_buffer_broadcast(module, data_parallel_group(mesh), device)
    guard_first_forward(module, unwritten, device, config.stage)  # after the broadcast: it sees rank 0's buffers
    return module


def _shard_units(
    module: nn.Module, mesh, config: ZeroConfig, device: torch.device, kwargs: dict
) -> list[list[nn.Module]]:
    """``fully_shard`` each unit group below ``module`` (returned, in the order sharded), then ``module`` itself.

    Children before parents: fully_shard on a parent excludes parameters already owned by a child unit. A deferred
    build (see lightning_zero.distributed.deferred_init) becomes real one unit at a time, right before that unit is
    sharded: the peak is one unit plus the shards. Every unit takes rank 0's values, as DDP does at stages 0-1
    (broadcast_module_states skips what a child unit already sharded)."""
    from torch.distributed.fsdp import fully_shard

    groups, persistent = unit_groups(module, config)
    kept_units = _KEPT_UNITS[module] = []
    for group in [*groups, [module]]:
        for unit in group:
            materialize_module(unit)
            broadcast_module_states(unit, data_parallel_group(mesh), device)
        kept = _kept_from_forward_to_backward(group, module, groups, persistent, config)
        reshard = False if kept else kwargs["reshard_after_forward"]
        fully_shard(group if len(group) > 1 else group[0], **{**kwargs, "reshard_after_forward": reshard})
        if reshard is False:
            kept_units.append(group[0])  # the modules of a group share one FSDP2 state
    return groups


def _checkpoint_activations(module: nn.Module, settings: ActivationCheckpointConfig, config: ZeroConfig) -> None:
    if settings.policy is True and config.sharded_module_classes:
        # True means "the blocks": when the user named the FSDP units, those are the blocks.
        settings = dataclasses.replace(settings, policy=config.sharded_module_classes)
    apply_activation_checkpointing(module, settings)


def _kept_from_forward_to_backward(
    group: list[nn.Module], root: nn.Module, groups: list[list[nn.Module]], persistent: bool, config: ZeroConfig
) -> bool:
    """Whether this unit keeps its gathered parameters from its forward to its backward although the stage
    reshards after forward.

    [Note: the two units stage 3 does not reshard after forward]
    With ``reshard_after_forward`` left at ``None``, stage 3 keeps two units gathered from forward to backward, as
    FSDP2's own default does for the root and torchtitan does for the last block:

    * **the root** (embeddings, head, norms, the loss): its forward opens the step and closes it, and backward
      starts in it and ends in it (the embedding's gradient comes last), so the root is gathered for the whole
      forward and the whole backward anyway. Resharding it in between saves memory for no time at all and costs
      one all-gather of the root per step. (FSDP2 skips that reshard for the root only when ``reshard_after_forward``
      is not given; stage 3 passes ``True``, so it is said here.)
    * **the unit that runs last in forward** (the last in registration order, which is the execution order of a
      ``Sequential`` and of the usual ``for block in self.blocks`` loop): its backward comes right after the root's,
      and FSDP2's backward prefetch gathers it again as soon as the root's backward starts. Keeping it costs one
      gathered unit only while the rest of the root's forward runs (final norm, head, loss) and saves one
      all-gather per step.

    Step times and peaks: ``docs/performance.md``, "Stage 3: the root and the last unit kept from forward to
    backward". An explicit ``reshard_after_forward=True`` (or an ``int``) reshards every unit, the root included, for
    the lowest memory; blocks left to the root by ``param_persistence_threshold`` always keep the root gathered (see
    :mod:`.units`). If the model's execution order differs from its registration order, the unit kept is not the
    last to run: it then holds one unit's gathered parameters longer, never a different result.
    """
    if group[0] is root:
        return persistent or (config.stage == 3 and config.reshard_after_forward is None)
    return config.stage == 3 and config.reshard_after_forward is None and group is groups[0]


def ddp_defaults(ddp_kwargs: Optional[dict] = None) -> dict:
    """The ``DistributedDataParallel`` keyword arguments of stages 0-1: ``ddp_kwargs`` over ZeRO's defaults.

    [Note: gradients are views of DDP's buckets]
    DDP's default (``gradient_as_bucket_view=False``) keeps two gradient-sized buffers per rank: autograd's ``.grad``
    and the all-reduce buckets it copies them into and back out of. ZeRO's point is not to hold what is not needed,
    and DeepSpeed's stage 0 keeps one gradient buffer, so here the gradients *are* the buckets (torch's
    ``gradient_as_bucket_view=True``): one gradient copy less at the peak (the figures:
    ``docs/performance_notes_stage0.md``) and no bucket-to-``.grad`` copy after the reduction. Values are the same
    (the reduced bucket is what DDP's default copies into ``.grad``). What changes for the user: ``.grad`` is a view,
    so ``p.grad.detach_()`` raises, and a ``.grad`` replaced by another tensor (not ``None``) between steps makes DDP
    raise ("not the expected DDP bucket view"), never a silent result; ``optimizer.zero_grad(set_to_none=True/False)``,
    in-place clipping/unscaling and accumulation work unchanged. An explicit ``gradient_as_bucket_view=False``
    (``ZeroStrategy`` argument or ``ddp_kwargs``) restores DDP's behaviour.
    """
    return {"gradient_as_bucket_view": True, **(ddp_kwargs or {})}


def swap_parameters(module: nn.Module, config: ZeroConfig, device: Optional[torch.device] = None) -> None:
    """With ``offload_params="nvme"``, put the stage-3 shards of ``module`` (sharded by :func:`apply_zero`) on disk
    (:mod:`lightning_zero.offload.param_swapper`); a no-op otherwise or when it already swaps. ``apply_zero`` calls
    it; call it again to resume swapping on a module reused after a teardown stopped it."""
    if not config.swaps_parameters:
        return
    from lightning_zero.offload.param_swapper import attach_param_swapper, get_param_swapper

    if get_param_swapper(module) is not None:
        return
    device = device or torch.device("cpu")
    pin = config.pin_memory if config.pin_memory is not None else device.type == "cuda"
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    attach_param_swapper(module, config.nvme, rank=rank, pin_memory=pin)


def reshard_gathered(module: nn.Module) -> None:
    """Free the gathered parameters that units kept after their last forward and put the shards back on the
    modules (FSDP2's ``reshard``, unit by unit). A unit that does not reshard after forward (every unit at stage 2;
    the root and the last unit at stage 3) stays gathered after a forward without backward, such as an
    evaluation loop's last batch: its full parameters then occupy memory until the next training step, and the
    module exposes plain tensors instead of its sharded DTensors. Teardown calls this; a no-op at stages 0-1 and
    for units already sharded."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def refuse_fsdp1_modules(module: nn.Module) -> None:
    """Refuse a model holding torch's legacy ``FullyShardedDataParallel`` (FSDP1) wrappers, naming them: such a module
    already shards its parameters into flat parameters and reduces its own gradients, so wrapping it again (DDP at
    stages 0-1, FSDP2 at stages 2-3) would shard or reduce it twice. Lightning's ModelParallelStrategy refuses them
    too; ZeroStrategy shards the plain model itself."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = [
        f"'{name}'" if name else "the model itself"
        for name, sub in module.named_modules()
        if isinstance(sub, FullyShardedDataParallel)
    ]
    if wrapped:
        raise TypeError(
            f"The model holds torch's legacy FullyShardedDataParallel (FSDP1) wrapper at "
            f"{', '.join(wrapped)}. ZeroStrategy shards the model itself (FSDP2 at stages 2-3, DDP at "
            "0-1) and would shard or reduce an FSDP1 module a second time: pass the unwrapped model."
        )


def refuse_parameter_gradient_hooks(module: nn.Module, *, sharded_only: bool = False) -> None:
    """Refuse, at stages 2-3, parameters carrying gradient hooks (``param.register_hook``,
    ``param.register_post_accumulate_grad_hook``), naming them. Before ``fully_shard`` every parameter is checked;
    with ``sharded_only`` (after setup, where a hook on a shard is as lost) only the sharded DTensor ones.

    ``fully_shard`` replaces every parameter with a new sharded DTensor parameter and runs the forward on separate
    unsharded tensors; FSDP2's post-backward hook then assigns the reduced shard to ``param.grad`` directly, not
    through autograd. The hooks stay on the original tensors, which no longer take part: they would never run and the
    model would train as if they did not exist. Under DDP (stages 0-1) the parameters keep their identity and the
    hooks run on each rank's gradient before the all-reduce (torch's ``Tensor.register_hook`` in ``torch/_tensor.py``
    stores them in ``_backward_hooks`` on the tensor itself)."""
    from torch.distributed.tensor import DTensor

    hooked = [
        name
        for name, param in module.named_parameters()
        if tensor_has_gradient_hooks(param) and (not sharded_only or isinstance(param, DTensor))
    ]
    if hooked:
        more = f" and {len(hooked) - 5} more" if len(hooked) > 5 else ""
        shown = ", ".join(f"'{name}'" for name in hooked[:5]) + more
        raise ValueError(
            f"The parameters {shown} have gradient hooks (Tensor.register_hook or register_post_accumulate_grad_hook). "
            "At stages 2-3 the parameters are replaced by shards whose gradients autograd does not compute, so the "
            "hooks would never run. Use stage 0 or 1, or change the gradients in on_before_optimizer_step (there "
            "param.grad is the reduced, sharded gradient)."
        )


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Turn gradient communication on or off for the next backward (gradient accumulation)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        module.require_backward_grad_sync = enabled
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
        note_gradient_sync(module, enabled)
        _keep_gathered_between_micro_steps(module, keep=not enabled)


def _keep_gathered_between_micro_steps(module: nn.Module, keep: bool) -> None:
    """Keep the gathered parameters of units that do not reshard after forward across the micro-steps.

    [Note: stage 2 under gradient accumulation]
    A unit with ``reshard_after_forward=False`` (every unit at stage 2; at stage 3 the root and the last unit, see
    :func:`_kept_from_forward_to_backward`) holds its gathered (low-precision) parameters from forward to backward
    anyway. FSDP2 still reshards them after every backward, so left alone each micro-step of gradient accumulation would
    all-gather every unit again: ``accumulate_grad_batches=4`` would cost four all-gathers per unit per optimizer step
    where one suffices, since the sharded parameters do not change until the optimizer steps (counts in
    ``docs/performance_notes_lowprec.md``, section 1). On the micro-steps that do not reduce, those units skip the
    post-backward reshard (FSDP2's ``reshard_after_backward``); the last micro-step reduces and reshards as usual,
    before the optimizer step. The peak is unchanged (these parameters are gathered during every forward-to-backward
    already); only the time between two micro-steps holds them too. Units that reshard after forward (stage 3) are left
    alone: keeping them would turn stage 3 into stage 2's memory. The switch is torch's public
    ``FSDPModule.set_reshard_after_backward``, per unit that :func:`apply_zero` sharded with
    ``reshard_after_forward=False``.
    """
    for unit in _KEPT_UNITS.get(module, ()):
        unit.set_reshard_after_backward(not keep, recurse=False)
