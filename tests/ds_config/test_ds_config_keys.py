"""Every key of DeepSpeed 0.19's configuration lands in exactly one class through ``ZeroStrategy``'s ds_config binding
(:class:`lightning_zero.ds_config.binding.DeepSpeedConfigBinding`, what ``ZeroStrategy(config=...)`` builds):

* **honoured**: a setting the strategy or the Trainer applies changes (the test names which one);
* **warned**: accepted with a warning whose text names the key (it has no effect here, or is a deprecated spelling);
* **refused**: an error whose text names the key.

None is accepted and dropped. The keys are ``tests/data/deepspeed_config_keys.json``, listed from DeepSpeed itself by
``tests/data/generate_deepspeed_config_keys.py`` (this test needs no DeepSpeed). Each key is written with a value
DeepSpeed would act on (not its default), in the smallest config where it can matter (``CONTEXTS``: the loss-scale
keys with fp16 on, the NVMe knobs with an NVMe offload...), and compared with that config without it.
"""

from __future__ import annotations

import copy
import functools
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from lightning_zero.adapters.settings import checkpoint_save_options
from lightning_zero.ds_config import DeepSpeedConfigError
from lightning_zero.ds_config.binding import (
    DeepSpeedConfigBinding,
    activation_checkpointing_over_config,
    config_reduce_bucket_size,
)
from lightning_zero.ds_config.schema import PERMISSIONS

DATA = json.loads((Path(__file__).parents[1] / "data" / "deepspeed_config_keys.json").read_text())
KEYS = {entry["path"]: entry for entry in DATA["keys"]}
# A key with keys under it (a section) is tested through them.
LEAVES = sorted(path for path in KEYS if not any(other.startswith(path + ".") for other in KEYS))

_NVME = {"device": "nvme", "nvme_path": "/nvme/a"}
_OPTIMIZER = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
# (key or section prefix, the config the key is written into); the longest matching prefix wins.
CONTEXTS = {
    "fp16.": {"fp16": {"enabled": True}},
    "fp16.enabled": {},
    "torch_autocast.dtype": {"torch_autocast": {"enabled": True}},
    "zero_optimization.offload_optimizer.": {"zero_optimization": {"stage": 3, "offload_optimizer": _NVME}},
    "zero_optimization.offload_optimizer.device": {"zero_optimization": {"stage": 2}},
    "zero_optimization.offload_optimizer.pin_memory": {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    },
    "zero_optimization.offload_param.": {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": _NVME}
    },
    "zero_optimization.offload_param.device": {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    },
    "zero_optimization.offload_param.pin_memory": {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    },
    "aio.": {"zero_optimization": {"stage": 3, "offload_optimizer": _NVME}},
    "zero_optimization.sub_group_size": {"zero_optimization": {"stage": 3, "offload_optimizer": _NVME}},
    "zero_optimization.": {"zero_optimization": {"stage": 3}},
    "zero_optimization.stage": {},
    "zero_optimization.reduce_bucket_size": {"zero_optimization": {"stage": 2}},
    "zero_optimization.allgather_bucket_size": {"zero_optimization": {"stage": 2}},
    "optimizer.params": {"optimizer": {"type": "AdamW"}},
    "optimizer.legacy_fusion": _OPTIMIZER,
    "scheduler.type": _OPTIMIZER,
    "scheduler.params": {**_OPTIMIZER, "scheduler": {"type": "WarmupLR"}},
}

