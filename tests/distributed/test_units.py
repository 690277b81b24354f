"""FSDP2 units grouped by bytes, the persistence threshold and prefetch (lightning_zero.distributed.units).

Planning is checked without processes; one 2-rank launch checks parity with an unsharded single-process reference
(stages 2-3, flat Sequential and GPT-like models, grouping, persistence, prefetch, accumulation), the all-gather count,
and a checkpoint saved with one grouping and loaded with another.
"""

import pytest
import torch
from torch import nn

from lightning_zero import ZeroConfig, apply_zero
from lightning_zero.adapters.settings import resolve_settings
from lightning_zero.distributed.apply_zero import set_gradient_sync, sharded_units, unit_groups
from lightning_zero.distributed.units import DEFAULT_UNIT_BYTES, plan_units
from tests.ranks import run_distributed

WIDTH = 16
LINEAR_BYTES = (WIDTH * WIDTH + WIDTH) * 4
BLOCK_NUMEL = 2 * WIDTH + (WIDTH * WIDTH + WIDTH) + (WIDTH * 2 * WIDTH + 2 * WIDTH) + (2 * WIDTH * WIDTH + WIDTH)
BLOCK_BYTES = 4 * BLOCK_NUMEL


def mlp(depth=8):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class GPTLike(nn.Module):
    def __init__(self, depth=4):
        super().__init__()
        self.embed = nn.Embedding(32, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 32)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ------------------------------------------------------------------ planning (no processes)


def _indices(model, groups):
    position = {id(m): i for i, m in enumerate(model)}
    return sorted([position[id(m)] for m in group] for group in groups)


def test_consecutive_blocks_are_grouped_up_to_the_byte_target():
    model = mlp(8)
    blocks = sharded_units(model, ZeroConfig(stage=3))
    assert len(blocks) == 8
    assert len(plan_units(model, blocks, 0).groups) == 8  # 0: one unit per block, as before grouping
    plan = plan_units(model, blocks, 3 * LINEAR_BYTES)
    assert _indices(model, plan.groups) == [[0, 2, 4], [6, 8, 10], [12, 14]]  # the last pair is >= half a target
    plan = plan_units(model, blocks, 6 * LINEAR_BYTES)
    assert _indices(model, plan.groups) == [[0, 2, 4, 6, 8, 10, 12, 14]]  # a 2-block tail (< half) is merged


def test_the_default_unit_groups_two_4_mib_linears_of_the_issue_mlp():
    """The default unit size is what the quiet-machine time and memory measurements chose (units.py's note): on
    the bench MLP (24 x Linear(1024, 1024), 4 MiB each) it makes 12 units of 2 layers, not one unit per layer nor
    the 6 of 4 layers that cost stage 2 its capacity; the shapes alone are planned (meta device), nothing is
    allocated."""
    with torch.device("meta"):
        model = nn.Sequential(*[m for _ in range(24) for m in (nn.Linear(1024, 1024), nn.GELU())])
    config = ZeroConfig(stage=3)
    plan = plan_units(model, sharded_units(model, config), config.effective_unit_bytes)
    assert config.effective_unit_bytes == DEFAULT_UNIT_BYTES == 8 * 2**20
    assert _indices(model, plan.groups) == [[4 * i, 4 * i + 2] for i in range(12)]


def test_a_block_with_parameters_between_breaks_the_run_and_nested_blocks_stay_alone():
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        nn.Linear(WIDTH, WIDTH),
        nn.LayerNorm(WIDTH),
        nn.Linear(WIDTH, WIDTH),
        nn.Linear(WIDTH, WIDTH),
    )
    blocks = [model[0], model[1], model[3], model[4]]
    plan = plan_units(model, blocks, 10 * LINEAR_BYTES)
    assert _indices(model, plan.groups) == [[0, 1], [3, 4]]
    gpt = GPTLike()
    config = ZeroConfig(stage=3, sharded_module_classes={"Block", "Sequential"}, unit_bytes=10**9)
    groups, _ = unit_groups(gpt, config)
    # Blocks hold Sequentials (units themselves): not grouped; the inner Sequentials (one per parent) neither.
    assert sorted(len(g) for g in groups) == [1] * 8
    heads = [g[0] for g in groups]
    for block in gpt.blocks:
        assert heads.index(block.mlp) < heads.index(block)  # sharded before the block holding it


