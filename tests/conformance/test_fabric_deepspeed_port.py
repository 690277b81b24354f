"""The intent of Lightning's Fabric-side ``tests_fabric/strategies/test_deepspeed.py`` and
``test_deepspeed_integration.py`` on ``lightning_zero.fabric.ZeroStrategy`` (CPU, 2 gloo ranks).

DeepSpeed stage N is ``ZeroStrategy(stage=N)``, which takes DeepSpeedStrategy's constructor arguments
(``docs/deepspeed_arguments.md``). Where DeepSpeed refuses something (clipping, a filter on save, setting up the
optimizer apart from the model, CPU), ZeroStrategy must do it right, so the port checks the numbers, against
Lightning's own ``DDPStrategy`` under Fabric in the same ranks or an unsharded model. Tests of mocked DeepSpeed
internals are ported to the behaviour they stand for. ``README.md`` maps every Lightning test to its port or reason.
"""

import json
import os
import warnings
from contextlib import nullcontext

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import HalfPrecision
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_zero.checkpoint import CheckpointError, consolidate_checkpoint
from lightning_zero.checkpoint.safe_load import read_dcp_metadata
from lightning_zero.distributed.deferred_init import has_deferred
from lightning_zero.ds_config import DeepSpeedConfigError, DeepSpeedConfigWarning
from lightning_zero.fabric import FabricZeroPrecision, ZeroStrategy
from lightning_zero.ops.loss_scaler import DynamicLossScaler, StaticLossScaler
from tests.conformance.test_fabric_model_parallel_port import (
    FeedForward,
    assert_equal,
    full_state,
    inner,
    launch,
    train,
)
from tests.ranks import run_distributed

# Lightning's ``deepspeed_config`` fixture: an optimizer and a scheduler for DeepSpeed to build
LIGHTNING_CONFIG = {
    "optimizer": {"type": "SGD", "params": {"lr": 3e-5}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"last_batch_iteration": -1, "warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 100},
    },
}


class BoringModel(nn.Module):
    """``tests_fabric``'s ``BoringModel``."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(32, 2)

    def forward(self, x):
        return self.layer(x)


# ---------------------------------------------------------------------------------------------- no process group
def test_invalid_config_path():
    with pytest.raises(DeepSpeedConfigError, match="'invalid_path.json' does not exist"):
        ZeroStrategy(config="invalid_path.json")


def test_config_from_the_environment(tmp_path, monkeypatch):
    """``PL_DEEPSPEED_CONFIG_PATH`` is read. Lightning's fixture config names an optimizer and a scheduler for DeepSpeed
    to build; under Fabric the loop creates them, so such a config is refused naming the keys (Fabric's
    DeepSpeedStrategy would hand them to ``deepspeed.initialize``, which refuses them next to a client optimizer)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(path))
    strategy = ZeroStrategy()
    assert (strategy.stage, strategy.zero_config.offload) == (3, "cpu") and strategy.ds_config is not None
    path.write_text(json.dumps(LIGHTNING_CONFIG))
    with pytest.raises(ValueError, match="the ds_config sets optimizer=.*scheduler=.*with Fabric the loop is yours"):
        ZeroStrategy()


def test_defaults():
    strategy = ZeroStrategy()
    assert strategy.stage == 2 and strategy.zero_config.offload == "none" and strategy.ds_config is None
    # DeepSpeed has no backward-sync control (it accumulates itself); ZeroStrategy has fabric.no_backward_sync
    assert strategy._backward_sync_control is not None


