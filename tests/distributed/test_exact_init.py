"""Exact model initialisation at every ZeRO stage (lightning_zero.distributed.exact_init).

For the same seed, the initial full weights, buffers and metric states of a model built in ``configure_model`` or
under ``Trainer.init_module`` must be bitwise those of a plain CPU build, at stages 0-3 and with offload, for a tiny
Hugging Face Llama (``LlamaRMSNorm`` has no ``reset_parameters``, rotary ``inv_freq`` is a non-persistent buffer,
``_init_weights`` uses std=0.02), a torchmetrics metric, and custom init code.
"""

import itertools
import math

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroConfig, ZeroStrategy, apply_zero
from lightning_zero.distributed.deferred_init import InitMemoryError, is_deferred
from lightning_zero.distributed.exact_init import InitConfig, exact_init
from tests.ranks import run_distributed

SEED = 1234
VOCAB = 64
STEPS = 2


class CustomInit(nn.Module):
    """Init code of its own and no ``reset_parameters``: a drawn parameter, a random non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)
        self.scale = nn.Parameter(torch.randn(8) * 0.1 + 1)
        self.register_buffer("noise", torch.rand(8), persistent=False)
        self.register_buffer("steps", torch.arange(8.0))

    def forward(self, x):
        return self.proj(x) * self.scale + self.noise


def build_parts():
    """What the LightningModule builds; seeding first makes the plain CPU reference the very same call."""
    import torchmetrics
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config), torchmetrics.MeanSquaredError(), CustomInit()


def snapshot(**modules):
    """Full values of every parameter, buffer (persistent or not) and torchmetrics state and default."""
    import torchmetrics

    out = {}
    for prefix, module in modules.items():
        for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            out[f"{prefix}.{name}"] = tensor.detach().cpu().clone()
        for sub_name, sub in module.named_modules():
            if isinstance(sub, torchmetrics.Metric):
                for state, default in sub._defaults.items():
                    out[f"{prefix}.{sub_name}.{state}"] = getattr(sub, state).detach().cpu().clone()
                    out[f"{prefix}.{sub_name}.{state}.default"] = default.detach().cpu().clone()
    return out


def assert_bitwise_equal(got, expected, label):
    assert got.keys() == expected.keys(), f"{label}: {sorted(got.keys() ^ expected.keys())}"
    wrong = [
        name
        for name in expected
        if got[name].dtype != expected[name].dtype or not torch.equal(got[name], expected[name])
    ]
    assert not wrong, f"{label}: initial values differ from a plain CPU build for {wrong}"


class InitModule(LightningModule):
    def __init__(self, build_now: bool = False):
        super().__init__()
        self.llama = self.metric = self.custom = None
        if build_now:
            self.llama, self.metric, self.custom = build_parts()
        self.initial = None
        self.rng_after_build = None
        self.deferred = is_deferred(self.llama.lm_head.weight) if build_now else None
        self.losses = []

    def configure_model(self):
        if self.llama is None:
            self.llama, self.metric, self.custom = build_parts()
            self.rng_after_build = torch.random.get_rng_state()
            self.deferred = is_deferred(self.llama.lm_head.weight)

    def on_fit_start(self):
        self.initial = snapshot(llama=self.llama, metric=self.metric, custom=self.custom)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        lm_loss = self.llama(input_ids=ids, labels=ids).loss
        self.losses.append(lm_loss.item())
        return lm_loss + 1e-3 * self.custom(torch.ones(ids.shape[0], 8)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=2)


def make_trainer(strategy, world_size):
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def expected_values():
    llama, metric, custom = build_parts()
    return snapshot(llama=llama, metric=metric, custom=custom), torch.random.get_rng_state()


def _configure_model_worker(rank, world_size):
    expected, rng_after_build = expected_values()
    for stage, offload in ((0, None), (1, None), (2, None), (2, "cpu"), (3, None), (3, "cpu")):
        module = InitModule()
        make_trainer(ZeroStrategy(stage=stage, offload=offload), world_size).fit(module)
        label = f"configure_model stage={stage} offload={offload}"
        assert module.deferred == (stage >= 2), label  # stages 2-3 record and replay (deferred_init)
        assert_bitwise_equal(module.initial, expected, label)
        # The build consumed the RNG stream exactly as the plain build did (dropout etc. then match stage 0's).
        assert torch.equal(module.rng_after_build, rng_after_build), label
        assert len(module.losses) == STEPS and all(math.isfinite(loss) for loss in module.losses), (
            f"{label}: {module.losses}"
        )


def test_configure_model_initial_weights_are_exact_at_every_stage():
    run_distributed(_configure_model_worker, 2)


def _init_module_worker(rank, world_size):
    expected, _ = expected_values()
    trainer = make_trainer(ZeroStrategy(stage=3), world_size)
    # empty_init=True skips torch's layer init (tests/distributed/test_empty_and_meta_init.py)
    with trainer.init_module(empty_init=False):
        module = InitModule(build_now=True)
    assert module.deferred
    trainer.fit(module)
    assert_bitwise_equal(module.initial, expected, "init_module(empty_init=False) stage=3")
    assert all(math.isfinite(loss) for loss in module.losses), module.losses


def test_init_module_without_empty_init_is_exact_at_stage_3():
    run_distributed(_init_module_worker, 2)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([CustomInit(), CustomInit()])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


build_stack = Stack


def _apply_zero_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(SEED)
    expected = snapshot(stack=build_stack())  # what rank 0 builds
    for stage in (2, 3):
        # Each rank draws other numbers, and the default device is meta: the build still lands on real CPU memory
        # and every rank ends with rank 0's values, as DDP gives at stage 0.
        torch.manual_seed(SEED + rank)
        with torch.device("meta"), exact_init(InitConfig(local_world_size=world_size)):
            stack = build_stack()
        apply_zero(stack, mesh, ZeroConfig(stage=stage))
        assert isinstance(stack.head.weight, torch.distributed.tensor.DTensor)
        assert_bitwise_equal(snapshot(stack=stack), expected, f"apply_zero stage={stage}")

    with torch.device("meta"):
        meta = build_stack()
    # a meta model gets its values from reset_parameters() (tests/distributed/test_empty_and_meta_init.py);
    # CustomInit has none
    with pytest.raises(
        ValueError,
        match=r"without a reset_parameters\(\) method: blocks\.0 \(CustomInit\), "
        r"blocks\.1 \(CustomInit\)\.",
    ):
        apply_zero(meta, mesh, ZeroConfig(stage=3))


def test_apply_zero_takes_rank_0_values_and_refuses_meta_models_without_reset_parameters():
    run_distributed(_apply_zero_worker, 2)


def test_exact_init_guard_names_the_module_before_exceeding_the_budget():
    with pytest.raises(InitMemoryError, match=r"at Linear\.weight.*InitConfig\.host_memory_budget"):
        with exact_init(InitConfig(host_memory_budget=10_000)):
            nn.Sequential(nn.Linear(4, 4), nn.Linear(64, 64))  # 80 B, then a 16 KiB weight crosses it
    with exact_init(InitConfig(host_memory_budget=10_000)):  # tied / shared storage is counted once
        small = nn.Linear(40, 40)
        small.register_buffer("alias", small.weight.detach())
    with exact_init(InitConfig(host_memory_budget=0)):  # 0: no guard
        nn.Linear(64, 64)


@pytest.mark.parametrize(
    "kwargs",
    [dict(local_world_size=0), dict(local_world_size=True), dict(host_memory_budget=-1), dict(host_memory_budget=1.5)],
)
def test_init_config_rejects_invalid_values(kwargs):
    with pytest.raises(ValueError):
        InitConfig(**kwargs)


def test_strategy_builds_under_the_guard_with_the_budget_from_the_environment(monkeypatch):
    trainer = Trainer(
        strategy=ZeroStrategy(stage=1),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    stage_3 = Trainer(
        strategy=ZeroStrategy(stage=3),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    monkeypatch.setenv("LIGHTNING_ZERO_INIT_MEMORY_BUDGET", "10000")
    with pytest.raises(InitMemoryError, match=r"at Linear\.weight.*LIGHTNING_ZERO_INIT_MEMORY_BUDGET"):
        with trainer.init_module():
            nn.Linear(64, 64)
    # stage 3 records the build: nothing real to count (tests/distributed/test_deferred_init.py)
    with stage_3.init_module():
        deferred = nn.Linear(64, 64)
    assert is_deferred(deferred.weight)
    monkeypatch.setenv("LIGHTNING_ZERO_DEFERRED_INIT", "0")  # the switch back to a real build, under the guard
    with pytest.raises(InitMemoryError, match=r"at Linear\.weight"):
        with stage_3.init_module():
            nn.Linear(64, 64)
    monkeypatch.setenv("LIGHTNING_ZERO_DEFERRED_INIT", "no")
    with pytest.raises(ValueError, match="LIGHTNING_ZERO_DEFERRED_INIT must be 0"):
        with stage_3.init_module():
            pass
    monkeypatch.delenv("LIGHTNING_ZERO_DEFERRED_INIT")
    monkeypatch.setenv("LIGHTNING_ZERO_INIT_MEMORY_BUDGET", "ten kilobytes")
    with pytest.raises(ValueError, match="LIGHTNING_ZERO_INIT_MEMORY_BUDGET must be a number of bytes"):
        with trainer.init_module():
            pass
    monkeypatch.setenv("LIGHTNING_ZERO_INIT_MEMORY_BUDGET", "0")
    with torch.device("meta"), trainer.init_module(empty_init=False):
        built = nn.Linear(64, 64)
    assert built.weight.device.type == "cpu" and torch.isfinite(built.weight).all()
