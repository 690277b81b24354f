"""Pipelined training equals the unsplit model: every schedule, pipeline 2 x data 1 and pipeline 2 x data 2 (gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_zero.distributed.comm_buffers import comm_buffer_pool
from lightning_zero.pipeline import LayerSpec, PipelineModule, TiedLayerSpec, build_pipeline
from tests.ranks import run_distributed

VOCAB, WIDTH, GLOBAL_BATCH, STEPS = 12, 8, 8, 3


class SeededLinear(nn.Linear):
    """A linear layer whose initial values depend only on ``seed``, so a stage that builds only some layers gets
    exactly the values of the unsplit reference."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__(width, width)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(width, width, generator=gen) / width**0.5)
            self.bias.copy_(torch.randn(width, generator=gen) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x))


class SeededEmbedding(nn.Embedding):
    def __init__(self, vocab: int, width: int, seed: int) -> None:
        super().__init__(vocab, width)
        with torch.no_grad():
            self.weight.copy_(torch.randn(vocab, width, generator=torch.Generator().manual_seed(seed)))


def head(embedding: nn.Embedding, hidden: torch.Tensor) -> torch.Tensor:
    return hidden @ embedding.weight.t()


def make_model(checkpoint_interval: int = 0) -> PipelineModule:
    """Embedding, 6 blocks, output head tied to the embedding: 8 layers, enough for 4 stages."""
    layers = [TiedLayerSpec("embed", SeededEmbedding, VOCAB, WIDTH, seed=100)]
    layers += [LayerSpec(SeededLinear, WIDTH, seed=i) for i in range(6)]
    layers += [TiedLayerSpec("embed", SeededEmbedding, VOCAB, WIDTH, seed=100, forward_fn=head)]
    return PipelineModule(
        layers, loss_fn=F.cross_entropy, partition_method="uniform", activation_checkpoint_interval=checkpoint_interval
    )


def full_state(module: nn.Module) -> dict:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }


# (schedule, virtual_stages, data_parallel, optimizer, activation_checkpoint_interval)
CASES_DP1 = [
    ("gpipe", 1, "allreduce", "sgd", 0),
    ("1f1b", 1, "allreduce", "adam", 2),
    ("interleaved_1f1b", 2, "allreduce", "sgd", 0),
    ("zero_bubble", 2, "allreduce", "adam", 0),
    ("zbv", 2, "allreduce", "sgd", 0),
]
CASES_DP2 = [
    ("gpipe", 1, "allreduce", "adam", 0),
    ("1f1b", 1, "fully_shard", "sgd", 0),
    ("interleaved_1f1b", 2, "fully_shard", "adam", 1),
    ("zero_bubble", 2, "allreduce", "sgd", 0),
    ("zero_bubble", 2, "fully_shard", "sgd", 0),
    ("zbv", 2, "allreduce", "adam", 0),
    ("1f1b", 1, "fully_shard-reshard", "adam", 0),  # ZeRO-3 flavour: parameters resharded after forward
]


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5) if kind == "sgd" else torch.optim.Adam(params, lr=0.02)


def _parity_worker(rank: int, world_size: int, cases: list) -> None:
    dp = world_size // 2
    mesh = init_device_mesh("cpu", (2, dp), mesh_dim_names=("pp", "dp"))
    dp_rank = mesh["dp"].get_local_rank()
    for schedule, virtual, data_parallel, opt_kind, interval in cases:
        label = f"{schedule} v={virtual} {data_parallel} {opt_kind} ckpt={interval} dp={dp}"
        model = make_model(interval)
        assert len(model.layers) == 0, "specs must not be built before the stage assignment in a multi-rank run"
        mode, reshard = data_parallel.split("-")[0], data_parallel.endswith("-reshard")
        runner = build_pipeline(
            model,
            mesh["pp"],
            schedule=schedule,
            micro_batches=4,
            virtual_stages=virtual,
            dp_mesh=mesh["dp"],
            data_parallel=mode,
            reshard_after_forward=reshard,
        )
        pools = {id(pool) for sm in runner.stage_modules if (pool := comm_buffer_pool(sm)) is not None}
        assert len(pools) == (1 if runner.fully_sharded else 0), f"{label}: one CPU buffer pool per sharded pipeline"
        owned = sorted(int(k) for k in model.layers)
        assert owned != list(range(8)), f"{label}: a stage must build only its own layers, built {owned}"
        reference = make_model(interval)
        reference.materialize()
        opt, ref_opt = _optimizer(opt_kind, model.parameters()), _optimizer(opt_kind, reference.parameters())
        gen = torch.Generator().manual_seed(7)
        for _ in range(STEPS):
            x = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=gen)
            y = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=gen)
            local = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
            with torch.no_grad():
                expected_loss = reference(x[local], y[local])
            loss = model(x[local], y[local])
            torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=0, msg=label)
            opt.step()
            opt.zero_grad()
            reference(x, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        ref_state, state = full_state(reference), full_state(model)
        for key, value in state.items():
            diff = (value - ref_state[key]).abs().max().item()
            assert diff <= 1e-5, f"{label}: {key} differs from the unsplit reference by {diff}"
        # Union of the stage modules' keys is the unsplit key set (tied weight stored once, as layers.0.weight).
        keys: list = [None] * 2
        dist.all_gather_object(keys, sorted(state), group=mesh["pp"].get_group())
        assert set(keys[0]) | set(keys[1]) == set(ref_state), label
        # Eval is forward-only and returns the loss on every rank.
        model.eval()
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH // dp,), generator=gen)
        y = torch.randint(0, VOCAB, (GLOBAL_BATCH // dp,), generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(model(x, y), reference(x, y), atol=1e-5, rtol=0, msg=label)
        assert all(p.grad is None for p in model.parameters()), f"{label}: eval must not produce gradients"


@pytest.mark.parametrize("world_size, cases", [(2, CASES_DP1), (4, CASES_DP2)], ids=["pp2xdp1", "pp2xdp2"])
def test_every_schedule_matches_unsplit_reference(world_size: int, cases: list) -> None:
    run_distributed(_parity_worker, world_size, cases)


def _fsdp_tied_same_rank_worker(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    # ZBV puts stage 0 (embedding) and stage 3 (tied head) on pipeline rank 0: FSDP2 cannot shard it under two roots.
    with pytest.raises(NotImplementedError, match="tied module used by two stages"):
        build_pipeline(
            make_model(),
            mesh["pp"],
            schedule="zbv",
            micro_batches=2,
            virtual_stages=2,
            dp_mesh=mesh["dp"],
            data_parallel="fully_shard",
        )


def test_fully_shard_rejects_tied_module_in_two_local_stages() -> None:
    run_distributed(_fsdp_tied_same_rank_worker, 4)
