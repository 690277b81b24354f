"""``fabric.save``/``fabric.load`` with the Fabric ZeroStrategy: a sharded, atomic directory; resuming equals not
stopping, also at another stage (resharding on load); ``lightning-zero consolidate`` reads it."""

import contextlib
import os

import pytest
import torch

from lightning_zero.checkpoint.consolidate import consolidate_checkpoint
from lightning_zero.checkpoint.directory import is_sharded_checkpoint, read_checkpoint_info
from lightning_zero.checkpoint.safe_load import read_dcp_metadata
from lightning_zero.cli import main as lightning_zero_cli
from lightning_zero.fabric import ZeroStrategy
from tests.distributed.test_zero_parity import STEPS, TinyNet, make_optimizer
from tests.fabric.test_fabric_parity import fabric_train, full_weights, make_fabric
from tests.ranks import run_distributed


def _unwrapped(model):
    inner = model._forward_module
    return getattr(inner, "module", inner)


def _roundtrip_worker(rank, world_size, path, save_stage, load_stage):
    # Uninterrupted: STEPS steps.
    fabric = make_fabric(ZeroStrategy(stage=save_stage, offload="cpu" if save_stage == 1 else None))
    model, optimizer = fabric_train(fabric, rank, world_size, steps=range(1))
    state = {"model": model, "optimizer": optimizer, "step": 1, "note": {"lr": [1, 2]}}
    fabric.save(path, state)
    at_save = full_weights(_unwrapped(model))
    fabric_train(fabric, rank, world_size, steps=range(1, STEPS), model=model, optimizer=optimizer)
    uninterrupted = full_weights(_unwrapped(model))

    # Resumed: a fresh model (other init), another stage, load, the remaining steps.
    fabric = make_fabric(ZeroStrategy(stage=load_stage))
    torch.manual_seed(123)
    with fabric.init_module():
        module = TinyNet()
    model, optimizer = fabric.setup(module, make_optimizer(module))
    state = {"model": model, "optimizer": optimizer, "step": 0, "note": None}
    remainder = fabric.load(path, state)
    assert state["step"] == 1 and state["note"] == {"lr": [1, 2]} and remainder == {}
    loaded = full_weights(_unwrapped(model))
    assert all(torch.equal(loaded[k], at_save[k]) for k in at_save)
    fabric_train(fabric, rank, world_size, steps=range(1, STEPS), model=model, optimizer=optimizer)
    resumed = full_weights(_unwrapped(model))
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=0, atol=0, msg=key)
    if rank == 0:
        torch.save(at_save, os.path.join(os.path.dirname(path), "at_save.pt"))
    # fabric.save(filter=...) keeps only the module entries the filter accepts
    filtered = path + ".blocks"
    fabric.save(filtered, {"model": model}, filter={"model": lambda name, value: name.startswith("blocks.")})
    stored = read_dcp_metadata(filtered).state_dict_metadata
    assert {k for k in stored if k.startswith("state_dict.")} == {
        f"state_dict.{k}" for k in at_save if k.startswith("blocks.")
    }


@pytest.mark.parametrize(("save_stage", "load_stage"), [(3, 1), (1, 2)])
def test_save_load_resume_equals_uninterrupted_and_consolidates(tmp_path, save_stage, load_stage):
    path = str(tmp_path / "fabric.ckpt")
    run_distributed(_roundtrip_worker, 2, path, save_stage, load_stage)
    assert is_sharded_checkpoint(path)
    assert read_checkpoint_info(path)["stage"] == save_stage
    out = tmp_path / "consolidated.pt"
    if save_stage == 3:
        assert lightning_zero_cli(["consolidate", path, str(out)]) == 0  # `lightning-zero consolidate`
    else:
        consolidate_checkpoint(path, str(out))
    consolidated = torch.load(out, weights_only=True)
    at_save = torch.load(tmp_path / "at_save.pt", weights_only=True)
    assert consolidated["step"] == 1
    assert set(consolidated["state_dict"]) == set(at_save)
    for key, value in at_save.items():
        assert torch.equal(consolidated["state_dict"][key], value), key
    TinyNet().load_state_dict(consolidated["state_dict"])  # loads straight into the unwrapped module


