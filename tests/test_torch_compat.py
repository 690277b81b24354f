"""lightning_zero.torch_compat: every entry called on the installed torch (on real tensors, modules, optimizers, FSDP2
units and a DDP module of a two-rank gloo group), and each version guard reading both torch layouts it names (the
other one is what this torch lacks, so it is built here by hand). Run under each supported torch as
``docs/compatibility.md`` says: a rename in a new torch fails here, by the entry's name."""

import io
import pickle
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero import torch_compat as tc
from tests.ranks import run_distributed


def test_fsdp_param_groups_reads_the_list_and_the_single_group_layouts():
    a, b = object(), object()
    assert tc.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]  # torch >= 2.12
    assert tc.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=a)) == [a]  # torch 2.11
    assert tc.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == []  # a unit without parameters


def _check_fsdp_state_and_params(model):
    held = {
        id(tc.sharded_parameter(fp))
        for m in (model, model[0])
        for g in tc.fsdp_param_groups(tc.fsdp_state(m))
        for fp in tc.group_fsdp_params(g)
    }
    assert held == {id(p) for p in model.parameters()}, torch.__version__
    fsdp_param = tc.group_fsdp_params(tc.fsdp_param_groups(tc.fsdp_state(model[0]))[0])[0]
    assert tc.fsdp_param_module(fsdp_param) is model[0]
    data = tc.sharded_param_data(fsdp_param)
    local = tc.dtensor_local(tc.sharded_parameter(fsdp_param))
    assert data.dim() == 1 and local.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
    padded = tc.padded_shard_size(fsdp_param)  # 4 rows over 2 ranks: 2 each, no padding
    assert padded[0] == local.size(0) == 2 and data.numel() == padded.numel()
    assert tc.shard_placement(fsdp_param).dim == 0
    tc.set_sharded_param_data(fsdp_param, data.clone())
    assert tc.sharded_param_data(fsdp_param) is not data and torch.equal(tc.sharded_param_data(fsdp_param), data)
    assert tc.sharded_param_data(object(), "absent") == "absent"
    return fsdp_param


def _check_fsdp_forward_machinery(model, fsdp_param):
    seen = []
    model[1].register_forward_pre_hook(lambda *_: seen.append(tc.fsdp_in_forward(tc.fsdp_state(model))))
    group = tc.fsdp_param_groups(tc.fsdp_state(model))[0]
    calls = []
    tc.wrap_param_group_methods(
        group, {"unshard": lambda original: lambda *a, **k: calls.append(1) or original(*a, **k)}
    )
    out = model(torch.ones(2, 4))
    assert calls and tc.group_is_unsharded(group)  # reshard_after_forward=False: gathered after the forward
    tc.unwrap_param_group_methods(group)
    assert "unshard" not in vars(group) and not tc.group_is_unsharded(object())
    with pytest.raises(ValueError, match="not one of"):
        tc.wrap_param_group_methods(group, {"reshard": lambda original: original})
    assert seen == [True] and not tc.fsdp_in_forward(tc.fsdp_state(model))
    assert tc.unsharded_param(fsdp_param) is not None  # gathered and kept (reshard_after_forward=False)
    assert not any(tc.all_gather_in_flight(g) for g in tc.fsdp_param_groups(tc.fsdp_state(model)))
    hooks, with_kwargs, always_called = tc.forward_hook_tables(model)
    key = tc.post_forward_hook_id(tc.fsdp_state(model))
    assert key in hooks and key not in with_kwargs and key not in always_called
    out.sum().backward()
    # a backward closed by hand inside a forward: reopen (gathers), close on a fresh output, backward
    tc.fsdp_pre_forward(tc.fsdp_state(model), model)
    assert tc.fsdp_in_forward(tc.fsdp_state(model))
    loss = tc.fsdp_post_forward(tc.fsdp_state(model), model, model[1](model[0](torch.ones(2, 4))).sum())
    assert not tc.fsdp_in_forward(tc.fsdp_state(model))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def _fsdp_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    fsdp_param = _check_fsdp_state_and_params(model)
    _check_fsdp_forward_machinery(model, fsdp_param)
    all_gather, reduce_scatter = tc.fsdp_comm_bases()
    assert hasattr(model, "set_custom_all_gather") and all_gather.__call__ and reduce_scatter.__call__


