"""Run by tests/fabric/test_fabric_async_save.py: a Fabric script that ends with an async save still pending
(its commit delayed, then failing when argv[2] == "fail") and never calls teardown."""

import sys
import time

import torch
from lightning.fabric import Fabric

from lightning_zero.checkpoint import io as checkpoint_io
from lightning_zero.fabric import ZeroStrategy

path, mode = sys.argv[1], sys.argv[2]
write_info = checkpoint_io._write_info


def slow_commit(*args, **kwargs):
    time.sleep(1.0)
    if mode == "fail":
        raise OSError("disk full")
    return write_info(*args, **kwargs)


checkpoint_io._write_info = slow_commit
fabric = Fabric(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=1, async_save=True))
fabric.launch()
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.Adam(model.parameters())
model, optimizer = fabric.setup(model, optimizer)
fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
print("saved", checkpoint_io.pending_save_paths(), flush=True)
