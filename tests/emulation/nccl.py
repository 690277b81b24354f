"""NCCL's one restriction, emulated on CPU.

NCCL carries CUDA tensors only: a collective on a CPU tensor over a group whose only backend is NCCL raises
``RuntimeError: No backend type associated with device type cpu``. Gloo on CPU hides that, so a test suite that
only ever starts ``"gloo"`` cannot see the class of crash. torch binds backends to device types, and
``init_process_group("cuda:gloo")`` on CPU gives a group that refuses CPU tensors exactly as an NCCL group does.

:func:`emulated_nccl` rewrites the backend torch is asked for so that every NCCL part becomes gloo *bound to CUDA
tensors only* (``"nccl"`` -> ``"cuda:gloo"``, ``"cpu:gloo,cuda:nccl"`` -> ``"cpu:gloo,cuda:gloo"``), and drops the
CUDA ``device_id``. :func:`started_as_on_cuda` makes both strategies start their group as they would on a GPU (the
root device they pass to ``start_process_group`` is ``cuda:0``) under that emulation, while the run itself computes
on CPU. Whatever the package then communicates reaches torch with the device-to-backend binding a GPU run has: a
CPU tensor only passes where the group has a CPU backend.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional
from unittest import mock

import torch
import torch.distributed as dist


def emulated_backend(backend: Optional[str]) -> str:
    """The backend string with every NCCL part replaced by gloo bound to the device types NCCL serves."""
    if backend is None:  # torch's default on a CUDA machine
        backend = "cpu:gloo,cuda:nccl"
    pairs = []
    for part in backend.split(","):
        device, _, name = part.strip().rpartition(":")
        devices = [device] if device else dist.Backend.backend_capability[name.lower()]
        pairs += [f"{d}:{'gloo' if name.lower() == 'nccl' else name}" for d in devices]
    return ",".join(pairs)


@contextlib.contextmanager
def emulated_nccl() -> Iterator[None]:
    """``dist.init_process_group`` starts the emulation of what it is asked for (see the module docstring)."""
    real = dist.init_process_group

    def init(backend=None, *args, device_id=None, **kwargs):
        return real(emulated_backend(backend), *args, **kwargs)

    with mock.patch.object(dist, "init_process_group", init):
        yield


def _as_on_cuda(start):
    def start_as_on_cuda(cluster_environment, backend, device, **kwargs):
        with emulated_nccl():
            return start(cluster_environment, backend, torch.device("cuda", 0), **kwargs)

    return start_as_on_cuda


@contextlib.contextmanager
def started_as_on_cuda() -> Iterator[None]:
    """Both adapters start the default group as on a GPU (device ``cuda:0``), with NCCL emulated (they start it
    through :func:`lightning_zero.adapters.runtime_steps.start`)."""
    from lightning_zero.adapters import runtime_steps

    with mock.patch.object(runtime_steps, "start_process_group", _as_on_cuda(runtime_steps.start_process_group)):
        yield
