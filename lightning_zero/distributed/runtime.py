"""The ZeRO runtime: every step a strategy runs, written once, in the order it runs them.

Both Lightning adapters (the Trainer's :mod:`lightning_zero.strategies.trainer_strategy` and Fabric's
:mod:`lightning_zero.fabric.fabric_strategy`) call these functions from their hooks with explicit values, the way
torchtitan's ``parallelize`` functions call ``apply_*``; what happens inside is written here and nowhere else.

==  ======================  ===========================================  ===========================================
#   step                    function                                     Trainer hook / Fabric call
==  ======================  ===========================================  ===========================================
1   meshes                  :func:`build_meshes`                         ``setup_environment`` (both)
2   build the model         :func:`init_context`                         ``configure_model`` / ``fabric.init_module``
3   wrap the module         :func:`wrap_module`                          ``setup`` / ``fabric.setup``
4   shard the optimizers    :func:`shard_optimizer_of`                   ``setup_optimizers`` / ``fabric.setup``
5   accumulate              :func:`no_gradient_sync`                     ``block_backward_sync`` / ``no_backward_sync``
6   release                 :func:`release`                              ``teardown`` (both)
==  ======================  ===========================================  ===========================================

Under a pipeline (``pipeline_parallel_size > 1``) step 3 is
:func:`lightning_zero.pipeline.zero_pipeline.setup_pipeline`, which applies the ZeRO stage to each pipeline stage.
Where the work of a training step then happens (forward, gradient reduction, optimizer step) is drawn in
``docs/architecture.md``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Generator, Iterable, Optional

import torch
from torch import nn

from lightning_zero.distributed.apply_zero import apply_zero, reshard_gathered, set_gradient_sync
from lightning_zero.distributed.comm_buffers import comm_buffer_pool
from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.distributed.ddp import DDPOptions, ddp_kwargs_for, low_precision_allreduce_hook
from lightning_zero.distributed.deferred_init import materialize_module
from lightning_zero.distributed.empty_init import guard_first_forward, skipped_names
from lightning_zero.distributed.exact_init import InitConfig, broadcast_module_states, exact_init, to_fp32_masters
from lightning_zero.distributed.full_tensor_load import accept_full_tensors
from lightning_zero.distributed.hybrid import data_parallel_group, data_parallel_mesh, shard_group
from lightning_zero.distributed.meta_init import holds_meta_tensors, init_meta_tensors
from lightning_zero.distributed.optimizer import get_sharding, only_constructor_states, shard_optimizer
from lightning_zero.offload.param_swapper import detach_param_swapper

PIPELINE_MESH_DIM_NAMES = ("pp", "dp")


@dataclass(frozen=True)
class Meshes:
    """The device meshes of a run.

    Attributes:
        world: every rank; the LightningModule's ``device_mesh``. Under a pipeline the 2-D ``("pp", "dp")`` mesh,
            else the same mesh as ``data_parallel``.
        data_parallel: the mesh ZeRO shards over: 1-D, or 2-D ``("replicate", "shard")`` with hybrid sharding
            (:mod:`.hybrid`); under a pipeline the ``"dp"`` dimension.
        pipeline: the ``"pp"`` dimension under a pipeline, else ``None``.
    """

    world: Any
    data_parallel: Any
    pipeline: Optional[Any] = None


def build_meshes(
    device_type: str, world_size: int, *, pipeline_parallel_size: int = 1, hybrid_shard_size: Optional[int] = None
) -> Meshes:
    """Step 1, right after the process group exists: a ``(pp, world / pp)`` mesh under a pipeline (the ZeRO stage
    applies on ``"dp"``), else the data-parallel mesh
    (:func:`~lightning_zero.distributed.hybrid.data_parallel_mesh`)."""
    if pipeline_parallel_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        pp = pipeline_parallel_size
        mesh = init_device_mesh(device_type, (pp, world_size // pp), mesh_dim_names=PIPELINE_MESH_DIM_NAMES)
        return Meshes(world=mesh, data_parallel=mesh["dp"], pipeline=mesh["pp"])
    mesh = data_parallel_mesh(device_type, world_size, hybrid_shard_size)
    return Meshes(world=mesh, data_parallel=mesh)


def sampler_kwargs(meshes: Optional[Meshes], world_size: int, global_rank: int) -> dict[str, int]:
    """The ``DistributedSampler``'s replicas: under a pipeline the data-parallel replicas (every stage of a replica
    reads the same batch), else every rank."""
    if meshes is not None and meshes.pipeline is not None:
        return {"num_replicas": meshes.data_parallel.size(), "rank": meshes.data_parallel.get_local_rank()}
    return {"num_replicas": world_size, "rank": global_rank}


def init_context(
    config: ZeroConfig,
    *,
    pipelined: bool,
    local_world_size: int,
    empty_init: Optional[bool] = None,
    init_dtype: Optional[torch.dtype] = None,
) -> AbstractContextManager:
    """Step 2, around the user's model construction: the model's own init runs exactly as on CPU; ``empty_init=True``
    skips the init of torch's layers, as Lightning's strategies do: the script initialises (or loads) the weights at
    stages 0-1, as under DDP, and :func:`wrap_module` calls the untouched modules' ``reset_parameters()`` at stages
    2-3, as FSDP/ModelParallel do (``[Note: empty_init at each stage]`` in :mod:`.empty_init`). At stages 2-3 the
    build is recorded and :func:`wrap_module` replays it one FSDP unit at a time, so no rank holds the whole model
    (:mod:`.exact_init`, :mod:`.deferred_init`). A pipeline builds only its own stages at setup, so it is never
    deferred. ``init_dtype``: the precision's build dtype (``[Note: the build under bf16-true]``)."""
    deferred = config.stage >= 2 and not pipelined
    return exact_init(
        InitConfig.from_env(max(1, local_world_size), deferred=deferred), empty_init, None if pipelined else init_dtype
    )


