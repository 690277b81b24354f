"""Starting the process group, one code path for both adapters: the rendezvous store, torch's init through
Lightning's, and the clean-up registered for exit. What must be refused before it is in :mod:`.launch_checks`.

[Note: why a restarted torchrun attempt failed to form its gloo group]
Under ``torchrun`` the workers' ``env://`` rendezvous uses the *agent's* TCPStore (``TORCHELASTIC_USE_AGENT_STORE``),
and a restarted attempt gets the same ``MASTER_ADDR:MASTER_PORT`` and the same store server, with the previous
attempt's keys still in it (torch's rendezvous assumes a new store per attempt; the c10d rendezvous backend keeps
one). ``init_process_group`` writes its keys under the same names every attempt, so a rank of attempt 2 that starts
before its peers reads the *old* attempt's gloo addresses and connects to ports nobody listens on any more:
"Connection refused" after gloo's few retries, or a hang when a stale barrier count looks complete. A rank that is
slow to start (imports on a loaded machine) makes it likely. :func:`attempt_store` gives each attempt its own
namespace, ``lightning_zero/attempt_<N>/``, on a client of the same server, ``N`` agreed by the ranks (not the
agents' restart counts, which differ between nodes after a peer's death: see ``diagnostics.peers``). Plain DDP
(``init_process_group("gloo")`` with ``env://``) has the same failure; it is torch's to fix there.

[Note: the default group on CUDA serves CPU tensors too]
NCCL carries CUDA tensors only: a collective on a CPU tensor over an NCCL-only group raises "No backend type
associated with device type cpu". A ZeRO run on GPUs still communicates CPU tensors: with CPU offload the sharded
parameters and gradients live in host memory, so the gradient norm of clipping, fp16's overflow flag, LAMB's shard
sums and every ``full_tensor()`` of an offloaded shard are CPU collectives over the mesh's group. On CUDA the
default group is therefore started as ``"cpu:gloo,cuda:nccl"`` (:func:`default_backend`), offload or not: CUDA
tensors still go to NCCL, CPU tensors to gloo, and every group derived from it (``init_device_mesh``'s dimensions,
``new_group`` without a backend) gets both. Lightning names ``"nccl"`` alone
(``lightning/fabric/utilities/distributed.py``, ``_get_default_process_group_backend_for_device``), and so does torch
2.13 when given no backend (``torch/distributed/distributed_c10d.py``, ``BackendConfig.__init__``: ``"undefined"``
maps only the detected accelerator); torchtitan adds ``cpu:gloo`` when asked (``torchtitan/distributed/utils.py``,
``init_distributed(enable_cpu_backend=...)``), and torch's own ``dcp.async_save`` refuses a group without one
(``torch/distributed/checkpoint/state_dict_saver.py``). Always rather than only with offload: object collectives
and barriers then run on CPU too (torch picks the CPU backend for them, ``_get_object_coll_device``), without a CUDA
sync, and the cost is one gloo connection per peer at start-up (its figures and their command,
``benchmarks/bench_group_start.py``: ``docs/offload.md``). A backend the user names is taken as given; one that serves
no CPU tensors is refused with offload before any group starts (``launch_checks.check_backend_serves_offload``), and a
group started before the strategy (by the user's script) is checked the same way once it exists
(:func:`check_group_serves_offload`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection

from lightning_zero.diagnostics.network import checked_store, startup_check
from lightning_zero.diagnostics.peers import agree_attempt, publish_identity
from lightning_zero.distributed.group_timeout import set_package_group_timeout
from lightning_zero.distributed.process_group_exit import destroy_process_group_at_exit
from lightning_zero.torch_compat import backend_serving, default_store

CPU_AND_CUDA_BACKEND = "cpu:gloo,cuda:nccl"


def default_backend(device: torch.device) -> str:
    """The backend the package starts the default group with when none is named: ``"cpu:gloo,cuda:nccl"`` on CUDA
    (see the note), Lightning's choice for the device elsewhere (``gloo`` on CPU)."""
    if device.type == "cuda":
        return CPU_AND_CUDA_BACKEND
    return _get_default_process_group_backend_for_device(device)


