"""``empty_init=True`` as Lightning means it, and models built on the meta device.

* ``fabric.init_module(empty_init=True)`` / ``Trainer.init_module(empty_init=True)`` skip torch's layer init, as
  Lightning's DDP strategy does: the build consumes no random numbers, stages 2-3 still record it (no rank holds the
  model), and the script's own init afterwards (LitGPT's pretraining flow) gives bitwise the weights, and leaves the
  random stream where, a DDP run with the same seed does.
* A model built under ``torch.device("meta")`` (Lightning's ModelParallel/FSDP pattern) gets its values from each
  module's ``reset_parameters()``: bitwise a non-meta build followed by the same calls, in bounded memory, and it
  trains to the same weights; a module holding meta tensors without ``reset_parameters`` is refused by name before
  any step.
"""

import math
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.distributed.deferred_init import has_deferred, materialize_module
from lightning_zero.distributed.exact_init import InitConfig, exact_init
from lightning_zero.distributed.meta_init import init_meta_tensors
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from tests.distributed.test_exact_init import assert_bitwise_equal
from tests.ranks import run_distributed

SEED = 4321
VOCAB, EMBD, HEADS, LAYERS, BLOCK = 64, 32, 2, 4, 16
STEPS = 2


# ---------------------------------------------------------------------------------------------- a LitGPT-like GPT
class RMSNorm(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(EMBD, 3 * EMBD, bias=False)
        self.proj = nn.Linear(EMBD, EMBD, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, -1).transpose(1, 2) for z in self.attn(x).split(EMBD, dim=2))
        q, k = (
            z * cos[:t] + torch.cat((-z[..., z.size(-1) // 2 :], z[..., : z.size(-1) // 2]), -1) * sin[:t]
            for z in (q, k)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, EMBD))


class LLaMAMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_1 = nn.Linear(EMBD, 2 * EMBD, bias=False)
        self.fc_2 = nn.Linear(EMBD, 2 * EMBD, bias=False)
        self.proj = nn.Linear(2 * EMBD, EMBD, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_1, self.attn = RMSNorm(EMBD), CausalSelfAttention()
        self.norm_2, self.mlp = RMSNorm(EMBD), LLaMAMLP()
        self.drop = nn.Dropout(0.1)  # draws from the stream training sees: it must be DDP's too

    def forward(self, x, cos, sin):
        x = x + self.drop(self.attn(self.norm_1(x), cos, sin))
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    """LitGPT's layout: rotary caches as non-persistent buffers that ``reset_parameters`` recomputes."""

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(
            dict(wte=nn.Embedding(VOCAB, EMBD), h=nn.ModuleList(Block() for _ in range(LAYERS)), ln_f=RMSNorm(EMBD))
        )
        cos, sin = self.rope_cache()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rope_cache(self, device=None):
        half = EMBD // HEADS // 2
        theta = 1.0 / (10000 ** (torch.arange(half, device=device).float() / half))
        angles = torch.outer(torch.arange(BLOCK, device=device).float(), theta).repeat(1, 2)
        return torch.cos(angles), torch.sin(angles)

    def reset_parameters(self):
        self.cos, self.sin = self.rope_cache(device=self.cos.device)

    def forward(self, idx):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, self.cos, self.sin)
        return self.lm_head(self.transformer.ln_f(x))


def initialize_weights(model, call_reset=True):
    """LitGPT pretraining's ``initialize_weights``: per-module ``reset_parameters`` overrides, then (for every strategy
    but Lightning's FSDPStrategy, whose meta build calls them at setup) every module's ``reset_parameters()``."""

    def init_weights(module, std):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)

    for mod in model.modules():
        if isinstance(mod, (nn.Embedding, nn.Linear)):
            mod.reset_parameters = partial(init_weights, mod, std=math.sqrt(2.0 / 5 / EMBD))
    for mod in model.modules():
        if isinstance(mod, (LLaMAMLP, CausalSelfAttention)):
            mod.proj.reset_parameters = partial(init_weights, mod.proj, std=1 / math.sqrt(EMBD) / LAYERS)
    if call_reset:
        for mod in model.modules():
            if callable(getattr(mod, "reset_parameters", None)):
                mod.reset_parameters()


def reset_like_lightning(model):
    """The calls a meta build gets: ``reset_parameters()`` of each module holding tensors, in ``modules()`` order."""
    for mod in model.modules():
        if any(True for _ in (*mod.parameters(recurse=False), *mod.buffers(recurse=False))):
            mod.reset_parameters()


def full_state(module):
    """Every parameter and buffer (non-persistent ones too) as full tensors."""
    out = {}
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        out[name] = (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu().clone()
    return out


def model_bytes(module):
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def batches(rank):
    ids = torch.randint(0, VOCAB, (STEPS, 2, BLOCK), generator=torch.Generator().manual_seed(7 + rank))
    return list(ids)


# ---------------------------------------------------------------------------------------------- one process
def test_empty_init_consumes_no_random_numbers_and_still_defers():
    """The build skips torch's layer init at every stage, so the stream is untouched; stages 2-3 still record."""
    for deferred in (False, True):
        torch.manual_seed(SEED)
        before = torch.random.get_rng_state()
        with exact_init(InitConfig(deferred=deferred), empty_init=True):
            model = GPT()
        assert torch.equal(torch.random.get_rng_state(), before), f"deferred={deferred}"
        assert has_deferred(model) == deferred
        initialize_weights(model)  # the script's own init, on the recorded tensors too
        materialize_module(model)
        torch.manual_seed(SEED)
        reference = GPT()
        torch.manual_seed(SEED)
        initialize_weights(reference)
        assert_bitwise_equal(full_state(model), full_state(reference), f"deferred={deferred}")
    for empty_init in (None, False):  # today's exact init: the model's own init runs and draws
        torch.manual_seed(SEED)
        with exact_init(InitConfig(deferred=True), empty_init=empty_init):
            model = GPT()
        materialize_module(model)
        torch.manual_seed(SEED)
        assert_bitwise_equal(full_state(model), full_state(GPT()), f"empty_init={empty_init}")


def test_meta_build_is_bitwise_a_real_build_then_reset_parameters_in_bounded_memory():
    with torch.device("meta"):
        model = GPT()
    initialize_weights(model, call_reset=False)
    model.lm_head.weight = model.transformer.wte.weight  # tied weights stay one tensor
    torch.manual_seed(SEED)
    assert init_meta_tensors(model)
    recorder = model.lm_head.weight._recorder
    rng_after = torch.random.get_rng_state()
    assert model.lm_head.weight is model.transformer.wte.weight
    # reset_parameters() was recorded: the most real memory held at once is a tensor's RNG scratch, not the model
    assert 0 < recorder.peak_bytes < model_bytes(GPT()) / 4, recorder.peak_bytes
    materialize_module(model)
    reference = GPT()
    initialize_weights(reference, call_reset=False)
    reference.lm_head.weight = reference.transformer.wte.weight
    torch.manual_seed(SEED)
    reset_like_lightning(reference)
    assert torch.equal(torch.random.get_rng_state(), rng_after)
    assert_bitwise_equal(full_state(model), full_state(reference), "meta")


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(EMBD))


class ForgetsABuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(EMBD))
        self.register_buffer("table", torch.empty(4))

    def reset_parameters(self):
        nn.init.normal_(self.weight)


