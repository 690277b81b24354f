"""bf16-true at stages 0-1: bf16 replicas, fp32 masters beside the optimizer (lightning_zero/distributed/replicas.py).

Against a single-process reference written out here step by step (each rank's micro-batch through a bf16 copy of the
model, the bf16 gradients averaged in fp32 and rounded once, AdamW on fp32 masters), the bytes each rank holds,
and checkpoints that keep the masters' fp32 values.
"""

import os

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.distributed.optimizer import get_sharding
from lightning_zero.distributed.replicas import clip_replica_grads
from tests.lightning_models import (
    RegressionModule,
    dataset,
    make_optimizer_and_scheduler,
    quiet_trainer,
    trained_weights,
)
from tests.ranks import run_distributed

BATCH = 4  # per rank
STEPS = 4


def replica_reference(
    steps: int, world_size: int, batch: int = BATCH, clip=None, accumulate: int = 1
) -> dict[str, torch.Tensor]:
    """What ``bf16-true`` at stages 0-1 computes, on one process: per step, each rank's micro-batch (Lightning's
    DistributedSampler: every ``world_size``-th index of the shuffled epoch) forward and backward through bf16
    parameters; the gradients divided by the world size and summed in fp32, rounded to bf16 once (the DDP hook);
    with ``clip``, scaled by torch's ``clip_grads_with_norm_`` for their norm taken in fp32; AdamW and the scheduler
    on fp32 masters; the masters rounded into the parameters. With ``accumulate``, each rank's micro-batches add
    their gradients of ``loss / accumulate`` in bf16 before the reduction, as autograd does into DDP's replicas."""
    torch.manual_seed(0)
    model = RegressionModule()
    masters = {name: p.detach().clone() for name, p in model.named_parameters()}
    model = model.to(torch.bfloat16)
    master_list = [nn.Parameter(masters[name]) for name, _ in model.named_parameters()]
    optimizer, scheduler = make_optimizer_and_scheduler(zip([n for n, _ in model.named_parameters()], master_list))
    x_all, y_all = dataset().tensors
    order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        total = [torch.zeros_like(m) for m in master_list]
        for rank in range(world_size):
            model.zero_grad(set_to_none=True)
            for micro in range(step * accumulate, (step + 1) * accumulate):
                index = order[rank::world_size][micro * batch : (micro + 1) * batch]
                x, y = x_all[index].to(torch.bfloat16), y_all[index].to(torch.bfloat16)
                (nn.functional.mse_loss(model(x), y) / accumulate).backward()
            for acc, p in zip(total, model.parameters()):
                acc.add_(p.grad.float().div_(world_size))
        for p, reduced in zip(model.parameters(), total):
            p.grad = reduced.to(torch.bfloat16)
        if clip is not None:
            norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in model.parameters()]
            torch.nn.utils.clip_grads_with_norm_(
                list(model.parameters()), clip, torch.linalg.vector_norm(torch.stack(norms))
            )
        for master, p in zip(master_list, model.parameters()):
            master.grad = p.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        with torch.no_grad():
            for p, master in zip(model.parameters(), master_list):
                p.copy_(master)
    return {name: master.detach().clone() for (name, _), master in zip(model.named_parameters(), master_list)}


def _fit(stage, world_size, steps=STEPS, **kwargs):
    torch.manual_seed(0)
    module = RegressionModule(batch_size=BATCH)
    trainer = quiet_trainer(ZeroStrategy(stage=stage), world_size, max_steps=steps, precision="bf16-true", **kwargs)
    trainer.fit(module)
    return module, trainer


def _parity_worker(rank, world_size):
    expected = replica_reference(STEPS, world_size)  # on each rank: one thread, as the ranks compute
    results = {}
    for stage in (0, 1):
        module, trainer = _fit(stage, world_size)
        assert {p.dtype for p in module.parameters()} == {torch.bfloat16}, f"stage {stage}: replicas not bf16"
        sharding = get_sharding(trainer.optimizers[0])
        assert sharding.beside_replicas and {m.dtype for m in sharding.masters.values()} == {torch.float32}
        got = trained_weights(trainer)
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-6, f"stage {stage}: {worst:.3e} from the written-out reference"
        for name, p in module.named_parameters():  # the replicas are the masters rounded
            assert torch.equal(p.detach(), got[name].to(torch.bfloat16)), f"stage {stage}: replica {name}"
        results[stage] = got
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0]), "stage 1 differs from stage 0"


