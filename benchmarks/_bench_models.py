"""The models of ``bench_stages.py``: each one built the same way for every strategy, with its batches and loss.

- ``gpt``: the GPT of ``examples/gpt.py`` (imported from the file, so the benchmark follows the example);
- ``mlp``: a flat ``nn.Sequential`` of ``Linear(width, width)`` + ``GELU``, ``depth`` times: the repeated unit is
  a single small ``Linear``, which is where per-module communication granularity hurts most;
- ``llama``: a tiny Hugging Face ``LlamaForCausalLM`` built from a ``LlamaConfig`` (no download, tied embeddings);
- ``gpt2`` (opt-in, never in ``all``): the same GPT class at GPT-2 small's shape (12 layers, width 768, 12 heads,
  50257-token vocabulary, 256 positions) with the output head tied to the token embedding as GPT-2 ties them:
  123.85M parameters, a size where ZeRO's partitioning decides the memory a rank needs.

Every builder seeds torch first, so all strategies start from the same weights; every batch list is seeded by rank.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F

MODELS = ("gpt", "mlp", "llama")
LARGE = ("gpt2",)  # opt-in: minutes per step on 2 CPU ranks, so ``--model all`` (the small matrix) leaves it out
_EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")

# (full, quick) shapes. The full shapes are the issue's: GPT as the example's defaults, the 25M-parameter MLP,
# a ~2.9M-parameter Llama.
SHAPES = {
    "gpt": (
        {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64, "vocab": 65},
        {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16, "vocab": 32},
    ),
    "mlp": ({"width": 1024, "depth": 24}, {"width": 64, "depth": 4}),
    "llama": (
        {"hidden": 256, "intermediate": 512, "layers": 4, "heads": 4, "vocab": 1024, "seq": 64},
        {"hidden": 32, "intermediate": 64, "layers": 2, "heads": 2, "vocab": 64, "seq": 8},
    ),
    "gpt2": (
        {"n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 256, "vocab": 50257},
        {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16, "vocab": 64},
    ),
}


def unavailable(name: str) -> str | None:
    """Why model ``name`` cannot run here (a message for the user), or None."""
    if name == "llama" and importlib.util.find_spec("transformers") is None:
        return "skipping --model llama: transformers is not installed (pip install transformers)"
    return None


def shape(name: str, args) -> dict:
    """The model's shape: the quick or full defaults, with ``--width``/``--depth`` for the MLP when given."""
    full, quick = SHAPES[name]
    result = dict(quick if args.quick else full)
    if name == "mlp":
        result.update({k: v for k, v in (("width", args.width), ("depth", args.depth)) if v is not None})
    if name == "gpt" and getattr(args, "gpt", None):  # gpu_suite.py's ~1B shape and its capacity search
        result.update(args.gpt)
    return result


def _gpt_class():
    # Imported from the example's file (not copied), under a private module name so it never shadows anything.
    module = sys.modules.get("_bench_gpt_example")
    if module is None:
        spec = importlib.util.spec_from_file_location("_bench_gpt_example", os.path.join(_EXAMPLES, "gpt.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module.GPT


def build(name: str, args) -> nn.Module:
    """The model in CPU memory, seeded so every strategy starts from the same weights.

    ``args.init_device`` (optional, e.g. ``"cuda"``) runs the initialisation there, then moves the model to CPU
    memory: torch's CPU random fill is serial (about 100M values/s), 12 s for a 1.2B-parameter model and most of a
    minute for a 5B one, which a benchmark on a GPU would otherwise spend in every run. The device's peak-memory
    statistics are reset after the move, so the transient copy never counts in a run's peak (the runner's baseline,
    taken before, is the same)."""
    init_device = getattr(args, "init_device", None)
    with torch.device(init_device) if init_device else contextlib.nullcontext():
        model = _construct(name, args)
    if init_device and torch.device(init_device).type != "cpu":
        model = model.to("cpu")
        if torch.device(init_device).type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return model


def _construct(name: str, args) -> nn.Module:
    s = shape(name, args)
    torch.manual_seed(0)
    if name == "gpt":
        return _gpt_class()(s["vocab"], s["block_size"], s["n_layer"], s["n_head"], s["n_embd"])
    if name == "gpt2":
        model = _gpt_class()(s["vocab"], s["block_size"], s["n_layer"], s["n_head"], s["n_embd"])
        model.head.weight = model.tok.weight  # GPT-2 ties them: untied, the head alone would add 38.6M parameters
        return model
    if name == "mlp":
        layers = []
        for _ in range(s["depth"]):
            layers += [nn.Linear(s["width"], s["width"]), nn.GELU()]
        return nn.Sequential(*layers)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=s["hidden"],
            intermediate_size=s["intermediate"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["heads"],
            vocab_size=s["vocab"],
            max_position_embeddings=s["seq"],
            tie_word_embeddings=True,
            attention_dropout=0.0,
        )
        return LlamaForCausalLM(config)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def units(name: str, model: nn.Module) -> list[nn.Module]:
    """The modules a user of Lightning's ModelParallelStrategy would ``fully_shard`` (the repeated blocks)."""
    if name in ("gpt", "gpt2"):
        return list(model.blocks)
    if name == "mlp":
        return [m for m in model if isinstance(m, nn.Linear)]
    if name == "llama":
        return list(model.model.layers)
    raise ValueError(name)


def batches(name: str, args, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``warmup + steps`` (input, target) pairs, different per rank, the same for every strategy."""
    s, gen = shape(name, args), torch.Generator().manual_seed(100 + rank)
    count = args.warmup + args.steps
    if name == "mlp":
        return [
            (torch.randn(args.batch, s["width"], generator=gen), torch.randn(args.batch, s["width"], generator=gen))
            for _ in range(count)
        ]
    vocab, seq = s["vocab"], s.get("block_size", s.get("seq"))
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (args.batch, seq + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def loss(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward and loss; the loss is computed in fp32 whatever the compute dtype."""
    out = model(x)
    if name == "llama":
        out = out.logits
    if name == "mlp":
        return F.mse_loss(out.float(), y.float())
    return F.cross_entropy(out.float().reshape(-1, out.size(-1)), y.reshape(-1))


def lightning_module(name: str, args):
    """A LightningModule class training model ``name`` (built in ``__init__``) with AdamW, lr 1e-4: the module every
    benchmark worker times (subclass it to add ``configure_model``). ``args.optimizer == "cpu_adam"`` steps with
    ``lightning_zero.ops.CPUAdam`` instead (offload runs set against DeepSpeed's ``DeepSpeedCPUAdam``)."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build(name, args)

        def training_step(self, batch, batch_idx):
            return loss(name, self.net, *batch)

        def configure_optimizers(self):
            if getattr(args, "optimizer", "adamw") == "cpu_adam":  # gpu_suite.py --ds-cpu-adam: each side's own
                from lightning_zero.ops import CPUAdam

                return CPUAdam(self.parameters(), lr=1e-4)
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Module


def describe(name: str, args) -> str:
    """One line: the model, its shape and parameter count."""
    s = shape(name, args)
    with torch.device("meta"):
        count = sum(p.numel() for p in build(name, args).parameters())  # tied weights counted once
    return f"{name} ({', '.join(f'{k} {v}' for k, v in s.items())}; {count / 1e6:.2f}M params)"
