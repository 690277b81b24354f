"""DeepSpeed ds_config translation, "auto" resolution and batch arithmetic (pure Python, no process group)."""

from __future__ import annotations

import json
import sys
import warnings

import pytest

from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.ds_config import (
    AutoContext,
    DeepSpeedConfigError,
    DeepSpeedConfigWarning,
    effective_config_table,
    infer_hidden_size,
    load_ds_config,
    resolve_auto,
    resolve_batch_sizes,
    save_effective_config,
    schema,
    translate_ds_config,
)

# ---------------------------------------------------------------------------------------------------------------
# Configs shown in ../shared/seeds (fixed into valid JSON where the seed text had missing commas or "...").
# ---------------------------------------------------------------------------------------------------------------
SEED_ZERO3_FP16_ADAMW = {  # seed 000: the basic ZeRO-3 example
    "zero_optimization": {"stage": 3},
    "fp16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
}
SEED_ZERO3_OFFLOAD_OPTIMIZER = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
SEED_ZERO3_OFFLOAD_ALL = {
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
}
SEED_ZERO3_NVME = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme_data"},
        "offload_param": {"device": "nvme", "nvme_path": "/nvme_data"},
    }
}
SEED_DSCHAT_TRAIN = {  # seed 000: DeepSpeed-Chat's get_train_ds_config(offload=True, stage=2)
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 10,
    "zero_optimization": {
        "stage": 2,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    },
    "fp16": {"enabled": True, "loss_scale_window": 100},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "wall_clock_breakdown": False,
    "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1},
    "tensorboard": {"enabled": False, "output_path": "", "job_name": ""},
}
SEED_GETTING_STARTED = {  # seed 001: DeepSpeed's getting-started ds_config.json (deprecated boolean ZeRO)
    "train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "fp16": {"enabled": True},
    "zero_optimization": True,
}
SEED_ZERO3_CPU_FULL = {  # seed 002: ZeRO-3 CPU offload with WarmupLR
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 1e6,
        "stage3_prefetch_bucket_size": 0.94e6,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
}
SEED_STAGE2_BUCKETS = {
    "zero_optimization": {  # seed 003: ZeRO-2 with bucket knobs
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 3e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 3e8,
        "contiguous_gradients": True,
    }
}
SEED_NVME_KNOBS = {
    "zero_optimization": {  # seed 003: NVMe offload knobs
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/dev/shm", "buffer_count": 4, "fast_init": False},
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/dev/shm",
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
    }
}
SEED_FP16_ALL_KEYS = {
    "fp16": {  # seed 003: every fp16 key
        "enabled": True,
        "auto_cast": False,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    }
}
SEED_HF_AUTO = {  # seed 003: a Hugging Face style config full of "auto"
    "train_batch_size": "auto",
    "optimizer": {
        "type": "Adam",
        "params": {"lr": "auto", "betas": [0.9, 0.95], "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 5e-6,
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "steps_per_print": 10,
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

# name -> (config, expected strategy kwargs subset, expected precision)
SEEDS = {
    "zero3_fp16_adamw": (SEED_ZERO3_FP16_ADAMW, {"stage": 3, "offload": None, "loss_scale": 0.0}, "16-mixed"),
    "zero3_offload_optimizer": (SEED_ZERO3_OFFLOAD_OPTIMIZER, {"stage": 3, "offload": "cpu"}, None),
    "zero3_offload_all": (SEED_ZERO3_OFFLOAD_ALL, {"stage": 3, "offload": "cpu"}, None),
    "zero3_nvme": (SEED_ZERO3_NVME, {"stage": 3, "offload": "nvme"}, None),
    "dschat_train": (SEED_DSCHAT_TRAIN, {"stage": 2, "offload": "cpu", "loss_scale_window": 100}, "16-mixed"),
    "getting_started": (SEED_GETTING_STARTED, {"stage": 1, "offload": None}, "16-mixed"),
    "zero3_cpu_full": (SEED_ZERO3_CPU_FULL, {"stage": 3, "offload": "cpu", "hysteresis": 2}, "16-mixed"),
    "stage2_buckets": (SEED_STAGE2_BUCKETS, {"stage": 2, "offload": None}, None),
    "nvme_knobs": (SEED_NVME_KNOBS, {"stage": 3, "offload": "nvme"}, None),
    "fp16_all_keys": (SEED_FP16_ALL_KEYS, {"stage": 0, "initial_scale_power": 16, "min_loss_scale": 1}, "16-mixed"),
    "hf_auto": (SEED_HF_AUTO, {"stage": 3, "offload": "cpu"}, "bf16-mixed"),
}


def _translate_quietly(config, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return translate_ds_config(config, **kwargs)


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_seed_config_translates_and_builds_zero_config(name):
    config, expected_kwargs, precision = SEEDS[name]
    translation = _translate_quietly(config)
    assert {k: translation.strategy_kwargs[k] for k in expected_kwargs} == expected_kwargs
    assert translation.precision == precision
    zero_fields = {
        k: v
        for k, v in translation.strategy_kwargs.items()
        if k in ("stage", "offload", "pin_memory", "reshard_after_forward")
    }
    if translation.strategy_kwargs["offload"] == "nvme":  # the NVMe settings are built from nvme_path & co
        with pytest.raises(ValueError, match="needs nvme_path"):
            ZeroConfig(**zero_fields)
    else:
        assert ZeroConfig(**zero_fields).stage == expected_kwargs["stage"]


def test_every_present_key_gets_a_note_never_silently_dropped():
    config = {
        key: spec.default
        for key, spec in schema.TOP_LEVEL_KEYS.items()
        if spec.default is not None and key not in ("gradient_allreduce_op",)
    }
    config["zero_optimization"] = {
        key: spec.default for key, spec in schema.ZERO_KEYS.items() if spec.default not in (None, schema.DERIVED)
    }
    config["zero_optimization"]["stage"] = 3
    config["zero_optimization"]["offload_optimizer"] = {k: s.default for k, s in schema.OFFLOAD_OPTIMIZER_KEYS.items()}
    config["zero_optimization"]["offload_param"] = {k: s.default for k, s in schema.OFFLOAD_PARAM_KEYS.items()}
    for section in ("fp16", "activation_checkpointing", "pipeline", "checkpoint"):
        config[section] = {k: s.default for k, s in schema.SECTION_KEYS[section].items()}
    config["fp16"]["enabled"] = True
    translation = _translate_quietly(config)
    noted = {key for key, _ in translation.notes}
    present = [
        f"{section}.{key}"
        for section, value in config.items()
        if isinstance(value, dict)
        for key in value
        if not isinstance(value[key], dict)
    ]
    present += [
        f"zero_optimization.{sub}.{key}"
        for sub in ("offload_optimizer", "offload_param")
        for key in config["zero_optimization"][sub]
    ]
    present += [key for key, value in config.items() if not isinstance(value, dict)]
    assert sorted(set(present) - noted) == []


def test_no_effect_key_with_non_default_value_warns_and_is_noted():
    # Stage 2's bucket sizes size the FSDP2 units (lightning_zero.distributed.units); allgather_bucket_size has no
    # effect at stage 3, where DeepSpeed itself does not use it.
    translation = translate_ds_config(SEED_STAGE2_BUCKETS)
    notes = dict(translation.notes)
    assert translation.strategy_kwargs["unit_bytes"] == 300_000_000 * 4
    assert "unit_bytes=1200000000" in notes["zero_optimization.reduce_bucket_size"]
    assert notes["zero_optimization.allgather_partitions"].startswith("no effect")
    stage3 = {"zero_optimization": {**SEED_STAGE2_BUCKETS["zero_optimization"], "stage": 3}}
    with pytest.warns(
        DeepSpeedConfigWarning,
        match=r"zero_optimization.allgather_bucket_size=.*no effect|no effect.*"
        r"zero_optimization.allgather_bucket_size",
    ):
        translation = translate_ds_config(stage3)
    assert "FSDP2" in dict(translation.notes)["zero_optimization.allgather_bucket_size"]


def test_unknown_keys_error_with_closest_suggestion_and_lenient_mode_warns():
    config = {
        "zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8},
        "gradient_clipign": 1.0,
        "reduce_scatter": True,
    }
    with pytest.raises(DeepSpeedConfigError) as error:
        translate_ds_config(config)
    message = str(error.value)
    assert "zero_optimization.reduce_bucket_sise" in message and "'reduce_bucket_size'" in message
    assert "gradient_clipign" in message and "'gradient_clipping'" in message
    assert "belongs under 'zero_optimization.reduce_scatter'" in message
    with pytest.warns(DeepSpeedConfigWarning, match="reduce_bucket_sise"):
        translation = translate_ds_config(config, strict=False)
    assert translation.strategy_kwargs["stage"] == 2
    assert "reduce_bucket_sise" not in translation.effective["zero_optimization"]


def test_unknown_keys_in_optimizer_and_offload_sections():
    with pytest.raises(DeepSpeedConfigError, match="did you mean 'pin_memory'"):
        translate_ds_config(
            {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}}
        )
    with pytest.raises(DeepSpeedConfigError, match="did you mean 'params'"):
        translate_ds_config({"optimizer": {"type": "Adam", "parms": {"lr": 1e-3}}})


def test_other_feature_sections_are_named_not_supported_unless_disabled():
    config = {
        "sparse_attention": {"mode": "fixed"},
        "flops_profiler": {"enabled": True},
        "compression_training": {"weight_quantization": {}},
    }
    with pytest.raises(DeepSpeedConfigError) as error:
        translate_ds_config(config)
    for section in ("sparse_attention", "flops_profiler", "compression_training"):
        assert f"{section}: not supported" in str(error.value)
    with pytest.warns(DeepSpeedConfigWarning, match="Sparse Attention"):
        translate_ds_config(config, strict=False)
    translation = translate_ds_config({"flops_profiler": {"enabled": False}, "autotuning": {"enabled": False}})
    assert dict(translation.notes)["flops_profiler"].startswith("disabled")


def test_deprecated_keys_are_translated_with_a_deprecation_warning():
    with pytest.warns(FutureWarning, match="cpu_offload"):
        translation = translate_ds_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert translation.strategy_kwargs["offload"] == "cpu"
    with pytest.warns(FutureWarning, match="zero_optimization"), pytest.warns(DeepSpeedConfigWarning):
        translation = translate_ds_config({"zero_optimization": True, "allgather_size": 2e8})
    assert translation.strategy_kwargs["stage"] == 1
    assert translation.effective["zero_optimization"]["allgather_bucket_size"] == 200_000_000
    with pytest.warns(FutureWarning, match="bfloat16"):
        translation = translate_ds_config({"bfloat16": {"enabled": True}})
    assert translation.precision == "bf16-mixed"
    with pytest.warns(FutureWarning):
        translation = translate_ds_config(
            {
                "zero_optimization": {
                    "stage": 3,
                    "cpu_offload_param": True,
                    "stage3_gather_fp16_weights_on_model_save": True,
                }
            }
        )
    assert translation.strategy_kwargs["offload"] == "cpu" and translation.gather_16bit_weights_on_model_save


@pytest.mark.parametrize(
    "config, match",
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, 'both "fp16.enabled" and "bf16.enabled"'),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "stage is 0"),
        ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}}, "needs stage 3"),
        ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, 'keep only "bf16"'),
        ({"zero_optimization": {"stage": 4}}, "must be 0, 1, 2 or 3"),
        ({"zero_optimization": {"stage": "auto"}}, '"auto" is not allowed'),
        ({"communication_data_type": "int8"}, "communication_data_type must be one of"),
        ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),
        ({"gradient_allreduce_op": "sum"}, "always averaged"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "ZeRO\\+\\+ quantized weight"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}, "'none', 'cpu' or 'nvme'"),
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "loss_scale_window must be > 0"),
        ({"train_batch_size": 0}, "train_batch_size must be > 0"),
        ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "fp16": {"enabled": True}}, "enable only one"),
    ],
)
def test_conflicts_and_bad_values_fail_clearly(config, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        _translate_quietly(config)


def test_mapping_rules_onto_strategy_kwargs():
    translation = _translate_quietly(
        {
            "zero_optimization": {
                "stage": 3,
                "zero_hpz_partition_size": 8,
                "offload_optimizer": {"device": "cpu", "pin_memory": False},
            },
            "communication_data_type": "BF16",
            "pipeline": {"stages": 2},
            "gradient_accumulation_steps": 4,
            "fp16": {"enabled": False, "loss_scale": 128},
        }
    )
    kwargs = translation.strategy_kwargs
    assert kwargs["reshard_after_forward"] == 8
    assert kwargs["pin_memory"] is False and kwargs["offload"] == "cpu"
    assert kwargs["communication_data_type"] == "bf16"
    assert kwargs["pipeline_parallel_size"] == 2 and kwargs["micro_batches"] == 4
    assert "loss_scale" not in kwargs  # fp16 disabled: its loss-scale keys do nothing
    assert translation.precision == "32-true"
    assert "only optimizer" in dict(translation.notes)["zero_optimization.offload_optimizer"]
    # pin_memory true is DeepSpeed's default: it means "pin where possible", i.e. our None.
    assert "pin_memory" not in _translate_quietly(SEED_ZERO3_CPU_FULL).strategy_kwargs


def test_offload_param_below_stage_3_has_no_effect_and_warns():
    with pytest.warns(DeepSpeedConfigWarning, match="offload_param has no effect at stage 1"):
        translation = translate_ds_config({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})
    assert translation.strategy_kwargs["offload"] is None


def test_precision_sources_and_trainer_settings():
    assert _translate_quietly({"torch_autocast": {"enabled": True, "dtype": "torch.float16"}}).precision == "16-mixed"
    assert _translate_quietly({}).precision is None
    translation = _translate_quietly(SEED_DSCHAT_TRAIN)
    assert translation.trainer_settings() == {
        "precision": "16-mixed",
        "gradient_clip_val": 1.0,
        "log_every_n_steps": 10,
    }
    assert translation.train_batch_size == 32 and translation.train_micro_batch_size_per_gpu == 4
    assert translation.gradient_accumulation_steps is None
    auto = _translate_quietly({"fp16": {"enabled": "auto"}, "gradient_clipping": "auto"})
    assert auto.precision is None and sorted(auto.unresolved_auto) == ["fp16.enabled", "gradient_clipping"]
    assert auto.trainer_settings() == {}


def test_activation_checkpointing_is_returned_with_defaults():
    translation = _translate_quietly(
        {"activation_checkpointing": {"cpu_checkpointing": True, "partition_activations": True}}
    )
    assert translation.activation_checkpointing["cpu_checkpointing"] is True
    assert translation.activation_checkpointing["number_checkpoints"] is None
    assert dict(translation.notes)["activation_checkpointing.partition_activations"].startswith("no effect")


def test_effective_config_is_printable_and_saved(tmp_path):
    translation = _translate_quietly(SEED_ZERO3_CPU_FULL)
    effective = translation.effective["zero_optimization"]
    assert effective["allgather_bucket_size"] == 500_000_000  # DeepSpeed default filled in
    assert effective["stage3_prefetch_bucket_size"] == 940_000 and effective["overlap_comm"] is True
    table = effective_config_table(translation)
    assert table.row_count > 40
    path = save_effective_config(translation, tmp_path / "ckpt")
    saved = json.loads(path.read_text())
    assert saved["strategy_kwargs"]["offload"] == "cpu"
    assert saved["effective"]["scheduler"]["type"] == "WarmupLR"
    assert saved["trainer_settings"]["precision"] == "16-mixed"


# --------------------------------------------------------------------------------- loading


def test_load_from_dict_json_yaml_and_string(tmp_path):
    json_path = tmp_path / "ds_config.json"
    json_path.write_text(json.dumps(SEED_ZERO3_CPU_FULL))
    yaml_path = tmp_path / "ds_config.yaml"
    yaml_path.write_text("zero_optimization:\n  stage: 2\nbf16:\n  enabled: true\n")
    assert load_ds_config(json_path) == SEED_ZERO3_CPU_FULL
    assert load_ds_config(str(yaml_path)) == {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    assert load_ds_config('{"zero_optimization": {"stage": 1}}') == {"zero_optimization": {"stage": 1}}
    original = {"zero_optimization": {"stage": 1}}
    loaded = load_ds_config(original)
    loaded["zero_optimization"]["stage"] = 3
    assert original["zero_optimization"]["stage"] == 1


def test_load_errors(tmp_path, monkeypatch):
    with pytest.raises(DeepSpeedConfigError, match="does not exist"):
        load_ds_config(tmp_path / "missing.json")
    duplicate = tmp_path / "dup.json"
    duplicate.write_text('{"steps_per_print": 1, "steps_per_print": 2}')
    with pytest.raises(DeepSpeedConfigError, match="duplicate key 'steps_per_print'"):
        load_ds_config(duplicate)
    relaxed = tmp_path / "relaxed.json"
    relaxed.write_text('// ds_config.json\n{\n  "zero_optimization": {"stage": 3,},\n}\n')
    monkeypatch.setitem(sys.modules, "hjson", None)  # as on a machine without hjson
    with pytest.raises(DeepSpeedConfigError, match="pip install hjson"):
        load_ds_config(relaxed)
    with pytest.raises(DeepSpeedConfigError, match="JSON object"):
        load_ds_config(_write(tmp_path / "list.json", "[1, 2]"))


def _write(path, text):
    path.write_text(text)
    return path


def test_load_relaxed_hjson_like_deepspeed(tmp_path):
    pytest.importorskip("hjson")
    relaxed = tmp_path / "relaxed.json"
    relaxed.write_text('// ds_config.json\n{\n  "zero_optimization": {"stage": 3,},\n}\n')
    assert load_ds_config(relaxed) == {"zero_optimization": {"stage": 3}}


# --------------------------------------------------------------------------------- batch arithmetic and "auto"


@pytest.mark.parametrize(
    "given, world, expected",
    [
        ((32, 4, 4), 2, (32, 4, 4)),
        ((32, 4, None), 2, (32, 4, 4)),
        ((32, None, 2), 2, (32, 8, 2)),
        ((None, 4, 2), 2, (16, 4, 2)),
        ((32, None, None), 4, (32, 8, 1)),
        ((None, 4, None), 3, (12, 4, 1)),
    ],
)
def test_deepspeed_batch_arithmetic(given, world, expected):
    assert resolve_batch_sizes(*given, world) == expected


def test_batch_arithmetic_mismatch_names_the_numbers():
    with pytest.raises(DeepSpeedConfigError, match=r"train_batch_size \(30\).*\(4\).*\(4\).*\(2\) = 32"):
        resolve_batch_sizes(30, 4, 4, 2)
    with pytest.raises(DeepSpeedConfigError, match="either train_batch_size or train_micro_batch_size_per_gpu"):
        resolve_batch_sizes(None, None, 2, 1)


def test_auto_batch_sizes_from_dataloader_and_trainer():
    context = AutoContext(world_size=2, micro_batch_size=4, accumulate_grad_batches=2)
    resolved = resolve_auto(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
        context,
    )
    assert (
        resolved["train_batch_size"],
        resolved["train_micro_batch_size_per_gpu"],
        resolved["gradient_accumulation_steps"],
    ) == (16, 4, 2)
    # Seed 001: only the global batch and accumulation are given; the DataLoader must agree with 8 / 2 / 1 = 4.
    resolved = resolve_auto(SEED_GETTING_STARTED, AutoContext(world_size=2, micro_batch_size=4))
    assert resolved["train_micro_batch_size_per_gpu"] == 4
    with pytest.raises(DeepSpeedConfigError, match=r"train_batch_size \(8\).*\(8\) x .*\(1\) x .*\(2\) = 16"):
        resolve_auto(SEED_GETTING_STARTED, AutoContext(world_size=2, micro_batch_size=8))
    with pytest.raises(
        DeepSpeedConfigError, match="train_micro_batch_size_per_gpu=4 .* DataLoader's batch_size \\(8\\)"
    ):
        resolve_auto(SEED_DSCHAT_TRAIN, AutoContext(world_size=4, micro_batch_size=8))
    with pytest.raises(DeepSpeedConfigError, match="gradient_accumulation_steps.*accumulate_grad_batches"):
        resolve_auto(
            {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"}, AutoContext(world_size=1)
        )


def test_auto_clipping_precision_and_mismatch():
    context = AutoContext(micro_batch_size=1, gradient_clip_val=0.5, precision="bf16-mixed")
    resolved = resolve_auto(
        {"gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, context
    )
    assert resolved["gradient_clipping"] == 0.5
    assert resolved["fp16"]["enabled"] is False and resolved["bf16"]["enabled"] is True
    assert translate_ds_config(resolved).precision == "bf16-mixed"
    assert resolve_auto({"gradient_clipping": "auto"}, AutoContext(micro_batch_size=1))["gradient_clipping"] == 0.0
    with pytest.raises(DeepSpeedConfigError, match="gradient_clipping=1.0 .* gradient_clip_val=0.5"):
        resolve_auto({"gradient_clipping": 1.0}, context)
    with pytest.raises(DeepSpeedConfigError, match=r'"fp16.enabled".*Trainer\'s precision'):
        resolve_auto({"fp16": {"enabled": "auto"}}, AutoContext(micro_batch_size=1))


def test_auto_optimizer_and_scheduler_from_hyperparameters_and_steps():
    context = AutoContext(
        world_size=2,
        micro_batch_size=2,
        accumulate_grad_batches=4,
        precision="bf16-mixed",
        hyperparameters={"learning_rate": 3e-4, "weight_decay": 0.1, "adam_epsilon": 1e-6, "warmup_ratio": 0.1},
        estimated_stepping_batches=1000,
        hidden_size=64,
    )
    resolved = resolve_auto(SEED_HF_AUTO, context)
    assert resolved["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert resolved["scheduler"]["params"] == {
        "warmup_min_lr": 5e-6,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 100,
        "total_num_steps": 1000,
    }
    zero = resolved["zero_optimization"]
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_prefetch_bucket_size"],
        zero["stage3_param_persistence_threshold"],
    ) == (64 * 64, int(0.9 * 64 * 64), 640)
    assert resolved["train_batch_size"] == 16
    translation = _translate_quietly(resolved)
    assert translation.unresolved_auto == ()
    assert SEED_HF_AUTO["optimizer"]["params"]["lr"] == "auto"  # input untouched
    betas = resolve_auto(
        {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"betas": "auto"}}},
        AutoContext(hyperparameters={"adam_beta1": 0.8, "adam_beta2": 0.9}),
    )
    assert betas["optimizer"]["params"]["betas"] == [0.8, 0.9]
    steps = resolve_auto(
        {
            "train_micro_batch_size_per_gpu": 1,
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_num_steps": "auto", "warmup_max_lr": "auto", "warmup_min_lr": "auto"},
            },
        },
        AutoContext(hyperparameters={"lr": 0.01, "warmup_steps": 7}),
    )
    assert steps["scheduler"]["params"] == {"warmup_num_steps": 7, "warmup_max_lr": 0.01, "warmup_min_lr": 0.0}