def test_units_under_the_persistence_threshold_are_left_to_the_root():
    model = mlp(4)
    blocks = sharded_units(model, ZeroConfig(stage=3))
    numel = WIDTH * WIDTH + WIDTH
    plan = plan_units(model, blocks, 0, param_persistence_threshold=numel + 1)
    assert plan.groups == [] and len(plan.persistent) == 4
    plan = plan_units(model, blocks, 2 * LINEAR_BYTES, param_persistence_threshold=numel + 1)
    assert len(plan.groups) == 2 and plan.persistent == []  # grouped units are large enough to stay units


def test_unit_knobs_are_validated_and_refused_without_fsdp_units():
    for bad in (-1, 1.5, True, "16MiB"):
        with pytest.raises(ValueError, match="unit_bytes must be a non-negative int"):
            ZeroConfig(stage=3, unit_bytes=bad)
    for name in ("unit_bytes", "param_persistence_threshold", "prefetch_bytes"):
        with pytest.raises(ValueError, match=f"{name}=8 sizes FSDP2 units"):
            ZeroConfig(stage=1, **{name: 8})
    assert ZeroConfig(stage=2).effective_unit_bytes == DEFAULT_UNIT_BYTES


def test_ds_config_bucket_keys_map_to_the_unit_knobs():
    def settings(zero, **kwargs):
        return resolve_settings(config={"zero_optimization": zero}, **kwargs).zero_config

    from lightning_zero.ds_config import DeepSpeedConfigWarning

    # DeepSpeed itself ignores the stage-3 keys at stage 2 and allgather_bucket_size at stage 3: reported, not mapped
    with pytest.warns(DeepSpeedConfigWarning, match="stage3_param_persistence_threshold=10"):
        stage2 = settings(
            {
                "stage": 2,
                "reduce_bucket_size": 3_000_000,
                "allgather_bucket_size": 2e6,
                "stage3_param_persistence_threshold": 10,
            }
        )
    assert (stage2.unit_bytes, stage2.param_persistence_threshold, stage2.prefetch_bytes) == (8_000_000, None, None)
    with pytest.warns(DeepSpeedConfigWarning, match="allgather_bucket_size=10"):
        stage3 = settings(
            {
                "stage": 3,
                "reduce_bucket_size": 1000,
                "allgather_bucket_size": 10,
                "stage3_prefetch_bucket_size": 500,
                "stage3_param_persistence_threshold": 77,
            }
        )
    assert (stage3.unit_bytes, stage3.prefetch_bytes, stage3.param_persistence_threshold) == (4000, 2000, 77)
    assert settings({"stage": 3, "reduce_bucket_size": 1000}, unit_bytes=64).unit_bytes == 64  # explicit wins
    auto = settings({"stage": 3, "reduce_bucket_size": "auto"})
    assert auto.unit_bytes is None  # "auto" is resolved at setup, after the units are planned: the default
    assert settings({"stage": 1, "reduce_bucket_size": 1000}).unit_bytes is None  # DDP's bucket at stages 0-1
    from lightning_zero.ds_config import translate_ds_config

    notes = dict(translate_ds_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}).notes)
    assert "unit_bytes=4000" in notes["zero_optimization.reduce_bucket_size"]


def test_both_strategies_take_the_unit_knobs():
    from lightning_zero.fabric.fabric_strategy import ZeroStrategy as FabricZero
    from lightning_zero.strategies.trainer_strategy import ZeroStrategy

    for cls in (ZeroStrategy, FabricZero):
        extra = {} if cls is ZeroStrategy else dict(auto_resume=False)
        config = cls(stage=3, unit_bytes=123, param_persistence_threshold=7, prefetch_bytes=0, **extra).zero_config
        assert (config.unit_bytes, config.param_persistence_threshold, config.prefetch_bytes) == (123, 7, 0)
        with pytest.raises(ValueError, match="unit_bytes=1 sizes FSDP2 units"):
            cls(stage=0, unit_bytes=1, **extra)