def check_group_serves_offload(offloads: bool) -> None:
    """Refuse an offloading run whose default group (started before the strategy, e.g. by the user's own
    ``init_process_group("nccl")``) has no backend for CPU tensors: its first CPU collective would fail mid-step."""
    if offloads and backend_serving("cpu") is None:
        raise RuntimeError(
            f"the process group was started with backend {dist.get_backend_config()!r}, which serves no CPU tensors, "
            "but this run offloads to CPU and communicates CPU tensors (gradient norms, overflow flags, offloaded "
            f"shards); start it with init_process_group({CPU_AND_CUDA_BACKEND!r}) or leave it to the strategy"
        )


def barrier() -> None:
    """Both adapters' ``barrier``: on a group that serves CPU tensors torch runs it on that backend (no device sync);
    on NCCL alone it names this rank's device (set current at setup), which torch would otherwise guess from the
    rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if backend_serving("cpu") is None and backend_serving("cuda") == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def attempt_store(timeout: Optional[timedelta]) -> dict[str, Any]:
    """``init_process_group`` keyword arguments: under torchrun's agent store, a store namespace of this attempt
    (see the note; the attempt is agreed by all ranks, :func:`~lightning_zero.diagnostics.peers.agree_attempt`);
    ``{}`` elsewhere."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return {}
    timeout = timeout or timedelta(minutes=30)
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = agree_attempt(client, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout)
    return {"store": dist.PrefixStore(f"lightning_zero/attempt_{attempt}/", client)}


def process_group_store(
    cluster_environment: Any,
    *,
    timeout: Optional[timedelta],
    rendezvous_timeout: float,
    num_nodes: int,
    node_rank: int,
    global_rank: int,
    world_size: int,
) -> dict[str, Any]:
    """``init_process_group`` keyword arguments: torchrun's agent store for this attempt (:func:`attempt_store`),
    else on more than one node a store every rank checks in to first, so that rank 0 names the node ranks that never
    arrive within ``rendezvous_timeout`` seconds (``network.checked_store``); one node keeps torch's ``env://``."""
    kwargs = attempt_store(timeout)
    if kwargs or num_nodes == 1 or dist.is_initialized():
        return kwargs
    identity = startup_check(os.environ, num_nodes, node_rank).identity
    store = checked_store(
        cluster_environment.main_address,
        cluster_environment.main_port,
        global_rank,
        world_size,
        node_rank,
        num_nodes,
        timeout or timedelta(minutes=30),
        rendezvous_timeout,
        identity,
    )
    return {"store": store}


def start_process_group(
    cluster_environment: Any,
    backend: Optional[str],
    device: torch.device,
    *,
    timeout: Optional[timedelta],
    rendezvous_timeout: float,
    num_nodes: int,
    node_rank: int,
    global_rank: int,
    world_size: int,
    offloads: bool = False,
) -> str:
    """Initialise the default process group (``backend``, or :func:`default_backend`) through Lightning's
    ``_init_dist_connection`` with :func:`process_group_store`'s store, and register its destruction at a clean exit
    (:mod:`lightning_zero.distributed.process_group_exit`); the groups the package creates later get the same
    ``timeout`` (:mod:`lightning_zero.distributed.group_timeout`). ``offloads``: the run communicates CPU tensors,
    which a group started earlier must then serve (:func:`check_group_serves_offload`). Returns the backend used."""
    backend = backend or default_backend(device)
    store = process_group_store(
        cluster_environment,
        timeout=timeout,
        rendezvous_timeout=rendezvous_timeout,
        num_nodes=num_nodes,
        node_rank=node_rank,
        global_rank=global_rank,
        world_size=world_size,
    )
    _init_dist_connection(
        cluster_environment, backend, timeout=timeout, device_id=device if device.type == "cuda" else None, **store
    )
    check_group_serves_offload(offloads)
    destroy_process_group_at_exit()
    # where this rank runs, for a survivor to name it if it dies (diagnostics.peers)
    publish_identity(default_store(), global_rank, node_rank)
    set_package_group_timeout(timeout)  # the package's own groups (save control groups...) honour it too
    return backend