def test_fsdp_entries_on_this_torchs_fsdp2():
    run_distributed(_fsdp_worker, 2)


def _dtensor_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(6.0).reshape(3, 2)
    dtensor = distribute_tensor(full, mesh, [Shard(0)])
    local = tc.local_tensor(dtensor)
    assert torch.equal(local, full[:2] if rank == 0 else full[2:]) and tc.dtensor_local(dtensor) is local
    plain = torch.ones(2)
    assert tc.local_tensor(plain) is plain
    tc.set_dtensor_local(dtensor, local * 10)
    assert torch.equal(dtensor.full_tensor(), full * 10)
    part, offsets, sizes = tc.local_part(dtensor)
    assert offsets == ((0, 0) if rank == 0 else (2, 0)) and sizes == tuple(part.shape)
    assert tc.local_part(plain)[1:] == ((0,), (2,))
    assert tc.backend_serving("cpu") == "gloo" and tc.default_store() is not None
    gathered, scattered = torch.empty(4), torch.empty(1)
    tc.all_gather_flat(gathered, torch.full((2,), float(rank)))
    tc.reduce_scatter_flat(scattered, torch.arange(2.0))
    assert gathered.tolist() == [0.0, 0.0, 1.0, 1.0] and scattered.item() == 2.0 * rank
    tc.default_store().set(f"compat{rank}", "x")
    assert tc.default_store().get(f"compat{1 - rank}") == b"x"


def test_dtensor_store_and_backend_entries():
    run_distributed(_dtensor_worker, 2)


def _ddp_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(nn.Linear(4, 4), **tc.ddp_buffer_sync_kwargs(False))
    tc.prepare_ddp_backward(ddp, ddp.module(torch.ones(2, 4)).sum())  # the plain module's output: DDP's forward not run
    assert tc.rebuild_ddp_buckets(ddp) is False  # nothing learnt yet: no order to rebuild with
    ddp(torch.ones(2, 4)).sum().backward()
    assert tc.rebuild_ddp_buckets(ddp) is True and ddp._has_rebuilt_buckets
    assert tc.rebuild_ddp_buckets(ddp) is False  # done once


def test_ddp_entries():
    run_distributed(_ddp_worker, 2)


def test_ddp_buffer_sync_kwargs_names_a_keyword_of_this_torchs_ddp():
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    (keyword,) = tc.ddp_buffer_sync_kwargs(True)
    assert keyword in inspect.signature(DistributedDataParallel.__init__).parameters


def test_storage_identity_use_count_version_and_base():
    base = torch.zeros(4)
    view = base[1:]
    meta_a, meta_b = torch.empty(2, device="meta"), torch.empty(2, device="meta")
    assert tc.storage_identity(view) == tc.storage_identity(base)
    assert tc.storage_identity(meta_a) != tc.storage_identity(meta_b)
    alone = torch.zeros(3)
    assert tc.storage_use_count(alone) == 2  # the tensor and the temporary storage object
    kept = alone[:1]
    assert tc.storage_use_count(alone) > 2 and kept.numel() == 1
    before = tc.tensor_version(base)
    base.add_(1)
    assert tc.tensor_version(base) == before + 1
    assert tc.view_base(view) is base and tc.view_base(base) is None


def test_tensor_has_gradient_hooks():
    param = nn.Parameter(torch.zeros(2))
    assert not tc.tensor_has_gradient_hooks(param)
    param.register_hook(lambda g: g)
    assert tc.tensor_has_gradient_hooks(param)
    other = nn.Parameter(torch.zeros(2))
    other.register_post_accumulate_grad_hook(lambda p: None)
    assert tc.tensor_has_gradient_hooks(other)


