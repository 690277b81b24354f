"""The intent of Lightning's Fabric-side ``tests_fabric/strategies/test_model_parallel.py`` and
``test_model_parallel_integration.py`` on ``lightning_zero.fabric.ZeroStrategy`` (CPU, 2 gloo ranks).

``ModelParallelStrategy`` is FSDP2 on a data-parallel dimension plus tensor parallelism; here it is stages 2-3 (FSDP2
on the data-parallel mesh). Tensor parallelism is not offered, so the tests of its API are left out. Where
Lightning's test checks behaviour, the numbers are compared with an unsharded run of the same script (Lightning's
single-device Fabric or plain torch). ``README.md`` maps every Lightning test to its port or the reason it is out.
"""

import os
from datetime import timedelta
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_zero.checkpoint import (
    CheckpointError,
    CheckpointSaveError,
    UnsafeCheckpointError,
    consolidate_checkpoint,
)
from lightning_zero.checkpoint.states import optimizer_state_dict
from lightning_zero.fabric import ZeroStrategy
from tests.ranks import run_distributed


class FeedForward(nn.Module):
    """Lightning's ``FeedForward`` (a gated MLP), narrower."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(8, 16)
        self.w3 = nn.Linear(16, 8)

    def forward(self, x):
        return self.w3(nn.functional.silu(self.w1(x)) * self.w2(x))


def launch(strategy, **kwargs) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, **kwargs)
    fabric.launch()  # the ranks exist already (tests.ranks): sets up the process group and the mesh
    return fabric


def inner(model: nn.Module) -> nn.Module:
    """The user's module under Fabric's wrapper (and DDP's at stages 0-1)."""
    model = getattr(model, "_forward_module", model)
    return getattr(model, "module", model)


def full_state(model: nn.Module) -> dict:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in inner(model).state_dict().items()
    }


def optimizer_states(model: nn.Module, optimizer) -> dict:
    """The optimizer's states by parameter name, unsharded (at stage 1 a rank holds those of what it steps)."""
    state = optimizer_state_dict(inner(model), getattr(optimizer, "optimizer", optimizer))["state"]
    return {
        name: {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in values.items()}
        for name, values in state.items()
    }


def assert_states_equal(got: dict, expected: dict, what: str) -> None:
    assert got and set(got) <= set(expected), (what, sorted(got), sorted(expected))
    for name in got:
        assert_equal(got[name], expected[name], f"{what}: {name}")


def train(fabric, model=None, optimizer=None, seed=0, lr=1e-3):
    """Lightning's ``_train``: one AdamW step on a batch every rank draws from the same seed."""
    fabric.seed_everything(seed)
    if model is None:
        with fabric.init_module():
            module = FeedForward()
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=lr))
    fabric.backward(model(torch.rand(2, 8)).sum())
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def assert_equal(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), (what, sorted(set(got) ^ set(expected)))
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=f"{what}: {key}")


# ---------------------------------------------------------------------------------------------- no process group
def test_device_mesh_before_launch_raises():
    with pytest.raises(RuntimeError, match="device mesh exists only after the process group"):
        _ = ZeroStrategy(stage=3).device_mesh


def test_checkpoint_io_plugin_refused():
    with pytest.raises(Exception, match="custom checkpoint_io would be ignored"):
        ZeroStrategy(checkpoint_io=TorchCheckpointIO())
    strategy = ZeroStrategy(stage=3)
    with pytest.raises(NotImplementedError, match="does not use a CheckpointIO plugin"):
        strategy.checkpoint_io = TorchCheckpointIO()


def test_save_checkpoint_storage_options_refused(tmp_path):
    with pytest.raises(TypeError, match="does not take storage_options"):
        ZeroStrategy().save_checkpoint(tmp_path / "x", {"model": nn.Linear(2, 2)}, storage_options={"a": 1})


def test_load_without_objects_to_load_into_is_refused(tmp_path):
    strategy = ZeroStrategy()
    for state in (None, {}):
        with pytest.raises(ValueError, match=r"loads sharded states into existing objects.*fabric.load\(path, "):
            strategy.load_checkpoint(tmp_path, state=state)


