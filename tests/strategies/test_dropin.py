"""Drop-in habits of DeepSpeedStrategy/DDPStrategy users: DDP options at stages 0-1, the ds_config conventions
(``PL_DEEPSPEED_CONFIG_PATH``, ``strategy.config``, a config optimizer winning, ``exclude_frozen_parameters``),
exports, quiet output, the LightningCLI install."""

import io
import json
import os
import re
import warnings

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.distributed.ddp import DDPOptions
from lightning_zero.ds_config import DeepSpeedConfigError, DeepSpeedConfigWarning, translate_ds_config
from tests.lightning_models import RegressionModule, full_state, quiet_trainer
from tests.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1024 * 1024
BATCH = 4
STEPS = 3


def _trainer(strategy, world_size, **kwargs):
    return quiet_trainer(strategy, world_size, **{"max_steps": STEPS, **kwargs})


# --------------------------------------------------------------------------------- DDP options (item 4)


def test_ddp_options_are_validated_and_refused_where_no_ddp_runs():
    with pytest.raises(TypeError, match="find_unused_parameters must be True, False or None"):
        ZeroStrategy(stage=1, find_unused_parameters="true")
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        ZeroStrategy(stage=0, bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"find_unused_parameters=True: DDP options apply at stages 0-1 only"):
        ZeroStrategy(stage=3, find_unused_parameters=True)
    with pytest.raises(ValueError, match="static_graph=True.*stages 0-1 only"):
        ZeroStrategy(config={"zero_optimization": {"stage": 2}}, static_graph=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1"):
        ZeroStrategy(stage=1, pipeline_parallel_size=2, find_unused_parameters=True)
    with pytest.raises(TypeError, match="exclude_frozen_parameters must be True or False"):
        ZeroStrategy(exclude_frozen_parameters="yes")
    # explicit bucket_cap_mb wins over a config's reduce_bucket_size; elements x bytes per element otherwise
    assert DDPOptions(bucket_cap_mb=2.0).ddp_kwargs(reduce_bucket_size=10 * MIB) == {"bucket_cap_mb": 2.0}
    assert DDPOptions().ddp_kwargs(reduce_bucket_size=MIB, grad_element_size=2) == {"bucket_cap_mb": 2.0}
    assert DDPOptions().ddp_kwargs() == {}


def test_reduce_bucket_size_is_a_ddp_bucket_at_stages_0_1_and_noted_as_such():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedConfigWarning)  # no "has no effect" warning at stage 1
        notes = dict(translate_ds_config({"zero_optimization": {"stage": 1, "reduce_bucket_size": 123}}).notes)
    assert "DDP bucket_cap_mb" in notes["zero_optimization.reduce_bucket_size"]
    # at stages 2-3 it sizes the FSDP2 units instead (4 bytes per element; distributed/units.py)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedConfigWarning)
        stage_2 = translate_ds_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": 123}})
    assert stage_2.strategy_kwargs["unit_bytes"] == 123 * 4
    assert "unit_bytes" in dict(stage_2.notes)["zero_optimization.reduce_bucket_size"]


