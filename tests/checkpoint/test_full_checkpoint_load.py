"""Loading full (single-file) checkpoints into a sharded model: ``lightning_zero/checkpoint/full_file.py``,
``lightning_zero/checkpoint/load_full.py`` and the Trainer's glue ``lightning_zero/strategies/trainer_checkpoints.py``.

The framework-level tests load a file written by a plain single-process model (the unsharded reference) into
``apply_zero`` + ``shard_optimizer`` at every stage on 2 gloo ranks and compare every weight and optimizer state
with the reference; the Trainer-level tests resume a DDP run's ``.ckpt`` under ``ZeroStrategy``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_zero import ZeroConfig, apply_zero
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.full_file import FullCheckpoint, check_load_full_weights
from lightning_zero.distributed.optimizer import shard_optimizer
from lightning_zero.strategies import trainer_checkpoints
from tests.ranks import run_distributed

# s2-offload: optimizer-only offload, DTensor CPU masters of uneven (and empty) shards; s3-offload: params too
STAGES = [(0, None), (1, None), (1, "cpu"), (2, None), (2, "cpu"), (3, None), (3, "cpu")]
STAGE_IDS = ["s0", "s1", "s1-offload", "s2", "s2-offload", "s3", "s3-offload"]


def load_full(strategy, path):
    """The Trainer strategy's load of a single file, for the stand-in ``strategy`` these tests build."""
    optimizers = trainer_checkpoints.optimizers_to_restore(
        getattr(strategy.lightning_module, "_trainer", None), strategy.optimizers
    )
    return trainer_checkpoints.load_full(
        path,
        strategy.lightning_module,
        optimizers,
        load_full_weights=strategy.load_full_weights,
        exclude_frozen_parameters=strategy.exclude_frozen_parameters,
    )