@pytest.mark.parametrize("url", ["gs://bucket/run/ckpt", "s3://bucket/ckpt", "local:///tmp/run/ckpt"])
def test_remote_urls_are_refused_by_name(tmp_path, monkeypatch, url):
    """Lightning passes the URL to fsspec uncorrupted; a ZeroStrategy save needs POSIX directory renames (atomic
    saves), so a URL is refused naming it, and nothing is written locally under a mangled name (``gs:``)."""
    monkeypatch.chdir(tmp_path)
    strategy = ZeroStrategy(stage=2)
    with pytest.raises(CheckpointSaveError, match=f"{url.split('://')[0]}:// URL"):
        strategy.save_checkpoint(url, {"model": nn.Linear(2, 2)})
    with pytest.raises(CheckpointSaveError, match=f"{url.split('://')[0]}:// URL"):
        strategy.load_checkpoint(url, {"model": nn.Linear(2, 2)})
    assert os.listdir(tmp_path) == []


def test_save_and_load_path_checks(tmp_path):
    """What is at the path decides: a file or directory that is not a lightning-zero checkpoint is never replaced (a
    ModelParallelStrategy full save overwrites a file); an earlier checkpoint is; loading names what is wrong, and a
    file inside a checkpoint names the directory to pass (as DeepSpeedStrategy suggests the parent)."""
    strategy = ZeroStrategy(stage=2)
    model = nn.Linear(2, 2)
    user_file, user_dir = tmp_path / "file.pt", tmp_path / "not-empty"
    user_file.write_text("mine")
    user_dir.mkdir()
    (user_dir / "file").write_text("mine")
    for path in (user_file, user_dir):
        with pytest.raises(CheckpointSaveError, match="not a lightning-zero checkpoint"):
            strategy.save_checkpoint(path, {"model": model})
    assert user_file.read_text() == "mine" and (user_dir / "file").read_text() == "mine"

    path = tmp_path / "ckpt"
    strategy.save_checkpoint(path, {"model": model, "step": 1})
    newer = nn.Linear(2, 2)
    strategy.save_checkpoint(path, {"model": newer, "step": 2})  # over its own earlier checkpoint
    fresh = nn.Linear(2, 2)
    state = {"model": fresh, "step": 0}
    strategy.load_checkpoint(path, state)
    assert state["step"] == 2 and torch.equal(fresh.weight, newer.weight)

    with pytest.raises(CheckpointError, match="not a complete lightning-zero checkpoint"):
        strategy.load_checkpoint(user_dir, {"model": fresh})  # a directory of something else
    with pytest.raises(FileNotFoundError, match="no sharded checkpoint"):
        strategy.load_checkpoint(tmp_path / "missing", {"model": fresh})
    with pytest.raises(CheckpointError, match=f"inside the checkpoint {path}.*fabric.load\\('{path}'"):
        strategy.load_checkpoint(path / "meta.pt", {"model": fresh})

    # A DeepSpeed checkpoint (fabric.load reads those too): its tag folder is accepted as well as the top folder, a
    # file in it names the top folder
    deepspeed = tmp_path / "deepspeed"
    (deepspeed / "checkpoint").mkdir(parents=True)
    (deepspeed / "latest").write_text("checkpoint")
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (deepspeed / "checkpoint" / name).touch()
    with pytest.raises(CheckpointError, match=f"inside the checkpoint {deepspeed}.*fabric.load\\('{deepspeed}'"):
        strategy.load_checkpoint(
            deepspeed / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt", {"model": fresh}
        )
    for state in ({"other": "data"}, {"model1": fresh, "model2": nn.Linear(2, 2)}):  # one engine's weights inside
        with pytest.raises(ValueError, match="is a DeepSpeed checkpoint, which holds one module"):
            strategy.load_checkpoint(deepspeed, state)


