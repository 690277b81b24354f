"""What each rank of ``tests/distributed/test_many_ranks.py`` runs: the ZeRO stages through the framework-free runtime
(``runtime.init_context``, ``wrap_module``, ``shard_optimizer_of``, ``no_gradient_sync``) and sharded checkpoints
through ``checkpoint.states``, compared with one unsharded process that trains on the whole global batch.

Every parameter's first dimension is 11, 13, 7 or 3 rows, below 16 and no multiple of 8: FSDP2 gives the last ranks
empty shards at 8 and 16 ranks (the last of 16 holds no element at all) and uneven ones at 3, and stage 1 leaves
ranks owning no parameter.
The global batch (96 samples) is the same at every world size, so one reference serves them all.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero import ZeroConfig
from lightning_zero.checkpoint import load_meta
from lightning_zero.checkpoint import states as checkpointing
from lightning_zero.distributed import runtime
from lightning_zero.distributed.optimizer import get_sharding

VOCAB, WIDTH, HIDDEN, OUT, TOKENS = 11, 13, 7, 3, 5
GLOBAL_BATCH = 96  # divisible by 16, 8 and 3 ranks times 2 micro-batches
STEPS = 3  # trained before the comparison and the save; a resume then takes one step more
TOLERANCE = 1e-5
CPU = torch.device("cpu")
# (stage, offload) trained in one world, one after another
CASES = ((0, None), (1, None), (1, "cpu"), (2, None), (2, "cpu"), (3, None), (3, "cpu"))
# how each case trains: plain, and two micro-batches per step (no gradient sync on the first) with the gradients'
# norm clipped (their norm is several times CLIP: every step clips)
VARIANTS = {"plain": {}, "accumulated and clipped": {"accumulate": 2, "clip": 0.05}}
SAVED_CASE = (3, None)  # its plain run is saved
SAVED_FILE = "saved_values.pt"  # the full weights and optimizer states the saving world held, next to the checkpoint
LR = {"decay": 1e-2, "no_decay": 5e-3}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class OddNet(nn.Module):
    """An embedding of 11 rows, two blocks of 13 (their own FSDP2 units with ``unit_bytes=0``), ``Linear(13, 7)``
    and a head of 3."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.proj = nn.Linear(WIDTH, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, ids):
        x = self.embed(ids).mean(dim=1)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.tanh(self.proj(x)))


def make_optimizer(module: nn.Module, scale: float = 1.0) -> torch.optim.Optimizer:
    """AdamW with two groups of different hyper-parameters. ``scale`` multiplies the learning rates: a resumed
    optimizer is built with other ones, which the checkpoint's param groups must replace."""
    decay = [p for p in module.parameters() if p.ndim == 2]
    no_decay = [p for p in module.parameters() if p.ndim != 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1, "lr": LR["decay"] * scale},
            {"params": no_decay, "weight_decay": 0.0, "lr": LR["no_decay"] * scale},
        ]
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, TOKENS), generator=gen), torch.randn(GLOBAL_BATCH, OUT, generator=gen)