def test_bf16_true_at_stages_0_and_1_is_the_written_out_replica_reference():
    run_distributed(_parity_worker, 2)


def _accumulate_worker(rank, world_size):
    expected = replica_reference(STEPS, world_size, accumulate=2)
    for stage in (0, 1):
        _, trainer = _fit(stage, world_size, accumulate_grad_batches=2)
        got = trained_weights(trainer)
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-6, f"stage {stage}: {worst:.3e} from the written-out reference with accumulation"


def test_gradient_accumulation_adds_bf16_gradients_before_the_fp32_reduction():
    run_distributed(_accumulate_worker, 2)


CLIP = 0.05  # below every step's gradient norm here: each step is clipped


def _clip_worker(rank, world_size):
    expected = replica_reference(STEPS, world_size, clip=CLIP)
    for stage in (0, 1):
        _, trainer = _fit(stage, world_size, gradient_clip_val=CLIP)
        got = trained_weights(trainer)
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-6, f"stage {stage}: {worst:.3e} from the written-out reference with clipping"


def test_clipping_bf16_replicas_takes_the_norm_in_fp32():
    run_distributed(_clip_worker, 2)


def test_clip_replica_grads_norm_is_the_fp32_norm_of_the_bf16_gradients():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(1000, 1000, dtype=torch.bfloat16)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(1000, 1000).to(torch.bfloat16)
    grads = [p.grad.float() for p in params]
    exact = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert abs(torch.nn.utils.get_total_norm([p.grad for p in params]).item() - exact.item()) > 1e-3 * exact.item()
    norm = clip_replica_grads(params, 1.0)
    assert norm.dtype == torch.float32 and torch.equal(norm, exact)
    for p, g in zip(params, grads):  # scaled by torch's own rule, 1 / (norm + 1e-6)
        assert torch.equal(p.grad, (g * (1.0 / (exact + 1e-6))).to(torch.bfloat16))


def _bytes_worker(rank, world_size):
    module, trainer = _fit(1, world_size, steps=2)
    total = sum(p.numel() for p in module.parameters())
    sharding = get_sharding(trainer.optimizers[0])
    replica_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    master_bytes = sum(m.numel() * m.element_size() for m in sharding.masters.values())
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in trainer.optimizers[0].state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.numel() > 1
    )
    every = [None] * world_size
    dist.all_gather_object(every, master_bytes)
    assert replica_bytes == 2 * total  # DeepSpeed's 2P of bf16 parameters, not 4P of fp32
    assert sum(every) == 4 * total  # the fp32 values exist once across the ranks: 4P/N each
    assert state_bytes == 2 * master_bytes  # Adam's two moments of the owned masters only
    # between steps no gradient is held: the bf16 ones go before the step, the fp32 ones after it
    assert all(p.grad is None for p in module.parameters())
    assert all(m.grad is None for m in sharding.masters.values())


def test_stage_1_bf16_true_holds_deepspeed_zero1_bytes():
    run_distributed(_bytes_worker, 2)


class SeesRestoredWeights(RegressionModule):
    def on_train_start(self):
        self.restored = trained_weights(self.trainer)


def _resume_worker(rank, world_size, root):
    _, trainer = _fit(1, world_size, steps=2)
    path = os.path.join(root, "half.ckpt")
    trainer.save_checkpoint(path)
    saved = trained_weights(trainer)
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in saved.values()), "masters hold bf16 values"
    for stage, precision in ((1, "bf16-true"), (0, "bf16-true"), (2, "32-true")):
        torch.manual_seed(1)
        module = SeesRestoredWeights(batch_size=BATCH)
        quiet_trainer(ZeroStrategy(stage=stage), world_size, max_steps=3, precision=precision).fit(
            module, ckpt_path=path
        )
        # the fp32 values, not the bf16 replicas, came back: into the masters of a bf16-true run, and into the
        # parameters of an fp32 run at another stage
        assert all(torch.equal(module.restored[k], saved[k]) for k in saved), f"stage {stage} {precision}"


