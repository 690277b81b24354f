import os

import pytest
import torch

# Tests share two cores: keep every process single-threaded so ranks do not fight over them.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: tests/gpu runs only where torch.cuda.is_available()")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
