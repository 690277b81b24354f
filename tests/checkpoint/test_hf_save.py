"""``save_hf_pretrained`` and the ``HuggingFaceExport`` callback: every rank writes its part through DCP's
``HuggingFaceStorageWriter``, and ``from_pretrained`` reads the directory back equal to the trained weights (tiny
Llama with tied embeddings, built from a config), at stages 0 to 3 with and without offload, on two gloo ranks."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_zero import HuggingFaceExport, ZeroStrategy, save_hf_pretrained
from tests.checkpoint.test_hf_export import HFModule
from tests.lightning_models import full_state
from tests.ranks import run_distributed
from tests.strategies.test_strategy import make_trainer

# (stage, offload, precision); at stage 1 under bf16-true each rank writes the fp32 masters it owns, and no other
CASES = [
    (0, None, "32-true"),
    (1, "cpu", "32-true"),
    (1, None, "bf16-true"),
    (2, None, "32-true"),
    (3, "cpu", "32-true"),
]


def _from_pretrained(directory: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def _fit_worker(rank: int, world_size: int, root: str) -> None:
    for stage, offload, precision in CASES:
        out = os.path.join(root, f"stage{stage}-{offload}-{precision}")
        torch.manual_seed(0)
        module = HFModule("llama", tied=True)
        before = module.model.lm_head.weight.detach().clone()
        strategy = ZeroStrategy(stage=stage, offload=offload)
        trainer = make_trainer(strategy, world_size, max_steps=1, precision=precision)
        trainer.callbacks.append(HuggingFaceExport(out))
        trainer.fit(module)
        trained = full_state(module)  # collective
        if rank == 0:
            assert not torch.equal(trained["model.lm_head.weight"], before), "the step must have changed the weights"
            loaded = _from_pretrained(out)
            assert loaded.keys() == {key[len("model.") :] for key in trained if key.startswith("model.")}
            for key, value in loaded.items():
                expected = trained["model." + key]  # under bf16-true the bf16 replica of the fp32 master written
                assert value.dtype == torch.float32 and torch.equal(value.to(expected.dtype), expected), (stage, key)
            assert sorted(os.listdir(out)) == [
                "config.json",
                "model-00001-of-00001.safetensors",
                "model.safetensors.index.json",
            ]
            index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
            assert "lm_head.weight" not in index["weight_map"], "a tied weight is written once"
        torch.distributed.barrier()


def test_the_callback_writes_what_from_pretrained_loads_at_every_stage(tmp_path):
    run_distributed(_fit_worker, 2, str(tmp_path))


def _dtype_and_files_worker(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    module = HFModule("llama", tied=False)
    trainer = make_trainer(ZeroStrategy(stage=3), world_size, max_steps=1)
    trainer.fit(module)
    save_hf_pretrained(module, root, dtype="bf16", max_shard_size="2KB")
    trained = full_state(module)
    if rank == 0:
        names = sorted(os.listdir(root))
        files = [name for name in names if name.endswith(".safetensors")]
        assert len(files) > 2 and "sharded" not in names, names
        assert json.load(open(os.path.join(root, "config.json")))["dtype"] == "bfloat16"
        for key, value in _from_pretrained(root).items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, trained["model." + key].bfloat16()), key


def test_dtype_and_max_shard_size(tmp_path):
    run_distributed(_dtype_and_files_worker, 2, str(tmp_path))


class StateOfTheInnerModule(torch.nn.Module):
    """Names its submodules under ``inner.`` but returns the inner module's state dict, as Fabric's wrapper does."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def state_dict(self, *args, **kwargs):
        return self.inner.state_dict(*args, **kwargs)


def test_a_module_without_a_transformers_model_or_its_weights_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds none"):
        save_hf_pretrained(torch.nn.Linear(2, 2), tmp_path)
    with pytest.raises(ValueError, match="under Fabric: model.module"):
        save_hf_pretrained(StateOfTheInnerModule(HFModule("llama", tied=True)), tmp_path)
    assert not os.listdir(tmp_path)
    with pytest.raises(ValueError, match="max_shard_size"):
        HuggingFaceExport(tmp_path, max_shard_size="lots")


def _stale_output_worker(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    module = HFModule("llama", tied=True)
    make_trainer(ZeroStrategy(stage=3), world_size, max_steps=1).fit(module)
    refused, stale = os.path.join(root, "refused"), os.path.join(root, "stale")
    if rank == 0:
        os.makedirs(refused)
        open(os.path.join(refused, "model.safetensors"), "w").close()  # from_pretrained would read it first
        os.makedirs(os.path.join(stale, "sharded"))  # an interrupted save with more ranks left a piece
        with open(os.path.join(stale, "sharded", "shard-00003-model-00001-of-00001.safetensors"), "wb") as file:
            file.write(b"not safetensors")
    torch.distributed.barrier()
    with pytest.raises(ValueError, match="from_pretrained could load"):
        save_hf_pretrained(module, refused)
    foreign = os.path.join(root, "foreign")
    if rank == 0:
        os.makedirs(os.path.join(foreign, "sharded"))  # a folder of the user's own: never merged, never removed
        open(os.path.join(foreign, "sharded", "notes.txt"), "w").close()
    torch.distributed.barrier()
    with pytest.raises(ValueError, match="not pieces of a save_hf_pretrained"):
        save_hf_pretrained(module, foreign)
    assert os.listdir(os.path.join(foreign, "sharded")) == ["notes.txt"]
    # a directory only rank 0 sees as stale (per-node disks): every rank raises, none is left waiting
    local = os.path.join(root, f"local{rank}")
    os.makedirs(local)
    if rank == 0:
        open(os.path.join(local, "model.safetensors"), "w").close()
    with pytest.raises(ValueError, match="from_pretrained could load"):
        save_hf_pretrained(module, local)
    save_hf_pretrained(module, stale)
    trained = full_state(module)
    if rank == 0:
        assert not os.path.exists(os.path.join(stale, "sharded"))
        for key, value in _from_pretrained(stale).items():
            assert torch.equal(value, trained["model." + key]), key


def test_an_output_from_pretrained_would_misread_is_refused_on_every_rank_and_stale_pieces_are_cleared(tmp_path):
    run_distributed(_stale_output_worker, 2, str(tmp_path))