def test_advise_sizes_the_stage_3_peak_by_the_grouped_unit():
    from types import SimpleNamespace

    from lightning_zero.cli.advise_model import infer_shape

    model = GPTLike()
    spec = SimpleNamespace(model_class="GPTLike", data_args={}, init_args={})
    _, _, unit = infer_shape(model, spec, dict(hidden=WIDTH, layers=4, heads=2, seq_len=5, vocab=32))
    assert unit == 4 * BLOCK_NUMEL  # the four small blocks share one default unit


# ------------------------------------------------------------------ 2 ranks

STEPS, LOCAL_BATCH = 3, 2
# (model, stage, ZeroConfig knobs, accumulation)
CASES = [
    ("mlp", 2, dict(unit_bytes=3 * LINEAR_BYTES), 1),
    ("mlp", 3, dict(unit_bytes=3 * LINEAR_BYTES), 2),
    ("mlp", 3, dict(unit_bytes=2 * LINEAR_BYTES, prefetch_bytes=4 * LINEAR_BYTES), 1),
    ("mlp", 3, dict(unit_bytes=0, param_persistence_threshold=WIDTH * WIDTH + WIDTH + 1), 2),
    ("gpt", 2, dict(unit_bytes=2 * BLOCK_BYTES), 2),
    ("gpt", 3, dict(unit_bytes=2 * BLOCK_BYTES, prefetch_bytes=1), 2),
    ("gpt", 3, dict(unit_bytes=0, param_persistence_threshold=BLOCK_NUMEL + 1), 1),
    # activation checkpointing wraps the blocks' forward before fully_shard groups them; a deferred build is
    # replayed one group at a time
    ("gpt", 3, dict(unit_bytes=2 * BLOCK_BYTES, checkpointing=True), 2),
    ("mlp", 3, dict(unit_bytes=3 * LINEAR_BYTES, deferred=True, checkpointing=True), 1),
    # the default unit size: a model under one unit is one unit at stage 2 (the root), keeps its grouped blocks
    # at stage 3, in a deferred build (made real one unit at a time) and with the units sharded_module_classes names
    ("gpt", 2, dict(), 2),
    ("gpt", 2, dict(deferred=True), 1),
    ("gpt", 2, dict(checkpointing=True), 1),
    ("gpt", 3, dict(), 1),
    ("gpt", 2, dict(sharded_module_classes={Block}), 1),
]


def _build(kind):
    torch.manual_seed(0)
    return mlp() if kind == "mlp" else GPTLike()


def _data(kind, world_size, accumulate):
    gen = torch.Generator().manual_seed(7)
    n = STEPS * accumulate * world_size * LOCAL_BATCH
    if kind == "mlp":
        return torch.randn(n, WIDTH, generator=gen), torch.randn(n, WIDTH, generator=gen)
    idx = torch.randint(0, 32, (n, 5), generator=gen)
    return idx, torch.randint(0, 32, (n, 5), generator=gen)


def _loss(kind, out, target):
    if kind == "mlp":
        return nn.functional.mse_loss(out, target)
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def _reference(kind, world_size, accumulate):
    model = _build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _data(kind, world_size, accumulate)
    per_step = accumulate * world_size * LOCAL_BATCH
    for step in range(STEPS):
        batch = slice(step * per_step, (step + 1) * per_step)
        _loss(kind, model(x[batch]), y[batch]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world_size, mesh, kind, stage, knobs, accumulate, steps=range(STEPS), model=None, opt=None):
    if model is None:
        from lightning_zero.distributed.activation_checkpointing import ActivationCheckpointConfig
        from lightning_zero.distributed.exact_init import InitConfig, exact_init

        knobs = dict(knobs)
        checkpointing = ActivationCheckpointConfig() if knobs.pop("checkpointing", False) else None
        if knobs.pop("deferred", False):
            with exact_init(InitConfig(local_world_size=world_size, deferred=True)):
                module = _build(kind)
            assert next(module.parameters()).__class__.__name__ == "_Deferred"
        else:
            module = _build(kind)
        model = apply_zero(module, mesh, ZeroConfig(stage=stage, **knobs), activation_checkpointing=checkpointing)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _data(kind, world_size, accumulate)
    per_step = accumulate * world_size * LOCAL_BATCH
    for step in steps:
        xs, ys = x[step * per_step : (step + 1) * per_step], y[step * per_step : (step + 1) * per_step]
        for i, (mx, my) in enumerate(zip(xs.chunk(accumulate), ys.chunk(accumulate))):
            set_gradient_sync(model, i == accumulate - 1)
            local = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            (_loss(kind, model(mx[local]), my[local]) / accumulate).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _full(model):
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def _units(model):
    from torch.distributed.fsdp import FSDPModule

    return len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)})


