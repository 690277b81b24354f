"""Activation checkpointing and CPU activation offload: recomputation happens, saved activations shrink, training
is unchanged (stages 0-3, every precision, the pipeline, dropout), checkpoints keep their keys, and the ds_config
section turns it on."""

import os

import pytest
import torch
from torch import nn

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ActivationCheckpointConfig, ZeroStrategy, apply_activation_checkpointing
from lightning_zero.distributed.activation_checkpointing import (
    activation_checkpoint_config,
    is_checkpointed,
    select_blocks,
)
from tests.lightning_models import Block as LightningBlock
from tests.lightning_models import ManualModule, RegressionModule, full_state, quiet_trainer, reference_weights
from tests.ranks import run_distributed

WIDTH = 32


class MLPBlock(nn.Module):
    calls = 0  # forward runs, recomputations included

    def __init__(self, dropout=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        MLPBlock.calls += 1
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class SixBlockNet(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(MLPBlock(dropout) for _ in range(6))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class SavedTensorMeter:
    """Bytes of the distinct non-parameter storages autograd saves for backward (outermost hooks: the tensors a
    checkpointed block drops never reach them, its kept inputs do unless save_on_cpu takes them first)."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.storages = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def nbytes(self):
        return sum(self.storages.values())


def _forward_backward(model, x):
    meter = SavedTensorMeter(model.parameters())
    with meter.hooks():
        loss = model(x).square().mean()
    loss.backward()
    return meter.nbytes


def test_recomputes_each_block_and_saves_at_least_half_less():
    torch.manual_seed(0)
    plain = SixBlockNet()
    checkpointed = SixBlockNet()
    checkpointed.load_state_dict(plain.state_dict())
    handle = apply_activation_checkpointing(checkpointed, ActivationCheckpointConfig())
    x = torch.randn(64, 8)
    MLPBlock.calls = 0
    plain_bytes = _forward_backward(plain, x)
    assert MLPBlock.calls == 6
    MLPBlock.calls = 0
    ckpt_bytes = _forward_backward(checkpointed, x)
    assert MLPBlock.calls == 12, "every block's forward must run again in backward"
    # The peak with checkpointing is in backward: the kept inputs plus one block's recomputed activations at a time,
    # at most a sixth of the plain run's saved bytes (six identical blocks, plus what lies outside them).
    assert ckpt_bytes + plain_bytes / 6 <= plain_bytes / 2, (
        f"saved activations {ckpt_bytes} vs {plain_bytes} without checkpointing"
    )
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # The module tree and the parameter names are those of the plain model (checkpoints keep their keys).
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert all(type(b) is MLPBlock for b in checkpointed.blocks)
    # A deep copy (SWA, EMA callbacks) checkpoints its own blocks, not the original's.
    clone = __import__("copy").deepcopy(checkpointed)
    assert all(is_checkpointed(b) and b.forward.forward.__self__ is b for b in clone.blocks)
    handle.remove()
    assert not any(is_checkpointed(b) for b in checkpointed.blocks)
    MLPBlock.calls = 0
    _forward_backward(checkpointed, x)
    assert MLPBlock.calls == 6


def test_cpu_checkpointing_moves_the_kept_inputs_through_save_on_cpu(monkeypatch):
    packed = []

    class RecordingSaveOnCpu(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook
            self.pack_hook = lambda t: packed.append(pack(t)) or packed[-1]

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", RecordingSaveOnCpu)
    torch.manual_seed(0)
    plain, offloaded = SixBlockNet(), SixBlockNet()
    offloaded.load_state_dict(plain.state_dict())
    kept = SixBlockNet()
    kept.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(offloaded, ActivationCheckpointConfig(cpu_checkpointing=True))
    apply_activation_checkpointing(kept, ActivationCheckpointConfig())
    x = torch.randn(16, 8)
    _forward_backward(plain, x)
    kept_bytes = _forward_backward(kept, x)
    offloaded_bytes = _forward_backward(offloaded, x)
    # save_on_cpu packs (device, CPU copy): exactly the six block inputs went to CPU memory. torch 2.11's
    # non-reentrant checkpoint also saves one empty placeholder tensor per call (torch 2.13 does not): no bytes.
    copies = [copy for _, copy in packed if copy.numel()]
    assert all(copy.device.type == "cpu" for _, copy in packed) and len(packed) in (6, 12)
    assert len(copies) == 6 and all(copy.shape == (16, WIDTH) for copy in copies)
    assert offloaded_bytes == kept_bytes - 6 * 16 * WIDTH * 4, "the kept inputs must leave the device's saved set"
    for (name, p), q in zip(plain.named_parameters(), offloaded.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_dropout_recomputes_the_same_mask():
    torch.manual_seed(0)
    plain = SixBlockNet(dropout=0.3)
    checkpointed = SixBlockNet(dropout=0.3)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, ActivationCheckpointConfig(cpu_checkpointing=True))
    x = torch.randn(16, 8)
    torch.manual_seed(5)
    _forward_backward(plain, x)
    torch.manual_seed(5)
    MLPBlock.calls = 0
    _forward_backward(checkpointed, x)
    assert MLPBlock.calls == 12, "the masks must come from a recomputation, else the test proves nothing"
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad), name


def _named_units_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero import ZeroConfig, apply_zero

    model = SixBlockNet()
    apply_zero(
        model,
        init_device_mesh("cpu", (world_size,)),
        ZeroConfig(stage=2, sharded_module_classes={"Linear"}),
        activation_checkpointing=ActivationCheckpointConfig(),
    )
    assert [is_checkpointed(m) for m in (model.inp, model.blocks[0], model.blocks[0].up, model.out)] == [
        True,
        False,
        True,
        True,
    ], "True must mean the FSDP units the user named"


def test_true_means_the_named_sharded_module_classes():
    run_distributed(_named_units_worker, 2)


def test_selection_policies_and_selective_checkpointing():
    model = SixBlockNet()
    assert select_blocks(model, ActivationCheckpointConfig()) == list(model.blocks)
    assert select_blocks(model, ActivationCheckpointConfig({"MLPBlock"})) == list(model.blocks)
    assert select_blocks(model, ActivationCheckpointConfig(every_k=2)) == list(model.blocks)[::2]
    assert select_blocks(model, ActivationCheckpointConfig(number_checkpoints=3)) == list(model.blocks)[::2]
    assert select_blocks(model, ActivationCheckpointConfig(number_checkpoints=9)) == list(model.blocks)
    # Only the outermost selected modules: the Linears inside a selected block are not checkpointed again.
    either = ActivationCheckpointConfig(lambda m: isinstance(m, (MLPBlock, nn.Linear)))
    assert select_blocks(model, either) == [model.inp, *model.blocks, model.out]
    apply_activation_checkpointing(model, ActivationCheckpointConfig(every_k=3))
    MLPBlock.calls = 0
    model(torch.randn(2, 8)).sum().backward()
    assert MLPBlock.calls == 8, "blocks 0 and 3 recompute, the other four do not"


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(activation_checkpointing=True, activation_checkpointing_policy=True), ValueError, "not both"),
        (dict(activation_checkpointing=set()), ValueError, "empty set"),
        (dict(activation_checkpointing=[3]), TypeError, "nn.Module subclasses"),
        (dict(activation_checkpointing="yes please", cpu_checkpointing="no"), TypeError, "cpu_checkpointing"),
        (dict(activation_checkpointing=ActivationCheckpointConfig(), cpu_checkpointing=True), ValueError, "disagrees"),
    ],
)
def test_invalid_arguments_fail_in_the_strategy_constructor(kwargs, error, message):
    with pytest.raises(error, match=message):
        ZeroStrategy(**kwargs)


def test_cpu_checkpointing_alone_is_deepspeed_strategys_config_key():
    # DeepSpeedStrategy(cpu_checkpointing=True) writes activation_checkpointing.cpu_checkpointing; that section turns
    # checkpointing of the repeated blocks on here, inputs kept on CPU (it used to be refused)
    config = ZeroStrategy(cpu_checkpointing=True).activation_checkpoint_config
    assert config is not None and config.cpu_checkpointing is True
    assert (
        config
        == ZeroStrategy(config={"activation_checkpointing": {"cpu_checkpointing": True}}).activation_checkpoint_config
    )


def test_config_validation_and_unmatched_policies():
    with pytest.raises(ValueError, match="not both"):
        ActivationCheckpointConfig(every_k=2, number_checkpoints=2)
    with pytest.raises(ValueError, match="every_k"):
        ActivationCheckpointConfig(every_k=0)
    with pytest.raises(ValueError, match="no module of that class"):
        select_blocks(SixBlockNet(), ActivationCheckpointConfig({"Missing"}))
    with pytest.raises(ValueError, match="has none"):
        select_blocks(nn.Sequential(nn.Linear(2, 2)), ActivationCheckpointConfig())
    with pytest.raises(ValueError, match="selects no submodule"):
        select_blocks(SixBlockNet(), ActivationCheckpointConfig(lambda m: False))
    assert ZeroStrategy(
        activation_checkpointing_policy={LightningBlock}
    ).activation_checkpoint_config.policy == frozenset({LightningBlock})
    assert ZeroStrategy().activation_checkpoint_config is None
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    lightning_style = ZeroStrategy(activation_checkpointing_policy=ModuleWrapPolicy({LightningBlock}))
    assert lightning_style.activation_checkpoint_config.policy == frozenset({LightningBlock})


def test_ds_config_section_enables_it_and_reports_the_keys_without_effect():
    from lightning_zero.ds_config.report import effective_config_rows

    section = {
        "cpu_checkpointing": True,
        "number_checkpoints": 4,
        "partition_activations": True,
        "contiguous_memory_optimization": True,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    with pytest.warns(Warning, match="no effect") as warned:
        strategy = ZeroStrategy(config={"zero_optimization": {"stage": 3}, "activation_checkpointing": section})
    # number_checkpoints sizes a DeepSpeed buffer; it never limited which blocks DeepSpeed checkpoints (here it
    # checkpointed only 4 blocks, so a DeepSpeed config with a small number used more memory): all blocks, and a word
    assert strategy.activation_checkpoint_config == ActivationCheckpointConfig(policy=True, cpu_checkpointing=True)
    assert any("activation_checkpointing.number_checkpoints=4" in str(w.message) for w in warned)
    rows = {key: note for key, _, note in effective_config_rows(strategy.ds_config.translation)}
    for key in (
        "partition_activations",
        "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary",
        "profile",
        "number_checkpoints",
    ):
        assert rows[f"activation_checkpointing.{key}"].startswith("no effect: "), key
    assert "tensor parallelism" in rows["activation_checkpointing.partition_activations"]
    assert rows["activation_checkpointing.cpu_checkpointing"].startswith("-> cpu_checkpointing")
    # Explicit arguments win over the section.
    overridden = ZeroStrategy(
        config={"activation_checkpointing": {"cpu_checkpointing": True}},
        activation_checkpointing={"Block"},
        cpu_checkpointing=False,
    )
    assert overridden.activation_checkpoint_config == ActivationCheckpointConfig({"Block"})
    assert (
        ZeroStrategy(
            config={"activation_checkpointing": {}}, activation_checkpointing=False
        ).activation_checkpoint_config
        is None
    )
    assert activation_checkpoint_config(ds_section=None) is None


# ---------------------------------------------------------------------------------------- Trainer, 2 gloo ranks
BATCH = 4
STEPS = 4


def _trainer(strategy, world_size, **kwargs):
    return quiet_trainer(strategy, world_size, **{"max_steps": STEPS, **kwargs})


def _counting_block_forward(counter):
    original = LightningBlock.forward

    def forward(self, x):
        counter[0] += 1
        return original(self, x)

    return forward


def _fit(world_size, counter=None, precision="32-true", **strategy_kwargs):
    torch.manual_seed(0)
    module = RegressionModule(batch_size=BATCH)
    trainer = _trainer(ZeroStrategy(**strategy_kwargs), world_size, precision=precision)
    if counter is not None:
        counter[0] = 0
    trainer.fit(module)
    return full_state(module)


def _worst(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


def _stage_parity_worker(rank, world_size):
    counter = [0]
    LightningBlock.forward = _counting_block_forward(counter)  # this forked rank only
    expected = reference_weights(STEPS, BATCH * world_size)
    failures = []
    for stage in (0, 1, 2, 3):
        plain = _fit(world_size, counter, stage=stage)
        plain_calls = counter[0]
        assert plain_calls == STEPS * 2, "two blocks, one forward each per step"
        for cpu in (False, True):
            got = _fit(world_size, counter, stage=stage, activation_checkpointing=True, cpu_checkpointing=cpu)
            assert counter[0] == 2 * plain_calls, f"stage {stage}: the block forwards must run twice per step"
            if _worst(got, plain) > 1e-6 or _worst(got, expected) > 1e-5:
                failures.append(
                    f"stage={stage} cpu={cpu}: {_worst(got, plain):.2e} from the run without "
                    f"checkpointing, {_worst(got, expected):.2e} from the single-process reference"
                )
    # A checkpointed region holding several FSDP units ("Net": the units' hooks run again in the recomputation), and
    # regions inside one unit ("Linear": the layers of the blocks).
    for policy in ({"Net"}, {"Linear"}):
        got = _fit(world_size, counter, stage=3, activation_checkpointing=policy)
        if _worst(got, expected) > 1e-5:
            failures.append(f"stage=3 {policy}: {_worst(got, expected):.2e} from the single-process reference")
    # Manual optimization: at stages 2-3 backward runs inside the root module's forward (see manual_backward.py).
    for stage in (0, 3):
        torch.manual_seed(0)
        module = ManualModule(batch_size=BATCH)
        strategy = ZeroStrategy(stage=stage, activation_checkpointing=True, cpu_checkpointing=True)
        counter[0] = 0
        _trainer(strategy, world_size).fit(module)
        assert counter[0] == 2 * STEPS * 2, f"manual optimization, stage {stage}: no recomputation"
        if _worst(full_state(module), expected) > 1e-5:
            failures.append(f"manual stage={stage}: {_worst(full_state(module), expected):.2e}")
    assert not failures, "\n".join(failures)


def test_trainer_parity_at_every_stage_with_and_without_cpu_checkpointing():
    run_distributed(_stage_parity_worker, 2)


def _precision_worker(rank, world_size):
    counter = [0]
    LightningBlock.forward = _counting_block_forward(counter)
    for stage, precision in ((2, "bf16-mixed"), (0, "16-mixed"), (3, "bf16-true"), (1, "bf16-mixed")):
        plain = _fit(world_size, counter, precision=precision, stage=stage)
        calls = counter[0]
        got = _fit(
            world_size,
            counter,
            precision=precision,
            stage=stage,
            activation_checkpointing={"Block"},
            cpu_checkpointing=stage == 3,
        )
        assert counter[0] == 2 * calls, precision
        assert _worst(got, plain) <= 1e-6, f"stage={stage} {precision}: {_worst(got, plain):.2e}"


def test_every_precision_trains_the_same_with_checkpointing():
    run_distributed(_precision_worker, 2)


def _save_load_worker(rank, world_size, root):
    """Saved with checkpointing, resumed without (and the reverse): the keys and values carry over."""
    from tests.strategies.test_strategy_checkpoint import STEPS_PER_EPOCH, _reference

    epoch = dict(max_steps=-1, limit_train_batches=STEPS_PER_EPOCH)
    for save_kwargs, load_kwargs in (
        (dict(stage=3, activation_checkpointing=True), dict(stage=2)),
        (dict(stage=2), dict(stage=3, activation_checkpointing=True, cpu_checkpointing=True)),
    ):
        path = os.path.join(root, f"ac-{len(save_kwargs)}.ckpt")
        torch.manual_seed(0)
        module = RegressionModule(batch_size=BATCH)
        trainer = _trainer(ZeroStrategy(**save_kwargs), world_size, max_epochs=1, **epoch)
        trainer.fit(module)
        trainer.save_checkpoint(path)
        torch.manual_seed(123)  # every weight must come from the checkpoint
        resumed = RegressionModule(batch_size=BATCH)
        trainer = _trainer(ZeroStrategy(**load_kwargs), world_size, max_epochs=2, **epoch)
        trainer.fit(resumed, ckpt_path=path)
        expected = _reference(2, BATCH * world_size)
        assert _worst(full_state(resumed), expected) <= 1e-5, (save_kwargs, load_kwargs)


def test_checkpoint_saved_with_checkpointing_resumes_without_and_back(tmp_path):
    root = str(tmp_path)
    run_distributed(_save_load_worker, 2, root)


# ---------------------------------------------------------------------------------------- the pipeline
def _pipeline_worker(rank, world_size, schedule, recomputes):
    from tests.pipeline.test_pipeline_parity import SeededLinear
    from tests.strategies.test_strategy_pipeline import STEPS as PIPE_STEPS
    from tests.strategies.test_strategy_pipeline import PipelinedLM, _gather_full_state, reference

    calls = [0]
    original = SeededLinear.forward

    def counting(self, x):
        calls[0] += 1
        return original(self, x)

    SeededLinear.forward = counting  # this forked rank only
    counts = []
    for kwargs in (dict(), dict(activation_checkpointing=True, cpu_checkpointing=True)):
        torch.manual_seed(0)
        module = PipelinedLM()
        strategy = ZeroStrategy(
            stage=0, pipeline_parallel_size=2, micro_batches=2, pipeline_schedule=schedule, **kwargs
        )
        calls[0] = 0
        _trainer(strategy, world_size, max_steps=PIPE_STEPS).fit(module)
        counts.append(calls[0])
        blocks = sum(isinstance(layer, SeededLinear) for layer in module.model.layers.values())
        got = _gather_full_state(module, strategy.meshes.pipeline.get_group())
        expected = reference(PIPE_STEPS, BATCH)
        assert _worst(got, expected) <= 1e-5, f"{schedule} {kwargs}: {_worst(got, expected):.2e}"
    # Each of this rank's blocks runs once more per micro-batch (2 per step); under the zero-bubble schedules up to
    # twice, since their backward runs in two passes (input gradients, then weight gradients) that may each unpack
    # the block's saved tensors. The last stage's set-up forward (torch.distributed.pipelining's shape inference,
    # counted in both runs) is also recomputed once per fit there.
    extra = counts[1] - counts[0]
    once = PIPE_STEPS * 2 * blocks
    assert blocks > 0 and once <= extra <= once * recomputes + blocks, f"{schedule}: block forwards {counts}"


@pytest.mark.parametrize("schedule,recomputes", [("1f1b", 1), ("zero_bubble", 2)])
def test_pipeline_stages_checkpoint_their_blocks(schedule, recomputes):
    run_distributed(_pipeline_worker, 2, schedule, recomputes)


def test_pipeline_policy_true_selects_the_repeated_layers_and_refuses_double_checkpointing():
    from lightning_zero.pipeline.zero_pipeline import checkpoint_pipeline_layers
    from tests.pipeline.test_pipeline_parity import SeededLinear, make_model

    model = make_model()  # embedding tied to the head (one module used twice), six SeededLinear blocks
    checkpoint_pipeline_layers(model, ActivationCheckpointConfig(cpu_checkpointing=True))
    chosen = [name for name, layer in model.layers.items() if is_checkpointed(layer)]
    assert chosen == [str(i) for i in range(1, 7)]
    assert all(isinstance(model.layers[name], SeededLinear) for name in chosen)
    with pytest.raises(ValueError, match="not both"):
        checkpoint_pipeline_layers(make_model(checkpoint_interval=2), ActivationCheckpointConfig())
