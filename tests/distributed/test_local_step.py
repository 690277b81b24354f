"""Adam/AdamW/SGD step the local shards of DTensor parameters at stages 2-3 (lightning_zero.distributed.local_step):
no per-op DTensor dispatch, the same values and the same ``state_dict`` format as torch's DTensor path, parity with
the single-process reference (accumulation, clipping) and a checkpoint resume through the Trainer."""

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.distributed.apply_zero import apply_zero, set_gradient_sync
from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.distributed.local_step import is_local_step, restore_step
from lightning_zero.distributed.optimizer import shard_optimizer
from lightning_zero.ops.step_override import base_class
from tests.lightning_models import RegressionModule, dataset, full_state, make_optimizer_and_scheduler, quiet_trainer
from tests.ranks import run_distributed

OPTIMIZERS = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(10, 10), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(10, 3)  # 3 x 10 + 3: uneven shards over 2 ranks

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def _train(rank, stage, cls, kwargs, local, steps=3, accumulate=2, clip=0.05, closure=False):
    from torch.distributed.device_mesh import init_device_mesh

    config = ZeroConfig(stage=stage)
    torch.manual_seed(0)
    module = apply_zero(Net(), init_device_mesh("cpu", (2,)), config)
    optimizer = cls(module.parameters(), **kwargs)
    sharding = shard_optimizer(optimizer, config)
    assert is_local_step(optimizer) == (stage >= 2)
    if not local:
        restore_step(optimizer)  # torch's DTensor path: the comparison's reference
    dispatches = train_counting_dispatches(rank, module, optimizer, sharding, steps, accumulate, clip, closure)
    return module, optimizer, dispatches


