"""The runtime's steps (:mod:`lightning_zero.distributed.runtime`) as both adapters call them, from their settings.

The Trainer's and Fabric's ``ZeroStrategy`` differ in the hooks they are called from, not in what a step does: each
function here takes the validated :class:`~lightning_zero.adapters.settings.ZeroSettings` and the few values the
framework knows (ranks, device, precision plugin, meshes) and makes the runtime call, so the two adapters are lists of
these calls, the way Lightning's Trainer ``ModelParallelStrategy`` calls the functions of Fabric's
``lightning/fabric/strategies/model_parallel.py`` (``_setup_device_mesh``, ``_load_checkpoint``, ...). None takes a
strategy.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Optional

import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import nn

from lightning_zero.adapters.launch_checks import check_before_process_group, check_external_launch, offloads
from lightning_zero.adapters.process_group import start_process_group
from lightning_zero.adapters.settings import ZeroSettings
from lightning_zero.checkpoint.io import wait_for_pending_saves
from lightning_zero.diagnostics.hang_guard import HangGuard
from lightning_zero.diagnostics.peers import LostPeer
from lightning_zero.distributed import runtime
from lightning_zero.ds_config.binding import config_reduce_bucket_size, precision_from_config


def check_launch_settings(
    settings: ZeroSettings,
    environment: Any,
    num_nodes: int,
    num_processes: int,
    device: torch.device,
    backend: Optional[str],
) -> int:
    """Step 0, on every rank before ``init_process_group``: the launch and the settings against the devices
    (:mod:`.launch_checks`), for the cluster ``environment``; returns the data-parallel size. The node rank is read
    after an external launcher's was adopted."""
    check_external_launch(environment, num_nodes, num_processes, settings.start_method)
    return check_before_process_group(
        num_nodes=num_nodes,
        num_processes=num_processes,
        node_rank=environment.node_rank(),
        device=device,
        backend=backend,
        zero_config=settings.zero_config,
        pipeline=settings.pipeline,
    )


def set_world_ranks(environment: Any, num_nodes: int, num_processes: int) -> None:
    """This process's global rank and the world size on the cluster ``environment``, and the rank ``rank_zero_only``
    (Lightning's and lightning_utilities', one object) decides by, as ``DDPStrategy._set_world_ranks`` in
    ``lightning/fabric/strategies/ddp.py`` sets them."""
    if environment is not None:
        environment.set_global_rank(environment.node_rank() * num_processes + environment.local_rank())
        environment.set_world_size(num_nodes * num_processes)
    rank_zero_only.rank = environment.global_rank() if environment is not None else 0


def start(
    settings: ZeroSettings, environment: Any, backend: Optional[str], device: torch.device, num_nodes: int
) -> tuple[str, runtime.Meshes]:
    """Steps 0-1 for this rank of the cluster ``environment``: the process group
    (:func:`~.process_group.start_process_group`), then the meshes; returns the backend used and the meshes."""
    world_size = environment.world_size()
    backend = start_process_group(
        environment,
        backend,
        device,
        timeout=settings.timeout,
        rendezvous_timeout=settings.rendezvous_timeout,
        num_nodes=num_nodes,
        node_rank=environment.node_rank(),
        global_rank=environment.global_rank(),
        world_size=world_size,
        offloads=offloads(settings.zero_config),
    )
    meshes = runtime.build_meshes(
        device.type,
        world_size,
        pipeline_parallel_size=settings.pipeline.pipeline_parallel_size,
        hybrid_shard_size=settings.zero_config.hybrid_shard_size,
    )
    return backend, meshes


def adopt_config_precision(settings: ZeroSettings, precision: str, *, print_table: bool) -> Optional[str]:
    """A ds_config's fp16/bf16 section applies when the framework was left at its default ``precision``: the flag to
    adopt (``None``: keep it); with ``print_table`` (rank 0) the config's report is printed."""
    binding = settings.ds_config
    if binding is None:
        return None
    adopted = precision_from_config(binding.precision, precision)
    if print_table:
        binding.print_table(verbose=settings.verbose)
    return adopted