def wrap_module(
    module: nn.Module,
    mesh,
    config: ZeroConfig,
    *,
    device: torch.device,
    mp_policy=None,
    reduce_dtype: Optional[torch.dtype] = None,
    ddp_options: Optional[DDPOptions] = None,
    reduce_bucket_size: Optional[int] = None,
    activation_checkpointing=None,
    replica_dtype: Optional[torch.dtype] = None,
    fp32_values: Optional[dict] = None,
) -> nn.Module:
    """Step 3: :func:`~lightning_zero.distributed.apply_zero.apply_zero` over the data-parallel ``mesh``. Stages 0-1
    return a ``DistributedDataParallel`` wrapper built with ``ddp_options`` (and a ds_config's
    ``reduce_bucket_size``, see :func:`~lightning_zero.distributed.ddp.ddp_kwargs_for`) that all-reduces in
    ``reduce_dtype`` when that is not ``None`` (DeepSpeed's ``communication_data_type``); stages 2-3 shard ``module``
    in place with FSDP2 and return it, ``mp_policy`` being its ``MixedPrecisionPolicy`` (stages 0-1 compute under
    autocast instead: the precision plugin's forward context; or, with ``replica_dtype``, hold the parameters in
    that dtype and fill ``fp32_values`` for step 4's masters: :mod:`.replicas`)."""
    if config.stage >= 2:
        return apply_zero(
            module, mesh, config, device=device, mp_policy=mp_policy, activation_checkpointing=activation_checkpointing
        )
    ddp_kwargs = ddp_kwargs_for(ddp_options or DDPOptions(), module, reduce_bucket_size)
    wrapped = apply_zero(
        module,
        mesh,
        config,
        device=device,
        ddp_kwargs=ddp_kwargs,
        activation_checkpointing=activation_checkpointing,
        replica_dtype=replica_dtype,
        fp32_values=fp32_values,
    )
    if reduce_dtype is not None:
        wrapped.register_comm_hook(wrapped.process_group, low_precision_allreduce_hook(reduce_dtype))
    return wrapped


