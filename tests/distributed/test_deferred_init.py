"""Bounded-memory exact initialisation (lightning_zero.distributed.deferred_init).

A model built under ``exact_init(InitConfig(deferred=True))`` (what ``ZeroStrategy`` does at stages 2-3) holds no
real parameter memory; ``apply_zero`` replays each unit right before sharding it. The values must be bitwise those of
a plain CPU build with the same seed, and the RNG stream must end where the plain build leaves it.
"""

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroConfig, ZeroStrategy, apply_zero
from lightning_zero.distributed.deferred_init import DeferredInitError, InitMemoryError, is_deferred, materialize_module
from lightning_zero.distributed.exact_init import InitConfig, exact_init
from tests.distributed.test_exact_init import assert_bitwise_equal, snapshot
from tests.ranks import run_distributed


class CustomInit(nn.Module):
    """Init code that reads values in Python, writes through views and mixes real tensors in."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, 6)
        nn.init.trunc_normal_(self.proj.weight, std=0.02)
        self.wide = nn.Parameter(torch.empty(4, 27))
        nn.init.orthogonal_(self.wide)  # rows < cols: orthogonal_ transposes its scratch in place (t_)
        self.tall = nn.Parameter(torch.empty(9, 3))
        nn.init.orthogonal_(self.tall, gain=2.0)
        self.proj.weight.data[1:3].zero_()  # a write through .data and a slice
        self.proj.bias.detach()[::2].fill_(0.5)
        scale = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # real, then changed: the log keeps this value
        self.proj.bias.data.mul_(scale)
        scale.zero_()
        if self.proj.weight.abs().max().item() > 0:  # a Python read of a deferred value in the middle
            self.proj.weight.data.add_(1e-3)
        self.emb = nn.Embedding(10, 6, padding_idx=3)
        self.norm = nn.LayerNorm(6)
        self.conv = nn.Conv2d(3, 4, 3)
        nn.init.kaiming_normal_(self.conv.weight, mode="fan_out")
        nn.init.xavier_uniform_(self.wide.data[:2])
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 6, 2).float() / 6)), persistent=False)
        self.register_buffer("mask", torch.tril(torch.ones(5, 5, dtype=torch.bool)))
        self.gate = nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(5)) * 0.1 + 1)
        with torch.no_grad():
            torch._foreach_mul_([self.proj.weight, self.tall], 0.5)  # writes a list and returns nothing
            self.gate.bernoulli_(torch.full((6,), 0.3))  # a random op with a tensor argument
        self.drop = torch.rand(3)  # a plain attribute: real when construction ends
        self.same = torch.equal(self.emb.weight[3], torch.zeros(6))


def custom():
    torch.manual_seed(11)
    return CustomInit()


def llama(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        torch.manual_seed(12)
        return LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                vocab_size=64,
                max_position_embeddings=32,
                tie_word_embeddings=tied,
            )
        )

    return build


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(13)
    return GPT2LMHeadModel(
        GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    )


class WithMetric(nn.Module):
    def __init__(self):
        super().__init__()
        import torchmetrics

        self.head = nn.Linear(4, 4)
        self.mse = torchmetrics.MeanSquaredError()
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average=None)


def with_metric():
    torch.manual_seed(14)
    return WithMetric()


BUILDERS = {
    "custom": custom,
    "llama_tied": llama(True),
    "llama_untied": llama(False),
    "gpt2": gpt2,
    "torchmetrics": with_metric,
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_deferred_build_is_bitwise_a_plain_build(name):
    build = BUILDERS[name]
    reference = build()
    expected, rng_after = snapshot(model=reference), torch.random.get_rng_state()
    with exact_init(InitConfig(deferred=True)):
        model = build()
    # The RNG stream ends exactly where the plain build left it, and no parameter or buffer holds real memory.
    assert torch.equal(torch.random.get_rng_state(), rng_after)
    assert all(is_deferred(t) for t in [*model.parameters(), *model.buffers()])
    if name == "custom":
        assert not is_deferred(model.drop) and torch.equal(model.drop, reference.drop)
        assert model.same is reference.same is True
    materialize_module(model)
    assert not any(is_deferred(t) for t in [*model.parameters(), *model.buffers()])
    assert_bitwise_equal(snapshot(model=model), expected, name)
    if name.startswith("llama"):
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        assert tied == (reference.lm_head.weight is reference.model.embed_tokens.weight) == (name == "llama_tied")


def test_deferred_tensors_keep_recording_after_construction():
    """What touches a deferred model before setup (a checkpoint load, a dtype conversion) is replayed too."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    state = {key: torch.full_like(value, 0.25) for key, value in reference.state_dict().items()}
    with exact_init(InitConfig(deferred=True)):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
    model.load_state_dict(state, strict=False)
    model.to(torch.bfloat16)  # Lightning's bf16-true convert_module runs between configure_model and setup
    assert "deferred(tensor(" in repr(model[0].weight)  # printing shows the replayed values
    materialize_module(model)
    assert model[0].weight is model[1].weight and model[0].weight.dtype == torch.bfloat16
    assert torch.equal(model[0].weight, torch.full((10, 4), 0.25, dtype=torch.bfloat16))
    with exact_init(InitConfig(deferred=True)):
        linear = nn.Linear(2, 2)
    with pytest.raises(DeferredInitError, match=r"\.data of a deferred tensor"):
        linear.weight.data = torch.zeros(2, 2)


