"""The per-rank memory benchmark (``benchmarks/scale/memory.py``) on a tiny Llama under torch's fake process group:
what rank 0 of 8 holds at rest agrees with ``estimate_memory`` at stages 1-3."""

import pytest

pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402

from benchmarks.scale.memory import deepspeed_formula, measure  # noqa: E402
from lightning_zero.estimate.model_states import estimate_memory  # noqa: E402

TINY = LlamaConfig(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


def _estimate(held, stage, **sizes):
    return estimate_memory(held.num_params, stage, 8, precision="bf16-mixed", **sizes).states.accelerator.total


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_rank_holds_what_estimate_memory_says_within_5_percent(stage):
    held = measure(TINY, 8, stage)
    assert held.grads > 0 and held.optimizer_states > 0
    estimate = _estimate(held, stage, parameter_sizes=held.parameter_sizes)
    assert abs(held.total / estimate - 1) < 0.05, (held.total, estimate)


def test_stage_1_estimate_counts_the_whole_parameters_the_heaviest_rank_steps():
    """Stage 1 partitions whole parameters (largest first, to the lightest rank): rank 0 steps the embedding, a fifth
    of the tiny model, alone, more than the even share ``8P/N`` that a bare parameter count gives."""
    held = measure(TINY, 8, 1)
    assert held.params == held.grads == 4 * held.num_params  # replicated fp32 parameters and gradients
    even_share = _estimate(held, 1)
    by_parameter = _estimate(held, 1, parameter_sizes=held.parameter_sizes)
    largest = TINY.vocab_size * TINY.hidden_size
    assert even_share < by_parameter <= even_share + 8 * largest
    assert held.total > 1.05 * even_share  # the even share misses rank 0's embedding


def test_stage_3_meets_deepspeeds_formula_and_stage_1_holds_more():
    """ZeroStrategy's 16 bytes per parameter are fp32 parameters, fp32 gradients and m, v (``docs/memory.md``): the
    total meets DeepSpeed's where everything is partitioned (stage 3), not at stage 1, which partitions K only."""
    stage3 = measure(TINY, 8, 3)
    assert abs(stage3.total / deepspeed_formula(stage3.num_params, 3, 8) - 1) < 0.05
    stage1 = measure(TINY, 8, 1)
    assert stage1.total > 1.3 * deepspeed_formula(stage1.num_params, 1, 8)