def needs_placing(module: nn.Module, config: ZeroConfig, pipelined: bool) -> bool:
    """Whether an adapter moves ``module`` to the compute device itself before step 3: at stages 0-1, unless the
    model is pipelined (the pipeline places its stages) or has tensors on the meta device (step 3 gives them values
    first, :mod:`.meta_init`). Stages 2-3 are placed by step 3."""
    return config.stage <= 1 and not pipelined and not holds_meta_tensors(module)


def replicate_for_evaluation(module: nn.Module, mesh, device: torch.device) -> nn.Module:
    """Step 3 of an evaluation-only run at stages 0-1 (no DDP: nothing to reduce): ``module`` on ``device`` with
    rank 0's parameters and buffers on every rank (a meta-device model first gets its values from
    ``reset_parameters()``, :mod:`.meta_init`)."""
    if init_meta_tensors(module):
        materialize_module(module)
    to_fp32_masters(module)
    module.to(device)
    broadcast_module_states(module, data_parallel_group(mesh), device)
    guard_first_forward(module, skipped_names(module), device, stage=1)  # see lightning_zero.distributed.empty_init
    accept_full_tensors(module)  # a dict of safetensors slices loads here too, as in a fit
    return module


def check_optimizer_params(optimizer: torch.optim.Optimizer, module: nn.Module, index: int = 0) -> None:
    """Raise if ``optimizer`` holds a tensor that is not a parameter of the (already sharded) ``module``.

    At stages 2-3 ``fully_shard`` replaces every parameter of the module with a new DTensor parameter. An optimizer
    built before that (in ``__init__`` or ``configure_model`` and merely returned by ``configure_optimizers``) keeps
    the old tensors: they never receive a gradient, so the optimizer silently steps nothing and the model never
    trains. Neither FSDP2 nor the optimizer can notice (both are consistent on their own), so it is checked here.
    ``index`` is the optimizer's position, for the message.
    """
    owned = {id(param) for param in module.parameters()}
    stale = sum(1 for group in optimizer.param_groups for param in group["params"] if id(param) not in owned)
    if stale:
        raise ValueError(
            f"optimizer {index} ({type(optimizer).__name__}) holds {stale} tensor(s) that are not parameters of the "
            "sharded model, so they would never be trained. At ZeRO stages 2-3 the parameters are replaced when the "
            "model is sharded: create the optimizer inside configure_optimizers from self.parameters(), not earlier "
            "(in __init__ or configure_model), and do not pass tensors that are not module parameters."
        )


def point_at_shards(
    optimizer: torch.optim.Optimizer, module: nn.Module, names: Optional[dict[int, str]] = None
) -> None:
    """Reshard ``module``'s units and put its sharded parameters in ``optimizer`` in place of the tensors they
    replaced, by name. ``names``: the name of each tensor (by ``id``) the optimizer may hold in place of a sharded
    parameter; by default the module's parameters now, which a forward may have left gathered (see the note). An
    optimizer built before step 3 (``fabric.setup(model, optimizer)``) passes the names of the parameters it was
    built from, which ``fully_shard`` replaced; tensors that were never the module's are left for
    :func:`check_optimizer_params` to refuse.

    [Note: an optimizer built from gathered parameters]
    A unit that does not reshard after forward (every unit at stage 2; the root and the last unit at stage 3) keeps
    its gathered full parameters registered on the module after a forward without backward, so
    ``module.parameters()`` returns plain tensors there until the next reshard. An optimizer built from them
    (``fabric.setup_module``, a forward to evaluate, then ``fabric.setup_optimizers``) held tensors FSDP2 then drops:
    it stepped nothing and the model silently never trained. The units are resharded first, and each such tensor is
    replaced by the shard of the parameter of the same name (what an optimizer built before ``fabric.setup`` gets).
    """
    if names is None:
        names = {id(param): name for name, param in module.named_parameters(remove_duplicate=False)}
    reshard_gathered(module)
    sharded = dict(module.named_parameters(remove_duplicate=False))
    replaced = [
        (group, i)
        for group in optimizer.param_groups
        for i, param in enumerate(group["params"])
        if id(param) in names and names[id(param)] in sharded and sharded[names[id(param)]] is not param
    ]
    if replaced and optimizer.state and not only_constructor_states(optimizer):  # Adagrad's: dropped by step 4
        raise RuntimeError(
            f"{type(optimizer).__name__} holds parameters that sharding the model replaced (it was "
            "built before the model was sharded, or from parameters a forward left gathered) and has "
            "stepped already: its states belong to tensors that are not the model's. Build it again, "
            "before any step, and load optimizer states after setup"
        )
    for group, i in replaced:
        group["params"][i] = sharded[names[id(group["params"][i])]]


