"""The Fabric ZeroStrategy takes the Trainer strategy's arguments (one validation path) and refuses, in its
constructor, what has no Fabric meaning."""

import inspect

import pytest
import torch
from torch import nn

from lightning_zero.fabric import ZeroStrategy
from lightning_zero.fabric.fabric_checkpoints import _split
from lightning_zero.strategies import ZeroStrategy as TrainerZeroStrategy


def test_same_arguments_as_the_trainer_strategy():
    fabric = inspect.signature(ZeroStrategy).parameters
    trainer = inspect.signature(TrainerZeroStrategy).parameters
    # Fabric's strategies call the precision plugin `precision`, the Trainer's `precision_plugin`.
    assert set(fabric) - {"precision"} == set(trainer) - {"precision_plugin"}
    for name in set(fabric) & set(trainer):
        if name != "auto_resume":  # Trainer-only feature: off (and refused when on) under Fabric
            assert fabric[name].default == trainer[name].default, name


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(stage=5), ValueError, "stage must be one of"),  # the shared validation
        (dict(stage=0, offload="cpu"), ValueError, "needs a ZeRO stage"),
        (dict(stage=2, find_unused_parameters=True), ValueError, "DDP options apply at stages 0-1"),
        (dict(stage=2, loss_scale=-1), ValueError, "loss_scale"),
        (dict(checkpoint_io=object()), ValueError, "checkpoint_io"),
        (
            dict(pipeline_parallel_size=2, stage=3, offload="cpu"),
            NotImplementedError,
            "offload_optimizer='cpu', offload_params='cpu' at stage 3 is not supported",
        ),
        (dict(auto_resume=True), ValueError, "auto_resume=True"),
        (
            dict(config={"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}),
            ValueError,
            "the ds_config sets optimizer=",
        ),
        (
            dict(config={"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}),
            ValueError,
            "gradient_clipping=1.0",
        ),
        (
            dict(config={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4}),
            ValueError,
            "train_micro_batch_size_per_gpu=4",
        ),
    ],
)
def test_invalid_or_trainer_only_arguments_fail_in_the_constructor(kwargs, error, match):
    with pytest.raises(error, match=match):
        ZeroStrategy(**kwargs)


def test_ds_config_sets_the_zero_arguments():
    strategy = ZeroStrategy(
        config={
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "train_micro_batch_size_per_gpu": "auto",
        }
    )
    assert (strategy.stage, strategy.zero_config.offload) == (3, "cpu")
    assert ZeroStrategy(stage=1, config={"zero_optimization": {"stage": 3}}).stage == 1  # explicit wins


def test_checkpoint_state_with_dotted_module_keys_or_orphan_optimizers_is_refused():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(ValueError, match="hold no '.'"):
        _split({"a.x": a, "b": b})
    with pytest.raises(ValueError, match="no module"):
        _split({"opt": torch.optim.SGD(a.parameters(), lr=0.1)})
    with pytest.raises(ValueError, match="weights_only=False is not honoured"):
        ZeroStrategy().load_checkpoint("x", {"a": a}, weights_only=False)


def test_both_adapters_block_gradient_sync_through_one_helper(monkeypatch):
    # Trainer.block_backward_sync and fabric.no_backward_sync: one helper (distributed/runtime.py), which switches
    # the module's and the pipeline runner's reductions off inside and back on after, also through an exception.
    from types import SimpleNamespace

    from lightning_zero.distributed import runtime

    calls = []
    monkeypatch.setattr(runtime, "set_gradient_sync", lambda module, enabled: calls.append((module, enabled)))
    module, runner = nn.Linear(2, 2), SimpleNamespace(sync_grads=True)
    trainer_strategy = TrainerZeroStrategy(stage=2)
    trainer_strategy.model, trainer_strategy._runner = module, runner
    fabric_strategy = ZeroStrategy(stage=2)
    fabric_strategy._runner = runner
    blocks = {
        "trainer": trainer_strategy.block_backward_sync,
        "fabric": lambda: fabric_strategy._backward_sync_control.no_backward_sync(module, enabled=True),
    }
    for name, block in blocks.items():
        calls.clear()
        with pytest.raises(RuntimeError, match="inside"):
            with block():
                assert calls == [(module, False)] and runner.sync_grads is False, name
                raise RuntimeError("inside")
        assert calls == [(module, False), (module, True)] and runner.sync_grads is True, name


@pytest.mark.parametrize("stage", [1, 2])
def test_both_adapters_pickle_for_spawned_ranks(stage):
    # start_method="spawn" pickles the strategy into every rank: nothing it holds may be a local function
    import pickle

    for cls in (TrainerZeroStrategy, ZeroStrategy):
        restored = pickle.loads(pickle.dumps(cls(stage=stage)))
        assert type(restored) is cls and restored.stage == stage
