"""Environment audit for distributed runs: versions, sizes, NCCL/gloo variables, GPU topology, InfiniBand.

``audit_environment()`` only reads (environment, /sys, ``nvidia-smi``); it never initialises CUDA contexts or
process groups, so it can run before ``init_process_group`` and inside a CLI. The warnings encode settings known
to hurt throughput (the measurements behind them: ``docs/callbacks.md``, "NCCLDiagnostics"); ``NCCL_DEBUG=INFO``
left on floods logs and slows start-up.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import torch

# Variable prefixes worth showing in full: they change how collectives are carried.
AUDITED_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_DISTRIBUTED_", "TORCHELASTIC_", "MALLOC_")
AUDITED_NAMES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "OMP_NUM_THREADS",
    "LD_PRELOAD",
)
# glibc's variables that fix its heap thresholds (any one of them also stops its dynamic adjustment)
GLIBC_HEAP_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
# the fix the warning names: blocks under 32 MiB from the heap, its top returned only past 128 MiB free
STEADY_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}

_TRUE = {"1", "true", "yes", "on"}


def _enabled(value: Optional[str]) -> bool:
    return value is not None and value.strip().lower() in _TRUE


def nccl_warnings(environ: Mapping[str, str], has_infiniband: Optional[bool] = None) -> list[str]:
    """Warnings for NCCL/torch-NCCL settings that cost throughput or hide errors (pure: reads only ``environ``)."""
    found = []
    if _enabled(environ.get("NCCL_P2P_DISABLE")):
        found.append(
            "NCCL_P2P_DISABLE=1 disables NVLink/PCIe peer-to-peer between GPUs of a node; intra-node traffic goes "
            "through host memory (measured ~50% slower end-to-end on 8xA800). Unset it unless P2P is broken."
        )
    if environ.get("NCCL_P2P_LEVEL", "").strip().upper() in {"LOC", "0"}:
        found.append("NCCL_P2P_LEVEL=LOC never uses peer-to-peer, the same cost as NCCL_P2P_DISABLE=1.")
    if _enabled(environ.get("NCCL_SHM_DISABLE")):
        found.append(
            "NCCL_SHM_DISABLE=1 disables the shared-memory transport between processes of a node; where P2P is "
            "unavailable traffic falls back to the network stack."
        )
    if _enabled(environ.get("NCCL_IB_DISABLE")):
        detail = " although InfiniBand devices are present" if has_infiniband else ""
        found.append(
            f"NCCL_IB_DISABLE=1 disables InfiniBand/RoCE{detail}; inter-node traffic uses TCP sockets, usually far "
            "slower."
        )
    if environ.get("NCCL_NET_GDR_LEVEL", "").strip().upper() in {"LOC", "0"}:
        found.append("NCCL_NET_GDR_LEVEL=LOC disables GPUDirect RDMA: network traffic is staged through host memory.")
    debug = environ.get("NCCL_DEBUG", "").strip().upper()
    if debug in {"INFO", "TRACE"}:
        found.append(
            f"NCCL_DEBUG={debug} is a debugging setting: it logs every communicator and slows start-up; unset it "
            "(or use WARN) in production runs."
        )
    for old in ("NCCL_BLOCKING_WAIT", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_DESYNC_DEBUG"):
        if old in environ and f"TORCH_{old}" not in environ:
            found.append(f"{old} is the pre-2.2 name; torch reads TORCH_{old} now.")
    if _enabled(environ.get("TORCH_NCCL_BLOCKING_WAIT")):
        found.append(
            "TORCH_NCCL_BLOCKING_WAIT=1 makes the host block on every collective, defeating compute/communication "
            "overlap; use it only to debug."
        )
    return found


def cpu_heap_warnings(environ: Mapping[str, str], computes_on_cpu: bool, libc: str) -> list[str]:
    """A warning for a CPU run under glibc's self-adjusting heap (pure: reads only its arguments).

    Where a rank's step leaves its activations free at the top of glibc's heap, glibc hands that top back to the OS
    after backward and the next forward faults it in again, every step; the other ranks wait for that rank in the
    gradient all-reduce, a cost that fixing the thresholds removes (its share of the benchmark GPT's step:
    docs/stages.md, "The mapping and its memory"). No warning where the run computes on a GPU, the C library is not
    glibc, a thresholds variable is set, or ``LD_PRELOAD`` names anything (most often another allocator; the audit
    does not tell which library it is): each is a choice made, except a trim threshold set alone, which is worse than
    glibc's default (its own warning)."""
    if not computes_on_cpu or libc != "glibc" or environ.get("LD_PRELOAD", "").strip():
        return []
    if "MALLOC_TRIM_THRESHOLD_" in environ and not {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"} & set(environ):
        # a fixed trim threshold also stops the mmap threshold's adjustment, leaving it at glibc's 128 KiB
        return [
            "MALLOC_TRIM_THRESHOLD_ without MALLOC_MMAP_THRESHOLD_ fixes glibc's mmap threshold at its 128 KiB "
            "default: every block from 128 KiB that the heap's top cannot serve is mapped anew and faulted in "
            "(8,400-9,100 faults a step and 55 ms steps against 40-44 ms on a small GPT at stage 0, docs/stages.md); "
            f"set MALLOC_MMAP_THRESHOLD_={STEADY_HEAP['MALLOC_MMAP_THRESHOLD_']} with it."
        ]
    if any(name in environ for name in GLIBC_HEAP_VARIABLES):
        return []
    return [
        "training on CPU under glibc's default heap: a rank whose heap top is returned to the OS after each "
        "backward faults it in again every forward (12-13% of a small GPT's stage-0 step, docs/stages.md); set "
        f"{' '.join(f'{k}={v}' for k, v in STEADY_HEAP.items())} in the ranks' environment."
    ]


def infiniband_devices(root: Path = Path("/sys/class/infiniband")) -> list[dict]:
    """InfiniBand/RoCE devices and their ports (state, rate, link layer) as listed by the kernel."""
    devices = []
    if not root.is_dir():
        return devices
    for device in sorted(root.iterdir()):
        ports = []
        for port in sorted((device / "ports").glob("*")):
            info = {"port": port.name}
            for key in ("state", "rate", "link_layer"):
                path = port / key
                info[key] = path.read_text().strip() if path.is_file() else None
            ports.append(info)
        devices.append({"device": device.name, "ports": ports})
    return devices


def gpu_topology() -> dict:
    """GPU names, the CUDA peer-access matrix and ``nvidia-smi topo -m`` output (empty where CUDA is absent)."""
    topology: dict = {"gpus": [], "peer_access": [], "nvidia_smi_topo": None}
    if not torch.cuda.is_available():
        return topology
    count = torch.cuda.device_count()
    topology["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
    topology["peer_access"] = [
        [i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(count)] for i in range(count)
    ]
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
            topology["nvidia_smi_topo"] = out.stdout.strip() or out.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            topology["nvidia_smi_topo"] = f"nvidia-smi topo -m failed: {err}"
    return topology


@dataclass
class EnvAudit:
    """What ``audit_environment`` found; ``warnings`` are the actionable part."""

    versions: dict
    hostname: str
    backend: Optional[str]
    world_size: Optional[int]
    local_world_size: Optional[int]
    variables: dict
    topology: dict
    infiniband: list
    warnings: list = field(default_factory=list)
    network: dict = field(default_factory=dict)  # host identity: node rank, address, interface (diagnostics.network)

    def to_dict(self) -> dict:
        return asdict(self)


def _versions() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:  # metadata, not an import: importing Lightning costs seconds in the CLI
        versions["lightning"] = importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        versions["lightning"] = None
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError):
            nccl = None
    versions["nccl"] = nccl
    versions["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return versions


def audit_environment(
    environ: Optional[Mapping[str, str]] = None,
    backend: Optional[str] = None,
    world_size: Optional[int] = None,
    local_world_size: Optional[int] = None,
    infiniband_root: Path = Path("/sys/class/infiniband"),
) -> EnvAudit:
    """Collect versions, sizes, relevant variables, topology and IB devices, and warn on known-bad settings."""
    environ = dict(os.environ if environ is None else environ)
    if world_size is None and "WORLD_SIZE" in environ:
        world_size = int(environ["WORLD_SIZE"])
    if local_world_size is None and "LOCAL_WORLD_SIZE" in environ:
        local_world_size = int(environ["LOCAL_WORLD_SIZE"])
    variables = {k: v for k, v in sorted(environ.items()) if k.startswith(AUDITED_PREFIXES) or k in AUDITED_NAMES}
    ib = infiniband_devices(infiniband_root)
    audit = EnvAudit(
        versions=_versions(),
        hostname=socket.gethostname(),
        backend=backend,
        world_size=world_size,
        local_world_size=local_world_size,
        variables=variables,
        topology=gpu_topology(),
        infiniband=ib,
    )
    audit.warnings = nccl_warnings(environ, has_infiniband=bool(ib))
    audit.warnings += cpu_heap_warnings(
        environ, computes_on_cpu=backend != "nccl" and not torch.cuda.is_available(), libc=platform.libc_ver()[0]
    )
    if backend == "gloo" and torch.cuda.is_available():
        audit.warnings.append("backend is gloo although CUDA is available: GPU collectives would use nccl.")
    return audit


def audit_text(audit: EnvAudit) -> str:
    """Plain-text rendering (for logs and the CLI)."""
    net = audit.network
    where = (
        f" (node rank {net.get('node_rank')}, address {net.get('address')} on {net.get('interface')}, hostname "
        f"resolves to {net.get('resolves_to')})"
        if net
        else ""
    )
    lines = [
        f"host {audit.hostname}{where}: backend={audit.backend} world_size={audit.world_size} "
        f"local_world_size={audit.local_world_size}"
    ]
    lines.append("versions: " + ", ".join(f"{k}={v}" for k, v in audit.versions.items()))
    if audit.variables:
        lines.append("variables: " + ", ".join(f"{k}={v}" for k, v in audit.variables.items()))
    else:
        lines.append("variables: no NCCL_/TORCH_NCCL_/GLOO_ variables set")
    if audit.topology["gpus"]:
        lines.append("gpus: " + ", ".join(audit.topology["gpus"]))
        matrix = audit.topology["peer_access"]
        lines.append("peer access: " + " ".join("".join("1" if x else "0" for x in row) for row in matrix))
        if audit.topology["nvidia_smi_topo"]:
            lines.append("nvidia-smi topo -m:\n" + audit.topology["nvidia_smi_topo"])
    if audit.infiniband:
        for dev in audit.infiniband:
            ports = "; ".join(f"port {p['port']} {p['state']} {p['rate']} {p['link_layer']}" for p in dev["ports"])
            lines.append(f"infiniband {dev['device']}: {ports}")
    else:
        lines.append("infiniband: none found")
    for warning in audit.warnings:
        lines.append(f"WARNING: {warning}")
    return "\n".join(lines)