def shard_optimizer_of(
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    mesh,
    config: ZeroConfig,
    *,
    device: torch.device,
    pipelined: bool = False,
    index: int = 0,
    fp32_values: Optional[dict] = None,
) -> bool:
    """Step 4, for one optimizer of ``module`` (wrapped by step 3): at stages 2-3 it must hold the sharded
    parameters (:func:`check_optimizer_params`; a pipeline's stage modules hold FSDP2 units of their own, so it is
    skipped there); then :func:`~lightning_zero.distributed.optimizer.shard_optimizer` partitions it over the shard
    group (stage 1) and/or offloads it, in place. An optimizer built from parameters a forward left gathered is
    pointed at the shards first (:func:`point_at_shards`). Returns ``False`` for an optimizer sharded before (an
    evaluation after a fit keeps the fit's optimizers); one whose sharding an earlier fit's end released is refused
    where sharding narrowed its groups (it cannot step correctly without the hooks), else kept as it is.
    ``fp32_values``: what step 3 filled under ``bf16-true`` (the optimizer's masters, :mod:`.replicas`)."""
    if (sharding := get_sharding(optimizer)) is not None:
        if sharding.released and sharding.narrowed_groups():
            raise RuntimeError(
                f"Optimizer {index} ({type(optimizer).__name__}) was sharded by an earlier fit, whose end removed the "
                "hooks it steps with: its param_groups hold this rank's partition (or CPU masters), so stepping it "
                "again would update part of the model and tell no other rank. Create the optimizer inside "
                "configure_optimizers (a new one for each fit), and restore its state from a checkpoint."
            )
        return False
    if config.stage >= 2 and not pipelined:
        point_at_shards(optimizer, module)
        check_optimizer_params(optimizer, module, index)
    shard_optimizer(
        optimizer, config, group=shard_group(mesh) if mesh is not None else None, device=device, fp32_values=fp32_values
    )
    if module is not None:
        get_sharding(optimizer).follow_module_loads(module)  # offloaded masters take loaded weights
    return True


@contextmanager
def no_gradient_sync(module: nn.Module, runner: Optional[Any] = None) -> Generator[None, None, None]:
    """Step 5, the micro-steps of gradient accumulation: inside, the backward passes of ``module`` (DDP, or FSDP2 at
    stages 2-3) reduce no gradients, and a pipeline ``runner`` (which reduces after its schedule when ``sync_grads``
    is set) skips its data-parallel and tied-weight reductions. Both are switched back on when the block exits, also
    through an exception."""
    set_gradient_sync(module, False)
    if runner is not None:
        runner.sync_grads = False
    try:
        yield
    finally:
        set_gradient_sync(module, True)
        if runner is not None:
            runner.sync_grads = True


def release(modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Step 6, at teardown: undo what the run attached to the user's objects, newest first. The optimizers' sharding
    goes first (step hooks, NVMe state swapping, the local-shard step: the optimizer's step runs through the module's
    parameter swapper); then, per module, the CPU communication buffers (refilled if the module trains again), the
    units an evaluation forward left gathered (:func:`~lightning_zero.distributed.apply_zero.reshard_gathered`) and
    NVMe parameter swapping with its swap files (``docs/offload.md``). The module itself stays sharded where it is:
    a later fit, validate or test reuses it."""
    for optimizer in optimizers:
        if (sharding := get_sharding(optimizer)) is not None:
            sharding.remove()
    for module in modules:
        if (pool := comm_buffer_pool(module)) is not None:
            pool.clear()
        reshard_gathered(module)
        detach_param_swapper(module)