def module_init_context(
    settings: ZeroSettings, local_world_size: int, empty_init: Optional[bool], init_dtype: Optional[torch.dtype]
) -> AbstractContextManager:
    """Step 2 (:func:`~lightning_zero.distributed.runtime.init_context`) for ``local_world_size`` ranks on this node,
    ``init_dtype`` being the precision's build dtype."""
    return runtime.init_context(
        settings.zero_config,
        pipelined=settings.pipeline.enabled,
        local_world_size=local_world_size,
        empty_init=empty_init,
        init_dtype=init_dtype,
    )


def wrap(
    module: nn.Module, settings: ZeroSettings, meshes: runtime.Meshes, device: torch.device, precision: Any
) -> nn.Module:
    """Step 3 outside a pipeline (:func:`~lightning_zero.distributed.runtime.wrap_module`): DDP at stages 0-1 with
    the DDP options and a ds_config's ``reduce_bucket_size``, FSDP2 at 2-3, under the ``precision`` plugin's
    policy."""
    zero_config = settings.zero_config
    return runtime.wrap_module(
        module,
        meshes.data_parallel,
        zero_config,
        device=device,
        ddp_options=settings.ddp_options,
        reduce_bucket_size=config_reduce_bucket_size(settings.ds_config),
        activation_checkpointing=settings.activation_checkpoint_config,
        **precision.wrap_module_kwargs(zero_config),
    )


def shard_optimizer_by_settings(
    optimizer: torch.optim.Optimizer,
    module: Optional[nn.Module],
    settings: ZeroSettings,
    meshes: Optional[runtime.Meshes],
    device: torch.device,
    precision: Any,
    index: int = 0,
) -> bool:
    """Step 4 (:func:`~lightning_zero.distributed.runtime.shard_optimizer_of`) over the data-parallel mesh, the fp32
    masters of ``bf16-true``'s replicas from the ``precision`` plugin."""
    return runtime.shard_optimizer_of(
        optimizer,
        module,
        meshes.data_parallel if meshes is not None else None,
        settings.zero_config,
        device=device,
        pipelined=settings.pipeline.enabled,
        index=index,
        fp32_values=precision.replica_fp32_values(),
    )


def owner_of(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> Optional[nn.Module]:
    """The first of ``modules`` holding one of ``optimizer``'s parameters, else the newest one (``None``: none)."""
    for module in modules:
        owned = {id(param) for param in module.parameters()}
        if any(id(param) in owned for group in optimizer.param_groups for param in group["params"]):
            return module
    return modules[-1] if modules else None


def data_parallel_mesh_of(meshes: Optional[runtime.Meshes]) -> Any:
    """The strategies' ``device_mesh``: the mesh ZeRO shards over, once the process group exists."""
    if meshes is None:
        raise RuntimeError("The device mesh exists only after the process group was set up")
    return meshes.data_parallel


def finish_saves(hang_guard: HangGuard, lost_peer: LostPeer) -> None:
    """Step 6's start, at teardown: an async save must land before exit (with a lost peer each rank waits for its
    own saves only, with no agreement); then the hang watchdog stops."""
    with hang_guard.teardown():
        wait_for_pending_saves(barrier=_distributed_is_initialized() and not lost_peer.lost)


def refuse_storage_options(storage_options: Any) -> None:
    if storage_options is not None:
        raise TypeError(
            "ZeroStrategy.save_checkpoint does not take storage_options: it writes with torch.distributed.checkpoint"
        )


def refuse_checkpoint_io(io: Any, plugins: str) -> None:
    """A CheckpointIO plugin set through ``plugins`` (``"Trainer(plugins=...)"``/``"Fabric(plugins=...)"``) is refused,
    never silently unused; the constructor's ``checkpoint_io`` is refused in ``resolve_settings``."""
    if io is not None:
        raise NotImplementedError(
            f"ZeroStrategy does not use a CheckpointIO plugin ({type(io).__name__}): it writes and reads checkpoints "
            f"with torch.distributed.checkpoint itself, so the plugin would never be called. Remove it from {plugins}"
        )
