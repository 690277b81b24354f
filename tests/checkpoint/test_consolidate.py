"""Streaming consolidation: equality with the full state dict, output formats, CLI, callback, memory bound."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_zero.callbacks.consolidate import ConsolidateCheckpoint
from lightning_zero.checkpoint import consolidate_checkpoint, save_sharded_checkpoint
from lightning_zero.cli import main as cli_main
from tests.ranks import run_distributed


class TinyModule(pl.LightningModule):
    def __init__(self, hidden: int = 7) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))
        self.register_buffer("counter", torch.arange(3))

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)


def lightning_meta(module: pl.LightningModule) -> dict:
    return {
        "epoch": 1,
        "global_step": 4,
        "pytorch-lightning_version": pl.__version__,
        "hyper_parameters": dict(module.hparams),
        "hparams_name": "kwargs",
    }


def sharded_save_worker(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    module = TinyModule()
    fully_shard(module.net, mesh=init_device_mesh("cpu", (world_size,)))
    state = {"state_dict": module.state_dict()}
    assert isinstance(state["state_dict"]["net.0.weight"], DTensor)
    save_sharded_checkpoint(path, state, lightning_meta(module))
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}
    if rank == 0:
        torch.save(full, path + ".reference.pt")


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("consolidate") / "model.ckpt")
    run_distributed(sharded_save_worker, 2, path)
    return path, torch.load(path + ".reference.pt", weights_only=True)


def test_python_api_returns_the_full_state_dict(sharded_checkpoint):
    path, reference = sharded_checkpoint
    state = consolidate_checkpoint(path)
    assert list(state) == list(reference)  # the module's key order
    for key in reference:
        assert torch.equal(state[key], reference[key]), key
    half = consolidate_checkpoint(path, dtype="bf16")
    assert half["net.0.weight"].dtype == torch.bfloat16 and half["counter"].dtype == torch.int64


def test_lightning_checkpoint_output_loads_into_the_module(sharded_checkpoint, tmp_path):
    path, reference = sharded_checkpoint
    output = tmp_path / "consolidated.ckpt"
    assert cli_main(["consolidate", path, str(output)]) == 0
    plain = torch.load(output, weights_only=True)
    assert plain["epoch"] == 1 and plain["hyper_parameters"] == {"hidden": 7}
    module = TinyModule.load_from_checkpoint(output)
    for key, value in module.state_dict().items():
        assert torch.equal(value, reference[key]), key


def test_safetensors_output(sharded_checkpoint, tmp_path):
    from safetensors.torch import load_file

    path, reference = sharded_checkpoint
    output = tmp_path / "model.safetensors"
    assert cli_main(["consolidate", path, str(output), "--dtype", "fp16"]) == 0
    loaded = load_file(str(output))
    assert set(loaded) == set(reference)
    for key, value in reference.items():
        expected = value.half() if value.is_floating_point() else value
        assert torch.equal(loaded[key], expected), key


def test_cli_reports_a_missing_checkpoint(tmp_path, capsys):
    assert cli_main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "out.ckpt")]) == 1
    assert "no sharded checkpoint" in capsys.readouterr().err


class Probe(pl.Callback):
    seen: tuple = ()

    def on_train_end(self, trainer, pl_module):
        root = trainer.default_root_dir
        Probe.seen = (
            torch.load(os.path.join(root, "every.ckpt"), weights_only=True),
            torch.load(os.path.join(root, "ckpts", "last.ckpt"), weights_only=True),
        )


def test_callback_writes_after_fit_and_after_each_save(tmp_path):
    torch.manual_seed(0)
    module = TinyModule()
    final = tmp_path / "final.safetensors"
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[
            ConsolidateCheckpoint(final),
            ConsolidateCheckpoint(tmp_path / "every.ckpt", every_save=True),
            Probe(),
            pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True),
        ],
    )
    trainer.fit(module)
    from safetensors.torch import load_file

    loaded = load_file(str(final))
    for key, value in module.state_dict().items():
        assert torch.equal(loaded[key], value), key
    # Before fit ends, every.ckpt is the consolidation of the last ModelCheckpoint save (of both epochs).
    every, last = Probe.seen
    assert every["epoch"] == last["epoch"] == 1 and every["global_step"] == last["global_step"] == 4
    assert all(torch.equal(every["state_dict"][k], v) for k, v in last["state_dict"].items())
    assert torch.load(tmp_path / "every.ckpt", weights_only=True)["epoch"] == 2  # and after fit, the final state
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]  # temporary source removed
    with pytest.raises(ValueError, match="dtype"):
        ConsolidateCheckpoint(final, dtype="int8")


MEMORY_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from lightning_zero.checkpoint import consolidate_checkpoint
    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    consolidate_checkpoint(sys.argv[4], sys.argv[2] + ".warmup" + os.path.splitext(sys.argv[2])[1])  # warm-up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    base = rss("VmRSS:")
    consolidate_checkpoint(sys.argv[1], sys.argv[2], dtype=sys.argv[3])
    print(rss("VmHWM:") - base)
""")


def test_streaming_peak_memory_is_bounded_by_the_largest_tensor(tmp_path):
    largest = 2**20 * 2  # 2 MiB fp32 tensors; 32 of them: 64 MiB of model
    state = {f"layer{i}.weight": torch.full((largest // 4,), float(i)) for i in range(32)}
    path = tmp_path / "big.ckpt"
    save_sharded_checkpoint(path, {"state_dict": state}, {"epoch": 0})
    total = largest * len(state)
    save_sharded_checkpoint(tmp_path / "small.ckpt", {"state_dict": {"w": torch.ones(4)}}, {"epoch": 0})
    del state
    bound = 4 * largest + 16 * 2**20
    for output, dtype in (("out.ckpt", "fp32"), ("out.safetensors", "bf16")):
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                MEMORY_SCRIPT,
                str(path),
                str(tmp_path / output),
                dtype,
                str(tmp_path / "small.ckpt"),
            ],
            capture_output=True,
            text=True,
            check=True,
            # Fixed mmap threshold: big buffers go back to the OS when freed, so the peak measures what we hold,
            # not what glibc's adaptive threshold decided to keep cached.
            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)},
        )
        peak = int(result.stdout.strip().splitlines()[-1])
        assert peak < bound < total / 2, (output, peak / 2**20, bound / 2**20, total / 2**20)
    loaded = torch.load(tmp_path / "out.ckpt", weights_only=True, mmap=True)
    assert loaded["state_dict"]["layer23.weight"][0].item() == 23.0