@pytest.mark.parametrize(
    "config, match",
    [
        ({"optimizer": {"type": "Adam", "params": {"lr": "auto"}}}, r"optimizer.params.lr.*'lr'/'learning_rate'"),
        ({"optimizer": {"type": "Adam", "params": {"betas": "auto"}}}, r"optimizer.params.betas.*'adam_beta1'"),
        ({"optimizer": {"type": "Adam", "params": {"momentum": "auto"}}}, "only lr, weight_decay, betas and eps"),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
            "estimated_stepping_batches.*max_steps",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
            r"warmup_max_lr.*'lr'/'learning_rate'",
        ),
        ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, "hidden size.*hidden_size"),
        ({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, "only reduce_bucket_size"),
    ],
)
def test_unresolvable_auto_names_key_and_where_it_looked(config, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        resolve_auto({"train_micro_batch_size_per_gpu": 1, **config}, AutoContext())


def test_auto_context_validation_and_hidden_size_inference():
    with pytest.raises(ValueError, match="world_size"):
        AutoContext(world_size=0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        AutoContext(micro_batch_size=0)
    import torch

    class Config:
        hidden_size = 48

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Config()

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net()

    assert infer_hidden_size(Wrapper()) == 48
    assert infer_hidden_size(torch.nn.Linear(2, 2), {"n_embd": 32}) == 32
    assert infer_hidden_size(torch.nn.Linear(2, 2)) is None


def test_docs_mapping_table_covers_every_known_key():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "ds_config.md").read_text()
    tables = {
        "": schema.TOP_LEVEL_KEYS,
        "zero_optimization.": schema.ZERO_KEYS,
        "offload_optimizer.": schema.OFFLOAD_OPTIMIZER_KEYS,
        "offload_param.": schema.OFFLOAD_PARAM_KEYS,
    }
    tables.update({f"{section}.": keys for section, keys in schema.SECTION_KEYS.items() if "." not in section})
    missing = [prefix + key for prefix, keys in tables.items() for key in keys if f"`{prefix}{key}`" not in docs]
    missing += [section for section in schema.UNSUPPORTED_SECTIONS if f"`{section}`" not in docs]
    assert missing == []


def test_overlap_comm_false_is_warned_about_by_name():
    # FSDP2 and DDP always overlap communication with compute; a config asking for no overlap is told so, by name
    with pytest.warns(DeepSpeedConfigWarning, match=r"zero_optimization\.overlap_comm=False"):
        translate_ds_config({"zero_optimization": {"stage": 2, "overlap_comm": False}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        translate_ds_config({"zero_optimization": {"stage": 2, "overlap_comm": True}})
        translate_ds_config({"zero_optimization": {"stage": 3}})


def test_docs_first_snippet_runs(tmp_path, monkeypatch):
    """The first snippet of docs/ds_config.md runs as written, given the `trainer` and `model` it says it needs."""
    import re
    import shutil
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    root = Path(__file__).resolve().parents[2]
    snippet = re.search(r"```python\n(.*?)```", (root / "docs" / "ds_config.md").read_text(), re.S).group(1)
    shutil.copy(root / "examples" / "configs" / "ds_config.json", tmp_path / "ds_config.json")
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 4)
    model.hparams = {"n_embd": 64}
    namespace = {"model": model, "trainer": SimpleNamespace(estimated_stepping_batches=10)}
    exec(compile(snippet, "docs/ds_config.md", "exec"), namespace)
    assert namespace["translation"].strategy_kwargs["stage"] == 2
