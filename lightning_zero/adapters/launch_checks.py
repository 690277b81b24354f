"""Checks on ``ZeroStrategy``'s inputs that must fail before any process group starts.

Two moments are early enough: the strategy's constructor (everything knowable without the Trainer: the timeout,
the backend's name and whether this torch build has it, the ds_config's optimizer and scheduler) and the top of
``setup_environment`` on every rank, before ``init_process_group`` (the Trainer is attached by then: its precision,
clipping, accumulation and logging flags, the devices, the launcher's world size). Checks that need the training
DataLoader stay at ``setup``: Lightning builds the DataLoader only after the LightningModule's and DataModule's
``setup`` hooks ran, which come after the process group.

[Note: external launchers and the world size]
Under ``torchrun``, ``srun``, ``fabric run``, ``deepspeed`` or ``mpirun`` the launcher starts the processes, and
Lightning trusts ``Trainer(devices=..., num_nodes=...)`` for the ``DistributedSampler``'s replica count. If the
two disagree, every rank reads ``1/(devices x num_nodes)`` of the data while fewer ranks exist: part of the data is
never seen, silently. :func:`check_launcher_world_size` compares the two numbers (the launcher's from its
environment, or from an already initialised process group) and refuses a mismatch, naming both and the launcher.
It runs at ``Trainer(...)`` (``_configure_launcher``) and again before the process group, for the ``popen`` start
method only: with ``spawn``/``fork`` the strategy starts its own processes whatever the environment says.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_zero.diagnostics.hang_guard import positive_seconds
from lightning_zero.diagnostics.network import startup_check
from lightning_zero.distributed.hybrid import check_hybrid_world
from lightning_zero.pipeline.zero_pipeline import check_pipeline_world

log = logging.getLogger(__name__)

# Which device type each built-in backend needs (``None``: any device).
_BACKEND_DEVICE = {"gloo": None, "mpi": None, "ucc": None, "nccl": "cuda", "xccl": "xpu"}
_BACKEND_AVAILABLE = {
    "gloo": dist.is_gloo_available,
    "nccl": dist.is_nccl_available,
    "mpi": dist.is_mpi_available,
    "ucc": dist.is_ucc_available,
    "xccl": getattr(dist, "is_xccl_available", lambda: False),
}


def check_timeout(timeout: Any) -> Optional[timedelta]:
    """The process-group timeout as a ``timedelta``: a positive ``timedelta`` or a positive number of seconds.

    ``None`` keeps torch's default. Anything else is refused here, in the constructor, rather than by
    ``init_process_group`` after the launch.
    """
    if timeout is None:
        return None
    seconds = positive_seconds(timeout, "timeout")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def _backend_names(backend: str) -> list[tuple[Optional[str], str]]:
    """``"gloo"`` -> ``[(None, "gloo")]``; ``"cpu:gloo,cuda:nccl"`` -> ``[("cpu", "gloo"), ("cuda", "nccl")]``."""
    pairs = []
    for part in backend.split(","):
        device, _, name = part.strip().rpartition(":")
        pairs.append((device or None, name.strip().lower()))
    return pairs


def check_backend_name(backend: Any) -> None:
    """A known process-group backend that this torch build has (``None``: chosen from the device at setup)."""
    if backend is None:
        return
    if not isinstance(backend, str) or not backend.strip():
        raise TypeError(f"process_group_backend must be a backend name such as 'gloo' or 'nccl', got {backend!r}")
    registered = [name for name in dist.Backend.backend_list if name not in ("undefined", "fake")]
    for _, name in _backend_names(backend):
        if name not in registered:
            raise ValueError(f"process_group_backend={backend!r}: unknown backend {name!r}; known: {registered}")
        available = _BACKEND_AVAILABLE.get(name)
        if available is not None and not available():
            raise ValueError(
                f"process_group_backend={backend!r}: this torch build has no {name!r} backend "
                f"(torch.distributed.is_{name}_available() is False)"
                + ("; on CPU use 'gloo'" if name == "nccl" else "")
            )


def offloads(zero_config: Any) -> bool:
    """The run keeps states in host memory or on NVMe (through host memory), so it communicates CPU tensors."""
    return zero_config.offload_optimizer != "none" or zero_config.offload_params != "none"


def check_backend_serves_offload(backend: Optional[str], zero_config: Any) -> None:
    """A named backend that serves no CPU tensors (``"nccl"``, ``"cuda:nccl"``) cannot carry an offloading run's CPU
    collectives (see ``adapters/process_group.py``, the note on the default group): refuse it before it starts."""
    if backend is None or not offloads(zero_config):
        return
    serves_cpu = any(
        device == "cpu" if device is not None else "cpu" in dist.Backend.backend_capability.get(name, ())
        for device, name in _backend_names(backend)
    )
    if not serves_cpu:
        raise ValueError(
            f"process_group_backend={backend!r} serves no CPU tensors, but offload_optimizer="
            f"{zero_config.offload_optimizer!r}, offload_params={zero_config.offload_params!r} "
            "communicates CPU tensors (gradient norms, overflow flags, offloaded shards): use "
            "'cpu:gloo,cuda:nccl' or leave process_group_backend unset (the strategy then starts that)"
        )


def check_backend_for_device(backend: Optional[str], device: torch.device) -> None:
    """``nccl`` needs CUDA, ``xccl`` an XPU: refuse the pair before ``init_process_group`` tries it."""
    if backend is None:
        return
    for device_type, name in _backend_names(backend):
        needed = _BACKEND_DEVICE.get(name)
        if device_type is not None and device_type != device.type:
            continue  # a per-device backend for another device type ("cpu:gloo,cuda:nccl" on CPU uses gloo)
        if needed is not None and needed != device.type:
            raise ValueError(
                f"process_group_backend={backend!r} needs a {needed.upper()} device, but this run "
                f"computes on {device.type!r}; use 'gloo' or leave process_group_backend unset"
            )


def _launcher(environment: Any) -> tuple[str, Optional[int], Optional[int]]:
    """``(launcher name, world size it started, processes per node it started)``; unknown numbers are ``None``."""
    kind = type(environment).__name__
    names = {
        "TorchElasticEnvironment": "torchrun (TorchElastic)",
        "SLURMEnvironment": "SLURM (srun)",
        "MPIEnvironment": "MPI (mpirun)",
        "LSFEnvironment": "LSF (jsrun)",
        "KubeflowEnvironment": "Kubeflow",
        "XLAEnvironment": "XLA",
    }
    if kind == "LightningEnvironment":
        # `fabric run`, the `deepspeed` launcher or a hand-made launch: they export LOCAL_RANK and WORLD_SIZE, while
        # LightningEnvironment.world_size() only echoes what Lightning itself sets.
        world = _int_env("WORLD_SIZE")
        local = _int_env("LOCAL_WORLD_SIZE") or _int_env("LOCAL_SIZE")  # LOCAL_SIZE: the deepspeed launcher's
        return (
            (
                "an external launcher (LOCAL_RANK and WORLD_SIZE are set: fabric run, deepspeed, a manual launch, or "
                "an earlier Trainer in this process)"
            ),
            world,
            local,
        )
    try:
        world = int(environment.world_size())
    except Exception:  # an environment without a world size of its own: nothing to compare
        world = None
    if kind == "SLURMEnvironment":
        # "2" on a uniform job; the "2(x3)" and "2,1" forms of SLURM_TASKS_PER_NODE are not one count and are skipped
        local = _int_env("SLURM_NTASKS_PER_NODE") or _int_env("SLURM_TASKS_PER_NODE")
    else:
        local = _int_env("LOCAL_WORLD_SIZE")
    return names.get(kind, kind), world, local


def _int_env(name: str) -> Optional[int]:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def check_launcher_world_size(environment: Any, num_nodes: int, num_processes: int) -> None:
    """Refuse ``devices x num_nodes`` that differs from the world the external launcher started (see the note).

    Only applies when the environment creates the processes (``creates_processes_externally``); when Lightning
    launches them itself the two agree by construction.

    Raises:
        ValueError: the numbers differ; the message names both, the launcher, and the fix.
    """
    if environment is None or not getattr(environment, "creates_processes_externally", False):
        return
    launcher, world, local = _launcher(environment)
    if dist.is_available() and dist.is_initialized():
        launcher, world = "the process group that already exists", dist.get_world_size()
    expected = num_nodes * num_processes
    if world is not None and world != expected:
        raise ValueError(
            f"The Trainer is set up for devices={num_processes} x num_nodes={num_nodes} = {expected} processes, but "
            f"{launcher} started a world of {world} processes. The DistributedSampler would split the data "
            f"{expected} ways over {world} ranks and silently skip part of it. Make Trainer(devices=..., "
            f"num_nodes=...) match the launch (e.g. devices={world // num_nodes if world % num_nodes == 0 else world}"
            f", num_nodes={num_nodes if world % num_nodes == 0 else 1}), or launch {expected} processes."
        )
    if local is not None and local != num_processes:
        raise ValueError(
            f"The Trainer is set up for devices={num_processes} processes per node, but {launcher} started "
            f"{local} processes on this node: set Trainer(devices={local}) or launch {num_processes} per node."
        )


def adopt_deepspeed_launcher_node_rank() -> None:
    """Read the ``deepspeed`` launcher's node rank: it exports ``CROSS_RANK``/``CROSS_SIZE`` (node rank, node count)
    but not ``NODE_RANK``, which Lightning's ``LightningEnvironment`` reads, defaulting to 0. Without this, every
    node of a ``deepspeed --no_local_rank`` launch would compute its global ranks as node 0's. ``NODE_RANK`` (or
    torchrun's ``GROUP_RANK``) wins when set; one that contradicts ``CROSS_RANK`` is refused rather than guessed."""
    cross = os.environ.get("CROSS_RANK", "").strip()
    if not cross:
        return
    if not cross.isdigit():
        raise ValueError(f"CROSS_RANK={cross!r} (the deepspeed launcher's node rank) is not a node index")
    for name in ("NODE_RANK", "GROUP_RANK"):
        value = os.environ.get(name, "").strip()
        if value:
            if value != cross:
                raise ValueError(
                    f"{name}={value} and CROSS_RANK={cross} (the deepspeed launcher's node rank) "
                    "disagree: unset the stale one"
                )
            return
    os.environ["NODE_RANK"] = cross  # what LightningEnvironment.node_rank() and Lightning's launchers read


