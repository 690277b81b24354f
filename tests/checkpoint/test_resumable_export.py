"""``consolidate --with-optimizer`` / ``ConsolidateCheckpoint(with_optimizer=True)``: a run saved by ZeroStrategy
resumes under Lightning's own DDPStrategy from the single file, exactly as it resumes under ZeroStrategy."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ConsolidateCheckpoint, ZeroStrategy
from lightning_zero.checkpoint import consolidate_checkpoint, save_sharded_checkpoint
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.cli import main as cli_main
from tests.lightning_models import RegressionModule, full_state
from tests.ranks import run_distributed
from tests.strategies.test_strategy import make_trainer

FIRST, MORE = 9, 3  # the save is in the middle of an epoch, after more than one


def _resume_worker(rank, world_size, root):
    for stage, offload in ((1, None), (2, None), (2, "cpu"), (3, None), (3, "cpu")):
        sharded = os.path.join(root, f"s{stage}{offload}.ckpt")
        single = os.path.join(root, f"s{stage}{offload}-single.ckpt")
        torch.manual_seed(0)
        module = RegressionModule()
        # stage 3: the callback writes the resumable file after fit; the others: the CLI, from the trainer's save
        by_callback = stage == 3 and offload is None
        callbacks = [ConsolidateCheckpoint(single, with_optimizer=True)] if by_callback else []
        trainer = make_trainer(
            ZeroStrategy(stage=stage, offload=offload), world_size, max_steps=FIRST, callbacks=callbacks
        )
        trainer.fit(module)
        trainer.save_checkpoint(sharded)
        if not by_callback and rank == 0:
            assert cli_main(["consolidate", sharded, single, "--with-optimizer"]) == 0
        dist.barrier()

        torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
        zero_module = RegressionModule()
        zero = make_trainer(ZeroStrategy(stage=stage, offload=offload), world_size, max_steps=FIRST + MORE)
        zero.fit(zero_module, ckpt_path=sharded)
        expected = full_state(zero_module)

        torch.manual_seed(2)
        ddp_module = RegressionModule()
        ddp = make_trainer(DDPStrategy(), world_size, max_steps=FIRST + MORE)
        ddp.fit(ddp_module, ckpt_path=single)
        got = ddp_module.state_dict()
        for key, value in expected.items():
            torch.testing.assert_close(
                got[key], value, atol=1e-6, rtol=1e-5, msg=lambda m: f"stage {stage} {offload} {key}: {m}"
            )
        assert ddp.global_step == zero.global_step == FIRST + MORE
        assert ddp.current_epoch == zero.current_epoch > 0
        assert [g["lr"] for g in ddp.optimizers[0].param_groups] == pytest.approx(
            [g["lr"] for g in zero.optimizers[0].param_groups]
        )
        if rank == 0:
            plain = torch.load(single, weights_only=True)
            assert plain["global_step"] == FIRST and plain["hyper_parameters"] == {
                "batch_size": 4,
                "build_in_configure_model": False,
            }
            assert "optimizer_param_groups" not in plain and len(plain["lr_schedulers"]) == 1
            # Lightning's layout: integer ids counting through the two param groups in order
            groups = plain["optimizer_states"][0]["param_groups"]
            assert [len(g["params"]) for g in groups] == [4, 4] and groups[1]["params"] == [4, 5, 6, 7]
        dist.barrier()


def test_resume_under_ddp_from_consolidated_checkpoint(tmp_path):
    run_distributed(_resume_worker, 2, str(tmp_path))


def test_with_optimizer_refuses_what_it_cannot_honour(tmp_path):
    path = tmp_path / "weights.ckpt"
    save_sharded_checkpoint(path, {"state_dict": {"w": torch.ones(2)}}, {"epoch": 0})
    with pytest.raises(CheckpointError, match="does not record its optimizers' param groups"):
        consolidate_checkpoint(path, tmp_path / "out.ckpt", with_optimizer=True)
    save_sharded_checkpoint(path, {"state_dict": {"w": torch.ones(2)}}, {"optimizer_param_groups": []})
    with pytest.raises(CheckpointError, match="holds no optimizer states"):
        consolidate_checkpoint(path, tmp_path / "out.ckpt", with_optimizer=True)
    groups = [[{"lr": 0.1, "params": ["w"]}]]
    save_sharded_checkpoint(
        path,
        {"state_dict": {"w": torch.ones(2)}},
        {"optimizer_param_groups": groups, "ZeroPrecision": {"loss_scaler": {"cur_scale": 8.0}}},
    )
    with pytest.warns(UserWarning, match="loss-scaler state .* scale 8.0"):
        consolidate_checkpoint(path, tmp_path / "fp16.ckpt", with_optimizer=True)
    assert torch.load(tmp_path / "fp16.ckpt", weights_only=True)["optimizer_states"] == [
        {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    ]
    with pytest.raises(ValueError, match="keeps the trained dtypes"):
        consolidate_checkpoint(path, tmp_path / "out.ckpt", dtype="bf16", with_optimizer=True)
    with pytest.raises(ValueError, match=r"\.safetensors"):
        consolidate_checkpoint(path, tmp_path / "out.safetensors", with_optimizer=True)
    # One rule set (checkpoint/consolidate.options_problem) for the function, the callback and the CLI
    for output, dtype in ((tmp_path / "out.ckpt", "bf16"), (tmp_path / "out.safetensors", None)):
        with pytest.raises(ValueError) as direct:
            consolidate_checkpoint(path, output, dtype=dtype, with_optimizer=True)
        with pytest.raises(ValueError) as callback:
            ConsolidateCheckpoint(output, dtype=dtype, with_optimizer=True)
        assert str(callback.value) == f"ConsolidateCheckpoint: {direct.value}"
    assert not os.path.exists(tmp_path / "out.ckpt") and not os.path.exists(tmp_path / "out.safetensors")


def test_with_optimizer_streams_with_peak_memory_bounded_by_the_largest_tensor(tmp_path):
    import subprocess
    import sys

    from tests.checkpoint.test_consolidate import MEMORY_SCRIPT

    largest, count = 2**20 * 2, 12  # 12 weights of 2 MiB and two Adam states each: 72 MiB
    names = [f"layer{i}.weight" for i in range(count)]
    weights = {name: torch.full((largest // 4,), float(i)) for i, name in enumerate(names)}
    states = {
        name: {"step": torch.tensor(3.0), "exp_avg": weights[name] + 1, "exp_avg_sq": weights[name] + 2}
        for name in names
    }
    groups = [[{"lr": 0.1, "params": names[:5]}, {"lr": 0.2, "params": names[5:]}]]
    path = tmp_path / "big.ckpt"
    save_sharded_checkpoint(
        path,
        {"state_dict": weights, "optimizer_states": {"0": {"state": states}}},
        {"epoch": 0, "optimizer_param_groups": groups},
    )
    save_sharded_checkpoint(
        tmp_path / "small.ckpt",
        {"state_dict": {"w": torch.ones(4)}},
        {"optimizer_param_groups": [[{"lr": 0.1, "params": ["w"]}]]},
    )
    del weights, states
    script = MEMORY_SCRIPT.replace("dtype=sys.argv[3])", "with_optimizer=True)").replace(
        '".warmup" + os.path.splitext(sys.argv[2])[1])', '".warmup.ckpt", with_optimizer=True)'
    )
    assert script.count("with_optimizer=True") == 2
    result = subprocess.run(
        [sys.executable, "-c", script, str(path), str(tmp_path / "out.ckpt"), "-", str(tmp_path / "small.ckpt")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)},
    )
    peak = int(result.stdout.strip().splitlines()[-1])
    assert peak < 4 * largest + 16 * 2**20 < 3 * largest * count / 2, peak / 2**20
    loaded = torch.load(tmp_path / "out.ckpt", weights_only=True, mmap=True)
    optimizer = loaded["optimizer_states"][0]
    assert [g["params"] for g in optimizer["param_groups"]] == [list(range(5)), list(range(5, count))]
    assert optimizer["param_groups"][1]["lr"] == 0.2 and optimizer["state"][7]["exp_avg_sq"][0].item() == 9.0
    assert optimizer["state"][7]["step"].item() == 3.0
