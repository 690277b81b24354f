"""The checkpoint tests of Lightning's Fabric-side ``tests_fabric/strategies/test_fsdp.py`` and
``test_fsdp_integration.py`` on ``lightning_zero.fabric.ZeroStrategy`` (CPU, 2 gloo ranks): sharded saves and
loads, one-file checkpoints both ways (``fabric.load`` of a file, ``state_dict_type="full"``), filters, refusals.
``README.md`` maps every Lightning test to its port or the reason it is left out; the set-up tests are in
``test_fabric_fsdp_port.py``.
"""

import os

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero.checkpoint import CheckpointError
from lightning_zero.checkpoint.atomic import CheckpointSaveError
from lightning_zero.checkpoint.consolidate import consolidate_checkpoint
from lightning_zero.checkpoint.full_save import FULL_FILE_MARKER
from tests.conformance.fabric_models import (
    IN,
    OUT,
    compute_dtypes,
    fresh_run,
    full_weights,
    make_fabric,
    max_diff,
    train_step,
)
from tests.ranks import run_distributed


class _Net(nn.Sequential):
    """The model of Lightning's ``_Trainer``."""

    def __init__(self):
        super().__init__(nn.Linear(IN, IN), nn.ReLU(), nn.Linear(IN, OUT))


def _train_save_load_worker(rank, world_size, root):
    """``test_train_save_load``: train, save (a sharded directory), resume into a fresh run: exact weights and
    optimizer states, user values back; a key the checkpoint lacks is an error unless ``strict=False``. The
    "wrapping" cases are the units ``sharded_module_classes`` makes; every unit computes in the precision's dtype."""
    for stage, precision, classes in ((3, "32-true", None), (3, "bf16-mixed", {nn.Linear}), (2, "bf16-mixed", None)):
        where = (stage, precision, classes)
        path = os.path.join(root, f"ckpt-{stage}-{precision}")
        fabric = make_fabric(stage, precision=precision, sharded_module_classes=classes)
        model, optimizer = fresh_run(fabric, seed=0, model_fn=_Net)
        assert all(p.dtype == torch.float32 for p in model.parameters()), where  # fp32 masters
        assert compute_dtypes(model) == {torch.bfloat16 if precision == "bf16-mixed" else torch.float32}, where
        at_save = full_weights(model)
        fabric.save(path, {"model": model, "optimizer": optimizer, "steps": 1})
        assert {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(path)), where

        resumed = make_fabric(stage, precision=precision, sharded_module_classes=classes)
        model2, optimizer2 = fresh_run(resumed, seed=1, model_fn=_Net)
        assert max_diff(full_weights(model2), at_save) > 0
        state = {"model": model2, "optimizer": optimizer2, "steps": 0}
        metadata = resumed.load(path, state)
        assert max_diff(full_weights(model2), at_save) == 0.0 and state["steps"] == 1 and metadata == {}, where
        train_step(fabric, model, optimizer, seed=2)  # the optimizer states came back too: the next step agrees
        train_step(resumed, model2, optimizer2, seed=2)
        assert max_diff(full_weights(model2), full_weights(model)) == 0.0, where
        with pytest.raises(KeyError, match="coconut"):
            resumed.load(path, {"model": model2, "coconut": 11})
        state = {"model": model2, "coconut": 11}
        resumed.load(path, state, strict=False)
        assert state["coconut"] == 11


def test_train_save_load(tmp_path):
    run_distributed(_train_save_load_worker, 2, str(tmp_path))


class _Opaque:
    """Not a tensor or a plain container: loading it needs unpickling an arbitrary class."""


def _check_path_exists(fabric, model, root, rank):
    """``test_save_checkpoint_path_exists``: Lightning's FSDP replaces whatever is at the path; ZeroStrategy replaces
    only its own checkpoint and refuses (on every rank) a file or directory of the user's, keeping it."""
    for what in ("file", "directory", "checkpoint"):
        path = os.path.join(root, f"exists-{what}")
        if rank == 0 and what == "file":
            with open(path, "w") as f:
                f.write("mine")
        elif rank == 0 and what == "directory":
            os.makedirs(path)
            with open(os.path.join(path, "file"), "w") as f:
                f.write("mine")
        fabric.barrier()
        if what == "checkpoint":
            fabric.save(path, {"model": model, "steps": 1})
            fabric.save(path, {"model": model, "steps": 2})
            state = {"model": model, "steps": 0}
            fabric.load(path, state)
            assert state["steps"] == 2
            continue
        with pytest.raises(CheckpointSaveError, match="not a lightning-zero checkpoint"):
            fabric.save(path, {"model": model})
        assert os.path.isfile(path if what == "file" else os.path.join(path, "file"))


