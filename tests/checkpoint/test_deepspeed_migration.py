"""DeepSpeed ZeRO checkpoints written by the real deepspeed package (CPU, gloo) consolidate through our reader, which
never imports deepspeed, to exactly the weights DeepSpeed itself reports."""

import os

import pytest
import torch

from tests.deepspeed_cpu import deepspeed_on_cpu
from tests.ranks import run_distributed

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[bench]')")

STAGES = (1, 2, 3)


def _model():
    torch.manual_seed(0)
    # 7 and 5 rows do not divide by 2: DeepSpeed pads partitions, which the reader must strip
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))


def _write_worker(rank, world_size, root, stage):
    ds = deepspeed_on_cpu()

    model = _model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "zero_force_ds_cpu_optimizer": False,
    }
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        loss = engine(torch.randn(2, 6, generator=generator)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(root, tag="step3", client_state={"global_step": 3})
    # DeepSpeed's own view of the trained weights (gathered at stage 3)
    if stage == 3:
        with ds.zero.GatheredParameters(list(engine.module.parameters())):
            weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    else:
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if rank == 0:
        torch.save(weights, os.path.join(root, "engine_weights.pt"))


@pytest.fixture(scope="module")
def deepspeed_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed")
    paths = {}
    for stage in STAGES:
        path = str(root / f"stage{stage}")
        run_distributed(_write_worker, 2, path, stage)
        paths[stage] = path
    return paths


@pytest.mark.parametrize("stage", STAGES)
def test_consolidated_weights_equal_deepspeeds_own(deepspeed_checkpoints, stage, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from lightning_zero.checkpoint import consolidate_checkpoint, is_deepspeed_checkpoint
    from lightning_zero.cli import main as cli_main

    path = deepspeed_checkpoints[stage]
    assert is_deepspeed_checkpoint(path)
    reference = get_fp32_state_dict_from_zero_checkpoint(path)  # DeepSpeed's zero_to_fp32
    engine = torch.load(os.path.join(path, "engine_weights.pt"), weights_only=True)

    ours = consolidate_checkpoint(path)  # Python API, the DIR (tag from `latest`)
    assert set(ours) >= set(reference)
    for key, value in reference.items():
        assert torch.equal(ours[key], value.float()), f"stage {stage}: {key} differs from zero_to_fp32"
        torch.testing.assert_close(ours[key], engine[key].float(), rtol=0, atol=0)
    assert torch.equal(consolidate_checkpoint(os.path.join(path, "step3"))["0.weight"], ours["0.weight"])

    out = str(tmp_path / "model.safetensors")
    assert cli_main(["consolidate", path, out]) == 0
    from safetensors.torch import load_file

    written = load_file(out)
    assert all(torch.equal(written[k], reference[k].float()) for k in reference)
    ckpt = str(tmp_path / "model.ckpt")
    assert cli_main(["consolidate", path, ckpt, "--dtype", "bf16"]) == 0
    loaded = torch.load(ckpt, weights_only=True)
    assert loaded["state_dict"]["2.weight"].dtype == torch.bfloat16
    plain = _model()
    plain.load_state_dict({k: v.float() for k, v in loaded["state_dict"].items()})
    torch.testing.assert_close(plain[2].weight, reference["2.weight"].float(), atol=1e-2, rtol=1e-2)


def test_reader_does_not_import_deepspeed(deepspeed_checkpoints):
    import subprocess
    import sys

    code = (
        "import sys; from lightning_zero.checkpoint import consolidate_checkpoint; "
        f"consolidate_checkpoint({deepspeed_checkpoints[3]!r}); "
        "assert 'deepspeed' not in sys.modules, 'the reader imported deepspeed'"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_consolidate_takes_zero_to_fp32_spellings(deepspeed_checkpoints, tmp_path, capsys):
    """`-t/--tag`, `--safe_serialization` and `--max_shard_size` as zero_to_fp32's `main` spells them."""
    from safetensors.torch import load_file

    from lightning_zero.cli import main as cli_main

    path = deepspeed_checkpoints[1]
    expected = torch.load(os.path.join(path, "engine_weights.pt"), weights_only=True)
    for tag in ("step3", "latest"):
        out = str(tmp_path / f"{tag}.safetensors")
        assert cli_main(["consolidate", path, out, "-t", tag, "--safe_serialization"]) == 0
        assert torch.equal(load_file(out)["0.weight"], expected["0.weight"].float())
    assert cli_main(["consolidate", path, str(tmp_path / "x.safetensors"), "--tag", "step9"]) == 1
    assert "the tags there are ['step3']" in capsys.readouterr().err
    hf = tmp_path / "hf"
    assert cli_main(["consolidate", path, "--hf", str(hf), "--strip_prefix", "0", "--max_shard_size", "1MB"]) == 0
    assert load_file(str(hf / "model.safetensors"))["weight"].shape == (7, 6)


def test_verify_names_a_deepspeed_directory_and_what_to_do_with_it(deepspeed_checkpoints, capsys):
    from lightning_zero.cli import main as cli_main

    assert cli_main(["verify", deepspeed_checkpoints[2]]) == 1
    err = capsys.readouterr().err
    assert "is a DeepSpeed checkpoint directory (tag step3)" in err and "not a complete" not in err
    assert "lightning-zero consolidate" in err and "ckpt_path" in err
