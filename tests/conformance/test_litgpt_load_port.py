"""LitGPT's fine-tuning load under ZeroStrategy: full state dicts of every tensor-like kind into the set-up model.

``litgpt.utils.load_checkpoint(fabric, model, path)`` (Lightning-AI/litgpt, litgpt/utils.py) loads with
``fabric.load_raw`` under Lightning's ``FSDPStrategy``, with its own DTensor conversion under
``ModelParallelStrategy``, and for any other strategy (ours included) with ``state_dict = lazy_load(path)``
(Lightning's ``_lazy_load``, whose values are ``_NotYetLoadedTensor``), ``state_dict.get("model", state_dict)`` and
``model.load_state_dict(state_dict, strict=strict)``; ``litgpt/finetune/full.py`` calls it after ``fabric.setup``
and ``fabric.setup_optimizers``. The real ``GPT`` and ``load_checkpoint`` are used when ``litgpt`` is installed;
the same call sequence on a small model runs without it, with the other full sources a script may hand
``load_state_dict``: a memory-mapped ``torch.load`` and a dict of safetensors slices. Each run is compared with
Lightning's ``DDPStrategy`` running the same script on the same ranks.
"""

import os

import pytest
import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.load import _lazy_load
from safetensors import safe_open
from torch import nn

from lightning_zero.fabric import ZeroStrategy
from tests.conformance.models import RegressionModule, full_state, max_abs_diff, trainer, zero
from tests.distributed.test_zero_parity import TinyNet
from tests.fabric.test_fabric_parity import full_weights, make_fabric
from tests.fabric.test_fabric_raw_loads import _finetune, _unwrapped, _write_base
from tests.ranks import run_distributed

WORLD, VOCAB, SEQ = 2, 32, 8
QUICK = [(0, None), (2, None), (3, None)]
SWEEP = [(0, None), (1, None), (1, "cpu"), (2, None), (2, "cpu"), (3, None), (3, "cpu")]


def _gathered(model):
    return full_weights(_unwrapped(model))


# ---------------------------------------------------------------------------------------------- LitGPT itself
SIZES = dict(n_layer=2, n_head=2, n_embd=16, block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB)


def _litgpt_config():
    from litgpt import Config

    return Config(**SIZES)


def _litgpt_finetune(strategy, path, rank):
    """litgpt/finetune/full.py's order: init_module, setup, setup_optimizers, load_checkpoint; then 2 steps."""
    from litgpt import GPT
    from litgpt.utils import load_checkpoint

    fabric = make_fabric(strategy)
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=fabric.world_size > 1):
        model = GPT(_litgpt_config())
    model = fabric.setup(model)
    # foreach chosen: ZeroStrategy would otherwise pick torch's fused CPU kernel (lightning_zero/ops/cpu_fused.py),
    # whose rounding Adam amplifies on the key biases (gradients that are zero but for rounding)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True))
    load_checkpoint(fabric, model, path)
    loaded = _gathered(model)
    _train_lm(fabric, model, optimizer, rank)
    return loaded, _gathered(model)


def _lora_finetune(strategy, path, rank):
    """litgpt/finetune/lora.py's order: init_module, mark_only_lora_as_trainable, setup_module, setup_optimizers,
    load_checkpoint(strict=False), into the LoRA GPT, whose attention renames the base checkpoint's ``qkv.weight``
    to ``qkv.linear.weight`` in its own ``_load_from_state_dict``. Built with its own init (not ``empty_init``):
    the LoRA matrices are not in the checkpoint, and under DDP an empty init would leave them uninitialised."""
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
    from litgpt.utils import load_checkpoint

    fabric = make_fabric(strategy)
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=False):
        model = GPT(
            Config(
                **SIZES,
                lora_r=4,
                lora_alpha=8,
                lora_query=True,
                lora_value=True,
                lora_projection=True,
                lora_mlp=True,
            )
        )
    mark_only_lora_as_trainable(model)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True))
    load_checkpoint(fabric, model, path, strict=False)
    loaded = _gathered(model)
    _train_lm(fabric, model, optimizer, rank)
    return loaded, _gathered(model)


def _train_lm(fabric, model, optimizer, rank):
    ids = torch.randint(0, VOCAB, (2 * WORLD, 2, SEQ), generator=torch.Generator().manual_seed(3))
    for step in range(2):
        batch = ids[step * WORLD + rank]
        logits = model(batch)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def _renamed(weights: dict) -> dict:
    """The base checkpoint's entries under the LoRA model's names, as LitGPT's LoRA modules rename them."""
    renames = (
        (".qkv.", ".qkv.linear."),
        (".proj.", ".proj.linear."),
        (".fc.", ".fc.linear."),
        ("lm_head.", "lm_head.linear."),
    )
    out = {}
    for key, value in weights.items():
        for old, new in renames:
            key = key.replace(old, new) if old in key and new not in key else key
        out[key] = value
    return out