def test_activation_checkpointing_arguments():
    """The four arguments become the ds_config's ``activation_checkpointing`` section: checkpointing of the repeated
    blocks with CPU-held inputs is honoured; the three with no meaning without tensor parallelism or DeepSpeed's
    buffers are warned about by name."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = ZeroStrategy(
            partition_activations=True,
            cpu_checkpointing=True,
            contiguous_memory_optimization=True,
            synchronize_checkpoint_boundary=True,
        )
    section = strategy.ds_config.translation.activation_checkpointing
    assert all(
        section[key]
        for key in (
            "partition_activations",
            "cpu_checkpointing",
            "contiguous_memory_optimization",
            "synchronize_checkpoint_boundary",
        )
    )
    config = strategy.settings.activation_checkpoint_config
    assert config.policy is True and config.cpu_checkpointing is True
    warned = " ".join(str(w.message) for w in caught if issubclass(w.category, DeepSpeedConfigWarning))
    for key in ("partition_activations", "contiguous_memory_optimization", "synchronize_checkpoint_boundary"):
        assert f"activation_checkpointing.{key}" in warned, key


def test_optimizer_offload_configuration():
    config = {"zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 2}}
    assert ZeroStrategy(config=config).zero_config.offload == "none"
    assert ZeroStrategy().zero_config.offload == "none"
    assert ZeroStrategy(offload_optimizer=True).zero_config.offload_optimizer == "cpu"
    # `"offload_optimizer": false`, which Lightning passes through: DeepSpeed's own config parser refuses it
    config["zero_optimization"]["offload_optimizer"] = False
    with pytest.raises(DeepSpeedConfigError, match="offload_optimizer must be a JSON object, got False"):
        ZeroStrategy(config=config)
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    with pytest.raises(Exception, match="offload_optimizer"):
        DeepSpeedZeroConfig(**config["zero_optimization"])


def test_custom_precision_params():
    """The fp16 arguments reach the loss scaler (on CPU fp16 is ``16-true``: Fabric turns ``16-mixed`` into bf16)."""
    fabric = Fabric(
        accelerator="cpu",
        devices=1,
        precision="16-true",
        strategy=ZeroStrategy(
            loss_scale=10, initial_scale_power=11, loss_scale_window=12, hysteresis=13, min_loss_scale=14
        ),
    )
    assert isinstance(fabric.strategy.precision, FabricZeroPrecision)
    scaler = fabric.strategy.precision.scaler
    assert isinstance(scaler, StaticLossScaler) and scaler.loss_scale == 10  # loss_scale > 0: static, as DeepSpeed
    fabric = Fabric(
        accelerator="cpu",
        devices=1,
        precision="16-true",
        strategy=ZeroStrategy(initial_scale_power=11, loss_scale_window=12, hysteresis=13, min_loss_scale=14),
    )
    scaler = fabric.strategy.precision.scaler
    assert isinstance(scaler, DynamicLossScaler)
    assert (scaler.loss_scale, scaler.loss_scale_window, scaler.hysteresis, scaler.min_loss_scale) == (
        2.0**11,
        12,
        13,
        14,
    )
    with pytest.raises(ValueError, match="loss scaling applies to fp16 training only"):
        Fabric(accelerator="cpu", devices=1, precision="bf16-mixed", strategy=ZeroStrategy(loss_scale=10))


def test_colliding_keys(tmp_path):
    """DeepSpeed warns when a state key collides with its client-state keys; a ZeroStrategy checkpoint has its own
    names and refuses them (the value would be lost), so DeepSpeed's (``mp_world_size``) is an ordinary key."""
    strategy = ZeroStrategy()
    model = nn.Linear(2, 2)
    strategy.save_checkpoint(tmp_path / "ckpt", {"model": model, "mp_world_size": 2})
    state = {"model": model, "mp_world_size": 0}
    strategy.load_checkpoint(tmp_path / "ckpt", state)
    assert state["mp_world_size"] == 2
    with pytest.raises(ValueError, match=r"the state key\(s\) \['optimizer_states'\] are names the checkpoint uses"):
        strategy.save_checkpoint(tmp_path / "other", {"model": model, "optimizer_states": 2})


