"""Partition boundaries, lazy specs and the plain (non-distributed) behaviour of PipelineModule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.pipeline import LayerSpec, PipelineConfig, PipelineModule, TiedLayerSpec, partition_layers
from lightning_zero.pipeline.partition import layer_weights
from lightning_zero.pipeline.schedules import stage_to_rank


# ------------------------------------------------------------------------------------------ partition_layers
@pytest.mark.parametrize(
    "weights, stages, expected",
    [
        ([1] * 8, 2, [0, 4, 8]),
        ([1] * 5, 2, [0, 3, 5]),  # heaviest stage minimised (3), earlier stages filled first
        ([1] * 4, 3, [0, 2, 3, 4]),
        ([5, 1, 1, 1, 1, 1], 2, [0, 1, 6]),  # a heavy first layer gets a stage of its own
        ([1, 1, 1, 1, 1, 5], 2, [0, 5, 6]),
        ([0, 1, 1, 1, 1, 0], 2, [0, 3, 6]),  # zero-weight layers stay with the stage before them
        ([3, 3, 3], 3, [0, 1, 2, 3]),
        ([7], 1, [0, 1]),
    ],
)
def test_partition_layers_documented_boundaries(weights, stages, expected):
    assert partition_layers(weights, stages) == expected


def test_partition_layers_rejects_impossible_requests():
    with pytest.raises(ValueError, match="every stage needs a layer"):
        partition_layers([1, 1], 3)
    with pytest.raises(ValueError, match="non-negative"):
        partition_layers([1, -1], 1)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.proj(x))


def _layers():
    # 0: Embedding 10x4 (40 params), 1-4: Block(4) (20 each), 5: flatten-free callable, 6: Linear 4->10 (50)
    return [LayerSpec(nn.Embedding, 10, 4)] + [LayerSpec(Block, 4) for _ in range(4)] + [torch.tanh, nn.Linear(4, 10)]


def test_partition_methods_produce_documented_boundaries():
    layers = _layers()
    assert layer_weights(layers, "parameters") == [40, 20, 20, 20, 20, 0, 50]
    assert PipelineModule(layers, partition_method="parameters").partition(2) == [0, 3, 7]  # 80 | 90
    assert PipelineModule(layers, partition_method="uniform").partition(2) == [0, 4, 7]
    assert PipelineModule(layers, partition_method="type:block").partition(2) == [0, 3, 7]  # 2 blocks each
    assert PipelineModule(layers, partition_method="type:^Block$").partition(4) == [0, 2, 3, 4, 7]
    assert PipelineModule(layers, partition_method=[0, 1, 5, 7]).partition(3) == [0, 1, 5, 7]


def test_partition_method_errors_are_explicit():
    with pytest.raises(ValueError, match="matches no layer class"):
        PipelineModule(_layers(), partition_method="type:Transformer").partition(2)
    with pytest.raises(ValueError, match="partition_method must be one of"):
        PipelineModule(_layers(), partition_method="balanced").partition(2)
    with pytest.raises(ValueError, match="strictly increasing"):
        PipelineModule(_layers(), num_stages=2, partition_method=[0, 7, 7])
    with pytest.raises(ValueError, match="created with num_stages=2"):
        PipelineModule(_layers(), num_stages=2).partition(4)


def test_parameter_count_of_specs_does_not_build_them():
    built = []

    class Recording(nn.Linear):
        def __init__(self, *args):
            built.append(torch.empty(0).device.type)
            super().__init__(*args)

    assert LayerSpec(Recording, 3, 5).count_parameters() == 20
    assert built == ["meta"], "parameter counting must build on the meta device only"


# ------------------------------------------------------------------------------------------ plain behaviour
def _tied_model(checkpoint_interval: int = 0) -> PipelineModule:
    torch.manual_seed(0)
    return PipelineModule(
        [
            TiedLayerSpec("embed", nn.Embedding, 10, 4),
            LayerSpec(Block, 4),
            LayerSpec(Block, 4),
            TiedLayerSpec("embed", nn.Embedding, 10, 4, forward_fn=lambda emb, h: h @ emb.weight.t()),
        ],
        loss_fn=F.cross_entropy,
        activation_checkpoint_interval=checkpoint_interval,
    )


def test_plain_module_is_the_sequential_model_with_unsplit_keys():
    model = _tied_model()
    assert sorted(model.state_dict()) == [
        "layers.0.weight",
        "layers.1.proj.bias",
        "layers.1.proj.weight",
        "layers.2.proj.bias",
        "layers.2.proj.weight",
    ]
    x, y = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    emb = model.layers["0"]
    hidden = model.layers["2"](model.layers["1"](emb(x)))
    torch.testing.assert_close(model(x), hidden @ emb.weight.t())
    torch.testing.assert_close(model(x, y), F.cross_entropy(hidden @ emb.weight.t(), y))
    # A consolidated checkpoint (unsplit keys) loads into a freshly constructed model.
    other = _tied_model()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other(x, y), model(x, y))


def test_stage_modules_name_layers_with_global_indices():
    model = _tied_model()
    first, second = model.stage_module(0, 2), model.stage_module(2, 4)
    assert sorted(first.state_dict()) == ["layers.0.weight", "layers.1.proj.bias", "layers.1.proj.weight"]
    # The second stage holds the tied head: its weight is stored under the first occurrence's index.
    assert sorted(second.state_dict()) == ["layers.0.weight", "layers.2.proj.bias", "layers.2.proj.weight"]
    x = torch.tensor([1, 2, 3])
    torch.testing.assert_close(second(first(x)), model(x))


def test_dropping_other_stages_layers_keeps_global_names():
    model = _tied_model()
    model.drop_layers_except([2, 3])
    assert sorted(model.state_dict()) == ["layers.0.weight", "layers.2.proj.bias", "layers.2.proj.weight"]
    with pytest.raises(RuntimeError, match="holds only some layers"):
        model(torch.tensor([1]))


def test_activation_checkpoint_interval_recomputes_layers_with_same_gradients():
    calls = []
    x, y = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    grads = []
    for interval in (0, 2):
        model = _tied_model(interval)
        hook = model.layers["1"].register_forward_pre_hook(lambda *_: calls.append(interval))
        model(x, y).backward()
        hook.remove()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert calls.count(0) == 1 and calls.count(2) == 2, "checkpointed layers run again in backward"
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_tied_spec_must_name_a_real_parameter_and_class():
    with pytest.raises(TypeError, match="same class"):
        PipelineModule([TiedLayerSpec("k", nn.Embedding, 3, 2), TiedLayerSpec("k", nn.Linear, 2, 3)])
    with pytest.raises(TypeError, match="nn.Module subclass"):
        LayerSpec(torch.tanh)


# ------------------------------------------------------------------------------------------ configuration
def test_pipeline_config_validation():
    with pytest.raises(ValueError, match="virtual_stages must be 1"):
        PipelineConfig(schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="needs virtual_stages >= 2"):
        PipelineConfig(schedule="interleaved_1f1b", virtual_stages=1)
    with pytest.raises(ValueError, match="exactly 2 stages"):
        PipelineConfig(schedule="zbv", virtual_stages=3)
    with pytest.raises(ValueError, match="schedule must be one of"):
        PipelineConfig(schedule="dualpipe")
    with pytest.raises(ValueError, match="only applies with data_parallel='fully_shard'"):
        PipelineConfig(reshard_after_forward=True)


def test_stage_placement():
    assert stage_to_rank(4, 2, "interleaved_1f1b") == [0, 1, 0, 1]
    assert stage_to_rank(4, 2, "zbv") == [0, 1, 1, 0]


def test_docs_first_example_trains_on_token_batches():
    """docs/pipeline.md's first example, with its `vocab`, `width` and `Block`, takes a batch of token ids and
    targets (B, T) and returns a scalar loss with gradients for every layer."""
    import re
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "pipeline.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", docs, re.S).group(1)

    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x):
            return x + torch.tanh(self.linear(x))

    namespace = {"vocab": 50, "width": 16, "Block": Block}
    exec(compile(snippet, "docs/pipeline.md", "exec"), namespace)
    model = namespace["model"]
    tokens = torch.randint(0, 50, (8, 16))
    loss = model(tokens, torch.randint(0, 50, (8, 16)))
    assert loss.dim() == 0
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