def train_counting_dispatches(rank, module, optimizer, sharding, steps, accumulate, clip, closure=False) -> int:
    """``steps`` optimizer steps of ``Net`` on per-rank batches, with accumulation and clipping; returns the DTensor
    Python dispatches (``PythonSubclass`` profiler events) counted inside ``optimizer.step``."""
    dispatches = 0
    for step in range(steps):
        for micro in range(accumulate):
            set_gradient_sync(module, micro == accumulate - 1)
            gen = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
            (nn.functional.mse_loss(module(x), y) / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(sharding.all_model_params(), clip)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            optimizer.step(closure=(lambda: None) if closure else None)
        dispatches += sum(event.name == "PythonSubclass" for event in prof.events())
        optimizer.zero_grad()
    return dispatches


def _same(a, b) -> bool:
    if hasattr(a, "placements") != hasattr(b, "placements"):
        return False
    if hasattr(a, "placements"):
        return (
            a.placements == b.placements
            and a.shape == b.shape
            and a.stride() == b.stride()
            and torch.equal(a.full_tensor(), b.full_tensor())
        )
    return torch.equal(a, b)


def _bitwise_worker(rank, world_size):
    for cls, kwargs in OPTIMIZERS:
        for stage in (2, 3):
            ref_module, ref_opt, ref_dispatches = _train(rank, stage, cls, kwargs, local=False)
            module, optimizer, dispatches = _train(rank, stage, cls, kwargs, local=True)
            name = f"{cls.__name__} stage {stage}"
            assert ref_dispatches > 0, f"{name}: the DTensor path dispatched nothing: the count would be vacuous"
            assert dispatches == 0, f"{name}: the local step still made {dispatches} DTensor dispatches"
            for (key, a), b in zip(ref_module.state_dict().items(), module.state_dict().values()):
                assert _same(a, b), f"{name}: parameter {key} differs from torch's DTensor path"
            ref_state, state = ref_opt.state_dict(), optimizer.state_dict()
            assert ref_state["param_groups"] == state["param_groups"], name
            assert ref_state["state"].keys() == state["state"].keys(), name
            for index, entry in ref_state["state"].items():
                assert entry.keys() == state["state"][index].keys(), f"{name}: state keys of parameter {index}"
                for key, value in entry.items():
                    assert _same(value, state["state"][index][key]), f"{name}: state {key} of parameter {index}"
            # the optimizer keeps its class name (checkpoints record it) and loads its own state back
            assert type(optimizer).__qualname__ == cls.__qualname__ and type(optimizer).__module__ == cls.__module__
            optimizer.load_state_dict(state)
    # step(closure) keeps torch's DTensor path (the closure's gradients come after any swap could read them)
    module, _, dispatches = _train(rank, 2, torch.optim.AdamW, OPTIMIZERS[0][1], local=True, closure=True)
    ref_module, _, _ = _train(rank, 2, torch.optim.AdamW, OPTIMIZERS[0][1], local=False)
    assert dispatches > 0
    assert all(_same(a, b) for a, b in zip(ref_module.state_dict().values(), module.state_dict().values()))


def test_local_step_matches_torch_dtensor_path_bitwise_without_dtensor_dispatch():
    run_distributed(_bitwise_worker, 2)


class MyAdamW(torch.optim.AdamW):
    pass


def _fallback_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    for stage, cls in ((2, MyAdamW), (2, torch.optim.RMSprop), (1, torch.optim.AdamW)):
        config = ZeroConfig(stage=stage)
        torch.manual_seed(0)
        module = apply_zero(Net(), mesh, config)
        optimizer = cls(module.parameters(), lr=1e-2)
        shard_optimizer(optimizer, config, group=mesh.get_group())
        # a subclass may add non-elementwise math, another class is not known elementwise, stage 1 has no DTensors
        assert not is_local_step(optimizer), f"{cls.__name__} at stage {stage} must keep torch's own step"
        # stage 1's class only gains the zero_grad that reaches the other ranks' gradients (optimizer.py)
        assert (base_class(optimizer) if stage == 1 else type(optimizer)) is cls


def test_local_step_only_switches_exact_elementwise_optimizers_on_dtensors():
    run_distributed(_fallback_worker, 2)


BATCH, ACCUMULATE, CLIP, STEPS_PER_EPOCH = 4, 2, 0.05, 2


def _reference(epochs, world_size):
    """One process, the same global batches: epoch e reads DistributedSampler's permutation seeded e, in global
    micro-batches of BATCH x world_size, ACCUMULATE per optimizer step, norm-clipped at CLIP."""
    torch.manual_seed(0)
    module = RegressionModule()
    opt, sched = make_optimizer_and_scheduler(module.named_parameters())
    x_all, y_all = dataset().tensors
    micro = BATCH * world_size
    for epoch in range(epochs):
        order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(epoch))
        for step in range(STEPS_PER_EPOCH):
            for i in range(ACCUMULATE):
                idx = order[(step * ACCUMULATE + i) * micro : (step * ACCUMULATE + i + 1) * micro]
                (nn.functional.mse_loss(module(x_all[idx]), y_all[idx]) / ACCUMULATE).backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            sched.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _trainer_worker(rank, world_size, stage, path, resume):
    torch.manual_seed(123 if resume else 0)  # a resumed run must take every weight and state from the checkpoint
    module = RegressionModule(batch_size=BATCH)
    epochs = 2 if resume else 1
    seen = []

    class Witness(Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(is_local_step(trainer.optimizers[0]))

    trainer = quiet_trainer(
        ZeroStrategy(stage=stage),
        world_size,
        max_steps=-1,
        max_epochs=epochs,
        limit_train_batches=STEPS_PER_EPOCH * ACCUMULATE,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        callbacks=[Witness()],
    )
    trainer.fit(module, ckpt_path=path if resume else None)
    assert trainer.global_step == epochs * STEPS_PER_EPOCH
    assert seen and all(seen), "the Trainer's optimizer did not step the local shards"
    assert not is_local_step(trainer.optimizers[0]), "teardown leaves torch's own step"
    expected = _reference(epochs, world_size)
    got = full_state(module)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"stage {stage} (resume={resume}): max abs diff {worst:.2e} from the reference"
    if not resume:
        trainer.save_checkpoint(path)


@pytest.mark.parametrize("saved,resumed", [(2, 2), (2, 3)])
def test_local_step_trains_and_resumes_like_the_single_process_reference(tmp_path, saved, resumed):
    path = str(tmp_path / "ckpt")
    run_distributed(_trainer_worker, 2, saved, path, False)
    run_distributed(_trainer_worker, 2, resumed, path, True)