def test_meta_modules_that_would_stay_uninitialised_are_refused_by_name():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ModuleDict({"gate": NoReset()}))
    with pytest.raises(ValueError, match=r"without a reset_parameters\(\) method: 1\.gate \(NoReset\)\."):
        init_meta_tensors(model)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), ForgetsABuffer())
    with pytest.raises(ValueError, match=r"left these meta-device tensors unwritten: 1\.table \(ForgetsABuffer\)\."):
        init_meta_tensors(model)


# ---------------------------------------------------------------------------------------------- Fabric
def _fabric(strategy):
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()  # the ranks exist (tests.ranks): joins the process group
    return fabric


def _fabric_empty_init_run(strategy):
    """LitGPT's pretraining flow; returns the starting weights, whether the build drew, and the stream after setup."""
    fabric = _fabric(strategy)
    torch.manual_seed(SEED)
    before = torch.random.get_rng_state()
    with fabric.init_module(empty_init=True):
        model = GPT()
    drew = not torch.equal(before, torch.random.get_rng_state())
    initialize_weights(model)
    recorder = model.lm_head.weight._recorder if has_deferred(model) else None
    model = fabric.setup(model)
    return full_state(model.module), drew, torch.random.get_rng_state(), recorder


def _fabric_empty_init_worker(rank, world_size, configs):
    expected, drew, rng, _ = _fabric_empty_init_run("ddp")  # Lightning's own DDPStrategy
    assert not drew
    for stage, offload in configs:
        label = f"fabric stage={stage} offload={offload}"
        got, drew, got_rng, recorder = _fabric_empty_init_run(FabricZeroStrategy(stage=stage, offload=offload))
        assert not drew, f"{label}: the empty_init=True build drew random numbers"
        assert_bitwise_equal(got, expected, label)
        assert torch.equal(got_rng, rng), f"{label}: the stream after setup is not DDP's"
        if stage >= 2:  # recorded and replayed unit by unit: never the whole model at once
            assert 0 < recorder.peak_bytes < model_bytes(GPT()) / 2, (label, recorder.peak_bytes)