class Model(nn.Module):
    """Uneven shapes on 2 ranks: 5 rows split 3 + 2, and a 1-row tensor whose second shard is empty."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 1)
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _optimizer(model):
    return torch.optim.AdamW(
        [
            {"params": [model.a.weight, model.b.weight], "weight_decay": 0.1},
            {"params": [model.a.bias, model.b.bias], "lr": 0.05},
        ],
        lr=0.1,
    )


def _reference(path, steps=2, frozen=None):
    """A plain model trained ``steps`` steps, saved as DDP would save it (positional optimizer state)."""
    torch.manual_seed(1)
    model = Model()
    if frozen:
        getattr(model, frozen).requires_grad_(False)
    opt = _optimizer(model)
    for _ in range(steps):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    model.count += 3
    opt.param_groups[1]["lr"] = 0.025  # a hyper-parameter changed by a scheduler: restored with the states
    torch.save(
        {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "epoch": 1, "global_step": steps},
        path,
    )
    return model, opt


def _full(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _sharded(stage, offload, rank):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(100 + rank)  # other weights than the file's: loading must replace every one
    module = Model()
    config = ZeroConfig(stage=stage, offload=offload)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    apply_zero(module, mesh, config)  # stages 0-1 return a DDP wrapper; the module is what loading sees
    opt = _optimizer(module)
    shard_optimizer(opt, config, group=mesh.get_group())
    strategy = SimpleNamespace(
        lightning_module=module, optimizers=[opt], exclude_frozen_parameters=False, load_full_weights=False
    )
    module.strict_loading = True
    return module, opt, strategy


def _every_rank_state(module, opt):
    """Full optimizer state by parameter name, gathered from the owners (stage 1 keeps it on one rank)."""
    from lightning_zero.checkpoint.states import optimizer_state_dict

    mine = {
        name: {k: _full(v) for k, v in state.items()}
        for name, state in optimizer_state_dict(module, opt)["state"].items()
    }
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged


def _stage_worker(rank, world_size, root, stage, offload):
    path = os.path.join(root, "ddp.ckpt")
    if rank == 0:
        _reference(path)
    torch.distributed.barrier()
    reference, ref_opt = _reference(os.path.join(root, f"unused{rank}.ckpt"))
    module, opt, strategy = _sharded(stage, offload, rank)
    rest = load_full(strategy, path)
    assert rest["global_step"] == 2 and rest["epoch"] == 1 and "optimizer_states" not in rest
    expected = reference.state_dict()
    got = {k: _full(v) for k, v in module.state_dict().items()}
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    names = dict((id(p), n) for n, p in reference.named_parameters())
    states = _every_rank_state(module, opt)
    assert states.keys() == set(names.values())
    for param, state in ref_opt.state.items():
        for key, value in state.items():
            assert torch.equal(states[names[id(param)]][key].to(value.dtype), value), (names[id(param)], key)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.025]
    assert opt.param_groups[0]["weight_decay"] == 0.1
    # Training goes on exactly as the reference's would.
    torch.manual_seed(7)
    batch = torch.randn(8, 4)
    for net, optimizer in ((module, opt), (reference, ref_opt)):
        net(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for key, value in reference.state_dict().items():
        assert torch.allclose(_full(module.state_dict()[key]), value, atol=1e-6), key


@pytest.mark.parametrize("stage,offload", STAGES, ids=STAGE_IDS)
def test_full_checkpoint_loads_weights_and_optimizer_states_at_every_stage(tmp_path, stage, offload):
    run_distributed(_stage_worker, 2, str(tmp_path), stage, offload)


# ------------------------------------------------------------------------------ safetensors, dtypes (2 ranks, stage 3)
def _safetensors_and_dtype_worker(rank, world_size, root):
    from safetensors.torch import save_file

    reference, _ = _reference(os.path.join(root, f"ref{rank}.ckpt"))
    path = os.path.join(root, "model.safetensors")
    if rank == 0:
        save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    torch.distributed.barrier()
    module, _, strategy = _sharded(3, None, rank)
    strategy.optimizers = []  # validate/test: weights only
    rest = load_full(strategy, path)
    assert rest["state_dict"] is not None and "loops" not in rest
    for key, value in reference.state_dict().items():
        assert torch.equal(_full(module.state_dict()[key]), value), key
    # An fp32 file into a bf16 model: each slice is cast on the way in.
    module, _, strategy = _sharded(3, None, rank)
    module.to(torch.bfloat16)
    strategy.optimizers = []
    load_full(strategy, os.path.join(root, "ref0.ckpt"))
    for key, value in reference.state_dict().items():
        got = _full(module.state_dict()[key])
        assert got.dtype == torch.bfloat16 and torch.equal(got, value.to(torch.bfloat16)), key


def test_safetensors_file_and_a_bf16_model_at_stage_3(tmp_path):
    run_distributed(_safetensors_and_dtype_worker, 2, str(tmp_path))


# --------------------------------------------------------------------------------------- bounded memory (2 ranks)
def _rss_bytes():
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


def _bounded_memory_worker(rank, world_size, root):
    from torch.distributed.device_mesh import init_device_mesh

    # 4 x 16 MiB of weights. Large tensors, because the page cache maps file pages in large folios (several MiB on
    # recent kernels), so touching half of a small tensor may map all of it.
    width, layers = 2048, 4
    path = os.path.join(root, "big.ckpt")
    if rank == 0:
        torch.save(
            {"state_dict": nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).state_dict()},
            path,
        )
    torch.distributed.barrier()
    module = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world_size,))
    apply_zero(module, mesh, ZeroConfig(stage=3))
    module.strict_loading = True
    strategy = SimpleNamespace(
        lightning_module=module, optimizers=[], exclude_frozen_parameters=False, load_full_weights=False
    )
    file_size = os.path.getsize(path)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM (the peak) to the current RSS
    _, before = _rss_bytes()
    load_full(strategy, path)
    peak, _ = _rss_bytes()
    growth = peak - before
    # A rank holds half the weights: it maps that half of the file (plus large-folio overshoot at the slice edges:
    # 0.52-0.64 of the file measured); reading the file whole, or any tensor whole, is >= 1.0.
    assert growth < 0.8 * file_size, (
        f"rank {rank}: RSS grew {growth / 2**20:.1f} MiB loading a {file_size / 2**20:.1f} MiB file"
    )


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_loading_reads_only_this_ranks_slices(tmp_path):
    run_distributed(_bounded_memory_worker, 2, str(tmp_path))


# ------------------------------------------------------------------------------------- one process: what is refused
def _plain(tmp_path, **strategy_kwargs):
    """A plain (stage-0 layout, no process group) model and optimizer, and a file of a trained reference."""
    path = str(tmp_path / "ddp.ckpt")
    _reference(path)
    torch.manual_seed(100)
    module = Model()
    module.strict_loading = True
    opt = _optimizer(module)
    strategy = SimpleNamespace(
        lightning_module=module, optimizers=[opt], exclude_frozen_parameters=False, load_full_weights=False
    )
    strategy.__dict__.update(strategy_kwargs)
    return path, module, opt, strategy


def _rewrite(path, edit):
    checkpoint = torch.load(path, weights_only=True)
    edit(checkpoint)
    torch.save(checkpoint, path)


def test_strict_loading_missing_unexpected_and_shape_mismatch(tmp_path):
    path, module, _, strategy = _plain(tmp_path)
    strategy.optimizers = []
    reference = torch.load(path, weights_only=True)["state_dict"]

    def edit(checkpoint):
        checkpoint["state_dict"]["extra.weight"] = torch.ones(2)
        del checkpoint["state_dict"]["b.bias"]

    _rewrite(path, edit)
    kept = module.b.bias.detach().clone()
    with pytest.raises(CheckpointError, match=r"1 missing keys.*b\.bias.*1 unexpected keys.*extra\.weight"):
        load_full(strategy, path)
    module.strict_loading = False  # accepted: the rest loads, b.bias keeps its value
    load_full(strategy, path)
    assert torch.equal(module.a.weight, reference["a.weight"]) and torch.equal(module.b.bias, kept)
    _rewrite(path, lambda checkpoint: checkpoint["state_dict"].update({"a.weight": torch.zeros(5, 3)}))
    with pytest.raises(CheckpointError, match=r"shape mismatches: a\.weight \(checkpoint: \[5, 3\], target: \[5, 4\]"):
        load_full(strategy, path)  # never accepted, strict or not


def test_exclude_frozen_parameters(tmp_path):
    path, module, _, strategy = _plain(tmp_path)
    strategy.optimizers = []
    module.a.weight.requires_grad_(False)
    _rewrite(path, lambda checkpoint: checkpoint["state_dict"].pop("a.weight"))  # a save that left it out
    kept = module.a.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"missing keys.*a\.weight"):
        load_full(strategy, path)
    strategy.exclude_frozen_parameters = True
    load_full(strategy, path)
    assert torch.equal(module.a.weight, kept)
    assert torch.equal(module.b.weight, torch.load(path, weights_only=True)["state_dict"]["b.weight"])


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c["optimizer_states"].append(c["optimizer_states"][0]), "states of 2 optimizer"),
        (lambda c: c["optimizer_states"][0]["param_groups"].pop(), "has 1 param group.*has 2"),
        (lambda c: c["optimizer_states"][0]["param_groups"][0]["params"].pop(), "group 0: the checkpoint has 1 param"),
        (
            lambda c: c["optimizer_states"][0]["state"][0].update(exp_avg=torch.zeros(4, 5)),
            r"state 'exp_avg' of 'a\.weight' has shape \[4, 5\], the parameter \[5, 4\]",
        ),
        (
            lambda c: c["optimizer_states"][0]["state"][0].update(
                momentum_buffer=c["optimizer_states"][0]["state"][0].pop("exp_avg")
            ),
            "another optimizer type",
        ),
        (
            lambda c: c["optimizer_states"][0]["param_groups"][0].update(params=["b.weight", "a.weight"]),
            "holds parameter 'b.weight' where the optimizer being resumed has 'a.weight'",
        ),
    ],
    ids=["optimizer-count", "group-count", "param-count", "state-shape", "optimizer-type", "names-out-of-order"],
)
def test_optimizer_states_that_do_not_line_up_are_refused(tmp_path, edit, message):
    path, module, opt, strategy = _plain(tmp_path)
    _rewrite(path, edit)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(CheckpointError, match=message):
        load_full(strategy, path)
    for key, value in module.state_dict().items():  # refused before anything was loaded
        assert torch.equal(value, before[key]), key


def test_optimizer_states_keyed_by_name(tmp_path):
    """FSDP/ModelParallel full checkpoints key optimizer states by parameter name."""
    path, module, opt, strategy = _plain(tmp_path)
    names = ["a.weight", "b.weight", "a.bias", "b.bias"]

    def by_name(checkpoint):
        osd = checkpoint["optimizer_states"][0]
        osd["state"] = {names[i]: value for i, value in osd["state"].items()}
        for group in osd["param_groups"]:
            group["params"] = [names[i] for i in group["params"]]

    expected = torch.load(path, weights_only=True)["optimizer_states"][0]["state"]
    _rewrite(path, by_name)
    load_full(strategy, path)
    for index, param in enumerate([module.a.weight, module.b.weight, module.a.bias, module.b.bias]):
        for key, value in expected[index].items():
            assert torch.equal(opt.state[param][key], value), (names[index], key)


def test_which_paths_load_as_a_full_checkpoint(tmp_path):
    from lightning_zero.checkpoint.load_full import is_full_checkpoint
    from lightning_zero.strategies.ckpt_path_check import check_ckpt_path

    path, *_ = _plain(tmp_path)
    assert is_full_checkpoint(path, False) and is_full_checkpoint(path, True)
    sharded = tmp_path / "sharded.ckpt"
    sharded.mkdir()
    for name in ("zero.json", ".metadata", "__0_0.distcp"):
        (sharded / name).write_bytes(b"")
    assert not is_full_checkpoint(str(sharded), False)
    with pytest.raises(CheckpointError, match=r"is a directory, but ZeroStrategy\(load_full_weights=True\)"):
        is_full_checkpoint(str(sharded), True)
    with pytest.raises(CheckpointError, match=f"inside the sharded checkpoint {sharded}: pass the directory"):
        is_full_checkpoint(str(sharded / "__0_0.distcp"), False)
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "w.safetensors"))

    def fit(ckpt_path=None):
        pass

    for good in (path, str(tmp_path / "w.safetensors")):  # checked before launch: accepted
        check_ckpt_path(fit, (), {"ckpt_path": good})
    assert check_load_full_weights(True) is True
    with pytest.raises(TypeError, match="load_full_weights must be True or False"):
        check_load_full_weights(1)
    assert FullCheckpoint(str(tmp_path / "w.safetensors")).state_keys == ["w"]


# --------------------------------------------------------------------------- a refusal one rank finds (2 ranks)
def _one_rank_refuses_worker(rank, world_size, root):
    path = os.path.join(root, "ddp.ckpt")
    if rank == 0:
        _reference(path)

        def edit(checkpoint):  # another optimizer type's state for one parameter: only its owner sees it
            state = checkpoint["optimizer_states"][0]["state"][0]
            state["momentum_buffer"] = state.pop("exp_avg")

        _rewrite(path, edit)
    torch.distributed.barrier()
    module, opt, strategy = _sharded(1, None, rank)
    with pytest.raises(CheckpointError, match="another optimizer type"):
        load_full(strategy, path)  # on every rank, not only on the owner of a.weight (the other would hang)


def test_a_refusal_found_on_one_rank_is_raised_on_every_rank(tmp_path):
    run_distributed(_one_rank_refuses_worker, 2, str(tmp_path))


def _stage_split_worker(rank, world_size, root):
    """Pipeline stages hold parts of the model: a key another rank loads is not unexpected here (strict)."""
    path = os.path.join(root, "ddp.ckpt")
    if rank == 0:
        _reference(path)
    torch.distributed.barrier()
    reference = torch.load(path, weights_only=True)["state_dict"]
    torch.manual_seed(100)
    module = Model()
    if rank == 0:
        del module.b  # this rank's stage: a and the buffer
    else:
        del module.a
        module.count = None  # a None buffer is left out of state_dict, as on a stage without it
    module.strict_loading = True
    strategy = SimpleNamespace(
        lightning_module=module, optimizers=[], exclude_frozen_parameters=False, load_full_weights=False
    )
    load_full(strategy, path)
    for key, value in module.state_dict().items():
        assert torch.equal(value, reference[key]), key


def test_pipeline_stages_each_load_their_part(tmp_path):
    run_distributed(_stage_split_worker, 2, str(tmp_path))


# ------------------------------------------------------------------- through the Trainer: safetensors, bf16-true
def _trainer_safetensors_worker(rank, world_size, root, precision):
    from lightning.pytorch import seed_everything
    from safetensors.torch import save_file

    from tests.conformance.models import RegressionModule, full_state, trainer, zero

    seed_everything(0)
    saved = {k: v.to(torch.bfloat16) for k, v in RegressionModule().state_dict().items()}  # as bf16-true DDP saves
    path = os.path.join(root, "model.safetensors")
    if rank == 0:
        save_file(saved, path)
    torch.distributed.barrier()
    seed_everything(1)
    module = RegressionModule()
    trainer(zero(3), precision=precision, limit_val_batches=1).validate(module, ckpt_path=path, verbose=False)
    got = full_state(module)
    assert got.keys() == saved.keys()
    for key, value in got.items():  # the module's own dtype (ZeroStrategy keeps fp32 masters), the file's values
        assert torch.equal(value, saved[key].to(value.dtype)), key


@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_validate_from_a_safetensors_file(tmp_path, precision):
    run_distributed(_trainer_safetensors_worker, 2, str(tmp_path), precision)


def test_a_legacy_format_file_is_read_whole_with_a_warning(tmp_path):
    from lightning_zero.strategies.ckpt_path_check import check_ckpt_path

    path, module, _, strategy = _plain(tmp_path)
    strategy.optimizers = []
    checkpoint = torch.load(path, weights_only=True)
    torch.save(checkpoint, path, _use_new_zipfile_serialization=False)  # torch < 1.6's format: no mmap

    def fit(ckpt_path=None):
        pass

    check_ckpt_path(fit, (), {"ckpt_path": path})
    with pytest.warns(UserWarning, match="legacy serialization format.*every rank reads the whole file"):
        load_full(strategy, path)
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(module.state_dict()[key], value), key


def _validate_after_fit_worker(rank, world_size, root):
    """validate/test after a fit keep the fit's optimizers attached, yet restore weights only: a weights-only
    checkpoint (sharded or a single file) is not refused there, and the optimizer states are left alone."""
    from tests.conformance.models import RegressionModule, full_state, trainer, zero

    t = trainer(zero(2), max_steps=2, limit_val_batches=1)
    t.fit(RegressionModule())
    sharded = os.path.join(root, "weights.ckpt")
    t.save_checkpoint(sharded, weights_only=True)
    single = os.path.join(root, "single.ckpt")
    expected = {k: v + 1 for k, v in full_state(t.lightning_module).items()}  # other weights than the module's
    if rank == 0:
        torch.save({"state_dict": expected, "pytorch-lightning_version": "2.6.0"}, single)
    torch.distributed.barrier()
    before = {
        name: {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone() for k, v in state.items()}
        for name, state in enumerate(t.optimizers[0].state.values())
    }
    t.validate(ckpt_path=sharded, verbose=False)
    t.validate(ckpt_path=single, verbose=False)
    assert all(torch.equal(full_state(t.lightning_module)[k], v) for k, v in expected.items())
    after = {
        name: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
        for name, state in enumerate(t.optimizers[0].state.values())
    }
    assert after.keys() == before.keys() and all(
        torch.equal(after[n][k], before[n][k]) for n in before for k in before[n]
    )


def test_validate_after_fit_loads_weights_only(tmp_path):
    run_distributed(_validate_after_fit_worker, 2, str(tmp_path))


def test_states_read_by_range_and_a_step_counted_in_a_plain_number_load():
    """An optimizer state may be a RangeTensor (read a range at a time: a DeepSpeed checkpoint's flat buffers), and
    a saved tensor step goes into an optimizer that counts in a plain number as that number."""
    from lightning_zero.checkpoint.full_file import (
        OptimizerTarget,
        RangeTensor,
        apply_full_optimizer_states,
        check_full_optimizer_states,
    )

    flat, reads = torch.arange(20.0), []

    def read(start, length):
        reads.append((start, length))
        return flat[4 + start : 4 + start + length]  # the parameter lies 4 elements into a flat buffer

    lazy = RangeTensor((3, 2), torch.float32, read)
    assert torch.equal(lazy.rect((1, 1), (2, 1)), flat[4:10].reshape(3, 2)[1:3, 1:2]) and reads == [(2, 4)]
    param = nn.Parameter(torch.zeros(3, 2))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    optimizer.state[param] = {"momentum_buffer": torch.zeros(3, 2), "count": 0}
    source = SimpleNamespace(
        path="ds",
        optimizer_states=[
            {
                "state": {"w": {"momentum_buffer": lazy, "count": torch.tensor(5.0)}},
                "param_groups": [{"lr": 0.5, "params": ["w"]}],
            }
        ],
    )
    with pytest.raises(CheckpointError, match="has shape \\[3, 2\\], the parameter \\[6\\]"):
        other = nn.Parameter(torch.zeros(6))
        check_full_optimizer_states([OptimizerTarget(optimizer, [[other]], [["w"]], lambda p: p)], source)
    target = OptimizerTarget(optimizer, [[param]], [["w"]], lambda p: p)
    apply_full_optimizer_states(check_full_optimizer_states([target], source))
    assert torch.equal(optimizer.state[param]["momentum_buffer"], flat[4:10].reshape(3, 2))
    assert optimizer.state[param]["count"] == 5 and type(optimizer.state[param]["count"]) is int
    assert optimizer.param_groups[0]["lr"] == 0.5