def _two_modules_worker(rank, world_size, path):
    """A GAN-like state: two modules and two optimizers in one checkpoint, at stage 2."""

    def build(fabric, seed):
        torch.manual_seed(seed)
        a, b = TinyNet(), TinyNet()
        (a, opt_a), (b, opt_b) = fabric.setup(a, make_optimizer(a)), fabric.setup(b, make_optimizer(b))
        return {"gen": a, "disc": b, "opt_gen": opt_a, "opt_disc": opt_b}

    def step(fabric, state, seed):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + rank))
        fabric.backward(state["gen"](x).pow(2).mean() + state["disc"](x).abs().mean())
        for key in ("opt_gen", "opt_disc"):
            state[key].step()
            state[key].zero_grad()

    fabric = make_fabric(ZeroStrategy(stage=2))
    state = build(fabric, 0)
    step(fabric, state, 1)
    fabric.save(path, state)
    step(fabric, state, 2)
    expected = {k: full_weights(_unwrapped(state[k])) for k in ("gen", "disc")}
    fresh = build(fabric, 7)
    fabric.load(path, fresh)
    step(fabric, fresh, 2)
    for key in ("gen", "disc"):
        got = full_weights(_unwrapped(fresh[key]))
        assert all(torch.equal(got[name], expected[key][name]) for name in got), key


def test_two_modules_and_their_optimizers_in_one_checkpoint(tmp_path):
    path = str(tmp_path / "gan.ckpt")
    run_distributed(_two_modules_worker, 2, path)
    consolidate_checkpoint(path, str(tmp_path / "gan.pt"))
    weights = torch.load(tmp_path / "gan.pt", weights_only=True)["state_dict"]
    assert {k.split(".")[0] for k in weights} == {"gen", "disc"}