def check_deepspeed_launcher_nodes(num_nodes: int) -> None:
    """``Trainer(num_nodes=...)`` must match the deepspeed launcher's ``CROSS_SIZE`` (its node count)."""
    nodes = _int_env("CROSS_SIZE")
    if nodes is not None and nodes != num_nodes:
        raise ValueError(
            f"The deepspeed launcher started {nodes} node(s) (CROSS_SIZE={nodes}) but the Trainer has "
            f"num_nodes={num_nodes}: set Trainer(num_nodes={nodes})"
        )


def check_external_launch(cluster_environment: Any, num_nodes: int, num_processes: int, start_method: str) -> None:
    """Under an external launcher (``start_method="popen"``; spawn/fork start their own processes, whatever the
    environment says): adopt the deepspeed launcher's node rank (``CROSS_RANK``) before anything reads the node rank
    (so call it before reading ``node_rank`` for :func:`check_before_process_group`), and check the world and node
    count the launcher started against the Trainer's/Fabric's."""
    if start_method == "popen":
        adopt_deepspeed_launcher_node_rank()
        check_launcher_world_size(cluster_environment, num_nodes, num_processes)
        check_deepspeed_launcher_nodes(num_nodes)


def check_before_process_group(
    *,
    num_nodes: int,
    num_processes: int,
    node_rank: int,
    device: torch.device,
    backend: Optional[str],
    zero_config: Any,
    pipeline: Any,
) -> int:
    """The checks both adapters run on each rank before ``init_process_group``, after :func:`check_external_launch`
    (one code path, so a multi-node environment means the same under Fabric and the Trainer); returns the
    data-parallel size.

    The ``backend`` and ``zero_config.pin_memory`` against the ``device``, the ``pipeline`` (``PipelineSettings``)
    and hybrid sizes against the world size, and the network of this node (:mod:`lightning_zero.diagnostics.network`).
    """
    world_size = num_nodes * num_processes
    check_backend_for_device(backend, device)
    if zero_config.pin_memory and device.type != "cuda":
        raise ValueError(
            f"pin_memory=True pins the offloaded CPU copies for fast copies to CUDA, but this run "
            f"computes on {device.type!r}: use pin_memory=None (pin only on CUDA) or False"
        )
    data_parallel = world_size
    if pipeline.enabled:
        check_pipeline_world(pipeline, num_processes, num_nodes)
        data_parallel = world_size // pipeline.pipeline_parallel_size
    check_hybrid_world(
        zero_config.hybrid_shard_size,
        world_size,
        pipeline=pipeline.enabled,
        num_nodes=num_nodes,
        num_processes=num_processes,
    )
    check_network_before_process_group(num_nodes, node_rank)
    return data_parallel


def check_network_before_process_group(num_nodes: int, node_rank: int) -> None:
    """This node's network configuration (interfaces, ``*_SOCKET_IFNAME``, ``MASTER_ADDR``), before the process group:
    a ``NetworkError`` naming node rank, host, address and interface instead of a hang; warnings are logged.
    ``LIGHTNING_ZERO_SKIP_NETWORK_CHECK=1`` turns the errors into warnings (a network the check misjudges)."""
    report = startup_check(os.environ, num_nodes, node_rank)
    for warning in report.warnings:
        log.warning(f"lightning-zero network check on {report.who()}: {warning}")
    report.raise_errors()  # LIGHTNING_ZERO_SKIP_NETWORK_CHECK=1 turns them into a logged warning
