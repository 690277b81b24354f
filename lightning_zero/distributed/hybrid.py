"""Hybrid sharding (HSDP): shard within groups of ``K`` ranks, replicate across the ``N / K`` groups.

The data-parallel ranks form a 2-D ``DeviceMesh`` of shape ``(N / K, K)`` named ``("replicate", "shard")``. Rows
are consecutive global ranks, so with node-major rank numbering (every launcher's) and ``K`` = processes per node
the shard groups are the nodes: the heavy per-step collectives (all-gather, reduce-scatter) stay inside a node and
only one all-reduce of a ``1/K`` shard crosses nodes.

How each stage uses the mesh:

==========  ===========================================================================================
stage       with ``hybrid_shard_size=K``
==========  ===========================================================================================
0           refused (:class:`~lightning_zero.distributed.config.ZeroConfig`): nothing is sharded
1           DDP all-reduces gradients over every rank; the optimizer is partitioned over the ``K`` ranks
            of the shard group and each group steps redundantly, so the replicas stay identical
2-3         FSDP2 ``fully_shard(mesh=<2-D mesh>)``: FSDP2's own HSDP (reduce-scatter within the shard
            group, all-reduce of the shard across the replicate group)
==========  ===========================================================================================

Nothing here is hand-written communication: the mesh is ``init_device_mesh``'s and the engines are FSDP2 and DDP.

[Note: which group is which]
``data_parallel_group(mesh)`` is the group every gradient is averaged over (all ranks): DDP's process group and
the group module states are broadcast in. ``shard_group(mesh)`` is the group state is partitioned over: stage 1's
optimizer partition and its owner broadcasts. With a 1-D mesh both are the mesh's one group, so callers need no
branch.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

MESH_DIM_NAMES = ("replicate", "shard")


def check_hybrid_world(
    hybrid_shard_size: Optional[int],
    world_size: int,
    *,
    pipeline: bool = False,
    num_nodes: int = 1,
    num_processes: Optional[int] = None,
) -> None:
    """Refuse a ``hybrid_shard_size`` the world cannot be split by; runs before ``init_process_group``.

    Raises:
        ValueError: it does not divide ``world_size`` or exceeds it, or a pipeline is also asked for.
    """
    if hybrid_shard_size is None:
        return
    if pipeline:
        raise ValueError(
            f"hybrid_shard_size={hybrid_shard_size} with pipeline_parallel_size > 1 is not supported: "
            "the data-parallel dimension of a pipeline is a 1-D mesh. Use one of the two."
        )
    where = f"devices={num_processes} x num_nodes={num_nodes}" if num_processes is not None else "the launch"
    if hybrid_shard_size > world_size or world_size % hybrid_shard_size:
        raise ValueError(
            f"hybrid_shard_size={hybrid_shard_size} must divide the world size {world_size} ({where}) "
            "into equal shard groups; processes per node is the usual choice"
        )


def data_parallel_mesh(device_type: str, world_size: int, hybrid_shard_size: Optional[int] = None):
    """The ZeRO mesh: 1-D ``("data_parallel",)`` over every rank, or 2-D ``("replicate", "shard")`` for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if hybrid_shard_size is None:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("data_parallel",))
    check_hybrid_world(hybrid_shard_size, world_size)
    return init_device_mesh(
        device_type, (world_size // hybrid_shard_size, hybrid_shard_size), mesh_dim_names=MESH_DIM_NAMES
    )


def is_hybrid(mesh) -> bool:
    return mesh is not None and mesh.ndim == 2


def shard_group(mesh):
    """The process group model states are partitioned over (see the module note)."""
    return mesh.get_group("shard") if is_hybrid(mesh) else mesh.get_group()


def data_parallel_group(mesh):
    """The process group gradients are averaged over: every rank of ``mesh`` (see the module note)."""
    if not is_hybrid(mesh):
        return mesh.get_group()
    # The ZeRO mesh spans the whole world (a pipeline, the only other mesh, is refused with HSDP): the world group
    # is exactly its ranks, and needs no private DeviceMesh API to flatten the two dimensions.
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"a hybrid mesh must span every rank: it has {mesh.size()} of {dist.get_world_size()}")
    return dist.group.WORLD


def check_mesh_matches(mesh, hybrid_shard_size: Optional[int]) -> None:
    """The mesh given to :func:`~lightning_zero.distributed.apply_zero.apply_zero` must be the one the config asks for:
    a 1-D mesh with ``hybrid_shard_size`` set would shard over every rank, silently not hybrid."""
    if hybrid_shard_size is None:
        if is_hybrid(mesh):
            raise ValueError(
                "apply_zero got a 2-D mesh but the ZeroConfig has no hybrid_shard_size; set it to the "
                f"mesh's shard size {mesh.size(1)}"
            )
        if mesh.ndim != 1:
            raise ValueError(f"apply_zero needs a 1-D data-parallel mesh, got {mesh.ndim}-D")
        return
    if not is_hybrid(mesh) or mesh.size(1) != hybrid_shard_size:
        raise ValueError(
            f"hybrid_shard_size={hybrid_shard_size} needs a 2-D ('replicate', 'shard') mesh with a shard "
            f"dimension of {hybrid_shard_size}, got shape {tuple(mesh.shape)}; build it with "
            "lightning_zero.distributed.hybrid.data_parallel_mesh"
        )