def _parity(rank, world_size, mesh):
    failures = []
    for kind, stage, knobs, accumulate in CASES:
        expected = _reference(kind, world_size, accumulate)
        model, _ = _train(rank, world_size, mesh, kind, stage, knobs, accumulate)
        got = _full(model)
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        if not worst <= 1e-5:
            failures.append(f"{kind} stage {stage} {knobs} accumulate={accumulate}: max abs diff {worst:.2e}")
        expected_units = {
            ("mlp", 3 * LINEAR_BYTES): 4,
            ("mlp", 2 * LINEAR_BYTES): 5,
            ("gpt", 2 * BLOCK_BYTES): 3,
            ("gpt", None): 2,
        }  # the default size: the four blocks grouped, and the root
        if knobs.get("param_persistence_threshold"):
            assert _units(model) == 1, (kind, knobs, _units(model))  # every block left to the root
        elif stage == 2 and not {"unit_bytes", "sharded_module_classes", "deferred"} & set(knobs):
            assert _units(model) == 1, (kind, knobs, _units(model))  # the whole model fits in one unit
        else:
            assert _units(model) == expected_units[kind, knobs.get("unit_bytes")], (kind, knobs, _units(model))
    assert not failures, "\n".join(failures)


def _count_all_gathers(rank, world_size, mesh):
    """One step at stage 3: all-gathers per step drop with the units (forward + backward each), and the root and
    the last unit are gathered once unless every unit is told to reshard."""
    from lightning_zero.distributed import comm_buffers as buffers

    def with_root_params():  # a LayerNorm after the blocks belongs to the root unit
        return nn.Sequential(mlp(8), nn.LayerNorm(WIDTH))

    counts = {}
    persistent = dict(unit_bytes=0, param_persistence_threshold=LINEAR_BYTES)
    for name, build, knobs in (
        ("per block", mlp, dict(unit_bytes=0)),
        ("per block, reshard all", mlp, dict(unit_bytes=0, reshard_after_forward=True)),
        ("grouped", mlp, dict(unit_bytes=4 * LINEAR_BYTES)),
        ("persistent", mlp, persistent),
        ("root with parameters", with_root_params, dict(unit_bytes=0)),
        ("root with parameters, reshard all", with_root_params, dict(unit_bytes=0, reshard_after_forward=True)),
    ):
        model = apply_zero(build(), mesh, ZeroConfig(stage=3, **knobs))
        x = torch.randn(LOCAL_BATCH, WIDTH)
        model(x).sum().backward()  # FSDP2's lazy init
        calls = []
        real = buffers._all_gather_flat  # what FSDP2's all-gather calls on CPU (the pooled buffers)
        buffers._all_gather_flat = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        try:
            model(x).sum().backward()
        finally:
            buffers._all_gather_flat = real
        counts[name] = len(calls)
    # Each unit gathers twice (forward, and again in backward) except the last one to run, which stays gathered
    # into its backward; the root gathers once (kept through backward). With reshard_after_forward=True every unit
    # and the root gather twice. With persistence the root holds every parameter and gathers once.
    assert counts == {
        "per block": 2 * 8 - 1,
        "per block, reshard all": 2 * 8,
        "grouped": 2 * 2 - 1,
        "persistent": 1,
        "root with parameters": 1 + 2 * 8 - 1,
        "root with parameters, reshard all": 2 + 2 * 8,
    }, counts