class _Wrapper(torch.Tensor):
    @staticmethod
    def __new__(cls, meta):
        wrapper = tc.make_wrapper_subclass(cls, meta, device="cpu", requires_grad=False)
        wrapper.meta = meta
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        flat, spec = tc.tree_flatten((args, kwargs or {}))
        args, kwargs = tc.tree_unflatten([a.meta if isinstance(a, _Wrapper) else a for a in flat], spec)
        return func(*args, **kwargs)


def test_wrapper_subclass_pytree_schema_and_dispatch_entries():
    wrapper = _Wrapper(torch.empty(2, 3, device="meta"))
    assert wrapper.shape == (2, 3) and wrapper.device.type == "cpu" and type(wrapper) is _Wrapper
    assert (wrapper + 1).is_meta  # dispatched to the meta tensor by __torch_dispatch__
    with tc.disable_torch_dispatch():
        torch.ops.aten.as_strided_.default(wrapper, (3, 2), (2, 1), 0)  # the wrapper's own layout, no dispatch
    assert wrapper.shape == (3, 2)
    written = [
        a.name
        for a in tc.op_schema(torch.ops.aten.add_.Tensor).arguments
        if a.alias_info is not None and a.alias_info.is_write
    ]
    assert written == ["self"] and str(tc.op_schema(torch.ops.aten.add.Tensor).returns[0].type) == "Tensor"
    assert tc.TENSOR_DATA.__get__(torch.ones(1)).item() == 1.0
    ops = []

    class Recording(tc.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    with Recording():
        torch.ones(1) + 1
    assert torch.ops.aten.add.Tensor in ops


def test_privateuse1_backend_name():
    assert isinstance(tc.privateuse1_backend_name(), str) and tc.privateuse1_backend_name()


def test_foreach_aliases_compute_what_their_names_say():
    xs, ys = [torch.ones(2), torch.full((3,), 2.0)], [torch.full((2,), 3.0), torch.ones(3)]
    assert [t.tolist() for t in tc.foreach_add(xs, ys, alpha=2.0)] == [[7.0, 7.0], [4.0, 4.0, 4.0]]
    tc.foreach_add_(xs, 1)
    tc.foreach_mul_(xs, 2.0)
    assert [t.tolist() for t in xs] == [[4.0, 4.0], [6.0, 6.0, 6.0]]
    tc.foreach_lerp_(xs, ys, 0.5)
    assert [t.tolist() for t in xs] == [[3.5, 3.5], [3.5, 3.5, 3.5]]
    tc.foreach_addcmul_(xs, ys, ys, value=1.0)
    tc.foreach_maximum_(xs, [torch.full((2,), 100.0), torch.zeros(3)])
    assert [t.tolist() for t in xs] == [[100.0, 100.0], [4.5, 4.5, 4.5]]
    norms = tc.foreach_norm([torch.tensor([1.0, -5.0]), torch.tensor([float("nan")])], float("inf"))
    assert norms[0].item() == 5.0 and norms[1].isnan()
    assert "cpu" in tc.fused_kernel_devices()


def test_serialization_entries_write_what_torch_load_reads(tmp_path):
    path = str(tmp_path / "streamed.pt")
    storage = torch.arange(3.0).untyped_storage()
    data = io.BytesIO()

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor):
                return tc.REBUILD_TENSOR, (obj.untyped_storage(), 0, obj.shape, obj.stride(), False, {})
            return NotImplemented

        def persistent_id(self, obj):
            if isinstance(obj, torch.UntypedStorage):
                name = tc.storage_type_names()[torch.float32]
                return ("storage", getattr(torch, name), "0", "cpu", 3)
            return None

    Pickler(data, protocol=2).dump({"w": torch.arange(3.0)})
    with tc.open_zipfile_writer(path) as writer:
        writer.write_record("data.pkl", data.getvalue(), len(data.getvalue()))
        alignment = str(tc.storage_alignment())
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("data/0", storage.data_ptr(), storage.nbytes())
    assert tc.storage_alignment() == 64 and tc.storage_type_names()[torch.float32] == "FloatStorage"
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(3.0))