# Values DeepSpeed acts on, where the rule in sample() cannot choose one (no default, a string, a size).
SAMPLES: dict[str, Any] = {
    "zero_optimization.stage": 3,
    "zero_optimization.offload_optimizer.device": "cpu",
    "zero_optimization.offload_param.device": "cpu",
    "zero_optimization.offload_optimizer.nvme_path": "/nvme/b",
    "zero_optimization.offload_param.nvme_path": "/nvme/b",
    "zero_optimization.zero_hpz_partition_size": 2,
    "zero_optimization.mics_shard_size": 2,
    "zero_optimization.overlap_comm": False,
    "zero_optimization.zeropp_loco_param": {"err_beta": 0.8},
    "zero_optimization.mics_hierarchical_params_gather": True,
    "zero_optimization.cpu_offload": True,
    "zero_optimization.cpu_offload_param": True,
    "zero_optimization.cpu_offload_use_pin_memory": True,
    "zero_optimization.zenflow.steps_per_epoch": 100,
    "zero_optimization.zenflow.select_strategy": "step",
    "zero_optimization.zenflow.select_interval": 2,
    "zero_optimization.zenflow.update_interval": 2,
    "zero_optimization.leaf_module.classes": ["MyExpertBlock"],
    "zero_optimization.leaf_module.names": ["model.layers.0.mlp"],
    "zero_optimization.leaf_module.name_suffixes": ["mlp"],
    "aio.block_size": 262144,
    "fp16.loss_scale": 128.0,
    "torch_autocast.dtype": "bfloat16",  # absent is float16 (torch.autocast on CUDA), as in DeepSpeed
    "torch_autocast.lower_precision_safe_modules": ["torch.nn.Linear"],
    "optimizer.type": "AdamW",
    "optimizer.params": {"lr": 0.02},
    "optimizer.legacy_fusion": True,
    "scheduler.type": "WarmupLR",
    "scheduler.params": {"warmup_num_steps": 10},
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "steps_per_print": 10,
    "gradient_clipping": 0.5,
    "communication_data_type": "bf16",
    "seq_parallel_communication_data_type": "bf16",
    "gradient_allreduce_op": "sum",
    "log_level": "debug",
    "vocabulary_size": 50257,
    "disable_python_gc": 10,
    "sequence_parallel_size": 2,
    "data_parallel_size": 2,
    "pipeline.stages": 2,
    "pipeline.partition": "uniform",
    "pipeline.activation_checkpoint_interval": 1,
    "pipeline.seed_layers": True,
    "pipeline.pipe_partitioned": False,
    "pipeline.grad_partitioned": False,
    "pipeline.use_reentrant": False,
    "activation_checkpointing.number_checkpoints": 4,
    "checkpoint.tag_validation": "Fail",
    "checkpoint.writer.type": "DECOUPLED",
    "checkpoint.writer.data_parallel": "socket",
    "datastates_ckpt": {"host_cache_size": 16},
    "graph_harvesting": True,
    "sparse_gradients": True,
}

# Sections refused as a whole (features lightning-zero does not have, or DeepSpeed removed): any value written in
# them is refused, so their keys need no chosen value.
REFUSED_SECTIONS = (
    "autotuning",
    "comet",
    "comms_logger",
    "compile",
    "csv_monitor",
    "data_efficiency",
    "data_types",
    "expert_parallel",
    "flops_profiler",
    "hybrid_engine",
    "tensor_parallel",
    "tensorboard",
    "timers",
    "wandb",
    "weight_quantization",
    "zero_optimization.zenflow",
)

# What each honoured key changes (a strategy argument, a Trainer setting, or what the strategy builds from it).
HONOURED = {
    "zero_allow_untested_optimizer": "permission",
    "activation_checkpointing.cpu_checkpointing": "activation_checkpointing",
    "aio.block_size": "strategy.aio",
    "aio.intra_op_parallelism": "strategy.aio",
    "aio.overlap_events": "strategy.aio",
    "aio.queue_depth": "strategy.aio",
    "aio.single_submit": "strategy.aio",
    "bf16.enabled": "trainer.precision",
    "bfloat16.enabled": "trainer.precision",
    "communication_data_type": "strategy.communication_data_type",
    "fp16.consecutive_hysteresis": "strategy.consecutive_hysteresis",
    "fp16.enabled": "trainer.precision",
    "fp16.hysteresis": "strategy.hysteresis",
    "fp16.initial_scale_power": "strategy.initial_scale_power",
    "fp16.loss_scale": "strategy.loss_scale",
    "fp16.loss_scale_window": "strategy.loss_scale_window",
    "fp16.min_loss_scale": "strategy.min_loss_scale",
    "gradient_accumulation_steps": "trainer.accumulate_grad_batches",
    "gradient_clipping": "trainer.gradient_clip_val",
    "optimizer.params": "optimizer",
    "optimizer.type": "optimizer",
    "pipeline.stages": "strategy.pipeline_parallel_size",
    "scheduler.params": "scheduler",
    "scheduler.type": "scheduler",
    "steps_per_print": "trainer.log_every_n_steps",
    "torch_autocast.dtype": "trainer.precision",
    "torch_autocast.enabled": "trainer.precision",
    "train_batch_size": "trainer.train_batch_size",
    "train_micro_batch_size_per_gpu": "trainer.train_micro_batch_size_per_gpu",
    "wall_clock_breakdown": "trainer.wall_clock_breakdown",
    "zero_optimization.allgather_bucket_size": "strategy.unit_bytes",
    "zero_optimization.gather_16bit_weights_on_model_save": "weights_16bit",
    "zero_optimization.mics_shard_size": "strategy.hybrid_shard_size",
    "zero_optimization.offload_optimizer.buffer_count": "strategy.buffer_count",
    "zero_optimization.offload_optimizer.device": "strategy.offload_optimizer",
    "zero_optimization.offload_optimizer.nvme_path": "strategy.nvme_path",
    "zero_optimization.offload_optimizer.pin_memory": "strategy.pin_memory",
    "zero_optimization.offload_param.buffer_count": "strategy.buffer_count",
    "zero_optimization.offload_param.buffer_size": "strategy.buffer_size",
    "zero_optimization.offload_param.device": "strategy.offload_params",
    "zero_optimization.offload_param.max_in_cpu": "strategy.max_in_cpu",
    "zero_optimization.offload_param.nvme_path": "strategy.nvme_path",
    "zero_optimization.offload_param.pin_memory": "strategy.pin_memory",
    "zero_optimization.param_persistence_threshold": "strategy.param_persistence_threshold",
    "zero_optimization.prefetch_bucket_size": "strategy.prefetch_bytes",
    "zero_optimization.reduce_bucket_size": "strategy.unit_bytes",
    "zero_optimization.stage": "strategy.stage",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "weights_16bit",
    "zero_optimization.stage3_param_persistence_threshold": "strategy.param_persistence_threshold",
    "zero_optimization.stage3_prefetch_bucket_size": "strategy.prefetch_bytes",
    "zero_optimization.sub_group_size": "strategy.sub_group_size",
    "zero_optimization.zero_hpz_partition_size": "strategy.reshard_after_forward",
}