def test_a_resume_keeps_the_fp32_masters_and_other_stages_read_them(tmp_path):
    run_distributed(_resume_worker, 2, str(tmp_path))


class LoadsBaseWeights(RegressionModule):
    """Loads fp32 weights once training starts (after setup), as a fine-tuning script loads its base model."""

    def on_train_start(self):
        torch.manual_seed(3)
        self.loaded = {k: torch.randn(v.shape) for k, v in self.state_dict().items()}
        self.load_state_dict(self.loaded)
        self.seen = trained_weights(self.trainer)


def _load_state_dict_worker(rank, world_size):
    """A user's ``model.load_state_dict(fp32 weights)`` after setup: the masters take the fp32 values themselves."""
    for stage in (0, 1):
        module = LoadsBaseWeights(batch_size=BATCH)
        quiet_trainer(ZeroStrategy(stage=stage), world_size, max_steps=1, precision="bf16-true").fit(module)
        assert all(torch.equal(module.seen[k], module.loaded[k]) for k in module.loaded), f"stage {stage}"


def test_a_users_load_state_dict_sets_the_masters_to_the_loaded_values():
    run_distributed(_load_state_dict_worker, 2)


def _fabric_clip_worker(rank, world_size):
    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
    from tests.fabric.test_fabric_parity import make_fabric

    fabric = make_fabric(FabricZeroStrategy(stage=1), precision="bf16-true")
    torch.manual_seed(0)
    module = nn.Linear(64, 64)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters()))
    fabric.backward(model(torch.randn(4, 64) + rank).float().pow(2).sum())
    grads = [p.grad.float() for p in module.parameters()]  # bf16, reduced over the ranks
    exact = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    norm = fabric.clip_gradients(model, optimizer, max_norm=1e-3)
    assert norm.dtype == torch.float32 and torch.equal(norm, exact)


def test_fabric_clips_bf16_replicas_by_their_fp32_norm():
    run_distributed(_fabric_clip_worker, 2)


def _nvme_worker(rank, world_size, root):
    """With the masters swapped to NVMe the run keeps fp32 parameters (the swapper writes its first masters from the
    parameters and a checkpoint saves them): bf16 replicas there would start and save bf16-rounded weights."""
    torch.manual_seed(0)
    module = RegressionModule(batch_size=BATCH)
    strategy = ZeroStrategy(stage=1, offload="nvme", nvme_path=root)
    trainer = quiet_trainer(strategy, world_size, max_steps=2, precision="bf16-true")
    trainer.fit(module)
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert not strategy.precision_plugin.replicas_cast
    saved = trained_weights(trainer)
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in saved.values())


def test_nvme_swapped_masters_keep_fp32_parameters(tmp_path):
    run_distributed(_nvme_worker, 2, str(tmp_path))


def _gathered(mine):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {k: v.detach().clone() for k, v in mine.items()})
    return {k: v for part in every for k, v in part.items()}


def _fabric_model_only_load_worker(rank, world_size, root):
    """``fabric.load(path, {"model": model})`` without the optimizer still loads the fp32 values into the masters."""
    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
    from tests.fabric.test_fabric_parity import make_fabric

    fabric = make_fabric(FabricZeroStrategy(stage=1), precision="bf16-true")
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        module = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
        models.append((module, *fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))))
    first, model, optimizer = models[0]
    fabric.backward(model(torch.randn(4, 64) + rank).float().pow(2).sum())
    optimizer.step()
    path = os.path.join(root, "ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer})
    saved = _gathered(fabric.strategy.get_module_state_dict(first))
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in saved.values())
    second, model, _ = models[1]
    fabric.load(path, {"model": model})
    got = _gathered(fabric.strategy.get_module_state_dict(second))
    assert all(torch.equal(got[k], saved[k]) for k in saved), "a model-only load rounded the masters"


def test_a_model_only_fabric_load_fills_the_masters(tmp_path):
    run_distributed(_fabric_model_only_load_worker, 2, str(tmp_path))