def test_a_single_file_keyed_like_the_state_is_loaded_and_a_bare_state_dict_names_load_raw(tmp_path):
    """As ModelParallelStrategy's ``fabric.load``, one full-state file keyed like the state loads (the numbers:
    ``test_full_state_dicts``); a bare state dict, which has no such keys, is refused naming ``fabric.load_raw``."""
    path, bare = tmp_path / "full.pt", tmp_path / "bare.pt"
    model = nn.Linear(2, 2)
    torch.save({"model": model.state_dict(), "steps": 1}, path)
    torch.save(model.state_dict(), bare)
    target, state = nn.Linear(2, 2), {"steps": 0}
    state["model"] = target
    assert ZeroStrategy().load_checkpoint(path, state) == {} and state["steps"] == 1
    assert all(torch.equal(target.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(CheckpointError, match=r"fabric.load_raw\(path, model\)"):
        ZeroStrategy().load_checkpoint(bare, {"model": nn.Linear(2, 2)})


def test_states_without_a_sharded_module():
    """ModelParallelStrategy saves exactly one distributed model; a ZeroStrategy checkpoint holds any number (several
    are stored side by side, ``tests/fabric/test_fabric_checkpoint.py``), plain values alone, or a module that was
    not set up (saved and loaded as its plain weights, as under DDP)."""
    import tempfile

    strategy = ZeroStrategy(stage=3)
    with tempfile.TemporaryDirectory() as root:
        strategy.save_checkpoint(os.path.join(root, "values"), {"step": 3, "note": "x"})
        state = {"step": 0}
        assert strategy.load_checkpoint(os.path.join(root, "values"), state) == {"note": "x"}
        assert state == {"step": 3}
        plain = nn.Linear(3, 3)
        strategy.save_checkpoint(os.path.join(root, "plain"), {"model": plain})
        other = nn.Linear(3, 3)
        strategy.load_checkpoint(os.path.join(root, "plain"), {"model": other})
        assert torch.equal(other.weight, plain.weight) and torch.equal(other.bias, plain.bias)


class _NonTensorMeta:
    """A picklable object that ``torch.load(weights_only=True)`` refuses."""

    def __init__(self, value):
        self.value = value


def test_non_tensor_metadata_loads_once_allow_listed(tmp_path):
    """Lightning loads checkpoint metadata with ``weights_only=False`` (any pickled object). ZeroStrategy never
    unpickles arbitrary classes: the load names the type and how to allow-list it, and then it round-trips;
    ``weights_only=False`` is refused."""
    strategy = ZeroStrategy(stage=2)
    model = nn.Linear(2, 2)
    strategy.save_checkpoint(tmp_path / "ckpt", {"model": model, "user_meta": _NonTensorMeta(42)})
    state = {"model": model, "user_meta": None}
    with pytest.raises(UnsafeCheckpointError, match="_NonTensorMeta.*add_safe_globals"):
        strategy.load_checkpoint(tmp_path / "ckpt", state)
    with torch.serialization.safe_globals([_NonTensorMeta]):
        strategy.load_checkpoint(tmp_path / "ckpt", state)
    assert isinstance(state["user_meta"], _NonTensorMeta) and state["user_meta"].value == 42
    with pytest.raises(ValueError, match="weights_only=False is not honoured"):
        strategy.load_checkpoint(tmp_path / "ckpt", state, weights_only=False)


# ---------------------------------------------------------------------------------------------- 2 ranks
class _NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))


class _Resettable(_NoReset):
    def reset_parameters(self):
        nn.init.ones_(self.weight)


class _MetaModel(nn.Module):
    """Lightning's ``CustomModel``: a parameterless ``Sequential``, a module without ``reset_parameters``, a buffer
    the root's ``reset_parameters`` fills."""

    def __init__(self, block=_NoReset):
        super().__init__()
        self.layer1 = nn.Sequential(block(), block())
        self.layer2 = nn.Linear(4, 4)
        self.register_buffer("buffer", torch.rand(2))

    def reset_parameters(self):
        self.buffer.fill_(1.0)