def _refused_section(path: str) -> bool:
    return KEYS[path].get("removed", False) or any(path == s or path.startswith(s + ".") for s in REFUSED_SECTIONS)


def sample(path: str) -> Any:
    """A value DeepSpeed acts on for ``path``: ``SAMPLES``, else ``enabled`` on, a flipped switch, a larger number;
    any value for a key inside a refused section."""
    if path in SAMPLES:
        return SAMPLES[path]
    default = KEYS[path]["default"]
    if path.endswith(".enabled"):
        return True
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default * 2 + 1 if default >= 0 else default + 1
    if _refused_section(path):
        return {"any": 1} if default is None else "other"
    raise AssertionError(f"{path}: no sample value (default {default!r}); add one to SAMPLES")


def _context(path: str) -> dict:
    matches = [prefix for prefix in CONTEXTS if path == prefix or prefix.endswith(".") and path.startswith(prefix)]
    return copy.deepcopy(CONTEXTS[max(matches, key=len)]) if matches else {}


def _with_key(config: dict, path: str, value: Any) -> dict:
    config = copy.deepcopy(config)
    *parents, last = path.split(".")
    section = config
    for part in parents:
        section = section.setdefault(part, {})
    section[last] = value
    return config


def settings(binding: DeepSpeedConfigBinding) -> dict:
    """Everything the strategy and the Trainer take from a bound config."""
    translation = binding.translation
    found = {f"strategy.{key}": value for key, value in translation.strategy_kwargs.items()}
    found.update({f"trainer.{key}": value for key, value in translation.trainer_settings().items()})
    found.update(
        {
            "trainer.train_batch_size": translation.train_batch_size,
            "trainer.train_micro_batch_size_per_gpu": translation.train_micro_batch_size_per_gpu,
            "trainer.wall_clock_breakdown": translation.wall_clock_breakdown,
            "optimizer": translation.optimizer,
            "scheduler": translation.scheduler,
            "activation_checkpointing": activation_checkpointing_over_config(binding, None, None, None),
            "weights_16bit": checkpoint_save_options(binding, "bf16-mixed")["weights_16bit"],
            "ddp.bucket_cap": config_reduce_bucket_size(binding),
        }
    )
    return found