def train(
    model: nn.Module,
    optimizer,
    steps: range,
    rank: int = 0,
    world_size: int = 1,
    accumulate: int = 1,
    clip: Optional[float] = None,
) -> list[float]:
    """Optimizer steps on ``steps``' global batches, each cut into ``accumulate`` micro-batches of which this rank
    takes its equal slice; the gradients' norm clipped to ``clip``. Returns each step's norm before clipping."""
    local = GLOBAL_BATCH // (accumulate * world_size)
    norms = []
    for step in steps:
        for micro, (ids, target) in enumerate(zip(*(part.chunk(accumulate) for part in batch(step)))):
            mine = slice(rank * local, (rank + 1) * local)
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last or world_size == 1 else runtime.no_gradient_sync(model):
                (nn.functional.mse_loss(model(ids[mine]), target[mine]) / accumulate).backward()
        if clip is not None:
            norms.append(full(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms


def reference(accumulate: int = 1, clip: Optional[float] = None) -> dict[str, dict[str, torch.Tensor]]:
    """The unsharded run's weights at the start, after ``STEPS`` and after one step more."""
    torch.manual_seed(0)
    model = OddNet()
    optimizer = make_optimizer(model)
    found = {"init": _copy(model.state_dict())}
    norms = train(model, optimizer, range(STEPS), accumulate=accumulate, clip=clip)
    assert all(norm > 2 * clip for norm in norms) if clip else not norms, f"every step must clip: norms {norms}"
    found["trained"] = _copy(model.state_dict())
    train(model, optimizer, range(STEPS, STEPS + 1), accumulate=accumulate, clip=clip)
    found["resumed"] = _copy(model.state_dict())
    return found


def references() -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    return {name: reference(**variant) for name, variant in VARIANTS.items()}


def _copy(state: dict) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in state.items()}


def full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective for a DTensor: every rank calls it in the same order)."""
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(value) for name, value in sorted(module.state_dict().items())}


def setup(stage: int, offload: Optional[str], mesh, seed: int = 0, lr_scale: float = 1.0):
    """The module (sharded in place at stages 2-3), what runs it (DDP at stages 0-1) and its sharded optimizer, the
    way both adapters call the runtime (at stages 2-3 the build is recorded and replayed one unit at a time)."""
    config = ZeroConfig(stage=stage, offload=offload, **({"unit_bytes": 0} if stage >= 2 else {}))
    torch.manual_seed(seed)
    with runtime.init_context(config, pipelined=False, local_world_size=dist.get_world_size()):
        module = OddNet()
    model = runtime.wrap_module(module, mesh, config, device=CPU)
    optimizer = make_optimizer(module, lr_scale)
    runtime.shard_optimizer_of(optimizer, module, mesh, config, device=CPU)
    return module, model, optimizer


def worst_difference(got: dict, expected: dict) -> float:
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    return max((got[name] - expected[name]).abs().max().item() for name in expected)


def check_parity(
    rank: int, world_size: int, mesh, expected: dict, failures: list[str], variants: tuple, directory: str = ""
):
    """Every case of ``CASES`` in each of ``variants`` (names in ``VARIANTS``) trained ``STEPS`` steps against the
    reference; with ``directory`` the plain ``SAVED_CASE`` run is then saved there as a sharded checkpoint."""
    for stage, offload in CASES:
        for variant in variants:
            settings = VARIANTS[variant]
            where = f"{world_size} ranks, stage {stage}, offload {offload}, {variant}"
            module, model, optimizer = setup(stage, offload, mesh)
            if stage >= 2 and world_size == 16 and rank == world_size - 1:
                held = [name for name, param in module.named_parameters() if param.to_local().numel()]
                if held:  # every first dimension is below 16: the last rank must hold no element at all
                    failures.append(f"{where}: the last rank holds elements of {held}; the test lost its empty shards")
            train(model, optimizer, range(STEPS), rank, world_size, **settings)
            got = full_weights(module)
            worst = worst_difference(got, expected[variant]["trained"])
            if not worst <= TOLERANCE:
                failures.append(f"{where}: max abs diff {worst:.2e}")
            if worst_difference(got, expected[variant]["init"]) < 1e-3:
                failures.append(f"{where}: the weights did not train")
            if directory and (stage, offload) == SAVED_CASE and not settings:
                save(rank, module, optimizer, stage, directory)
            runtime.release([module], [optimizer])


def save(rank: int, module: nn.Module, optimizer, stage: int, directory: str) -> None:
    """The sharded checkpoint, and beside it (rank 0) the full values it must give back to any world."""
    states = checkpointing.optimizer_state_dict(module, optimizer)
    checkpoint = {
        "state_dict": checkpointing.module_state_dict(module, [optimizer]),
        "optimizer_states": [states],
        "step": STEPS,
    }
    values = {
        "weights": full_weights(module),
        "optimizer": {
            name: {key: full(value) for key, value in sorted(state.items())}
            for name, state in sorted(states["state"].items())
        },
    }
    checkpointing.save_states(
        checkpoint,
        os.path.join(directory, "ckpt"),
        module=module,
        optimizers=[optimizer],
        stage=stage,
        offload=None,
        exclude_frozen_parameters=False,
        ds_config_report=None,
        async_save=False,
    )
    if rank == 0:
        torch.save(values, os.path.join(directory, SAVED_FILE))


def check_resume(
    rank: int,
    world_size: int,
    mesh,
    stage: int,
    offload: Optional[str],
    expected: dict,
    directory: str,
    failures: list[str],
) -> None:
    """Resume the saved checkpoint at ``stage``: the weights and optimizer states equal the saved ones exactly, the
    param groups' learning rates are the saved ones, and one more step equals the reference's."""
    where = f"resumed at {world_size} ranks, stage {stage}, offload {offload}"
    saved = torch.load(os.path.join(directory, SAVED_FILE), weights_only=True)
    module, model, optimizer = setup(stage, offload, mesh, seed=1, lr_scale=7.0)
    path = os.path.join(directory, "ckpt")
    meta = load_meta(path)
    checkpointing.load_states(path, meta, module, [optimizer], strict=True)
    if meta.get("step") != STEPS:
        failures.append(f"{where}: meta.pt's step is {meta.get('step')!r}")
    weights = full_weights(module)
    differing = [name for name in saved["weights"] if not torch.equal(weights[name], saved["weights"][name])]
    if differing or weights.keys() != saved["weights"].keys():
        failures.append(f"{where}: weights differ from the saved ones: {differing or sorted(weights)}")
    failures.extend(f"{where}: {problem}" for problem in _state_problems(module, optimizer, saved["optimizer"]))
    lrs = sorted(group["lr"] for group in optimizer.param_groups)
    if lrs != sorted(LR.values()):
        failures.append(f"{where}: learning rates {lrs}, saved {sorted(LR.values())}")
    train(model, optimizer, range(STEPS, STEPS + 1), rank, world_size)
    worst = worst_difference(full_weights(module), expected["plain"]["resumed"])
    if not worst <= TOLERANCE:
        failures.append(f"{where}: the step after the resume is off the reference by {worst:.2e}")
    runtime.release([module], [optimizer])


def _state_problems(module: nn.Module, optimizer, saved: dict) -> list[str]:
    """Where this rank's optimizer states differ from the saved ones: every parameter this rank steps (all at stages
    0 and 2-3, its partition at stage 1) must hold exactly the saved states."""
    held = checkpointing.optimizer_state_dict(module, optimizer)["state"]
    names = checkpointing.param_names(module)
    stepped = sorted(names[id(param)] for param in get_sharding(optimizer).owned_model_params())
    problems = [] if sorted(held) == stepped else [f"states held for {sorted(held)}, stepped {stepped}"]
    for name in sorted(held):
        got = {key: full(value) for key, value in sorted(held[name].items())}
        if got.keys() != saved[name].keys() or not all(torch.equal(got[k], saved[name][k]) for k in got):
            problems.append(f"optimizer state of {name} differs from the saved one")
    return problems


def raise_failures(failures: list[str]) -> None:
    """Every rank agrees on the verdict (each compares full tensors, but stage 1's states differ per rank)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failures)
    found = list(dict.fromkeys(problem for problems in gathered for problem in problems))
    assert not found, "\n".join(found)


def saving_world(rank: int, world_size: int, expected: dict, directory: str) -> None:
    """Parity of every case in every variant, and the plain ``SAVED_CASE`` run saved."""
    mesh = runtime.build_meshes("cpu", world_size).data_parallel
    failures: list[str] = []
    check_parity(rank, world_size, mesh, expected, failures, tuple(VARIANTS), directory)
    raise_failures(failures)


def resuming_world(rank: int, world_size: int, expected: dict, directory: str, variants: tuple, resumes: tuple) -> None:
    """Parity of every case in each of ``variants`` (none: no parity run), then a resume of the saved checkpoint at
    each of ``resumes``' ``(stage, offload)``."""
    mesh = runtime.build_meshes("cpu", world_size).data_parallel
    failures: list[str] = []
    check_parity(rank, world_size, mesh, expected, failures, variants)
    for stage, offload in resumes:
        check_resume(rank, world_size, mesh, stage, offload, expected, directory, failures)
    raise_failures(failures)