def test_dcp_nested_dict_entries():
    state = {"model": {"w": torch.ones(1)}, "step": 3, "groups": [{"lr": 0.1}]}
    flat, mappings = tc.flatten_state_dict(state)
    assert set(flat) == {"model.w", "step", "groups.0.lr"} and mappings["groups.0.lr"] == ("groups", 0, "lr")
    tc.set_element(state, mappings["model.w"], torch.zeros(1))
    tc.set_element(state, mappings["groups.0.lr"], 0.5)
    assert state["model"]["w"].item() == 0.0 and state["groups"] == [{"lr": 0.5}]


def test_optimizer_step_hooks_suspended_skips_and_restores_them():
    param = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    calls = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    param.grad = torch.ones(1)
    with tc.optimizer_step_hooks_suspended(optimizer):
        optimizer.step()
    assert calls == []
    with pytest.raises(RuntimeError), tc.optimizer_step_hooks_suspended(optimizer):
        raise RuntimeError("put back on errors too")
    optimizer.step()
    assert calls == ["pre", "post"]


def test_a_step_flagged_and_recording_like_torchs_scheduler_wrapper_satisfies_lr_schedulers(recwarn):
    param = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    plain_step = optimizer.step

    def step(*args, **kwargs):
        tc.record_optimizer_step(optimizer)
        return plain_step(*args, **kwargs)

    assert not tc.is_scheduler_step_wrapper(step)
    tc.flag_scheduler_step_wrapper(step)
    optimizer.step = step
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert optimizer.step is step and tc.is_scheduler_step_wrapper(optimizer.step)  # not wrapped a second time
    param.grad = torch.ones(1)
    optimizer.step()
    scheduler.step()
    assert [str(w.message) for w in recwarn if "lr_scheduler" in str(w.message)] == []


def test_the_scheduler_contract_names_are_the_ones_torch_checks(recwarn):
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert tc.is_scheduler_step_wrapper(optimizer.step)  # torch's own wrapper carries the flag
    scheduler.step()  # before any optimizer step: torch warns, by the record the wrapper keeps
    assert any("lr_scheduler.step()` before `optimizer.step()" in str(w.message) for w in recwarn)


def test_wrap_policy_module_classes():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    assert set(tc.wrap_policy_module_classes(ModuleWrapPolicy({nn.Linear, nn.ReLU}))) == {nn.Linear, nn.ReLU}


def _pipeline_worker(rank, world_size):
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    stages = [PipelineStage(nn.Linear(2, 2), index, 4, torch.device("cpu")) for index in (rank, 3 - rank)]
    for stage in stages:
        original = tc.stage_warmup_ops(stage)
        if original is not None:  # torch 2.11's warm-up; later torch may drop it
            tc.set_stage_warmup_ops(stage, lambda original=original: original()[:1])
            assert [op.peer for op in tc.stage_warmup_ops(stage)()] == [op.peer for op in original()[:1]]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=2, loss_fn=lambda out, target: out.sum())
    lowered = tc.lower_forward_actions(schedule, 4)
    mine = [str(action) for action in lowered[rank]]
    assert mine and all("F" in action or "SEND" in action or "RECV" in action for action in mine), mine
    dist.barrier()


def test_pipelining_entries():
    run_distributed(_pipeline_worker, 2)


def test_every_entry_is_exercised_in_this_file():
    from pathlib import Path

    source = Path(__file__).read_text()
    untested = [name for name in tc.__all__ if f"tc.{name}" not in source]
    assert untested == [], f"add a test that calls each of {untested} on the installed torch"