class TinyGAN(LightningModule):
    """Lightning's GAN pattern: manual optimization, two optimizers, ``toggle_optimizer``. Each step leaves one
    network without gradients (the discriminator is frozen for the generator's loss, the fakes are detached for the
    discriminator's), which DDP accepts only with ``find_unused_parameters=True``."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
        self.discriminator = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, noise):
        return self.generator(noise)

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        real, noise = batch
        self.toggle_optimizer(opt_g)
        g_loss = generator_loss(self, noise)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = discriminator_loss(self, real, self(noise).detach())
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-2),
            torch.optim.Adam(self.discriminator.parameters(), lr=2e-2),
        )

    def train_dataloader(self):
        return DataLoader(gan_data(), batch_size=BATCH)


def generator_loss(gan, noise):
    score = gan.discriminator(gan(noise))
    return nn.functional.binary_cross_entropy_with_logits(score, torch.ones_like(score))


def discriminator_loss(gan, real, fake):
    real_score, fake_score = gan.discriminator(real), gan.discriminator(fake)
    return nn.functional.binary_cross_entropy_with_logits(
        real_score, torch.ones_like(real_score)
    ) + nn.functional.binary_cross_entropy_with_logits(fake_score, torch.zeros_like(fake_score))


def gan_data(n=32):
    gen = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 6, generator=gen) + 2.0, torch.randn(n, 4, generator=gen))


def gan_reference(global_batch):
    """The same two updates per step on one process over the global batch (what DDP's averaged gradients give)."""
    gan = TinyGAN()
    opt_g, opt_d = gan.configure_optimizers()
    real_all, noise_all = gan_data().tensors
    order = torch.randperm(len(real_all), generator=torch.Generator().manual_seed(0))  # DistributedSampler's
    real_all, noise_all = real_all[order], noise_all[order]
    for step in range(STEPS):
        rows = slice(step * global_batch, (step + 1) * global_batch)
        real, noise = real_all[rows], noise_all[rows]
        opt_g.zero_grad()
        generator_loss(gan, noise).backward()
        opt_g.step()
        opt_d.zero_grad()
        discriminator_loss(gan, real, gan(noise).detach()).backward()
        opt_d.step()
    return {k: v.detach().clone() for k, v in gan.state_dict().items()}


class _RecordDDP(Callback):
    def on_train_start(self, trainer, pl_module):
        ddp = trainer.strategy.model
        self.seen = dict(
            find_unused_parameters=ddp.find_unused_parameters,
            static_graph=ddp.static_graph,
            gradient_as_bucket_view=ddp.gradient_as_bucket_view,
            bucket_bytes_cap=ddp.bucket_bytes_cap,
        )


def _ddp_options_worker(rank, world_size):
    from lightning.pytorch.strategies import DDPStrategy

    expected = gan_reference(BATCH * world_size)
    steps = 2 * STEPS  # with manual optimization every optimizer.step() counts as a Trainer step
    lightning_ddp = TinyGAN()
    _trainer(DDPStrategy(find_unused_parameters=True), world_size, max_steps=steps).fit(lightning_ddp)
    for stage in (0, 1):
        gan = TinyGAN()
        _trainer(ZeroStrategy(stage=stage, find_unused_parameters=True), world_size, max_steps=steps).fit(gan)
        got = full_state(gan)
        for key, value in expected.items():
            torch.testing.assert_close(
                got[key],
                lightning_ddp.state_dict()[key],
                atol=1e-6,
                rtol=0,
                msg=lambda m: f"stage {stage} vs DDPStrategy: {key}: {m}",
            )
            torch.testing.assert_close(
                got[key], value, atol=1e-5, rtol=0, msg=lambda m: f"stage {stage} vs one process: {key}: {m}"
            )

    # every option reaches the DistributedDataParallel; a config's reduce_bucket_size becomes its bucket
    record = _RecordDDP()
    _trainer(
        ZeroStrategy(stage=0, static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=1.5),
        world_size,
        max_steps=1,
        callbacks=[record],
    ).fit(RegressionModule(batch_size=BATCH))
    assert record.seen == dict(
        find_unused_parameters=False, static_graph=True, gradient_as_bucket_view=True, bucket_bytes_cap=int(1.5 * MIB)
    )
    config = {"zero_optimization": {"stage": 1, "reduce_bucket_size": MIB}, "train_micro_batch_size_per_gpu": BATCH}
    _trainer(ZeroStrategy(config=config), world_size, max_steps=1, callbacks=[record]).fit(
        RegressionModule(batch_size=BATCH)
    )
    assert record.seen["bucket_bytes_cap"] == 4 * MIB  # 2**20 fp32 gradient elements

    # manual optimization defaults find_unused_parameters to True (a GAN step leaves the other network unused)
    record = _RecordDDP()
    _trainer(ZeroStrategy(stage=1), world_size, max_steps=1, callbacks=[record]).fit(TinyGAN())
    assert record.seen["find_unused_parameters"] is True
    # an explicit False wins, and DDP's error comes with the remedy in ZeroStrategy's terms (last: the run is broken)
    with pytest.raises(
        RuntimeError,
        match=r"(?s)ZeroStrategy\(stage=1, find_unused_parameters=True\).*"
        "Expected to have finished reduction",
    ):
        _trainer(ZeroStrategy(stage=1, find_unused_parameters=False), world_size, max_steps=steps).fit(TinyGAN())


def test_gan_trains_at_stages_0_and_1_with_find_unused_parameters_as_with_ddp():
    run_distributed(_ddp_options_worker, 2)


# --------------------------------------------------------------------------------- ds_config conventions (item 5)


def test_config_is_read_from_pl_deepspeed_config_path(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                "train_micro_batch_size_per_gpu": 2,
            }
        )
    )
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(path))
    strategy = ZeroStrategy()
    assert (strategy.stage, strategy.zero_config.offload) == (3, "cpu")
    assert strategy.ds_config.origin == f"PL_DEEPSPEED_CONFIG_PATH={path}"  # named in the startup table's caption
    assert strategy.config["train_micro_batch_size_per_gpu"] == 2
    # an explicit config wins over the variable; explicit arguments over both
    assert ZeroStrategy(config={"zero_optimization": {"stage": 1}}).stage == 1
    assert ZeroStrategy(stage=2).config["zero_optimization"]["stage"] == 2
    for bad in ("", str(tmp_path / "missing.json")):
        monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", bad)
        with pytest.raises(DeepSpeedConfigError, match="PL_DEEPSPEED_CONFIG_PATH=.*does not name a DeepSpeed config"):
            ZeroStrategy()


