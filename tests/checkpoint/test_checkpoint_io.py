"""Sharded save/load: resharding across world sizes and layouts, atomic saves under a crash, async saves, safety."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_zero.checkpoint import (
    CheckpointError,
    UnsafeCheckpointError,
    is_sharded_checkpoint,
    load_meta,
    load_sharded_checkpoint,
    read_checkpoint_info,
    save_sharded_checkpoint,
    wait_for_pending_saves,
)
from lightning_zero.checkpoint import io as ckpt_io
from tests.ranks import kill_rank_in_the_middle_of_the_next_save, run_distributed
from tests.reliability.tamper import reseal


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 7 and 5 rows do not divide by 2 or 4: shards are uneven and some ranks hold empty ones.
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))


def sharded(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def state_of(model: torch.nn.Module, step: float) -> dict:
    return {"state_dict": model.state_dict(), "optimizer_states": {"step": torch.tensor(step)}}


META = {"epoch": 3, "global_step": 42, "hyper_parameters": {"lr": 0.1, "name": "tiny"}}


def check_loads(path: str, reference: dict, world_size: int) -> None:
    """Load ``path`` into a DTensor (FSDP2) layout and a plain layout; both must equal ``reference``."""
    layouts = {"plain": make_model(seed=99)}
    if world_size > 1:
        layouts["dtensor"] = sharded(make_model(seed=99), world_size)
    for layout, model in layouts.items():
        state = state_of(model, step=0.0)
        meta = load_sharded_checkpoint(path, state)
        assert meta == META
        assert state["optimizer_states"]["step"].item() == 7.0
        loaded = model.state_dict()
        assert set(loaded) == set(reference)
        for key, value in loaded.items():
            assert torch.equal(full(value), reference[key]), (layout, key)
        if layout == "dtensor":
            assert isinstance(loaded["0.weight"], DTensor)


def save_worker(rank: int, world_size: int, directory: str, load_from: list) -> None:
    model = sharded(make_model(seed=world_size), world_size)
    path = os.path.join(directory, f"ws{world_size}.ckpt")
    save_sharded_checkpoint(path, state_of(model, step=7.0), META, info={"stage": 3})
    reference = {k: full(v) for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(reference, os.path.join(directory, f"ref{world_size}.pt"))
        assert read_checkpoint_info(path)["world_size"] == world_size
    for source in load_from:
        dist.barrier()
        expected = torch.load(os.path.join(directory, f"ref{source}.pt"), weights_only=True)
        check_loads(os.path.join(directory, f"ws{source}.ckpt"), expected, world_size)


def async_worker(rank: int, world_size: int, directory: str) -> None:
    model = sharded(make_model(seed=5), world_size)
    path = os.path.join(directory, "async.ckpt")
    first = {k: full(v).clone() for k, v in model.state_dict().items()}
    handle = save_sharded_checkpoint(path, state_of(model, 7.0), META, async_save=True)
    assert handle is not None
    with torch.no_grad():  # training goes on while the save is written: must not leak into the checkpoint
        for parameter in model.parameters():
            parameter.add_(1.0)
    second = {k: full(v).clone() for k, v in model.state_dict().items()}
    # The next save waits for the pending one first, then replaces it atomically.
    save_sharded_checkpoint(path, state_of(model, 7.0), META, async_save=True)
    wait_for_pending_saves()
    assert is_sharded_checkpoint(path) and not os.path.exists(ckpt_io._partial_dir(os.path.abspath(path)))
    check_loads(path, second, world_size)
    assert not all(torch.equal(first[k], second[k]) for k in first)


def test_async_saves_release_the_saved_state_without_the_cyclic_collector(tmp_path):
    """A finished async save keeps no reference to the state it was given (nor to its pending handle): with the
    cyclic collector off, the tensors are freed as soon as the caller drops them."""
    import gc
    import weakref

    alive = []
    gc.collect()
    gc.disable()
    try:
        for i in range(3):
            tensors = {"a": torch.randn(64), "b": torch.randn(8, 8)}
            alive += [weakref.ref(t) for t in tensors.values()]
            handle = save_sharded_checkpoint(
                str(tmp_path / f"c{i}.ckpt"), {"state_dict": tensors}, {"step": i}, async_save=True
            )
            wait_for_pending_saves()
            alive.append(weakref.ref(handle))
            del tensors, handle
        assert [ref for ref in alive if ref() is not None] == []
    finally:
        gc.enable()


def crash_worker(rank: int, world_size: int, directory: str) -> None:
    path = os.path.join(directory, "crash.ckpt")
    model = sharded(make_model(seed=world_size), world_size)
    save_sharded_checkpoint(path, state_of(model, 7.0), META)
    reference = {k: full(v) for k, v in model.state_dict().items()}  # collective: every rank gathers
    if rank == 0:
        torch.save(reference, os.path.join(directory, "crash_ref.pt"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-3.0)

    kill_rank_in_the_middle_of_the_next_save(1)
    save_sharded_checkpoint(path, state_of(model, 7.0), META)
    raise AssertionError("the save should not complete when a rank died in the middle")


def test_reshard_between_world_sizes_and_layouts(tmp_path):
    run_distributed(save_worker, 2, str(tmp_path), [])
    run_distributed(save_worker, 4, str(tmp_path), [2])
    run_distributed(async_worker, 2, str(tmp_path))
    # and on one process without any process group
    for source in (2, 4):
        expected = torch.load(tmp_path / f"ref{source}.pt", weights_only=True)
        check_loads(str(tmp_path / f"ws{source}.ckpt"), expected, world_size=1)


def test_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(Exception):  # noqa: B017  (the crashed rank's failure, whichever way it surfaces)
        run_distributed(crash_worker, 2, str(tmp_path))
    path = tmp_path / "crash.ckpt"
    partial = tmp_path / ".crash.ckpt.partial"
    assert partial.is_dir() and not is_sharded_checkpoint(partial)  # the half-written save is not a checkpoint
    check_loads(str(path), torch.load(tmp_path / "crash_ref.pt", weights_only=True), world_size=1)
    # The next save cleans the leftover up.
    save_sharded_checkpoint(path, state_of(make_model(1), 7.0), META)
    assert not partial.exists()


def test_crash_between_the_two_renames_falls_back_to_old(tmp_path):
    path = tmp_path / "swap.ckpt"
    model = make_model(3)
    save_sharded_checkpoint(path, state_of(model, 7.0), META)
    os.rename(path, tmp_path / ".swap.ckpt.old")  # as if the process died right after moving the old one away
    check_loads(str(path), {k: v.clone() for k, v in model.state_dict().items()}, world_size=1)


def test_single_process_save_replaces_and_validates(tmp_path):
    path = tmp_path / "x.ckpt"
    save_sharded_checkpoint(path, state_of(make_model(1), 7.0), META)
    model = make_model(2)
    save_sharded_checkpoint(path, state_of(model, 7.0), META)
    check_loads(str(path), {k: v.clone() for k, v in model.state_dict().items()}, world_size=1)
    assert not os.path.exists(tmp_path / ".x.ckpt.old")
    with pytest.raises(ValueError, match="both"):
        save_sharded_checkpoint(path, state_of(model, 7.0), {"state_dict": 1})
    with pytest.raises(CheckpointError, match="not a complete"):
        load_sharded_checkpoint(tmp_path, {})


class _Evil:
    def __reduce__(self):
        return (exec, (f"open({MARKER!r}, 'w').write('pwned')",))


MARKER = "/tmp/lightning_zero_test_pwned_marker"


@pytest.fixture
def marker():
    if os.path.exists(MARKER):
        os.remove(MARKER)
    yield MARKER
    assert not os.path.exists(MARKER), "unpickling executed code from the checkpoint"


def test_meta_pt_with_code_is_refused(tmp_path, marker):
    path = tmp_path / "m.ckpt"
    save_sharded_checkpoint(path, state_of(make_model(1), 7.0), META)
    torch.save({"epoch": _Evil()}, path / "meta.pt")
    with pytest.raises(CheckpointError, match="meta.pt: contents changed"):
        load_sharded_checkpoint(path, state_of(make_model(1), 0.0))
    reseal(path)  # as a forger would: the records now match, the unpickler must still refuse
    with pytest.raises(UnsafeCheckpointError, match="add_safe_globals"):
        load_meta(path)
    with pytest.raises(UnsafeCheckpointError, match="exec"):
        load_sharded_checkpoint(path, state_of(make_model(1), 0.0))


def test_dcp_metadata_with_code_is_refused(tmp_path, marker):
    path = tmp_path / "d.ckpt"
    save_sharded_checkpoint(path, state_of(make_model(1), 7.0), META)
    with open(path / ".metadata", "wb") as file:
        pickle.dump(_Evil(), file)
    reseal(path)
    with pytest.raises(UnsafeCheckpointError, match="exec"):
        load_sharded_checkpoint(path, state_of(make_model(1), 0.0))


def test_non_tensor_items_are_read_weights_only(tmp_path, marker):
    path = tmp_path / "b.ckpt"
    state = state_of(make_model(1), 7.0)
    state["extra"] = _Evil()  # DCP stores non-tensor values as pickled bytes
    save_sharded_checkpoint(path, state, META)
    target = state_of(make_model(1), 0.0)
    target["extra"] = None
    with pytest.raises(UnsafeCheckpointError):
        load_sharded_checkpoint(path, target)


def _object_collectives_worker(rank: int, world_size: int, directory: str) -> None:
    import sys

    from lightning_zero.checkpoint import load_full as full_loading
    from lightning_zero.checkpoint.save_guards import control_group

    model = sharded(make_model(seed=1), world_size)
    path = os.path.join(directory, "objects.ckpt")
    save_sharded_checkpoint(path, state_of(model, step=7.0), META)
    groups = []
    original = dist.all_gather_object

    def recording(object_list, obj, group=None):
        caller = sys._getframe(1).f_code.co_filename
        if f"{os.sep}lightning_zero{os.sep}" in caller:  # DCP's own planning exchanges are torch's business
            groups.append(group)
        return original(object_list, obj, group=group)

    dist.all_gather_object = recording
    try:
        assert load_sharded_checkpoint(path, state_of(sharded(make_model(seed=2), world_size), 0.0)) == META
        assert full_loading._all_ranks(rank) == [0, 1]
    finally:
        dist.all_gather_object = original
    # The load's verdicts and state descriptions, and the full-file loader's, are Python objects: they go over the
    # gloo control group, never the training group (NCCL would pickle them through CUDA tensors).
    control = control_group(None)
    assert groups and all(group is control for group in groups), groups
    assert dist.get_backend(control) == "gloo"


def test_load_exchanges_python_objects_on_the_gloo_control_group(tmp_path):
    run_distributed(_object_collectives_worker, 2, str(tmp_path))


def _adapter_broadcast_worker(rank: int, world_size: int) -> None:
    import sys

    from lightning_zero.checkpoint.save_guards import control_group
    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
    from lightning_zero.strategies import ZeroStrategy as TrainerZeroStrategy

    groups = []
    original = dist.broadcast_object_list

    def recording(object_list, src=None, group=None, *args, **kwargs):
        if f"{os.sep}lightning_zero{os.sep}" in sys._getframe(1).f_code.co_filename:
            groups.append(group)
        return original(object_list, src, group, *args, **kwargs)

    dist.broadcast_object_list = recording
    try:
        for strategy in (TrainerZeroStrategy(stage=2), FabricZeroStrategy(stage=2)):
            assert strategy.broadcast({"path": f"from rank {rank}"}, src=1) == {"path": "from rank 1"}
    finally:
        dist.broadcast_object_list = original
    # Both adapters' broadcast (ModelCheckpoint paths, the resume decision) is an object collective: gloo control
    # group, never the training group (NCCL would pickle through a CUDA tensor and synchronise the device).
    assert len(groups) == 2 and all(group is control_group(None) for group in groups), groups


def test_adapters_broadcast_python_objects_on_the_gloo_control_group():
    run_distributed(_adapter_broadcast_worker, 2)
