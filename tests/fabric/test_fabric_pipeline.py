"""Pipeline parallelism under Fabric: ``fabric.setup_module(PipelineModule)`` + ``fabric.strategy.pipeline_step``
equals the unsplit model on one process (accumulation, clipping, tied weights, ZeRO on ``dp``), and
``fabric.save``/``fabric.load`` round-trip a pipelined model and its optimizer."""

import pytest
import torch
from lightning.fabric import Fabric

from lightning_zero.fabric import ZeroStrategy
from tests.pipeline.test_pipeline_parity import VOCAB, full_state, make_model
from tests.ranks import run_distributed
from tests.strategies.test_strategy_pipeline import _gather_full_state

STEPS, BATCH, ACCUMULATE, CLIP = 3, 4, 2, 0.05  # BATCH: per data-parallel replica and micro-step


def _fabric(world_size, **kwargs):
    fabric = Fabric(
        accelerator="cpu",
        devices=world_size,
        strategy=ZeroStrategy(pipeline_parallel_size=2, micro_batches=2, **kwargs),
    )
    fabric.launch()
    return fabric


def _batches(dp):
    gen = torch.Generator().manual_seed(7)
    n = STEPS * ACCUMULATE * BATCH * dp
    return torch.randint(0, VOCAB, (n,), generator=gen), torch.randint(0, VOCAB, (n,), generator=gen)


def _train(fabric, model, optimizer, x, y, steps, dp, dp_rank, reference_losses=None):
    """``steps`` optimizer steps of ACCUMULATE micro-steps; this replica reads its slice of each micro-batch."""
    for step in steps:
        for i in range(ACCUMULATE):
            start = (step * ACCUMULATE + i) * BATCH * dp + dp_rank * BATCH
            with fabric.no_backward_sync(model, enabled=i < ACCUMULATE - 1):
                loss = fabric.strategy.pipeline_step(
                    model, x[start : start + BATCH], y[start : start + BATCH], grad_scale=1 / ACCUMULATE
                )
            if reference_losses is not None:  # this replica's mean loss, on every rank of its pipeline
                ref = reference_losses[step * ACCUMULATE + i][dp_rank]
                torch.testing.assert_close(loss, ref, atol=1e-5, rtol=0)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()


def _reference(dp):
    """The unsplit model on one process: mean loss over each global micro-batch, accumulated, clipped, stepped."""
    model = make_model()
    model.materialize()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    x, y = _batches(dp)
    losses = []
    for step in range(STEPS):
        for i in range(ACCUMULATE):
            start = (step * ACCUMULATE + i) * BATCH * dp
            xs, ys = x[start : start + BATCH * dp], y[start : start + BATCH * dp]
            with torch.no_grad():
                losses.append(
                    [model(xs[r * BATCH : (r + 1) * BATCH], ys[r * BATCH : (r + 1) * BATCH]) for r in range(dp)]
                )
            (model(xs, ys) / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return full_state(model), losses


def _parity_worker(rank, world_size, stage, path):
    dp = world_size // 2
    fabric = _fabric(world_size, stage=stage)
    strategy = fabric.strategy
    assert strategy.distributed_sampler_kwargs["num_replicas"] == dp
    dp_rank = strategy.distributed_sampler_kwargs["rank"]
    pipeline = make_model()
    with pytest.raises(ValueError, match="create the optimizer after fabric.setup_module"):
        fabric.setup(pipeline, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    model = fabric.setup_module(pipeline)
    assert sorted(int(k) for k in pipeline.layers) != list(range(8)), "each rank builds only its stages"
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.02))
    x, y = _batches(dp)
    expected, losses = _reference(dp)
    _train(fabric, model, optimizer, x, y, range(STEPS), dp, dp_rank, losses)
    got = _gather_full_state(pipeline, strategy.meshes.pipeline.get_group())
    assert set(got) == set(expected)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"stage {stage} world {world_size}: max abs diff {worst:.2e} from the unsplit reference"
    with pytest.raises(RuntimeError, match="the schedule runs backward itself"):
        fabric.backward(torch.ones((), requires_grad=True))
    # Evaluation: model(x, y) in eval mode runs the forward-only schedule (no gradients); pipeline_step refuses it.
    reference = make_model()
    reference.materialize()
    reference.load_state_dict(expected)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x[:BATCH], y[:BATCH]), reference(x[:BATCH], y[:BATCH]), atol=1e-5, rtol=0)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="eval mode"):
        fabric.strategy.pipeline_step(model, x[:BATCH], y[:BATCH])
    model.train()
    if path is None:
        return

    # fabric.save / fabric.load: a fresh pipelined model and optimizer, scrambled, get exactly the saved state back,
    # and the next steps then equal those of the original.
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS})
    fresh_fabric = _fabric(world_size, stage=stage)
    fresh_module = make_model()
    fresh = fresh_fabric.setup_module(fresh_module)
    fresh_optimizer = fresh_fabric.setup_optimizers(torch.optim.Adam(fresh.parameters(), lr=0.02))
    with torch.no_grad():
        for param in fresh.parameters():
            param.mul_(-1.5).add_(0.3)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    fresh_fabric.load(path, state)
    assert state["step"] == STEPS
    saved, loaded = full_state(pipeline), full_state(fresh_module)
    assert set(saved) == set(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    more_x, more_y = torch.flip(x, [0]), torch.flip(y, [0])
    _train(fabric, model, optimizer, more_x, more_y, range(1), dp, dp_rank)
    _train(fresh_fabric, fresh, fresh_optimizer, more_x, more_y, range(1), dp, dp_rank)
    after, after_fresh = full_state(pipeline), full_state(fresh_module)
    for key in after:
        torch.testing.assert_close(after_fresh[key], after[key], rtol=0, atol=0, msg=key)


def test_two_ranks_as_two_stages_match_the_unsplit_model_and_checkpoint_round_trips(tmp_path):
    run_distributed(_parity_worker, 2, 1, str(tmp_path / "pipe.ckpt"))


@pytest.mark.parametrize("stage", [1, 2])
def test_pipeline_2_x_data_2_with_zero_stage_on_dp_matches_the_unsplit_model(tmp_path, stage):
    run_distributed(_parity_worker, 4, stage, str(tmp_path / "pipe.ckpt"))