@pytest.mark.parametrize("registry", ["trainer", "fabric"])
def test_the_name_zero_takes_the_stage_of_the_config_in_pl_deepspeed_config_path(tmp_path, monkeypatch, registry):
    # "zero" is DeepSpeedStrategy's "deepspeed": it names no stage, so a stage-3 config trains at stage 3 (it trained
    # at stage 2 while the startup table said 3); a numbered name is an explicit stage and wins, as arguments do.
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(path))
    names = StrategyRegistry if registry == "trainer" else FABRIC_REGISTRY
    assert names.get("zero").stage == 3
    assert names.get("zero_stage_2").stage == 2
    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH")
    assert names.get("zero").stage == 2  # the default without a config


def test_strategy_config_is_the_effective_config_and_refuses_writes():
    import copy

    strategy = ZeroStrategy(stage=2, offload="cpu", communication_data_type="bf16")
    assert strategy.config == {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "communication_data_type": "bf16",
    }
    strategy = ZeroStrategy(
        config={
            "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
        },
        stage=1,
    )
    config = strategy.config
    assert config["zero_optimization"]["stage"] == 1  # the explicit argument is what runs
    assert config["zero_optimization"]["reduce_bucket_size"] == 500_000_000  # DeepSpeed's default, filled in
    assert config["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert json.loads(json.dumps(config)) == config
    for write in (
        lambda: config.__setitem__("gradient_clipping", 1.0),
        lambda: config["zero_optimization"].update(stage=3),
        lambda: config["optimizer"]["params"]["betas"].append(0.1),
    ):
        with pytest.raises(TypeError, match="read-only report.*ZeroStrategy\\(config=...\\)"):
            write()
    mine = copy.deepcopy(config)  # an ordinary dict to edit and pass back as config=
    mine["zero_optimization"]["stage"] = 2
    assert ZeroStrategy(config=mine).stage == 2


def test_startup_table_is_compact_and_the_full_one_is_saved():
    from lightning_zero.ds_config.binding import DeepSpeedConfigBinding

    binding = DeepSpeedConfigBinding(
        {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": 4},
        origin="PL_DEEPSPEED_CONFIG_PATH=/x.json",
    )
    binding.translation = translate_ds_config({**binding.raw, "gradient_clipping": 1.0})  # as resolve() would
    from rich.console import Console

    def printed(verbose):
        console = Console(file=io.StringIO(), width=200)
        console.print(binding_table(binding, verbose))
        return console.file.getvalue()

    compact, full = printed(False), printed(True)
    assert len(compact.splitlines()) < 15 < 40 < len(full.splitlines())
    assert "default (not in the config)" not in compact and "default (not in the config)" in full
    assert re.search(r'gradient_clipping\s+"auto" -> 1.0', compact)
    assert "read from PL_DEEPSPEED_CONFIG_PATH=/x.json" in compact and "defaults not shown" in compact
    saved = binding.report()["table"]  # what zero.json holds: every row
    assert len(saved) > 40 and ["zero_optimization.stage", "2", "-> stage"] in saved


def binding_table(binding, verbose):
    from lightning_zero.ds_config import effective_config_table

    return effective_config_table(
        binding.translation, verbose=verbose, auto_paths=binding.auto_paths, caption=f"read from {binding.origin}"
    )


class FrozenModule(RegressionModule):
    """The first block is frozen (a pretrained part); the rest trains."""

    def __init__(self, batch_size=BATCH, frozen_value=None):
        super().__init__(batch_size=batch_size)
        for param in self.net.blocks[0].parameters():
            param.requires_grad = False
            if frozen_value is not None:
                param.data.fill_(frozen_value)


class ConfigOptimizerModule(RegressionModule):
    """Defines configure_optimizers, but the ds_config has an optimizer too: the config's wins."""


def _conventions_worker(rank, world_size, tmp_path):
    # Quiet output: none of these may appear (warnings raised as errors inside the run).
    warnings.filterwarnings("error", message=".*all_gather_into_tensor.*is deprecated")
    warnings.filterwarnings("error", message=".*reduce_scatter_tensor.*is deprecated")
    warnings.filterwarnings("error", message="DTensor random operators may not have complete support")
    warnings.filterwarnings("error", message=".*returned a view tensor")

    # a model built on the meta device and materialised sharded (the DTensor RNG warning's path)
    _trainer(ZeroStrategy(stage=3), world_size, max_steps=1).fit(RegressionModule(BATCH, build_in_configure_model=True))

    # a ds_config optimizer wins over configure_optimizers, with a warning naming both
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    trainer = _trainer(ZeroStrategy(config=config, stage=1), world_size, max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeepSpeedConfigWarning)
        trainer.fit(ConfigOptimizerModule(batch_size=BATCH))
    if rank == 0:
        message = " ".join(str(w.message) for w in caught if issubclass(w.category, DeepSpeedConfigWarning))
        assert "ConfigOptimizerModule.configure_optimizers" in message and "'SGD'" in message
    optimizer = trainer.optimizers[0]
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["lr"] == 0.1
    assert trainer.lr_scheduler_configs == []  # configure_optimizers' StepLR was not used either

    # exclude_frozen_parameters: frozen weights stay out of the checkpoint; loading keeps the module's own
    for stage in (1, 3):
        path = os.path.join(tmp_path, f"stage{stage}.ckpt")
        trained = FrozenModule(frozen_value=0.5)
        trainer = _trainer(ZeroStrategy(stage=stage, exclude_frozen_parameters=True), world_size)
        trainer.fit(trained)
        trainer.save_checkpoint(path)
        saved = full_state(trained)
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(path).read_metadata().state_dict_metadata
        assert not any("blocks.0." in key for key in keys), sorted(keys)
        assert any("blocks.1." in key for key in keys)
        fresh = FrozenModule(frozen_value=-1.0)
        trainer = _trainer(ZeroStrategy(stage=stage), world_size, max_steps=STEPS)  # resumes at STEPS: no step
        trainer.fit(fresh, ckpt_path=path)
        loaded = full_state(fresh)
        for key, value in saved.items():
            if "blocks.0." in key:
                assert torch.all(loaded[key] == -1.0), f"stage {stage}: {key} must keep the module's own weight"
            else:
                torch.testing.assert_close(loaded[key], value, atol=0, rtol=0)


def test_config_optimizer_wins_exclude_frozen_parameters_and_quiet_sharded_run(tmp_path):
    run_distributed(_conventions_worker, 2, str(tmp_path))


# --------------------------------------------------------------------------------- exports, output, install (6-9)


def test_callbacks_are_exported_where_the_messages_say():
    import lightning_zero
    from lightning_zero.callbacks import ConsolidateCheckpoint, NCCLDiagnostics, ThroughputLogger
    from lightning_zero.strategies import ds_config_fit

    assert (lightning_zero.ThroughputLogger, lightning_zero.NCCLDiagnostics, lightning_zero.ConsolidateCheckpoint) == (
        ThroughputLogger,
        NCCLDiagnostics,
        ConsolidateCheckpoint,
    )
    import inspect

    # the wall_clock_breakdown warning tells users to import from lightning_zero.callbacks: that path must exist
    assert "lightning_zero.callbacks.ThroughputLogger()" in inspect.getsource(ds_config_fit)


def test_repeated_blocks_exclude_layers_that_also_live_inside_the_blocks():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))

        def forward(self, x):
            return x + self.mlp(x)

    class GPTLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(4, 3)  # a Linear outside the blocks must not make every Linear a unit

    from lightning_zero.distributed.module_classes import find_repeated_blocks

    assert find_repeated_blocks(GPTLike()) == {Block}


