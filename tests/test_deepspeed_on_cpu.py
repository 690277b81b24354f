"""The tests' DeepSpeed starts on CPU build no C++ op (``[Note: a DeepSpeed start in the tests builds no op]`` in
``tests/deepspeed_cpu.py``): a 2-rank ``deepspeed.initialize`` and a step write nothing in the extensions directory,
and a build DeepSpeed would still start fails by the op's name instead of compiling."""

import os

import pytest
import torch

from tests.deepspeed_cpu import deepspeed_on_cpu
from tests.ranks import run_distributed

pytest.importorskip("deepspeed", reason="deepspeed is not installed")


def _start_worker(rank, world_size, extensions):
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    deepspeed = deepspeed_on_cpu()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    before = model.weight.detach().clone()
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    assert not torch.equal(model.weight.detach(), before), "the step changed nothing"
    assert deepspeed.comm.comm.cdb.shm_comm_op is None


def test_a_two_rank_deepspeed_start_and_step_build_no_op(tmp_path):
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    run_distributed(_start_worker, 2, str(extensions))
    assert sorted(os.listdir(extensions)) == []


def test_an_op_build_deepspeed_would_start_fails_by_name():
    deepspeed_on_cpu()
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    with pytest.raises(RuntimeError, match="would JIT-build DeepSpeed's cpu_adam op"):
        CPUAdamBuilder().load()
