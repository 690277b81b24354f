"""Hugging Face-style DeepSpeed configs ("auto" everywhere) resolve as Hugging Face resolves them."""

import json

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.ds_config import AutoContext, DeepSpeedConfigError, resolve_auto
from lightning_zero.ops.lr_schedules import WarmupLR
from tests.lightning_models import WIDTH, RegressionModule, dataset, full_state
from tests.ranks import run_distributed

BATCH = 4
HPARAMS = dict(
    lr=1e-2, weight_decay=0.01, adam_epsilon=1e-7, adam_beta1=0.85, adam_beta2=0.98, warmup_steps=0, hidden_size=WIDTH
)

# The ZeRO-3 example of the Hugging Face / accelerate DeepSpeed docs, unchanged apart from the tiny model's needs.
HF_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": "auto",
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


class HFStyleModule(RegressionModule):
    """Hyperparameters under Hugging Face's TrainingArguments names; no configure_optimizers (the config's)."""

    def __init__(self, batch_size=BATCH, **hparams):
        super().__init__(batch_size=batch_size)
        self.save_hyperparameters()

    configure_optimizers = LightningModule.configure_optimizers


def _reference(steps, world, clip):
    """One process, plain torch AdamW + the config's WarmupLR (1 warm-up step), on the same global batches."""
    torch.manual_seed(0)
    module = RegressionModule()
    optimizer = torch.optim.AdamW(
        module.parameters(), lr=HPARAMS["lr"], betas=(0.85, 0.98), eps=1e-7, weight_decay=0.01
    )
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=HPARAMS["lr"], warmup_num_steps=1)
    x_all, y_all = dataset().tensors
    order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        idx = torch.cat([order[r::world][step * BATCH : (step + 1) * BATCH] for r in range(world)])
        nn.functional.mse_loss(module(x_all[idx]), y_all[idx]).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _hf_zero3_worker(rank, world_size, path):
    torch.manual_seed(0)
    module = HFStyleModule(**HPARAMS)
    strategy = ZeroStrategy(config=path)
    assert (strategy.stage, strategy.zero_config.offload) == (3, "cpu")
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        max_steps=3,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module)
    effective = strategy.ds_config.translation.effective
    zero = effective["zero_optimization"]
    assert effective["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 1}
    assert effective["optimizer"]["params"] == {"lr": 1e-2, "betas": [0.85, 0.98], "eps": 1e-7, "weight_decay": 0.01}
    assert (
        effective["train_batch_size"],
        effective["train_micro_batch_size_per_gpu"],
        effective["gradient_accumulation_steps"],
    ) == (BATCH * world_size, BATCH, 1)
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_prefetch_bucket_size"],
        zero["stage3_param_persistence_threshold"],
    ) == (WIDTH * WIDTH, int(0.9 * WIDTH * WIDTH), 10 * WIDTH)
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False
    assert strategy.ds_config.translation.gather_16bit_weights_on_model_save is False
    assert effective["fp16"]["enabled"] is False and effective["bf16"]["enabled"] is False
    assert trainer.gradient_clip_val == 1.0
    expected = _reference(3, world_size, clip=1.0)
    got = full_state(module)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"HF-style config run differs from the single-process reference by {worst:.2e}"


def test_hf_zero3_config_trains_two_ranks_like_the_reference(tmp_path):
    path = tmp_path / "ds_config_zero3.json"
    path.write_text(json.dumps(HF_ZERO3, indent=2))
    run_distributed(_hf_zero3_worker, 2, str(path))


def _warmup(hparams, total=50):
    config = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    context = AutoContext(micro_batch_size=1, hyperparameters=hparams, estimated_stepping_batches=total)
    return resolve_auto(config, context)["scheduler"]["params"]["warmup_num_steps"]