def _litgpt_worker(rank, world_size, path, configs):
    base = torch.load(path, weights_only=True)
    failures = []
    for label, finetune, names in (("GPT", _litgpt_finetune, dict), ("LoRA GPT", _lora_finetune, _renamed)):
        expected_loaded, expected = finetune(DDPStrategy(), path, rank)
        loaded_base = {k: v for k, v in expected_loaded.items() if "lora_" not in k}
        assert max_abs_diff(loaded_base, names(base)) == 0, label
        for stage, offload in configs:
            loaded, got = finetune(ZeroStrategy(stage=stage, offload=offload), path, rank)
            if max_abs_diff(loaded, expected_loaded) != 0:
                failures.append(f"{label} stage {stage} offload {offload}: loaded weights are not DDP's")
            worst = max_abs_diff(got, expected)
            if not worst <= 1e-5:
                failures.append(f"{label} stage {stage} offload {offload}: max abs diff {worst:.2e} after 2 steps")
    assert not failures, "\n".join(failures)


def _write_litgpt_checkpoint(directory):
    from litgpt import GPT

    torch.manual_seed(5)  # "pretrained" weights, another init than the fine-tune's own
    path = os.path.join(directory, "lit_model.pth")
    torch.save(GPT(_litgpt_config()).state_dict(), path)
    return path


def test_litgpt_load_checkpoint_into_set_up_gpt_and_lora_gpt_equals_ddp(tmp_path):
    pytest.importorskip("litgpt")
    run_distributed(_litgpt_worker, WORLD, _write_litgpt_checkpoint(tmp_path), QUICK)


@pytest.mark.slow
def test_litgpt_load_checkpoint_into_set_up_gpt_and_lora_gpt_equals_ddp_at_every_stage(tmp_path):
    pytest.importorskip("litgpt")
    run_distributed(_litgpt_worker, WORLD, _write_litgpt_checkpoint(tmp_path), SWEEP)


# ---------------------------------------------------------------------------------------------- the same calls
def _slices(path):
    """A dict of safetensors slices, the file kept open for the load (the form the strategy reads slices of)."""
    handle = safe_open(path, framework="pt")
    return {name: handle.get_slice(name) for name in handle.keys()}


def _loaders(paths):
    return {
        "torch.load": lambda fabric, model: model.load_state_dict(torch.load(paths["pth"], weights_only=True)),
        # litgpt.utils.load_checkpoint's branch for strategies other than FSDP and ModelParallel
        "lazy_load": lambda fabric, model: model.load_state_dict(_lazy_load(paths["pth"])),
        "mmap": lambda fabric, model: model.load_state_dict(torch.load(paths["pth"], mmap=True, weights_only=True)),
        "safetensors slices": lambda fabric, model: model.load_state_dict(_slices(paths["safetensors"])),
    }


def _sources_worker(rank, world_size, paths, configs):
    loaders = _loaders(paths)
    expected = _finetune(make_fabric(DDPStrategy()), rank, world_size, loaders["torch.load"])
    failures = []
    for stage, offload in configs:
        for name in ("lazy_load", "mmap", "safetensors slices"):
            got = _finetune(make_fabric(ZeroStrategy(stage=stage, offload=offload)), rank, world_size, loaders[name])
            worst = max_abs_diff(got, expected)
            if not worst <= 1e-5:
                failures.append(f"stage {stage} offload {offload} {name}: max abs diff {worst:.2e} from DDP")
    assert not failures, "\n".join(failures)


def test_lazy_mmap_and_safetensors_sources_load_like_ddp(tmp_path):
    run_distributed(_sources_worker, WORLD, _write_base(tmp_path), QUICK)


@pytest.mark.slow
def test_lazy_mmap_and_safetensors_sources_load_like_ddp_at_every_stage(tmp_path):
    run_distributed(_sources_worker, WORLD, _write_base(tmp_path), SWEEP)


# ---------------------------------------------------------------------------------------------- what is read
class RecordingSlice:
    """A safetensors slice that records the parts read from it."""

    def __init__(self, piece, reads, name):
        self.piece, self.reads, self.name = piece, reads, name

    def get_shape(self):
        return self.piece.get_shape()

    def __getitem__(self, index):
        part = self.piece[index]
        self.reads.append((self.name, part.numel()))
        return part