def _lz_scale(x: torch.Tensor) -> None:
    x.mul_(3.0)


@pytest.fixture(scope="module")
def op_without_meta_kernel():
    """A custom op with no meta (fake) kernel: the recorder must run it for real and keep what it wrote."""
    lib = torch.library.Library("lz_deferred_test", "DEF")
    lib.define("scale_(Tensor(a!) x) -> ()")
    lib.impl("scale_", _lz_scale, "CPU")
    yield torch.ops.lz_deferred_test.scale_.default
    lib._destroy()


class UsesCustomOp(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16))
        with torch.no_grad():
            op(self.weight)


def test_an_op_without_meta_kernel_is_kept_exactly_or_refused_over_budget(op_without_meta_kernel):
    torch.manual_seed(3)
    expected = UsesCustomOp(op_without_meta_kernel).weight.detach().clone()
    torch.manual_seed(3)
    with exact_init(InitConfig(deferred=True, host_memory_budget=4096)):
        model = UsesCustomOp(op_without_meta_kernel)
    materialize_module(model)
    assert torch.equal(model.weight, expected)
    with pytest.raises(InitMemoryError, match=r"at UsesCustomOp.*lz_deferred_test\.scale_"):
        with exact_init(InitConfig(deferred=True, host_memory_budget=512)):  # the pinned 1 KiB exceeds it
            UsesCustomOp(op_without_meta_kernel)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        nn.init.orthogonal_(self.fc.weight)