def test_gpt_example_sets_a_real_epoch_count():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt_example", os.path.join(ROOT, "examples", "gpt.py"))
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    seen = {}

    class Stop(Exception):
        pass

    class FakeTrainer:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            raise Stop

    gpt.Trainer = FakeTrainer
    with pytest.raises(Stop):
        gpt.main(["--max-steps", "60"])
    assert (seen["max_epochs"], seen["limit_train_batches"], seen["max_steps"]) == (1, 60, 60)  # "Epoch 0/0 60/60"
    data = gpt.CharDataset(gpt.corpus(), 64)
    per_epoch = -(-len(data) // 2 // 16)  # batches per rank and epoch (DistributedSampler pads, no drop_last)
    with pytest.raises(Stop):
        gpt.main(["--max-steps", str(per_epoch * 2 + 1)])  # three epochs, the last one cut by max_steps
    assert (seen["max_epochs"], seen["limit_train_batches"]) == (3, None)


def test_lightning_cli_has_an_install_extra_and_the_readme_names_it():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(req.startswith("jsonargparse[signatures]") for req in extras["cli"])
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert 'pip install -e ".[cli]"' in readme


def test_lightning_cli_config_output_is_ignored_by_git():
    with open(os.path.join(ROOT, ".gitignore")) as f:
        ignored = f.read().split()
    assert "/config.yaml" in ignored