@contextlib.contextmanager
def _counting_checkpoint_reads():
    """Count, while inside, the reads of a checkpoint's three small files by their three readers; yields the counts."""
    import json

    from lightning_zero.checkpoint import safe_load

    counts = {"zero.json": 0, ".metadata": 0, "meta.pt": 0}
    json_load, torch_load, unpickle = json.load, torch.load, safe_load.DCPMetadataUnpickler.load

    def counted_json_load(file, *args, **kwargs):
        counts["zero.json"] += os.path.basename(getattr(file, "name", "")) == "zero.json"
        return json_load(file, *args, **kwargs)

    def counted_torch_load(source, *args, **kwargs):
        counts["meta.pt"] += isinstance(source, str) and os.path.basename(source) == "meta.pt"
        return torch_load(source, *args, **kwargs)

    def counted_unpickle(self):
        counts[".metadata"] += 1
        return unpickle(self)

    patches = [
        (json, "load", counted_json_load),
        (torch, "load", counted_torch_load),
        (safe_load.DCPMetadataUnpickler, "load", counted_unpickle),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield counts
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


def _reads_once_worker(rank, world_size, path):
    fabric = make_fabric(ZeroStrategy(stage=2))
    model, optimizer = fabric_train(fabric, rank, world_size, steps=range(1))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    state = {"model": model, "optimizer": optimizer, "step": 0}
    with _counting_checkpoint_reads() as counts:
        fabric.load(path, state)
    assert state["step"] == 1
    # Each small file of the checkpoint is read (and verified) once per load, DCP's own .metadata read included.
    assert counts == {"zero.json": 1, ".metadata": 1, "meta.pt": 1}, counts


def test_load_reads_each_checkpoint_record_once(tmp_path):
    run_distributed(_reads_once_worker, 2, str(tmp_path / "once.ckpt"))


def test_save_states_and_load_states_take_explicit_arguments_no_strategy(tmp_path):
    # The shared checkpoint helper both adapters call, without a strategy object (Fabric used to fake one).
    from lightning_zero.checkpoint import states as checkpointing

    torch.manual_seed(0)
    module = TinyNet()
    next(module.parameters()).requires_grad_(False)
    frozen = checkpointing.frozen_parameter_names(module)
    optimizer = make_optimizer(module)
    module(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    checkpoint = {
        "state_dict": checkpointing.module_state_dict(module),
        "optimizer_states": [checkpointing.optimizer_state_dict(module, optimizer)],
        "step": 1,
    }
    path = str(tmp_path / "states.ckpt")
    checkpointing.save_states(
        checkpoint,
        path,
        module=module,
        optimizers=[optimizer],
        stage=0,
        offload=None,
        exclude_frozen_parameters=True,
        ds_config_report=None,
        async_save=False,
    )
    info = read_checkpoint_info(path)
    assert info["stage"] == 0 and info["optimizers"] == [checkpointing.optimizer_type(optimizer)]
    stored = read_dcp_metadata(path).state_dict_metadata
    # excluded (and recorded in meta.pt, below)
    assert frozen and not any(f"state_dict.{name}" in stored for name in frozen)

    torch.manual_seed(1)
    fresh = TinyNet()
    fresh.load_state_dict({**fresh.state_dict(), **{name: saved[name] for name in frozen}})
    fresh_optimizer = make_optimizer(fresh)
    from lightning_zero.checkpoint.safe_load import load_meta

    meta = load_meta(path)
    assert meta["frozen_parameters_excluded"] == frozen and meta["step"] == 1
    checkpointing.load_states(path, meta, fresh, [fresh_optimizer], strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    assert fresh_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


def test_consolidation_reads_each_checkpoint_record_once(tmp_path):
    # DCPTensorSource verifies the checkpoint and then uses what verification read (.metadata, meta.pt), instead of
    # unpickling .metadata and loading meta.pt a second time.
    from lightning_zero.checkpoint.io import save_sharded_checkpoint

    model = TinyNet()
    path = str(tmp_path / "plain.ckpt")
    save_sharded_checkpoint(path, {"state_dict": model.state_dict()}, {"epoch": 1})
    with _counting_checkpoint_reads() as counts:
        consolidate_checkpoint(path, str(tmp_path / "out.ckpt"))
    assert counts == {"zero.json": 1, ".metadata": 1, "meta.pt": 1}, counts
    assert torch.load(tmp_path / "out.ckpt", weights_only=True)["epoch"] == 1


def _full_file_worker(rank, world_size, path):
    from lightning_zero.checkpoint.full_save import FULL_FILE_MARKER, staging_directory

    fabric = make_fabric(ZeroStrategy(stage=3, state_dict_type="full"))
    model, optimizer = fabric_train(fabric, rank, world_size, steps=range(1))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    at_save = full_weights(_unwrapped(model))
    if rank == 0:
        assert os.path.isfile(path) and not os.path.exists(staging_directory(path))
        stored = torch.load(path, weights_only=True)
        # Fabric's layout, as Lightning's FSDP strategy writes it: each object under its state key
        assert stored[FULL_FILE_MARKER] is True and stored["step"] == 1 and stored["optimizer"]["state"]
        assert all(torch.equal(stored["model"][k], v) for k, v in at_save.items())
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})  # our own file is replaced
    fabric_train(fabric, rank, world_size, steps=range(1, STEPS), model=model, optimizer=optimizer)
    uninterrupted = full_weights(_unwrapped(model))
    # resumed at stage 2 (the file reshards like any full checkpoint), the remaining steps as uninterrupted
    fabric = make_fabric(ZeroStrategy(stage=2))
    torch.manual_seed(123)
    with fabric.init_module():
        module = TinyNet()
    model, optimizer = fabric.setup(module, make_optimizer(module))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(path, state) == {} and state["step"] == 1
    assert all(torch.equal(full_weights(_unwrapped(model))[k], v) for k, v in at_save.items())
    fabric_train(fabric, rank, world_size, steps=range(1, STEPS), model=model, optimizer=optimizer)
    for key, value in full_weights(_unwrapped(model)).items():
        torch.testing.assert_close(value, uninterrupted[key], rtol=0, atol=0, msg=key)


def test_state_dict_type_full_writes_one_file_that_resumes_at_another_stage(tmp_path):
    run_distributed(_full_file_worker, 2, str(tmp_path / "fabric.pth"))