def _fsdp1_module() -> nn.Module:
    """A legacy FSDP (FSDP1) wrapper; FSDP1 cannot be constructed on CPU, so this one is built without ``__init__``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    legacy = object.__new__(FullyShardedDataParallel)
    nn.Module.__init__(legacy)
    return legacy


def _setup_worker(rank, world_size):
    import lightning_zero.adapters.process_group as process_group

    seen = {}
    connect = process_group._init_dist_connection

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return connect(*args, **kwargs)

    for stage in (2, 3):
        strategy = ZeroStrategy(stage=stage, timeout=timedelta(seconds=1234))
        with mock.patch.object(process_group, "_init_dist_connection", spy):
            fabric = launch(strategy)
        assert seen.pop("timeout") == timedelta(seconds=1234), "the timeout did not reach the process group"
        mesh = strategy.device_mesh  # 1-D: data parallel only
        assert isinstance(mesh, DeviceMesh) and mesh.ndim == 1 and mesh.size() == world_size
        assert mesh.device_type == fabric.device.type == "cpu"

        for move_to_device in (True, False):  # the strategy places the shards either way
            model = fabric.setup_module(FeedForward(), move_to_device=move_to_device)
            assert isinstance(model.w1.weight, DTensor) and model.w1.weight.device_mesh == mesh
            assert model.w1.weight.device == model.device == fabric.device

        module = FeedForward()
        optimizer = torch.optim.Adam(module.parameters())
        wrapped, [same], _ = strategy.setup_module_and_optimizers(module, [optimizer])
        assert wrapped is module and same is optimizer, "the user's module and optimizer are sharded in place"
        assert all(isinstance(p, DTensor) for p in optimizer.param_groups[0]["params"])

        legacy = FeedForward()
        legacy.inner = _fsdp1_module()
        with pytest.raises(TypeError, match=r"FullyShardedDataParallel \(FSDP1\).*'inner'"):
            fabric.setup_module(legacy)

        with torch.device("meta"):
            model = _MetaModel()
        with pytest.raises(ValueError, match=r"without a reset_parameters\(\) method: layer1.0 \(_NoReset\)"):
            launch(ZeroStrategy(stage=stage)).setup_module(model)
        with torch.device("meta"):
            model = _MetaModel(_Resettable)
        model = launch(ZeroStrategy(stage=stage)).setup_module(model)
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        state = full_state(model)
        assert torch.equal(state["buffer"], torch.ones(2)) and torch.equal(state["layer1.0.weight"], torch.ones(4, 4))


def test_launch_mesh_timeout_setup_and_meta_device_materialization():
    run_distributed(_setup_worker, 2)


def _train_save_load_worker(rank, world_size, root):
    for stage, precision in ((1, "bf16-mixed"), (2, "32-true"), (3, "32-true"), (3, "bf16-mixed")):
        path = os.path.join(root, f"s{stage}-{precision}")
        fabric = launch(ZeroStrategy(stage=stage), precision=precision)
        model, optimizer = train(fabric)
        saved, saved_optimizer = full_state(model), optimizer_states(model, optimizer)
        fabric.save(
            path, {"model": model, "optimizer": optimizer, "steps": 1, "user_data": {"iteration": 5}, "extra": "x"}
        )
        # the layout: DCP's files, the other values in meta.pt, the run's record (zero.json)
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", "zero.json"} <= set(os.listdir(path))
        meta = torch.load(os.path.join(path, "meta.pt"), weights_only=True)
        assert meta["steps"] == 1 and meta["user_data"] == {"iteration": 5} and "model" not in meta

        # re-init everything (another seed), take a step, load
        fabric = launch(ZeroStrategy(stage=stage), precision=precision)
        model, optimizer = train(fabric, seed=7)
        state = {"model": model, "optimizer": optimizer, "steps": 0, "user_data": {"iteration": 0}}
        remainder = fabric.load(path, state)
        assert_equal(full_state(model), saved, f"stage {stage} {precision} weights")
        assert_states_equal(optimizer_states(model, optimizer), saved_optimizer, f"stage {stage} {precision} optimizer")
        assert state["steps"] == 1 and state["user_data"] == {"iteration": 5}
        assert remainder == {"extra": "x"}, "what the state did not ask for comes back"
        with pytest.raises(KeyError, match="'coconut' is not in the checkpoint"):
            fabric.load(path, {"model": model, "coconut": 11})
        state = {"model": model, "coconut": 11}
        fabric.load(path, state, strict=False)
        assert state["coconut"] == 11

        # without the optimizer in the state, only the weights are loaded
        fabric = launch(ZeroStrategy(stage=stage), precision=precision)
        model, optimizer = train(fabric, seed=7)
        untouched = optimizer_states(model, optimizer)
        fabric.load(path, {"model": model})
        assert_equal(full_state(model), saved, f"stage {stage} {precision} weights only")
        assert_states_equal(optimizer_states(model, optimizer), untouched, f"stage {stage} {precision} optimizer kept")

        if rank == 0:  # the saved weights, unsharded, are the model's
            consolidated = consolidate_checkpoint(path)
            assert_equal({k: v.to(torch.float32) for k, v in consolidated.items()}, saved, "consolidated")
        fabric.barrier()


def test_train_save_load_resume(tmp_path):
    run_distributed(_train_save_load_worker, 2, str(tmp_path))


class _RawModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.parameter = nn.Parameter(torch.rand(2, 2))
        self.layer1 = nn.Linear(4, 4)
        self.layer2 = nn.Linear(4, 4)
        self.register_buffer("persistent_buffer", torch.rand(2), persistent=True)
        self.register_buffer("non_persistent_buffer", torch.rand(2), persistent=False)


def _full_state_worker(rank, world_size, root):
    # The unsharded run: Lightning's single-device Fabric, which saves one full-state file
    single = Fabric(accelerator="cpu", devices=1)
    reference, reference_optimizer = train(single)
    single_file = os.path.join(root, "single.pt")
    raw_model, raw_optimizer = os.path.join(root, "model.pt"), os.path.join(root, "optimizer.pt")
    if rank == 0:
        single.save(single_file, {"model": reference, "optimizer": reference_optimizer, "steps": 1})
        checkpoint = torch.load(single_file, weights_only=True)
        torch.save(checkpoint["model"], raw_model)
        torch.save(checkpoint["optimizer"], raw_optimizer)
    torch.distributed.barrier()
    weights, moments = full_state(reference), optimizer_states(reference, reference_optimizer)
    train(single, reference, reference_optimizer, seed=11)
    next_weights = full_state(reference)

    plain = FeedForward()  # a module that is not set up loads as under any strategy
    launch(ZeroStrategy(stage=3)).load_raw(raw_model, plain)
    assert_equal(full_state(plain), weights, "raw load before setup")

    for stage in (1, 2, 3):
        fabric = launch(ZeroStrategy(stage=stage))
        model, optimizer = train(fabric, seed=7, lr=2.0)
        # the single-device Fabric's file, by fabric.load (as ModelParallelStrategy reads it), then by load_raw
        for load in ("fabric.load", "load_raw"):
            model, optimizer = train(fabric, seed=7, lr=2.0)
            if load == "fabric.load":
                state = {"model": model, "optimizer": optimizer, "steps": 0}
                assert fabric.load(single_file, state) == {} and state["steps"] == 1
            else:
                fabric.load_raw(raw_model, model)
                fabric.load_raw(raw_optimizer, optimizer)
            assert_equal(full_state(model), weights, f"stage {stage}: weights from the single-device file ({load})")
            assert_states_equal(
                optimizer_states(model, optimizer), moments, f"stage {stage}: single-device optimizer states ({load})"
            )
            assert optimizer.param_groups[0]["lr"] == 1e-3, "the file's hyper-parameters are restored"
            train(fabric, model, optimizer, seed=11)  # the next step is the single-device run's
            for key, value in full_state(model).items():
                torch.testing.assert_close(
                    value, next_weights[key], rtol=0, atol=1e-6, msg=f"stage {stage} ({load}): {key}"
                )

        # a sharded save, consolidated into one file: plain tensors and Optimizer.state_dict() states
        path, full_file = os.path.join(root, f"sharded-{stage}"), os.path.join(root, f"full-{stage}.pt")
        fabric.save(path, {"model": model, "optimizer": optimizer, "steps": 2})
        if rank == 0:
            consolidate_checkpoint(path, full_file, with_optimizer=True)
            torch.save(torch.load(full_file, weights_only=True)["optimizer_states"][0], raw_optimizer + ".full")
        fabric.barrier()
        full = torch.load(full_file, weights_only=True)
        assert full["steps"] == 2 and all(type(v) is torch.Tensor for v in full["state_dict"].values())
        assert_equal(full["state_dict"], full_state(model), f"stage {stage}: consolidated weights")
        single_model = FeedForward()  # ... loads into the unsharded model and optimizer
        single_model.load_state_dict(full["state_dict"])
        single_optimizer = torch.optim.AdamW(single_model.parameters())
        single_optimizer.load_state_dict(full["optimizer_states"][0])
        expected_states = optimizer_states(model, optimizer)
        assert_states_equal(
            expected_states,
            optimizer_states(single_model, single_optimizer),
            f"stage {stage}: consolidated optimizer states",
        )
        fresh = launch(ZeroStrategy(stage=stage))  # ... and into a sharded run
        again, again_optimizer = train(fresh, seed=5)
        fresh.load_raw(full_file, again)
        fresh.load_raw(raw_optimizer + ".full", again_optimizer)
        assert_equal(full_state(again), full_state(model), f"stage {stage}: consolidated file into a sharded model")
        assert_states_equal(
            optimizer_states(again, again_optimizer),
            expected_states,
            f"stage {stage}: consolidated optimizer states into a sharded optimizer",
        )
    with pytest.raises(CheckpointError, match="this is a directory: load a sharded checkpoint with fabric.load"):
        fabric.load_raw(path, model)

    # a parameter of the root module, buffers (persistent or not), strict and non-strict loads
    torch.manual_seed(0)
    expected = _RawModel().state_dict()
    if rank == 0:
        torch.save(expected, raw_model)
        torch.save({k: v for k, v in expected.items() if k != "parameter"}, raw_model + ".partial")
    fabric.barrier()
    torch.manual_seed(1)
    model = fabric.setup_module(_RawModel())
    fabric.load_raw(raw_model, model)
    assert_equal(full_state(model), expected, "raw module state")
    with pytest.raises(CheckpointError, match="missing.*parameter"):
        fabric.load_raw(raw_model + ".partial", model)
    fabric.load_raw(raw_model + ".partial", model, strict=False)


def test_full_state_dicts(tmp_path):
    run_distributed(_full_state_worker, 2, str(tmp_path))


def _clip_worker(rank, world_size):
    for stage, precision, offload in (
        (1, "32-true", None),
        (2, "bf16-mixed", None),
        (2, "32-true", "cpu"),
        (3, "32-true", None),
        (3, "bf16-mixed", None),
    ):
        for how in ("value", "norm"):
            fabric = launch(ZeroStrategy(stage=stage, offload=offload), precision=precision)
            module = nn.Linear(32, 2, bias=False)
            module.weight.data.fill_(0.01)
            model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1.0))
            fabric.backward(model(torch.full((1, 32), 0.1)).sum())  # every gradient is the same number
            main = list(fabric.strategy.precision.main_params(optimizer.optimizer))
            grad = torch.cat(
                [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).flatten() for p in main]
            )
            value, norm = grad[0].item(), grad.norm().item()
            assert torch.all(grad == value) and grad.numel() == 64
            if how == "value":
                fabric.clip_gradients(model, optimizer, clip_val=value / 2)
                expected = value / 2
            else:
                returned = fabric.clip_gradients(model, optimizer, max_norm=norm / 4)
                assert returned.item() == pytest.approx(norm, rel=1e-6), "the norm before clipping"
                expected = value * (norm / 4) / (norm + 1e-6)  # torch's clip coefficient (its eps included)
            clipped = torch.cat(
                [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).flatten() for p in main]
            )
            torch.testing.assert_close(clipped, torch.full_like(clipped, expected), rtol=1e-6, atol=0)
            optimizer.step()  # SGD with lr 1: the weights move by the clipped gradient
            weight = full_state(model)["weight"]
            torch.testing.assert_close(
                weight,
                torch.full_like(weight, 0.01 - expected),
                rtol=1e-6,
                atol=0,
                msg=f"stage {stage} {precision} offload={offload} clip by {how}",
            )


def test_clip_gradients_by_value_and_norm():
    run_distributed(_clip_worker, 2)