def _check_module_count(fabric, root):
    """``test_save/load_checkpoint_one_fsdp_module_required``: Lightning's FSDP wants exactly one FSDP model in the
    state. ZeroStrategy saves and loads any number: none (plain values only), or several, each under its key."""
    path = os.path.join(root, "values-only")
    fabric.save(path, {"steps": 3, "note": "x"})
    state = {"steps": 0}
    assert fabric.load(path, state) == {"note": "x"} and state["steps"] == 3
    path = os.path.join(root, "two-modules")
    torch.manual_seed(0)
    first, second = fabric.setup(nn.Linear(2, 2)), fabric.setup(nn.Linear(2, 3))
    fabric.save(path, {"first": first, "second": second})
    saved = full_weights(first), full_weights(second)
    torch.manual_seed(1)
    first, second = fabric.setup(nn.Linear(2, 2)), fabric.setup(nn.Linear(2, 3))
    fabric.load(path, {"first": first, "second": second})
    assert max_diff(full_weights(first), saved[0]) == max_diff(full_weights(second), saved[1]) == 0.0


def _check_filter(fabric, model, root, rank):
    """``test_save_filter`` (sharded): Lightning's FSDP refuses a filter with sharded checkpoints because it cannot
    load them; here the filtered checkpoint holds only the kept weights and loads with ``strict=False``."""
    path = os.path.join(root, "filtered")
    fabric.save(path, {"model": model}, filter={"model": lambda name, value: "bias" in name})
    if rank == 0:
        weights = consolidate_checkpoint(path)
        assert set(weights) == {"bias"} and type(weights["bias"]) is torch.Tensor
    with pytest.raises(Exception, match="weight"):
        fabric.load(path, {"model": model})
    fabric.load(path, {"model": model}, strict=False)


def _check_weights_only(fabric, model, root, rank):
    """``test_load_sharded_checkpoint_metadata_weights_only`` and ``..._honors_explicit_weights_only``: the
    metadata is always read with ``weights_only=True`` (an arbitrary object is refused, never unpickled)."""
    path = os.path.join(root, "unsafe")
    fabric.save(path, {"model": model})
    if rank == 0:
        torch.save({"evil": _Opaque()}, os.path.join(path, "meta.pt"))
    fabric.barrier()
    with pytest.raises(Exception, match="(?i)weights_only|unsafe|unsupported global"):
        fabric.load(path, {"model": model})


def _checkpoint_cases_worker(rank, world_size, root):
    fabric = make_fabric(3)
    model, _ = fresh_run(fabric)
    _check_path_exists(fabric, model, root, rank)
    _check_module_count(fabric, root)
    _check_filter(fabric, model, root, rank)
    _check_weights_only(fabric, model, root, rank)


def test_checkpoint_cases(tmp_path):
    run_distributed(_checkpoint_cases_worker, 2, str(tmp_path))


def _single_device_run(root):
    """Lightning's own single-device Fabric: one step, a one-file checkpoint, one more step (rank 0 writes)."""
    path, after = os.path.join(root, "single.pt"), os.path.join(root, "single-after.pt")
    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = fresh_run(fabric, seed=0)
    fabric.save(path, {"model": model, "optimizer": optimizer, "steps": 1})
    train_step(fabric, model, optimizer, seed=1)
    torch.save(full_weights(model), after)
    return path, after