def test_logging_batch_size_is_warned_about_by_name():
    """DeepSpeed reads ``logging_batch_size_per_gpu`` for its throughput log only; the Fabric loop sizes the batches,
    so the argument has no effect and says so (left at its default it is silent)."""
    with pytest.warns(DeepSpeedConfigWarning, match="logging_batch_size_per_gpu=10 has no effect with Fabric"):
        ZeroStrategy(logging_batch_size_per_gpu=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroStrategy()


# ---------------------------------------------------------------------------------------------- 2 ranks
class _Random(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.full((32,), float(index))


class _RandomIterable(IterableDataset):
    def __iter__(self):
        return iter(torch.full((32,), float(i)) for i in range(64))


class _DtypeModel(nn.Module):
    """Lightning's bf16 test model: records the dtype its input and its layer's output have."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(32, 2)
        self.seen = []

    def forward(self, x):
        out = self.layer(x)
        self.seen += [x.dtype, out.dtype]
        return out


def _step(fabric, model, optimizer, x):
    optimizer.zero_grad()
    fabric.backward(model(x).sum(), model=model)
    optimizer.step()


def _deep_net():
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 32, bias=False), nn.ReLU()) for _ in range(5)), nn.Linear(32, 3))


def _models_worker(rank, world_size):
    # Two models with the same init, set up one after the other at stage 3: training one leaves the other alone,
    # the same data gives the same weights, and those are Lightning's DDPStrategy's.
    fabric = launch(ZeroStrategy(stage=3))
    models = []
    for _ in range(2):
        fabric.seed_everything(42)
        module = BoringModel()
        models.append(fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1)))
    (model_1, optimizer_1), (model_2, optimizer_2) = models
    initial = full_state(model_2)
    data = [torch.randn(1, 32, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    for x in data:
        _step(fabric, model_1, optimizer_1, x)
    assert all(not torch.equal(value, initial[key]) for key, value in full_state(model_1).items())
    assert_equal(full_state(model_2), initial, "the model not trained")
    for x in data:
        _step(fabric, model_2, optimizer_2, x)
    assert_equal(full_state(model_2), full_state(model_1), "the same training")
    ddp = launch("ddp")
    ddp.seed_everything(42)
    module = BoringModel()
    reference, reference_optimizer = ddp.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for x in data:
        _step(ddp, reference, reference_optimizer, x)
    for key, value in full_state(reference).items():
        torch.testing.assert_close(full_state(model_1)[key], value, rtol=0, atol=1e-6, msg=key)
    ranks = fabric.all_gather(torch.tensor([fabric.local_rank]))
    assert torch.equal(ranks, torch.tensor([[0], [1]]))
    assert fabric.broadcast(True) and fabric.is_global_zero == (rank == 0)
    loader = fabric.setup_dataloaders(DataLoader(_Random()))
    assert isinstance(loader.sampler, DistributedSampler) and len(loader) == 64 // world_size
    assert sum(1 for _ in fabric.setup_dataloaders(DataLoader(_RandomIterable()))) == 64  # left to the dataset

    # DeepSpeed's stage-3 test model (5 blocks and a head, Adam, cross-entropy of softmax): one step, as DDP's
    weights = {}
    for name, strategy in (("zero", ZeroStrategy(stage=3)), ("ddp", "ddp")):
        run = launch(strategy)
        run.seed_everything(0)
        with run.init_module():
            module = _deep_net()
        model, optimizer = run.setup(module, torch.optim.Adam(module.parameters(), lr=0.1))
        x = torch.rand(2, 32, generator=torch.Generator().manual_seed(rank))
        logits = nn.functional.softmax(model(x).float(), dim=1)
        run.backward(nn.functional.cross_entropy(logits, torch.ones(2, dtype=torch.long)))
        optimizer.step()
        weights[name] = full_state(model)
    for key, value in weights["ddp"].items():
        torch.testing.assert_close(weights["zero"][key], value, rtol=0, atol=1e-6, msg=key)

    # bf16-mixed by registry name: compute (and, at stage 3, the input) in bf16 on fp32 masters, where DeepSpeed's
    # module holds bf16 weights
    fabric = launch("zero_stage_3", precision="bf16-mixed")
    assert isinstance(fabric.strategy, ZeroStrategy) and fabric.strategy.stage == 3
    assert fabric.strategy.precision.precision == "bf16-mixed"
    with fabric.init_module():
        module = _DtypeModel()
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=0.1))
    _step(fabric, model, optimizer, torch.rand(2, 32))
    assert module.seen == [torch.bfloat16, torch.bfloat16] and inner(model).layer.weight.dtype == torch.float32

    # Without an optimizer (inference), and with the optimizer set up apart from the model (DeepSpeed needs both in
    # one call): the optimizer stays the user's, changed in place, and steps as after a joint setup. The inference
    # forward in between leaves units gathered, so model.parameters() are not the shards then (Fabric bug 3)
    x = torch.ones(2, 32) * (rank + 1)
    for stage in (1, 2, 3):
        fabric = launch(ZeroStrategy(stage=stage))
        torch.manual_seed(1)
        expected = BoringModel()(x)
        torch.manual_seed(1)
        model = fabric.setup(BoringModel())
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-6)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer = fabric.setup_optimizers(sgd)
        assert optimizer.optimizer is sgd
        if stage >= 2:
            assert all(isinstance(p, DTensor) for p in sgd.param_groups[0]["params"]), "not the model's shards"
        _step(fabric, model, optimizer, x)
        joint = launch(ZeroStrategy(stage=stage))
        torch.manual_seed(1)
        module = BoringModel()
        sgd = torch.optim.SGD(module.parameters(), lr=0.1)
        joint_model, joint_optimizer = joint.setup(module, sgd)
        assert joint_optimizer.optimizer is sgd
        _step(joint, joint_model, joint_optimizer, x)
        assert_equal(full_state(model), full_state(joint_model), f"stage {stage}: separate and joint setup")


def test_models_optimizers_collectives_and_precision():
    run_distributed(_models_worker, 2)


def _init_module_worker(rank, world_size):
    for stage in (1, 2, 3):
        for precision, low in (("32-true", torch.float32), ("16-true", torch.float16), ("bf16-true", torch.bfloat16)):
            fabric = launch(ZeroStrategy(stage=stage), precision=precision)
            for empty_init in (None, False, True):
                what = f"stage {stage} {precision} empty_init={empty_init}"
                torch.manual_seed(0)
                with fabric.init_module(empty_init=empty_init):
                    module = BoringModel()
                drawn_after = torch.rand(1)
                torch.manual_seed(0)
                # Lightning's build: under the low default dtype for *-true (HalfPrecision.module_init_context)
                with HalfPrecision(precision).module_init_context() if low != torch.float32 else nullcontext():
                    plain = BoringModel()
                plain_after = torch.rand(1)
                # on CPU in the flag's dtype until setup, as Lightning builds; recorded at stages 2-3, as DeepSpeed's
                # zero.Init at 3
                assert all(p.device.type == "cpu" and p.dtype == low for p in module.parameters()), what
                assert has_deferred(module) == (stage >= 2), what
                if empty_init:  # the layers' init is skipped: no random numbers are drawn
                    torch.manual_seed(0)
                    assert torch.equal(drawn_after, torch.rand(1)), what
                else:
                    assert torch.equal(drawn_after, plain_after), what
                seen = []
                module.layer.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
                model = fabric.setup(module)
                # setup makes the fp32 masters; bf16-true at stage 1 holds bf16 replicas of them (fp32 masters beside
                # the optimizer), as DeepSpeed's module
                held = torch.bfloat16 if stage == 1 and precision == "bf16-true" else torch.float32
                if not empty_init:
                    assert_equal(full_state(model), {k: v.to(held) for k, v in plain.state_dict().items()}, what)
                assert all(p.dtype == held and p.device == fabric.device for p in model.parameters()), what
                if empty_init and stage == 1:  # as under Lightning's DDP nothing initialises the skipped weights
                    with pytest.raises(RuntimeError, match=r"^layer\.weight, layer\.bias hold memory that nothing"):
                        model(torch.rand(2, 32))
                    module.layer.reset_parameters()  # the script's init (stages 2-3 ran it at setup)
                model(torch.rand(2, 32))
                assert seen == [low], (what, seen)


def test_init_module():
    run_distributed(_init_module_worker, 2)


def _frozen_and_filter_worker(rank, world_size, root):
    for exclude in (True, False):
        path = os.path.join(root, f"exclude-{exclude}")
        fabric = launch(ZeroStrategy(stage=3, exclude_frozen_parameters=exclude))
        assert fabric.strategy.exclude_frozen_parameters is exclude
        fabric.seed_everything(0)
        module = FeedForward()
        module.w1.requires_grad_(False)
        model, optimizer = train(fabric, *fabric.setup(module, torch.optim.AdamW(module.parameters())))
        saved = full_state(model)
        fabric.save(path, {"model": model, "optimizer": optimizer, "extra": "data"})
        stored = set(read_dcp_metadata(path).state_dict_metadata)
        assert ("state_dict.w1.weight" in stored) is not exclude and "state_dict.w2.weight" in stored

        fabric.seed_everything(5)
        fresh = FeedForward()
        fresh.w1.requires_grad_(False)
        own = {key: value.clone() for key, value in fresh.state_dict().items()}
        fresh_model, fresh_optimizer = fabric.setup(fresh, torch.optim.AdamW(fresh.parameters()))
        state = {"model": fresh_model, "optimizer": fresh_optimizer, "extra": None}
        fabric.load(path, state)
        expected = {key: own[key] if exclude and key.startswith("w1.") else value for key, value in saved.items()}
        assert_equal(full_state(fresh_model), expected, f"exclude_frozen_parameters={exclude}")
        assert state["extra"] == "data"

    # a filter keeps the module entries it accepts (DeepSpeed refuses filters; ModelParallelStrategy refuses them
    # for distributed saves)
    path = os.path.join(root, "filtered")
    fabric.save(path, {"model": fresh_model}, filter={"model": lambda name, value: "bias" in name})
    if rank == 0:
        consolidated = consolidate_checkpoint(path)
        assert set(consolidated) == {"w1.bias", "w2.bias", "w3.bias"}
        assert all(type(value) is torch.Tensor for value in consolidated.values())
    fabric.barrier()
    model, _ = train(fabric, seed=9)
    before = full_state(model)
    with pytest.raises(CheckpointError, match="3 missing keys.*state_dict.w1.weight"):
        fabric.load(path, {"model": model})
    fabric.load(path, {"model": model}, strict=False)
    got = full_state(model)
    assert_equal(
        got,
        {key: full_state(fresh_model)[key] if "bias" in key else before[key] for key in before},
        "a filtered checkpoint loaded with strict=False",
    )


def test_exclude_frozen_parameters_and_save_filter(tmp_path):
    run_distributed(_frozen_and_filter_worker, 2, str(tmp_path))
