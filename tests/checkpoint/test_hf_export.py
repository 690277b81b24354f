"""Hugging Face export (``export_hf`` / ``consolidate --hf``) and ``--strip-prefix``: tiny Llama (tied and untied)
and GPT-2 built from configs (no download), trained under ZeroStrategy stage 3, load with ``from_pretrained``."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from safetensors import safe_open

from lightning_zero import ZeroStrategy, export_hf
from lightning_zero.checkpoint import consolidate_checkpoint, save_sharded_checkpoint
from lightning_zero.cli import main as cli_main
from tests.lightning_models import full_state
from tests.ranks import run_distributed
from tests.strategies.test_strategy import make_trainer

VOCAB = 64


def tiny_model(kind: str, tied: bool):
    import transformers

    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            tie_word_embeddings=tied,
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


class HFModule(LightningModule):
    def __init__(self, kind: str = "llama", tied: bool = True):
        super().__init__()
        self.model = tiny_model(kind, tied)
        self.register_buffer("seen", torch.zeros(1))  # outside the HF model: left out of the export, and said so

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        ids = torch.randint(0, VOCAB, (8, 6), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(ids, batch_size=2)


CASES = [("llama", True), ("llama", False), ("gpt2", True)]


def _export_worker(rank, world_size, root):
    from transformers import AutoModelForCausalLM

    for kind, tied in CASES:
        torch.manual_seed(0)
        module = HFModule(kind, tied)
        before = module.model.lm_head.weight.detach().clone()
        trainer = make_trainer(ZeroStrategy(stage=3), world_size, max_steps=1)
        trainer.fit(module)
        path, out = os.path.join(root, f"{kind}{tied}.ckpt"), os.path.join(root, f"{kind}{tied}-hf")
        trainer.save_checkpoint(path)
        trained = full_state(module)  # collective
        if rank == 0:
            assert not torch.equal(trained["model.lm_head.weight"], before), "the step must have changed the weights"
            if kind == "gpt2":
                assert cli_main(["consolidate", path, "--hf", out]) == 0
            else:
                assert export_hf(path, out) == ["seen"]
            with safe_open(os.path.join(out, "model.safetensors"), "pt") as file:
                stored = set(file.keys())
            head = "lm_head.weight"
            assert (head in stored) == (not tied), "tied weights are stored once"
            loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
            assert type(loaded).__name__ == type(tiny_model(kind, tied)).__name__
            assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
            reference = HFModule(kind, tied)
            reference.load_state_dict(trained)
            ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                expected = reference.model.eval()(input_ids=ids).logits
                got = loaded.eval()(input_ids=ids).logits
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "float32"
        dist.barrier()


def test_export_hf_loads_with_from_pretrained(tmp_path):
    pytest.importorskip("transformers")
    run_distributed(_export_worker, 2, str(tmp_path))


@pytest.fixture
def plain_checkpoint(tmp_path):
    """A checkpoint that records no transformers model: the prefix must be given."""
    state = {"model.a.weight": torch.randn(3, 2), "model.b": torch.arange(4), "head.w": torch.ones(2)}
    path = tmp_path / "plain.ckpt"
    save_sharded_checkpoint(path, {"state_dict": state}, {"epoch": 0})
    return path, state


def test_strip_prefix_for_plain_safetensors_and_hf_without_record(plain_checkpoint, tmp_path, capsys):
    from safetensors.torch import load_file

    path, state = plain_checkpoint
    out = tmp_path / "inner.safetensors"
    assert cli_main(["consolidate", str(path), str(out), "--strip-prefix", "model", "--dtype", "bf16"]) == 0
    loaded = load_file(str(out))
    assert set(loaded) == {"a.weight", "b"}
    assert torch.equal(loaded["a.weight"], state["model.a.weight"].bfloat16())
    assert torch.equal(loaded["b"], state["model.b"])
    assert "head.w" in capsys.readouterr().out  # the key left out is named
    with pytest.warns(UserWarning, match="left out"):
        assert set(consolidate_checkpoint(path, strip_prefix="model.")) == {"a.weight", "b"}

    with pytest.raises(ValueError, match=r"records no transformers.PreTrainedModel.*'model\.'"):
        export_hf(path, tmp_path / "hf")  # the error lists the candidate prefixes
    with pytest.warns(UserWarning, match="no config.json"):
        assert export_hf(path, tmp_path / "hf", strip_prefix="model") == ["head.w"]
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"]
    with pytest.raises(ValueError, match="no key starts with 'nope.'"):
        export_hf(path, tmp_path / "hf2", strip_prefix="nope")
    save_sharded_checkpoint(path, {"state_dict": state}, {"frozen_parameters_excluded": ["model.c.weight"]})
    with pytest.raises(ValueError, match="left out 1 frozen weight"):
        export_hf(path, tmp_path / "hf3", strip_prefix="model")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["out.ckpt", "--hf", "D"], "exactly one of OUTPUT and --hf"),
        ([], "exactly one of OUTPUT and --hf"),
        (["--hf", "D", "--with-optimizer"], "cannot go with --hf"),
        (["out.ckpt", "--strip-prefix", "model"], "--strip-prefix applies to a .safetensors OUTPUT or --hf"),
        (["out.safetensors", "--with-optimizer"], "--with-optimizer writes a Lightning checkpoint file"),
        (["out.ckpt", "--with-optimizer", "--dtype", "bf16"], "keeps the trained dtypes"),
        (["out.safetensors", "--max-shard-size", "1GB"], "--max-shard-size applies to --hf"),
    ],
)
def test_cli_refuses_contradicting_options(plain_checkpoint, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["consolidate", str(plain_checkpoint[0]), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bf16_checkpoint_keeps_its_dtype_and_dtype_option_converts(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from lightning_zero.checkpoint.hf_export import describe_hf_models

    torch.manual_seed(0)
    wrapper = torch.nn.Module()
    wrapper.model = tiny_model("llama", True).to(torch.bfloat16)
    path = tmp_path / "bf16.ckpt"
    save_sharded_checkpoint(path, {"state_dict": wrapper.state_dict()}, {"epoch": 0}, info=describe_hf_models(wrapper))
    export_hf(path, tmp_path / "kept")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "kept")
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.model.embed_tokens.weight, wrapper.model.model.embed_tokens.weight)
    export_hf(path, tmp_path / "fp32", dtype="fp32")
    assert json.load(open(tmp_path / "fp32" / "config.json"))["dtype"] == "float32"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "fp32").dtype == torch.float32

    # sharded output, as save_pretrained writes it for large models
    assert cli_main(["consolidate", str(path), "--hf", str(tmp_path / "sharded"), "--max-shard-size", "4KB"]) == 0
    files = sorted(os.listdir(tmp_path / "sharded"))
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files
    assert len([name for name in files if name.startswith("model-0")]) > 3
    sharded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for key, value in wrapper.model.state_dict().items():
        assert torch.equal(sharded.state_dict()[key], value), key
    with pytest.raises(ValueError, match="already holds .*model.safetensors.index.json"):
        export_hf(path, tmp_path / "sharded")  # the single-file layout next to a stale index: refused
    # the same sharded export again replaces its own layout
    assert cli_main(["consolidate", str(path), "--hf", str(tmp_path / "sharded"), "--max-shard-size", "4KB"]) == 0
    assert sorted(os.listdir(tmp_path / "sharded")) == files
    with pytest.raises(ValueError, match="max_shard_size"):
        export_hf(path, tmp_path / "x", max_shard_size="lots")


def test_describing_a_model_without_hugging_face_parts_imports_no_modeling_code(monkeypatch):
    # Lightning's imports bring in the top-level transformers, whose PreTrainedModel is a lazy attribute that imports
    # the modeling code: a save of a plain model must not touch it (every rank did, at its first save).
    import sys
    import types

    from lightning_zero.checkpoint.hf_export import describe_hf_models

    touched = []

    class LazyTransformers(types.ModuleType):
        def __getattr__(self, name):
            touched.append(name)
            raise AttributeError(name)

    monkeypatch.setitem(sys.modules, "transformers", LazyTransformers("transformers"))
    monkeypatch.delitem(sys.modules, "transformers.modeling_utils", raising=False)
    assert describe_hf_models(torch.nn.Linear(2, 2)) == {}
    assert touched == []