def _full_file_worker(rank, world_size, root):
    """``test_load_full_state_dict_into_sharded_model`` and ``test_save_sharded_and_consolidate_and_load``:
    ``fabric.load`` of one file (a single-device Fabric checkpoint, a consolidated ZeroStrategy checkpoint) into a
    sharded model and optimizer, each rank reading its slices; the next step equals the single-device run's.
    ``fabric.load_raw`` of the bare model state dict too."""
    if rank == 0:
        _single_device_run(root)
    torch.distributed.barrier()
    path, after = os.path.join(root, "single.pt"), os.path.join(root, "single-after.pt")
    saved = torch.load(path, weights_only=True)
    after = torch.load(after, weights_only=True)
    raw = os.path.join(root, "raw.pt")
    if rank == 0:
        torch.save(saved["model"], raw)
    for stage in (1, 3):
        fabric = make_fabric(stage)
        model, optimizer = fresh_run(fabric, seed=5)
        state = {"model": model, "optimizer": optimizer, "steps": 44}
        assert fabric.load(path, state) == {} and state["steps"] == 1, stage
        assert max_diff(full_weights(model), saved["model"]) == 0.0, stage
        train_step(fabric, model, optimizer, seed=1)
        assert max_diff(full_weights(model), after) <= 1e-6, stage
        fabric.load_raw(raw, model)
        assert max_diff(full_weights(model), saved["model"]) == 0.0, stage
        # sharded save, consolidated into one file, loaded into a run at another stage
        sharded, consolidated = os.path.join(root, f"sharded-{stage}"), os.path.join(root, f"consolidated-{stage}.pt")
        fabric.save(sharded, {"model": model, "optimizer": optimizer, "steps": 7})
        if rank == 0:
            consolidate_checkpoint(sharded, consolidated, with_optimizer=True)
        fabric.barrier()
        other = make_fabric(4 - stage)
        model2, optimizer2 = fresh_run(other, seed=6)
        state = {"model": model2, "optimizer": optimizer2, "steps": 0}
        assert other.load(consolidated, state) == {} and state["steps"] == 7, stage
        assert max_diff(full_weights(model2), full_weights(model)) == 0.0, stage
        train_step(fabric, model, optimizer, seed=3)
        train_step(other, model2, optimizer2, seed=3)
        assert max_diff(full_weights(model2), full_weights(model)) <= 1e-6, stage
    # plain values alone; refusals name what is wrong (a key the file lacks, a file of another kind)
    state = {"steps": 0}
    assert set(fabric.load(path, state)) == {"model", "optimizer"} and state["steps"] == 1
    with pytest.raises(CheckpointError, match="'optimizer'"):
        fabric.load(raw, {"model": model, "optimizer": optimizer})
    with pytest.raises(CheckpointError, match=r"holds the modules \['model'\]"):
        fabric.load(os.path.join(root, "consolidated-3.pt"), {"net": model})


def test_load_full_checkpoint_file(tmp_path):
    run_distributed(_full_file_worker, 2, str(tmp_path))


def _full_save_worker(rank, world_size, root):
    """``test_save_full_state_dict`` and ``test_save_filter`` (full): ``state_dict_type="full"`` writes one file
    in Fabric's own layout (``{"model": state dict, "optimizer": Optimizer.state_dict(), ...}``), which a
    single-device Fabric and a ZeroStrategy run at any stage load; the next step agrees everywhere."""
    path = os.path.join(root, "full.pt")
    fabric = make_fabric(3, state_dict_type="full")
    model, optimizer = fresh_run(fabric)
    fabric.save(path, {"model": model, "optimizer": optimizer, "steps": 1})
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["steps"] == 1 and set(checkpoint["optimizer"]) == {"state", "param_groups"}
    assert max_diff(checkpoint["model"], full_weights(model)) == 0.0
    train_step(fabric, model, optimizer, seed=1)
    expected = full_weights(model)
    # 1. back into ZeroStrategy runs
    for stage in (1, 2):
        other = make_fabric(stage)
        model2, optimizer2 = fresh_run(other, seed=3)
        state = {"model": model2, "optimizer": optimizer2}
        assert other.load(path, state) == {"steps": 1}, stage
        train_step(other, model2, optimizer2, seed=1)
        assert max_diff(full_weights(model2), expected) <= 1e-6, stage
    # 2. into Lightning's single-device Fabric (each rank reads the file; nothing is written)
    single = Fabric(accelerator="cpu", devices=1)
    model3, optimizer3 = fresh_run(single, seed=4)
    remainder = single.load(path, {"model": model3, "optimizer": optimizer3})
    assert remainder == {"steps": 1, FULL_FILE_MARKER: True}  # the marker lets a later save replace the file
    train_step(single, model3, optimizer3, seed=1)
    assert max_diff(full_weights(model3), expected) <= 1e-6
    # filter: only the kept weights are written
    filtered = os.path.join(root, "filtered.pt")
    fabric.save(filtered, {"model": model}, filter={"model": lambda name, value: "bias" in name})
    weights = torch.load(filtered, weights_only=True)["model"]
    assert set(weights) == {"bias"} and type(weights["bias"]) is torch.Tensor
    # a file that is not such a checkpoint is refused, and kept
    mine = os.path.join(root, "mine.pt")
    if rank == 0:
        torch.save({"mine": torch.ones(1)}, mine)
    fabric.barrier()
    with pytest.raises(CheckpointSaveError, match="not a lightning-zero full checkpoint"):
        fabric.save(mine, {"model": model})
    assert torch.equal(torch.load(mine, weights_only=True)["mine"], torch.ones(1))


def test_save_full_state_dict(tmp_path):
    run_distributed(_full_save_worker, 2, str(tmp_path))