def _checkpoint_across_groupings(rank, world_size, mesh, path):
    """Save after two steps with one grouping (and persistence), resume with another: same as never stopping."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    expected = _full(_train(rank, world_size, mesh, "gpt", 3, dict(unit_bytes=0), 1)[0])
    knobs = dict(unit_bytes=10**9, param_persistence_threshold=BLOCK_NUMEL + 1)
    model, opt = _train(rank, world_size, mesh, "gpt", 3, knobs, 1, steps=range(2))
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)
    for knobs in (dict(unit_bytes=0), dict(unit_bytes=2 * BLOCK_BYTES, prefetch_bytes=1)):
        resumed = apply_zero(_build("gpt"), mesh, ZeroConfig(stage=3, **knobs))
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        model_sd, opt_sd = get_state_dict(resumed, resumed_opt)
        state = {"model": model_sd, "optim": opt_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _train(rank, world_size, mesh, "gpt", 3, knobs, 1, steps=range(2, STEPS), model=resumed, opt=resumed_opt)
        got = _full(resumed)
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-5, (knobs, worst)


def _prefetch_order(rank, world_size, mesh):
    """Each unit prefetches the next units up to prefetch_bytes: after it in forward, before it in backward."""
    model = apply_zero(mlp(8), mesh, ZeroConfig(stage=3, unit_bytes=LINEAR_BYTES, prefetch_bytes=2 * LINEAR_BYTES))
    state = [model[2 * i]._get_fsdp_state() for i in range(8)]
    assert state[0]._states_to_forward_prefetch == [state[1], state[2]]
    assert state[6]._states_to_forward_prefetch == [state[7]]
    assert state[7]._states_to_backward_prefetch == [state[6], state[5]]
    assert state[0]._states_to_backward_prefetch == []
    default = apply_zero(mlp(8), mesh, ZeroConfig(stage=3, unit_bytes=LINEAR_BYTES))
    assert default[0]._get_fsdp_state()._states_to_forward_prefetch == []  # FSDP2's own schedule


def _worker(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    _count_all_gathers(rank, world_size, mesh)
    _prefetch_order(rank, world_size, mesh)
    _parity(rank, world_size, mesh)
    _checkpoint_across_groupings(rank, world_size, mesh, path)


def test_grouped_units_parity_collectives_and_checkpoints_across_groupings(tmp_path):
    run_distributed(_worker, 2, str(tmp_path / "ckpt"))


# ------------------------------------------------------------------ Trainer: save with one grouping, resume with
# another


def _trainer_resume_worker(rank, world_size, root):
    import os

    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy
    from tests.lightning_models import RegressionModule, full_state
    from tests.strategies.test_strategy_checkpoint import BATCH, STEPS_PER_EPOCH, _reference

    def trainer(epochs, **knobs):
        return Trainer(
            strategy=ZeroStrategy(stage=3, **knobs),
            accelerator="cpu",
            devices=world_size,
            max_epochs=epochs,
            limit_train_batches=STEPS_PER_EPOCH,
            limit_val_batches=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=root,
        )

    path = os.path.join(root, "units.ckpt")
    torch.manual_seed(0)
    first = trainer(1, unit_bytes=0, param_persistence_threshold=10**6)  # every block left to the root
    module = RegressionModule(batch_size=BATCH)
    first.fit(module)
    assert _units(module) == 1
    first.save_checkpoint(path)
    torch.manual_seed(123)  # another init: every weight must come from the checkpoint
    module = RegressionModule(batch_size=BATCH)
    second = trainer(2, unit_bytes=10**9, prefetch_bytes=1)  # the blocks share one unit
    second.fit(module, ckpt_path=path)
    assert _units(module) == 2
    expected = _reference(2, BATCH * world_size)
    got = full_state(module)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, worst


def test_trainer_checkpoint_saved_with_persistent_blocks_resumes_with_grouped_units(tmp_path):
    run_distributed(_trainer_resume_worker, 2, str(tmp_path))