def test_fabric_empty_init_then_litgpt_init_is_bitwise_ddp():
    run_distributed(_fabric_empty_init_worker, 2, [(3, None)])


@pytest.mark.slow
def test_fabric_empty_init_then_litgpt_init_is_bitwise_ddp_at_every_stage():
    run_distributed(_fabric_empty_init_worker, 2, [(0, None), (1, None), (2, None), (2, "cpu"), (3, "cpu")])


def _fabric_train(fabric, model, optimizer, rank):
    for ids in batches(rank):
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return full_state(model.module)


def _fabric_meta_run(stage, meta, joint):
    fabric = _fabric(FabricZeroStrategy(stage=stage))
    if meta:
        with torch.device("meta"):
            model = GPT()
        initialize_weights(model, call_reset=False)  # LitGPT's FSDP branch: setup calls the overrides
        torch.manual_seed(SEED)
    else:
        with fabric.init_module():
            model = GPT()
        initialize_weights(model, call_reset=False)
        torch.manual_seed(SEED)
        reset_like_lightning(model)
    if joint:  # the optimizer made from the meta parameters: setup points it at the real, sharded ones by name
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    start, rng = full_state(model.module), torch.random.get_rng_state()
    return start, rng, _fabric_train(fabric, model, optimizer, fabric.global_rank)


def _meta_peak_is_one_unit(world_size):
    """apply_zero replays a meta build's reset_parameters() one unit at a time: never the whole model at once."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero import ZeroConfig, apply_zero

    with torch.device("meta"):
        model = GPT()
    init_meta_tensors(model)
    recorder = model.lm_head.weight._recorder
    apply_zero(model, init_device_mesh("cpu", (world_size,)), ZeroConfig(stage=3))
    assert isinstance(model.lm_head.weight, torch.distributed.tensor.DTensor)
    assert 0 < recorder.peak_bytes < model_bytes(GPT()) / 2, recorder.peak_bytes


def _fabric_meta_worker(rank, world_size, configs):
    _meta_peak_is_one_unit(world_size)
    for stage, joint in configs:
        label = f"fabric meta stage={stage} joint={joint}"
        start, rng, trained = _fabric_meta_run(stage, meta=False, joint=joint)
        got_start, got_rng, got_trained = _fabric_meta_run(stage, meta=True, joint=joint)
        assert_bitwise_equal(got_start, start, f"{label} (start)")
        assert torch.equal(got_rng, rng), label
        assert_bitwise_equal(got_trained, trained, f"{label} (after {STEPS} steps)")


def test_fabric_meta_build_trains_like_a_real_build_with_the_same_reset_parameters():
    run_distributed(_fabric_meta_worker, 2, [(3, True)])


@pytest.mark.slow
def test_fabric_meta_build_at_stages_0_and_2():
    run_distributed(_fabric_meta_worker, 2, [(2, False), (2, True), (0, True)])


# ---------------------------------------------------------------------------------------------- Trainer
class GPTModule(LightningModule):
    """``gpt`` given (built under ``Trainer.init_module``) or built in ``configure_model`` (``build="meta"``: on the
    meta device with LitGPT's overrides, ``build="real"``: for real, then the same ``reset_parameters`` calls)."""

    def __init__(self, gpt=None, build=None):
        super().__init__()
        self.gpt, self.build = gpt, build
        self.start = self.rng = None
        self.steps = 0

    def configure_model(self):
        if self.gpt is not None:
            return
        with torch.device("meta") if self.build == "meta" else nullcontext():
            self.gpt = GPT()
        initialize_weights(self.gpt, call_reset=False)
        torch.manual_seed(SEED)  # the meta build's reset_parameters() run at setup, from here
        if self.build != "meta":
            reset_like_lightning(self.gpt)

    def on_fit_start(self):
        self.start, self.rng = full_state(self.gpt), torch.random.get_rng_state()

    def training_step(self, batch, batch_idx):
        self.steps += 1
        ids = batch[0]
        return F.cross_entropy(self.gpt(ids).flatten(0, 1), ids.roll(-1, 1).flatten())

    def validation_step(self, batch, batch_idx):
        ids = batch[0]
        return F.cross_entropy(self.gpt(ids).flatten(0, 1), ids.roll(-1, 1).flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.cat(batches(0))), batch_size=2)

    val_dataloader = train_dataloader