def _bind(config: dict, strict: bool = True) -> tuple[Any, list[str]]:
    """The binding (or the error) and the texts of the warnings raised on the way."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: Any = DeepSpeedConfigBinding(config, strict=strict)
        except DeepSpeedConfigError as error:
            result = error
    return result, [str(warning.message) for warning in caught]


@functools.lru_cache(maxsize=None)
def classify(path: str) -> tuple[str, Any]:
    """``("refused", message)``, ``("warned", message)``, ``("honoured", changed settings)`` or ``("dropped", ...)``."""
    context = _context(path)
    result, texts = _bind(_with_key(context, path, sample(path)))
    if isinstance(result, Exception):
        return ("refused", str(result)) if path in str(result) else ("error not naming the key", str(result))
    named = [text for text in texts if path in text]
    if named:
        return "warned", named[0]
    if path in PERMISSIONS:  # asks for what the engines always do (any torch optimizer): nothing to change
        return "honoured", ["permission"]
    base, _ = _bind(context)
    assert not isinstance(base, Exception), f"{path}: the context alone fails: {base}"
    before, after = settings(base), settings(result)
    changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    return ("honoured", changed) if changed else ("dropped", texts)


def test_the_key_list_is_deepspeed_0_19s():
    assert DATA["deepspeed_version"].startswith("0.19.")
    assert len(LEAVES) > 300 and "zero_optimization.stage3_gather_16bit_weights_on_model_save" in LEAVES


@pytest.mark.parametrize("path", LEAVES)
def test_every_key_is_honoured_warned_or_refused_by_name(path):
    kind, detail = classify(path)
    assert kind in ("honoured", "warned", "refused"), f"{path}={sample(path)!r}: {kind}: {detail}"
    if kind == "honoured":
        assert path in HONOURED, f"{path} changes {detail}: add what it maps to HONOURED"
        assert HONOURED[path] in detail, f"{path} should change {HONOURED[path]}, changes {detail}"
    else:
        assert path not in HONOURED, f"{path} is {kind} ({detail[:200]}), HONOURED says it maps to {HONOURED[path]}"


def test_a_refused_key_still_names_itself_with_strict_false():
    # strict=False turns refusals of unknown and unsupported keys into warnings; either way the key is named
    unnamed = []
    for path in (path for path in LEAVES if classify(path)[0] == "refused"):
        result, texts = _bind(_with_key(_context(path), path, sample(path)), strict=False)
        named = str(result) if isinstance(result, Exception) else " ".join(texts)
        if path not in named:
            unnamed.append(f"{path}: {named[:200]}")
    assert unnamed == []


def test_counts_per_class():
    counts: dict[str, int] = {}
    for kind, _ in map(classify, LEAVES):
        counts[kind] = counts.get(kind, 0) + 1
    assert set(counts) <= {"honoured", "warned", "refused"} and sum(counts.values()) == len(LEAVES), counts
    assert counts["honoured"] == len(HONOURED)


@pytest.mark.parametrize(
    "config, named",
    [
        ({"fp16": {"enabled": False, "loss_scale_window": 100}}, "fp16.loss_scale_window=100"),
        ({"torch_autocast": {"dtype": "float16"}}, "torch_autocast.dtype='float16'"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": False}}},
            "zero_optimization.offload_optimizer.pin_memory=False",
        ),
        ({"aio": {"queue_depth": 2}}, "aio.queue_depth=2"),
        ({"optimizer": {"type": "AdamW", "legacy_fusion": True}}, "optimizer.legacy_fusion=True"),
        ({"zero_optimization": {"stage": 3, "max_live_parameters": 10}}, "zero_optimization.max_live_parameters=10"),
    ],
)
def test_a_key_without_effect_where_it_is_written_is_named(config, named):
    # DeepSpeed ignores these too here (fp16 off, no NVMe, device 'none'...); a value it would act on is still said
    result, texts = _bind(config)
    assert not isinstance(result, Exception) and any(named in text for text in texts), texts


def test_deepspeed_spellings_of_one_key():
    # the pydantic field name is the alias's key; giving both is ambiguous
    result, _ = _bind(
        {"zero_optimization": {"stage": 3, "prefetch_bucket_size": 10, "stage3_prefetch_bucket_size": 20}}
    )
    assert isinstance(result, DeepSpeedConfigError) and "prefetch_bucket_size" in str(result)
    # the section keeps DeepSpeed's deprecated spelling in what it says
    result, texts = _bind({"bfloat16": {"enabled": True, "bf16_optimizer_states": True}}, strict=False)
    assert any("bfloat16.bf16_optimizer_states" in text for text in texts)


def test_torch_autocast_without_dtype_is_fp16_as_in_deepspeed():
    # DeepSpeed passes no dtype to torch.autocast, which then takes its CUDA default: float16
    binding, _ = _bind({"torch_autocast": {"enabled": True}})
    assert binding.precision == "16-mixed"


# Where our effective defaults differ from what DeepSpeed's reader falls back to, and why that is right.
DEFAULTS_DIFFER = {
    "gradient_clipping": "absent -> the Trainer's clipping, as Lightning's DeepSpeedStrategy writes it (0.0 if off)",
    "pipeline.": "get_pipeline_config copies the section over its defaults without a per-key default (ours are those)",
    "zero_optimization.mics_shard_size": "removed from DeepSpeed 0.19 (no default); -1 is its last one, 'off'",
    "zero_optimization.mics_hierarchical_params_gather": "removed from DeepSpeed 0.19 (no default); false was its last",
}


def test_our_defaults_are_deepspeeds():
    from lightning_zero.ds_config import schema

    ours = {key: spec.default for key, spec in schema.TOP_LEVEL_KEYS.items()}
    ours.update(
        {
            f"{section}.{key}": spec.default
            for section, keys in {**schema.SECTION_KEYS, "zero_optimization": schema.ZERO_KEYS}.items()
            for key, spec in keys.items()
        }
    )
    differ = []
    for path, default in ours.items():
        theirs = KEYS.get(path, {}).get("default", default)
        if (
            path in LEAVES
            and default is not schema.DERIVED
            and not any(path == p or p.endswith(".") and path.startswith(p) for p in DEFAULTS_DIFFER)
        ):
            same = default == theirs or isinstance(default, str) and str(theirs).lower() == default.lower()
            if not same:
                differ.append(f"{path}: ours {default!r}, DeepSpeed {theirs!r}")
    assert differ == []