class Big(nn.Module):
    """Sixteen 16.6 KB blocks: 267 KB of parameters, over three times the 80 KB budget the test sets."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(16)])
        self.head = nn.Linear(64, 4)
        nn.init.trunc_normal_(self.head.weight, std=0.02)


BUDGET = 80_000
UNIT_BYTES = 64 * 64 * 4 + 64 * 4


def _bounded_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(21)
    expected = snapshot(model=Big())
    assert sum(t.numel() * 4 for t in expected.values()) > 3 * BUDGET
    with pytest.raises(InitMemoryError):  # building on real memory does not fit this budget
        with exact_init(InitConfig(local_world_size=world_size, host_memory_budget=BUDGET)):
            Big()
    for stage in (2, 3):
        torch.manual_seed(21 + rank)  # ranks draw other numbers: rank 0's values win, as with DDP
        with exact_init(InitConfig(local_world_size=world_size, host_memory_budget=BUDGET, deferred=True)):
            model = Big()
        recorder = model.head.weight._recorder
        apply_zero(model, mesh, ZeroConfig(stage=stage))
        assert isinstance(model.blocks[0].fc.weight, torch.distributed.tensor.DTensor)
        assert_bitwise_equal(snapshot(model=model), expected, f"deferred stage={stage}")
        # The most a replay held at once is one block plus the temporaries of its init (orthogonal_'s normal_
        # scratch, Q and R: three more of its size), never the model.
        assert 0 < recorder.peak_bytes <= 4 * UNIT_BYTES < BUDGET, recorder.peak_bytes


def test_stage_2_and_3_build_a_model_over_the_budget_exactly_in_bounded_memory():
    run_distributed(_bounded_worker, 2)


def test_a_large_real_input_is_held_and_a_later_change_to_it_refused(monkeypatch):
    import lightning_zero.distributed.deferred_init as deferred_init

    monkeypatch.setattr(deferred_init, "_COPY_BELOW", 16)  # hold every real input above 16 bytes
    source = torch.arange(12.0).reshape(3, 4)
    with exact_init(InitConfig(deferred=True)):
        linear = nn.Linear(4, 3)
        linear.weight.data.copy_(source)
    with exact_init(InitConfig(deferred=True)):
        held = nn.Linear(4, 3)
        held.weight.data.copy_(source)
    materialize_module(linear)
    assert torch.equal(linear.weight, torch.arange(12.0).reshape(3, 4))
    source.add_(1)  # after the read: the logged value is gone, so replaying must refuse, not use the new one
    with pytest.raises(DeferredInitError, match=r"shape \(3, 4\).*modified in place afterwards"):
        materialize_module(held)


def small_net():
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(12, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    nn.init.trunc_normal_(net[0].weight, std=0.02)
    net[2].weight.data[0].zero_()
    return net


class BuiltInConfigureModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = None
        self.initial = None

    def configure_model(self):
        self.deferred = None
        if self.net is None:
            self.net = small_net()
            self.deferred = is_deferred(self.net[0].weight)

    def on_fit_start(self):
        self.initial = snapshot(net=self.net)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.ones(4, 12)), batch_size=2)


def test_trainer_stage_3_bf16_true_configure_model_matches_the_real_build(monkeypatch):
    """Lightning's bf16-true builds under a bf16 default dtype and the strategy converts the module before setup:
    both are recorded, so the sharded model starts from exactly what building on real memory gives."""
    initial = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("LIGHTNING_ZERO_DEFERRED_INIT", switch)
        module = BuiltInConfigureModel()
        Trainer(
            strategy=ZeroStrategy(stage=3),
            accelerator="cpu",
            devices=1,
            precision="bf16-true",
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        ).fit(module)
        torch.distributed.destroy_process_group()  # the Trainer leaves it for a next fit; forked tests must not see it
        assert module.deferred == (switch == "1")
        initial[switch] = module.initial
    assert_bitwise_equal(initial["1"], initial["0"], "stage 3 bf16-true")
    assert {tensor.dtype for tensor in initial["0"].values()} == {torch.float32}  # fp32 masters (ZeroPrecision)


def test_two_deferred_builds_can_read_and_write_each_other():
    """A model built under Trainer.init_module and more built in configure_model: two logs, values still exact."""

    def build_first():
        torch.manual_seed(4)
        return nn.Linear(4, 4)

    def build_second(first):
        second = nn.Linear(4, 4)
        second.weight.data.copy_(first.weight * 2)  # reads the first build
        first.bias.data.copy_(second.bias)  # writes the first build from the second
        return second

    first = build_first()
    second = build_second(first)
    expected = snapshot(first=first, second=second)
    with exact_init(InitConfig(deferred=True)):
        first = build_first()
    with exact_init(InitConfig(deferred=True)):
        second = build_second(first)
    assert all(is_deferred(t) for t in [*first.parameters(), *second.parameters()])
    materialize_module(second)
    materialize_module(first)
    assert_bitwise_equal(snapshot(first=first, second=second), expected, "two builds")


def _hf(name):
    import transformers as T

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    return {
        "bert": lambda: T.BertModel(T.BertConfig(**small, vocab_size=100, max_position_embeddings=64)),
        "t5": lambda: T.T5ForConditionalGeneration(
            T.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=100, d_kv=16)
        ),
        "mistral": lambda: T.MistralForCausalLM(
            T.MistralConfig(**small, num_key_value_heads=1, vocab_size=100, max_position_embeddings=64)
        ),
        "qwen2": lambda: T.Qwen2ForCausalLM(
            T.Qwen2Config(**small, num_key_value_heads=1, vocab_size=100, max_position_embeddings=64)
        ),
        "opt": lambda: T.OPTForCausalLM(
            T.OPTConfig(
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                vocab_size=100,
                max_position_embeddings=64,
                word_embed_proj_dim=32,
            )
        ),
        "vit": lambda: T.ViTModel(T.ViTConfig(**small, image_size=32, patch_size=8)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**small, vocab_size=100, max_position_embeddings=64)),
        "nn_transformer": lambda: nn.Transformer(
            d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64
        ),
    }[name]


@pytest.mark.parametrize("name", ["bert", "t5", "mistral", "qwen2", "opt", "vit", "gpt_neox", "nn_transformer"])
def test_more_architectures_record_bitwise_a_plain_build(name):
    """Architectures the recorder was not written against: every weight and buffer bitwise a plain CPU build's,
    and the random stream left where a plain build leaves it."""
    from lightning_zero.distributed.deferred_init import deferred_build, materialize_module

    build = _hf(name)
    torch.manual_seed(3)
    plain = build()
    after_plain = torch.rand(4)
    torch.manual_seed(3)
    with deferred_build():
        recorded = build()
    after_recorded = torch.rand(4)
    materialize_module(recorded)
    assert torch.equal(after_plain, after_recorded)
    expected, got = plain.state_dict(), recorded.state_dict()
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    plain_buffers, recorded_buffers = dict(plain.named_buffers()), dict(recorded.named_buffers())
    assert [k for k in plain_buffers if not torch.equal(plain_buffers[k], recorded_buffers[k])] == []
