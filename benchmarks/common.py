"""What the benchmarks share besides their models (``_bench_models``) and rank runners (``_bench_workers``): the
repository's paths, a free port for a process group, and the dated file a run's results go to."""

from __future__ import annotations

import datetime
import json
import os
import socket

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")


def free_port() -> int:
    """A TCP port on localhost that is free now, for a process group's rendezvous (``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dated_results(name: str, directory: str | None, data: dict, text: str) -> str:
    """Write a run's record: ``text`` (its tables, markdown) to ``<directory>/<name>-<YYYY-MM-DD>.md`` and ``data``
    (its raw figures) to the ``.json`` beside it; ``directory`` defaults to ``benchmarks/results`` and is created.
    A second run on the same day gets ``-2``, ``-3``, ... rather than overwriting the first. Returns the .md path."""
    directory = directory or RESULTS_DIR
    os.makedirs(directory, exist_ok=True)
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    stem, n = os.path.join(directory, f"{name}-{day}"), 1
    while os.path.exists(stem + ".md") or os.path.exists(stem + ".json"):
        n += 1
        stem = os.path.join(directory, f"{name}-{day}-{n}")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text.rstrip("\n") + "\n")
    return stem + ".md"


def deepspeed_init_distributed(device: str = "cpu"):
    """``deepspeed.init_distributed`` for a benchmark rank (gloo on CPU, NCCL on CUDA), and the ``deepspeed`` module.

    On CPU DeepSpeed's accelerator JIT-builds its shared-memory collectives (``deepspeed/comm/torch.py``,
    ``build_shm_op``: minutes of compiling on a small machine, and a build killed half-way leaves a lock every later
    build waits on). They serve only its inference all-reduce, never ZeRO's collectives, so every DeepSpeed side of
    the benchmarks starts without them; its numbers do not change."""
    import importlib

    import deepspeed

    if device != "cuda":
        # The submodule itself: the attribute ``deepspeed.comm.torch`` is the torch package (``deepspeed.comm``
        # re-exports ``comm.py``'s names, its ``import torch`` included), so patching it would patch torch.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    return deepspeed
