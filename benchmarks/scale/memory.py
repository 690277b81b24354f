"""``python -m benchmarks.scale.memory``: per-rank bytes of model states at 8 to 1,024 ranks, on one CPU machine.

Each (model, N, stage) builds a Llama-shaped model from ``transformers.LlamaConfig`` under torch's
``FakeTensorMode`` (shapes and dtypes, no storage: nothing is allocated, nothing downloaded), joins torch's fake
process group as rank 0 of N (``torch.testing._internal.distributed.fake_pg``, a private testing module of torch:
the benchmark uses it, the package does not), and applies the package's ``apply_zero`` over
``init_device_mesh("cpu", (N,))``. The optimizer is AdamW sharded by the package's ``shard_optimizer``; every
trainable parameter gets a gradient (counted then: stage 1's step releases the gradients of what other ranks
step) and the optimizer takes one step under the fake tensors, so its states exist. Then the bytes of rank 0's local
tensors are summed.

What is measured and what is computed (the ``how`` column):

* stages 2-3: everything is measured: the parameters' local shards (FSDP2's ``DTensor.to_local()``), the gradients
  (same shards) and AdamW's ``exp_avg``/``exp_avg_sq`` as the fake step left them.
* stage 1: ``apply_zero`` cannot run under fake tensors: DDP's preparation moves the module with
  ``module.to(device)``, and torch refuses that for fake parameters (``RuntimeError: _apply(): Couldn't swap
  Embedding.weight``, from ``Cannot swap t1 because it has weakref associated with it``; a plain ``nn.Linear`` under
  ``FakeTensorMode`` fails the same way in torch 2.13). The replicated parameters and gradients are therefore the
  unwrapped module's (measured from its fake tensors, gradients set like the parameters: what DDP's bucket views
  hold), and the optimizer states are measured after ``shard_optimizer`` partitioned the parameters (rank 0 steps
  its share only): the DDP wrapper itself, which adds no model state, is not built.

Precision: ``bf16-mixed``. ZeroStrategy keeps fp32 parameters (the masters) and fp32 gradients at every stage and
low precision only in compute copies (``lightning_zero/estimate/model_states.py``, its note on mixed precision), so
the module is built in fp32. Compute copies (stage 2's gathered parameters, stage 3's gathered units) are not model
states at rest and are not counted; ``estimate_memory``'s peak column adds them.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn

from lightning_zero.distributed.apply_zero import apply_zero
from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.distributed.optimizer import shard_optimizer
from lightning_zero.estimate.model_states import estimate_memory

GIB = 1024**3
# The published sizes of Llama 3 (hidden, intermediate, layers, heads, KV heads, vocabulary).
SHAPES = {
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "llama-3-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}

# 70B at 1,024 ranks takes about 2 minutes on this machine's 2 cores (FSDP2 splits every parameter 1,024 ways, in
# Python): left out of the default run to keep it near 3 minutes; ``--models llama-3-70b --ranks 1024`` runs it.
DEFAULT_RANKS = {"llama-3-8b": [8, 64, 256, 1024], "llama-3-70b": [8, 64, 256]}


@dataclass(frozen=True)
class Held:
    """Bytes rank 0 holds at rest (between backward and the optimizer step, gradients allocated)."""

    num_params: int
    params: int
    grads: int
    optimizer_states: int
    how: str
    block_params: int = 0  # one decoder layer, the unit stage 3 gathers (and prefetches the next of)
    parameter_sizes: tuple = ()  # the trainable parameters' element counts: stage 1 partitions them whole

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = _local(tensor)
        total += local.numel() * local.element_size()
    return total


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """Rank ``rank`` of a fake process group of ``world_size`` ranks (collectives return at once) and its 1-D mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def build(config) -> nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config)


def measure(config, world_size: int, stage: int) -> Held:
    """Rank 0's model-state bytes for ``stage`` at ``world_size`` ranks; ``config`` a ``transformers.LlamaConfig``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_world(world_size) as mesh, FakeTensorMode(allow_non_fake_inputs=True):
        module = build(config)
        num_params = sum(p.numel() for p in module.parameters())
        block = sum(p.numel() for p in module.model.layers[0].parameters())
        sizes = tuple(p.numel() for p in module.parameters() if p.requires_grad)
        zero = ZeroConfig(stage=stage)
        if stage >= 2:
            module = apply_zero(module, mesh, zero)
            how = "measured"
        else:  # see the module docstring: DDP's module.to(device) refuses fake parameters
            how = "measured (no DDP wrapper)"
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        shard_optimizer(optimizer, zero)
        for param in params:
            param.grad = torch.zeros_like(param)
        grads = _bytes(p.grad for p in module.parameters())  # before the step: stage 1's step frees the others'
        optimizer.step()
        states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
        return Held(
            num_params,
            _bytes(module.parameters()),
            grads,
            _bytes(states),
            how,
            block,
            sizes,
        )


def deepspeed_formula(num_params: int, stage: int, world_size: int, k: int = 12) -> float:
    """DeepSpeed's per-rank model states under mixed-precision Adam (ZeRO paper, section 5): 2 bytes of parameters,
    2 of gradients, ``K = 12`` of fp32 masters, m and v, partitioned per stage."""
    p, n = num_params, world_size
    return {0: 4 * p + k * p, 1: 4 * p + k * p / n, 2: 2 * p + (2 + k) * p / n, 3: (4 + k) * p / n}[stage]


def row(name: str, world_size: int, stage: int) -> dict:
    from transformers import LlamaConfig

    begin = time.monotonic()
    held = measure(LlamaConfig(**SHAPES[name]), world_size, stage)
    estimate = estimate_memory(
        held.num_params,
        stage,
        world_size,
        precision="bf16-mixed",
        largest_unit_params=held.block_params,
        parameter_sizes=held.parameter_sizes,
    ).states
    formula = deepspeed_formula(held.num_params, stage, world_size)
    return {
        "model": name,
        "N": world_size,
        "stage": stage,
        "how": held.how,
        "held GiB": held.total / GIB,
        "estimate GiB": estimate.accelerator.total / GIB,
        "estimate peak GiB": estimate.accelerator_peak / GIB,
        "DeepSpeed GiB": formula / GIB,
        "held/estimate": held.total / estimate.accelerator.total,
        "held/DeepSpeed": held.total / formula,
        "estimate peak/DeepSpeed": estimate.accelerator_peak / formula,
        "s": time.monotonic() - begin,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale.memory", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--ranks", type=int, nargs="+", help="N for every model (default: DEFAULT_RANKS)")
    parser.add_argument("--stages", type=int, nargs="+", choices=(1, 2, 3), default=[1, 2, 3])
    args = parser.parse_args(argv)
    rows = [row(m, n, s) for m in args.models for n in args.ranks or DEFAULT_RANKS[m] for s in args.stages]
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in columns) + " |")


if __name__ == "__main__":
    main()