def _trainer(strategy, world_size):
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


def _trainer_empty_init_run(strategy, world_size):
    trainer = _trainer(strategy, world_size)
    torch.manual_seed(SEED)
    before = torch.random.get_rng_state()
    with trainer.init_module(empty_init=True):
        gpt = GPT()
    drew = not torch.equal(before, torch.random.get_rng_state())
    initialize_weights(gpt)
    module = GPTModule(gpt)
    trainer.fit(module)
    return module, drew


def _trainer_empty_init_worker(rank, world_size, stages):
    expected, drew = _trainer_empty_init_run("ddp", world_size)
    assert not drew
    for stage in stages:
        got, drew = _trainer_empty_init_run(ZeroStrategy(stage=stage), world_size)
        assert not drew, f"stage {stage}: the empty_init=True build drew random numbers"
        assert_bitwise_equal(got.start, expected.start, f"trainer stage={stage}")
        assert torch.equal(got.rng, expected.rng), f"stage {stage}: the stream at fit start is not DDP's"


def test_trainer_init_module_empty_init_then_litgpt_init_is_bitwise_ddp():
    run_distributed(_trainer_empty_init_worker, 2, [2])


@pytest.mark.slow
def test_trainer_init_module_empty_init_at_stages_1_and_3():
    run_distributed(_trainer_empty_init_worker, 2, [1, 3])


def _trainer_meta_worker(rank, world_size, stages):
    for stage in stages:
        real, meta = GPTModule(build="real"), GPTModule(build="meta")
        _trainer(ZeroStrategy(stage=stage), world_size).fit(real)
        _trainer(ZeroStrategy(stage=stage), world_size).fit(meta)
        assert_bitwise_equal(meta.start, real.start, f"trainer meta stage={stage} (start)")
        assert torch.equal(meta.rng, real.rng), f"stage {stage}: the stream at fit start differs"
        assert_bitwise_equal(full_state(meta.gpt), full_state(real.gpt), f"trainer meta stage={stage} (trained)")


def test_trainer_configure_model_on_the_meta_device_trains_like_a_real_build():
    run_distributed(_trainer_meta_worker, 2, [2])


def _trainer_meta_validate_worker(rank, world_size):
    for stage in (1, 3):  # an evaluation alone: stages 0-1 replicate without DDP, 2-3 shard
        real, meta = GPTModule(build="real"), GPTModule(build="meta")
        _trainer(ZeroStrategy(stage=stage), world_size).validate(real)
        _trainer(ZeroStrategy(stage=stage), world_size).validate(meta)
        assert_bitwise_equal(full_state(meta.gpt), full_state(real.gpt), f"validate meta stage={stage}")


@pytest.mark.slow
def test_trainer_configure_model_on_the_meta_device_at_stage_3_and_in_validate():
    run_distributed(_trainer_meta_worker, 2, [3])
    run_distributed(_trainer_meta_validate_worker, 2)


class MetaWithoutReset(GPTModule):
    def configure_model(self):
        with torch.device("meta"):
            self.gpt = GPT()
            self.gpt.transformer.h[1].gate = NoReset()


def _refused_worker(rank, world_size):
    for stage in (2, 3):
        module = MetaWithoutReset()
        with pytest.raises(
            ValueError,
            match=r"without a reset_parameters\(\) method: gpt\.transformer\.h\.1\.gate "
            r"\(NoReset\)\.",
        ):
            _trainer(ZeroStrategy(stage=stage), world_size).fit(module)
        assert module.steps == 0
        fabric = _fabric(FabricZeroStrategy(stage=stage))
        with torch.device("meta"):
            gpt = GPT()
            gpt.transformer.h[1].gate = NoReset()
        with pytest.raises(
            ValueError,
            match=r"without a reset_parameters\(\) method: transformer\.h\.1\.gate "
            r"\(NoReset\)\.",
        ):
            fabric.setup(gpt)


def test_a_meta_module_without_reset_parameters_is_refused_by_name_before_any_step():
    run_distributed(_refused_worker, 2)