@pytest.mark.parametrize(
    "hparams,expected",
    [
        (dict(warmup_steps=0), 1),  # HF: max(1, 0); DeepSpeed's schedulers refuse 0
        (dict(warmup_steps=0.0), 1),
        (dict(warmup_steps=7), 7),  # >= 1: a step count
        (dict(warmup_steps=7.9), 7),  # HF truncates with int()
        (dict(warmup_steps=0.1), 5),  # < 1: a fraction of the 50 total steps, rounded up
        (dict(warmup_steps=0.01), 1),  # ceil(0.5)
        (dict(warmup_ratio=0.25), 13),  # the older HF name: ceil(12.5)
        (dict(warmup_ratio=0.0), 1),
        (dict(), 1),  # no warm-up hyperparameter: HF's default warmup_steps=0 -> max(1, 0)
    ],
)
def test_warmup_num_steps_auto_resolves_as_hugging_face(hparams, expected):
    assert _warmup(hparams) == expected


@pytest.mark.parametrize(
    "hparams,message",
    [
        (dict(warmup_steps=-1), "warmup steps"),
        (dict(warmup_ratio=1.5), "warmup_ratio"),
        (dict(warmup_steps="ten"), "warmup steps"),
    ],
)
def test_warmup_num_steps_auto_refuses_what_hugging_face_refuses(hparams, message):
    with pytest.raises(DeepSpeedConfigError, match=message):
        _warmup(hparams)


def test_warmup_zero_builds_a_working_scheduler():
    """warmup_steps=0 used to resolve to 0 and the WarmupLR constructor raised; now it trains from step 1."""
    config = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        },
    }
    context = AutoContext(micro_batch_size=1, hyperparameters=dict(warmup_steps=0), estimated_stepping_batches=10)
    from lightning_zero.ds_config.optimizers import build_optimizer, build_scheduler

    resolved = resolve_auto(config, context)
    optimizer = build_optimizer(resolved["optimizer"], [nn.Parameter(torch.zeros(1))])
    scheduler = build_scheduler(resolved["scheduler"], optimizer)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5


# transformers' docs "ds_config_zero3.json" as published (stage3_gather_16bit_weights_on_model_save true).
HF_DOCS_ZERO3 = {
    **HF_ZERO3,
    "zero_optimization": {**HF_ZERO3["zero_optimization"], "stage3_gather_16bit_weights_on_model_save": True},
}
NO_WARMUP_HPARAMS = {k: v for k, v in HPARAMS.items() if k != "warmup_steps"}


def _hf_docs_zero3_no_warmup_worker(rank, world_size, path, table_path):
    import contextlib
    import io
    import os

    os.environ["COLUMNS"] = "240"  # the startup table's rows on one line each
    torch.manual_seed(0)
    module = HFStyleModule(**NO_WARMUP_HPARAMS)
    assert not any("warmup" in name for name in module.hparams)
    strategy = ZeroStrategy(config=path)
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        max_steps=3,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(module)
    if rank == 0:
        with open(table_path, "w") as f:
            f.write(printed.getvalue())
    effective = strategy.ds_config.translation.effective
    # Hugging Face: TrainingArguments.warmup_steps defaults to 0, and max(1, get_warmup_steps(n)) = 1 step
    assert effective["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 1}
    source = strategy.ds_config.auto_defaults["scheduler.params.warmup_num_steps"]
    assert source.startswith("TrainingArguments.warmup_steps=0 -> max(1, 0) = 1 step"), source
    expected = _reference(3, world_size, clip=1.0)  # the same WarmupLR with 1 warm-up step
    got = full_state(module)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"HF docs config run differs from the single-process reference by {worst:.2e}"


def test_hf_docs_zero3_config_trains_a_module_without_warmup_hyperparameter(tmp_path):
    """A "warmup_num_steps": "auto" with no warm-up hyperparameter on the LightningModule resolves as Hugging
    Face's TrainingArguments default does (1 step) instead of refusing, and the startup table says so."""
    path = tmp_path / "ds_config_zero3.json"
    path.write_text(json.dumps(HF_DOCS_ZERO3, indent=2))
    table = tmp_path / "table.txt"
    run_distributed(_hf_docs_zero3_no_warmup_worker, 2, str(path), str(table))
    row = next(line for line in table.read_text().splitlines() if "scheduler.params.warmup_num_steps" in line)
    assert '"auto" -> 1 (Hugging Face\'s default)' in row, row
