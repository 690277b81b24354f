"""Activation memory: the formula of ``lightning_zero.estimate.activations`` against the tensors autograd saves,
for the GPT of ``examples/gpt.py``, with and without checkpointing, and with model states at stages 0-3."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from lightning_zero import (
    TransformerShape,
    activation_bytes,
    estimate_memory,
    model_state_memory,
    saved_activation_bytes,
)
from lightning_zero.estimate.activations import layer_activation_bytes
from tests.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import GPT  # noqa: E402

VOCAB, SEQ, LAYERS, HEADS, HIDDEN, BATCH = 65, 64, 3, 4, 128, 4
_AUTOCAST = {"bf16-mixed": torch.bfloat16}
_DTYPE = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "bf16-mixed": torch.float32}


def _shape(model=None, batch=BATCH):
    layer_params = sum(p.numel() for p in model.blocks[0].parameters()) if model is not None else 0
    return TransformerShape(
        hidden=HIDDEN,
        layers=LAYERS,
        heads=HEADS,
        seq_len=SEQ,
        micro_batch=batch,
        vocab=VOCAB,
        layer_params=layer_params,
    )


def _loss(model, idx, targets, precision, block_checkpoint=False):
    def run():
        if not block_checkpoint:
            logits = model(idx)
        else:  # GPT.forward with each block under (reentrant) checkpointing, which saves the block input here
            x = model.tok(idx) + model.pos(torch.arange(idx.shape[1]))
            for block in model.blocks:
                x = checkpoint(block, x, use_reentrant=True)
            logits = model.head(model.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))

    if precision in _AUTOCAST:
        with torch.autocast("cpu", dtype=_AUTOCAST[precision]):
            return run()
    return run()


def _batch(batch=BATCH, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (batch, SEQ), generator=gen), torch.randint(0, VOCAB, (batch, SEQ), generator=gen))


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_formula_matches_saved_tensors_without_checkpointing(precision):
    torch.manual_seed(0)
    model = GPT(VOCAB, SEQ, LAYERS, HEADS, HIDDEN).to(_DTYPE[precision])
    idx, targets = _batch()
    with saved_activation_bytes() as saved:
        _loss(model, idx, targets, precision)
    predicted = activation_bytes(_shape(model), precision).accelerator
    assert abs(saved.total - predicted) <= 0.05 * saved.total, (precision, saved.total, predicted)


@pytest.mark.parametrize("stage, precision", [(0, "16-true"), (1, "16-true"), (2, "bf16"), (3, "16")])
def test_what_zero_strategy_computes_is_what_the_estimate_counts(stage, precision):
    """At stages 0-1 ZeroStrategy runs ``16-true`` as autocast over fp32 parameters (its loss scale comes off fp32
    gradients), and Lightning reads a bare ``"bf16"``/``"16"`` as ``*-mixed``: the estimate counts those runs' saved
    tensors, not an all-half model's (which it used to, under-counting the residual stream and autocast's weight
    copies). ``bf16-true`` holds bf16 replicas at stages 0-1 (``distributed/replicas.py``): all-bf16 at every stage."""
    torch.manual_seed(0)
    model = GPT(VOCAB, SEQ, LAYERS, HEADS, HIDDEN)  # fp32 parameters, the forward under autocast
    idx, targets = _batch()
    with saved_activation_bytes() as saved:
        _loss(model, idx, targets, "bf16-mixed")
    predicted = estimate_memory(1000, stage, 2, precision=precision, shape=_shape(model)).activations.accelerator
    assert abs(saved.total - predicted) <= 0.05 * saved.total, (stage, precision, saved.total, predicted)
    # bf16-true keeps its own meaning (every op in bf16) at every stage: fewer bytes than the autocast run
    all_bf16 = {
        estimate_memory(1000, s, 2, precision="bf16-true", shape=_shape(model)).activations.accelerator
        for s in (0, 1, 2, 3)
    }
    assert len(all_bf16) == 1 and all_bf16.pop() < predicted
    # ... except with the masters swapped to NVMe at stages 0-1, where the run keeps fp32 parameters under autocast
    swapped = estimate_memory(1000, 1, 2, "nvme", precision="bf16-true", shape=_shape(model)).activations.accelerator
    assert swapped == estimate_memory(1000, 1, 2, precision="bf16-mixed", shape=_shape(model)).activations.accelerator


def test_formula_matches_saved_tensors_with_checkpointing():
    torch.manual_seed(0)
    model = GPT(VOCAB, SEQ, LAYERS, HEADS, HIDDEN)
    idx, targets = _batch()
    with saved_activation_bytes() as kept:  # what stays alive through backward: block inputs and the head's
        _loss(model, idx, targets, "32-true", block_checkpoint=True)
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    with saved_activation_bytes(exclude=[x]) as one_block:  # rebuilt for one block at a time during backward
        model.blocks[0](x)
    measured = kept.total + one_block.total + x.untyped_storage().nbytes()
    predicted = activation_bytes(_shape(), "32-true", "full")
    assert abs(measured - predicted.accelerator) <= 0.05 * measured, (measured, predicted)
    offloaded = activation_bytes(_shape(), "32-true", "full+cpu")
    assert offloaded.cpu == LAYERS * SEQ * BATCH * HIDDEN * 4  # the block inputs
    assert offloaded.accelerator + offloaded.cpu == predicted.accelerator
    without = activation_bytes(_shape(), "32-true")
    assert predicted.accelerator < 0.6 * without.accelerator  # checkpointing must pay off on this model


def test_activation_formula_scales_with_batch_and_refuses_bad_input():
    one, four = (layer_activation_bytes(_shape(batch=b)) for b in (1, 4))
    assert four == 4 * one
    with pytest.raises(ValueError, match="micro_batch"):
        TransformerShape(hidden=8, layers=1, heads=2, seq_len=4, micro_batch=0)
    with pytest.raises(ValueError, match="divisible by heads"):
        TransformerShape(hidden=10, layers=1, heads=3, seq_len=4, micro_batch=1)
    with pytest.raises(ValueError, match="checkpointing must be one of"):
        activation_bytes(_shape(), checkpointing="selective")
    with pytest.raises(ValueError, match="precision must be one of"):
        activation_bytes(_shape(), precision="fp8")


def _stage_worker(rank, world_size, configs):
    import torch.distributed as dist

    from lightning_zero import ZeroConfig, apply_zero
    from lightning_zero.distributed.optimizer import shard_optimizer

    for stage, offload in configs:
        torch.manual_seed(0)
        model = GPT(VOCAB, SEQ, LAYERS, HEADS, HIDDEN)
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
        config = ZeroConfig(stage=stage, offload=offload)
        wrapped = apply_zero(model, mesh, config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        shard_optimizer(opt, config, group=mesh.get_group())
        for step in range(2):  # the first step creates the optimizer states
            idx, targets = _batch(seed=rank + 10 * step)
            opt.zero_grad(set_to_none=False)
            with saved_activation_bytes() as saved:
                loss = _loss(wrapped, idx, targets, "32-true")
            loss.backward()
            at_rest = model_state_memory(model, [opt]).total.total
            opt.step()
        measured = at_rest + saved.total
        est = estimate_memory(model, stage, world_size, offload, shape=_shape())
        predicted = est.states.accelerator.total + est.states.cpu.total + est.activations.accelerator
        assert abs(measured - predicted) <= 0.15 * measured, (stage, offload, measured, predicted)
        dist.barrier()


def test_prediction_matches_measured_states_and_activations_at_stages_0_to_3():
    run_distributed(_stage_worker, 2, [(0, None), (1, None), (2, None), (3, None), (3, "cpu")])


# -------------------------------------- checkpointing through ZeroStrategy: the measurement `advise --measure` takes
CKPT_SEQ, CKPT_BATCH, CKPT_STEPS = 128, 8, 2  # activations dominate the states, so a missed block shows


def _checkpointing_worker(rank, world_size):
    from gpt import GPTModule
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy
    from lightning_zero.cli.advise_measure import measuring_callback

    shape = TransformerShape(
        hidden=HIDDEN, layers=LAYERS, heads=HEADS, seq_len=CKPT_SEQ, micro_batch=CKPT_BATCH, vocab=VOCAB
    )
    gen = torch.Generator().manual_seed(rank)
    batches = [
        tuple(torch.randint(0, VOCAB, (CKPT_BATCH, CKPT_SEQ), generator=gen) for _ in range(2))
        for _ in range(CKPT_STEPS)
    ]
    failures = []
    for stage in (0, 1, 2, 3):
        for cpu in (False, True):
            torch.manual_seed(0)
            module = GPTModule(VOCAB, CKPT_SEQ, LAYERS, HEADS, HIDDEN)
            measure = measuring_callback()
            trainer = Trainer(
                accelerator="cpu",
                devices=world_size,
                max_steps=CKPT_STEPS,
                logger=False,
                strategy=ZeroStrategy(stage=stage, activation_checkpointing=True, cpu_checkpointing=cpu),
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[measure],
                use_distributed_sampler=False,
            )
            trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
            est = estimate_memory(
                module, stage, world_size, None, shape=shape, checkpointing="full+cpu" if cpu else "full"
            )
            predicted = (
                est.states.accelerator.total + est.states.cpu.total + est.activations.accelerator + est.activations.cpu
            )
            if cpu:
                assert est.activations.cpu > 0, "the block inputs are predicted in CPU memory"
            assert measure.recomputed > 0, f"stage {stage}: no checkpointed block was measured"
            if abs(measure.tensors - predicted) > 0.15 * measure.tensors:
                failures.append(
                    f"stage {stage} cpu_checkpointing={cpu}: measured {measure.tensors}, predicted "
                    f"{predicted} ({(predicted - measure.tensors) / measure.tensors:+.1%})"
                )
    assert not failures, "\n".join(failures)


def test_checkpointing_prediction_matches_a_measurement_through_the_strategy_at_stages_0_to_3():
    """The prediction with activation checkpointing (and cpu_checkpointing) against what ``advise --measure``
    measures through ``ZeroStrategy``: model states, the kept block inputs and one rebuilt block."""
    run_distributed(_checkpointing_worker, 2)