def _reads_worker(rank, world_size, paths):
    for stage in (0, 2, 3):
        fabric = make_fabric(ZeroStrategy(stage=stage))
        model = fabric.setup_module(TinyNet())
        reads = []
        model.load_state_dict({k: RecordingSlice(v, reads, k) for k, v in _slices(paths["safetensors"]).items()})
        sizes = {k: v.numel() for k, v in _gathered(model).items()}
        assert sorted(name for name, _ in reads) == sorted(sizes), stage  # each entry read once
        read = sum(numel for _, numel in reads)
        if stage >= 2:  # every parameter is sharded over the 2 ranks: this rank reads half of the file's elements
            assert read == sum(-(-n // WORLD) if rank == 0 else n // WORLD for n in sizes.values()), (stage, read)
        else:
            assert read == sum(sizes.values()), stage
        assert max_abs_diff(_gathered(model), torch.load(paths["pth"], weights_only=True)) == 0, stage


def test_each_rank_reads_only_its_slices_of_a_safetensors_file(tmp_path):
    run_distributed(_reads_worker, WORLD, _write_base(tmp_path))


# ---------------------------------------------------------------------------------------------- torch's reports
def _reports_worker(rank, world_size, paths):
    plain = TinyNet()
    pth = torch.load(paths["pth"], weights_only=True)
    partial = {k: v for k, v in pth.items() if k != "out.bias"}
    expected = plain.load_state_dict({**partial, "head.weight": torch.zeros(3)}, strict=False)
    for stage in (0, 2, 3):
        model = make_fabric(ZeroStrategy(stage=stage)).setup_module(TinyNet())
        for name, source in (("lazy_load", _lazy_load(paths["pth"])), ("slices", _slices(paths["safetensors"]))):
            entries = {k: v for k, v in source.items() if k != "out.bias"}
            got = model.load_state_dict({**entries, "head.weight": torch.zeros(3)}, strict=False)
            assert got == expected, (stage, name)
            wrong = dict(source)
            wrong["out.weight"] = source["inp.weight"]  # another shape
            with pytest.raises(RuntimeError, match="size mismatch for out.weight"):
                model.load_state_dict(wrong)


def test_missing_unexpected_and_mis_shaped_entries_are_reported_as_by_torch(tmp_path):
    run_distributed(_reports_worker, WORLD, _write_base(tmp_path))


# ---------------------------------------------------------------------------------------------- renamed entries
class Projection(nn.Module):
    """LitGPT's ``LoRALinear`` layout: the base weight one level down, under ``linear``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x)


class RenamingBlock(nn.Module):
    """Renames a base checkpoint's entries in its own ``_load_from_state_dict`` before its children load, as
    LitGPT's LoRA ``CausalSelfAttention`` maps ``qkv.weight`` to ``qkv.linear.weight`` (litgpt/lora.py)."""

    def __init__(self):
        super().__init__()
        self.proj = Projection()

    def forward(self, x):
        return x + torch.tanh(self.proj(x))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("weight", "bias"):
            if prefix + f"proj.{name}" in state_dict:
                state_dict[prefix + f"proj.linear.{name}"] = state_dict.pop(prefix + f"proj.{name}")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class RenamingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(RenamingBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _renaming_worker(rank, world_size, directory):
    from safetensors.torch import save_file

    torch.manual_seed(5)
    base = {
        f"blocks.{i}.proj.{name}": torch.randn(8, 8) if name == "weight" else torch.randn(8)
        for i in range(2)
        for name in ("weight", "bias")
    }
    expected = {k.replace("proj.", "proj.linear."): v for k, v in base.items()}
    pth, safetensors = os.path.join(directory, "base.pth"), os.path.join(directory, "base.safetensors")
    if rank == 0:
        torch.save(base, pth)
        save_file(base, safetensors)
    torch.distributed.barrier()
    sources = {
        "tensors": lambda: dict(base),
        "lazy_load": lambda: _lazy_load(pth),
        "slices": lambda: _slices(safetensors),
    }
    for stage in (0, 2, 3):
        model = make_fabric(ZeroStrategy(stage=stage)).setup_module(RenamingNet())
        for name, source in sources.items():
            with torch.no_grad():
                model(torch.randn(2, 8))  # at stage 2 the units stay gathered after a forward
            model.load_state_dict(source())
            assert max_abs_diff(_gathered(model), expected) == 0, (stage, name)


def test_entries_a_module_renames_while_loading_reach_the_sharded_parameters(tmp_path):
    run_distributed(_renaming_worker, WORLD, str(tmp_path))


# ---------------------------------------------------------------------------------------------- the Trainer
class LoadsSlicesOnStart(RegressionModule):
    """Loads a dict of safetensors slices once the strategy has set the module up (fit, or evaluation only)."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def _load(self):
        self.load_state_dict(_slices(self.path))

    on_fit_start = on_validation_start = _load


def _trainer_slices_worker(rank, world_size, directory):
    from safetensors.torch import save_file

    torch.manual_seed(5)
    base = {k: v.clone() for k, v in RegressionModule().state_dict().items()}
    path = os.path.join(directory, "base.safetensors")
    if rank == 0:
        save_file(base, path)
    torch.distributed.barrier()
    for stage in (0, 3):
        module = LoadsSlicesOnStart(path)
        trainer(zero(stage), limit_val_batches=1).validate(module)  # evaluation only: no DDP at stages 0-1
        assert max_abs_diff(full_state(module), base) == 0, stage


def test_trainer_loads_a_dict_of_safetensors_slices_in_evaluation(tmp_path):
    run_distributed(_trainer_slices_worker, WORLD, str(tmp_path))
