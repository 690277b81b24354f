"""Translate a DeepSpeed ``ds_config`` into ``ZeroStrategy`` keyword arguments and Trainer-level settings.

The translation is a pure function of the config dict: no process group, no Trainer. ``"auto"`` values are kept
as ``"auto"`` (listed in :attr:`DeepSpeedTranslation.unresolved_auto`); resolve them with
:func:`lightning_zero.ds_config.auto.resolve_auto` once the Trainer is known and translate again.

[Note: nothing is silently dropped. Every key present in the config ends in exactly one of: a strategy kwarg, a
Trainer-level field, a returned section (optimizer/scheduler/activation checkpointing), a note saying why it has no
effect with FSDP2/DDP (warned when set to a non-default value), or an error (warning with ``strict=False``).]
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_zero.distributed.config import COMMUNICATION_DATA_TYPES
from lightning_zero.distributed.units import DS_BUCKET_ELEMENT_BYTES
from lightning_zero.ds_config import schema
from lightning_zero.ds_config.loading import DeepSpeedConfigError
from lightning_zero.ds_config.translate_checks import (
    AUTO,
    Collector,
    at_default,
    check_flag,
    check_number,
    honoured,
    merge_section,
    no_effect,
    section_of,
    shown,
    suggest,
)
from lightning_zero.ds_config.translate_offload import translate_aio, translate_offload

_LOSS_SCALE_KWARGS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
)


@dataclass(frozen=True)
class DeepSpeedTranslation:
    """What a ``ds_config`` asks for, split by who has to act on it.

    Attributes:
        strategy_kwargs: keyword arguments for ``ZeroStrategy`` (``stage``, ``offload``, ``pin_memory``,
            ``reshard_after_forward``, ``communication_data_type``, the fp16 loss-scale knobs,
            ``pipeline_parallel_size``, ``micro_batches``); only keys the config determines are present.
        precision: ``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"`` or ``None`` when the config has no precision
            section (DeepSpeed would train in fp32) or its ``enabled`` is still ``"auto"``.
        gradient_clipping: Trainer ``gradient_clip_val`` (``0.0`` = off), ``None`` if absent, or ``"auto"``.
        gradient_accumulation_steps, train_batch_size, train_micro_batch_size_per_gpu: batch settings as written
            (``None`` if absent, or ``"auto"``); :func:`resolve_auto` applies DeepSpeed's arithmetic.
        steps_per_print: Trainer ``log_every_n_steps`` or ``None``.
        wall_clock_breakdown: the config asks for per-phase timings.
        activation_checkpointing: the section with DeepSpeed's defaults filled in (empty when absent).
        optimizer: ``{"type": ..., "params": {...}}`` or ``None``.
        scheduler: ``{"type": ..., "params": {...}}`` or ``None``.
        gather_16bit_weights_on_model_save: ``stage3_gather_16bit_weights_on_model_save``.
        notes: ``(key, what happened to it)`` for every key present in the config.
        effective: the fully-resolved config (DeepSpeed defaults filled in, deprecated keys renamed) to print and
            save next to checkpoints.
        unresolved_auto: dotted paths whose value is still ``"auto"``.
    """

    strategy_kwargs: dict
    precision: Optional[str]
    gradient_clipping: Any
    gradient_accumulation_steps: Any
    train_batch_size: Any
    train_micro_batch_size_per_gpu: Any
    steps_per_print: Optional[int]
    wall_clock_breakdown: bool
    activation_checkpointing: dict
    optimizer: Optional[dict]
    scheduler: Optional[dict]
    gather_16bit_weights_on_model_save: bool
    notes: tuple = field(default_factory=tuple)
    effective: dict = field(default_factory=dict)
    unresolved_auto: tuple = field(default_factory=tuple)

    def trainer_settings(self) -> dict:
        """The Trainer-level settings the config fixes, under the Trainer's argument names (absent = not fixed)."""
        settings = {
            "precision": self.precision,
            "gradient_clip_val": self.gradient_clipping,
            "accumulate_grad_batches": self.gradient_accumulation_steps,
            "log_every_n_steps": self.steps_per_print,
        }
        return {key: value for key, value in settings.items() if value is not None and value != AUTO}


def _is_disabled(value: Any) -> bool:
    """A section of another feature that asks for nothing: false/null, a size of 0 or 1, or ``{"enabled": false}``
    (``true`` asks for the feature)."""
    if value is None or value is False or (type(value) in (int, float) and value in (0, 1)):
        return True
    return isinstance(value, dict) and value.get("enabled", True) is False


def _normalise_deprecated(config: dict, out: Collector) -> dict:
    """Rewrite the spellings DeepSpeed still reads into current ones, warning once per key."""
    config = copy.deepcopy(config)
    zero = config.get("zero_optimization")
    if isinstance(zero, bool):
        warnings.warn(
            '"zero_optimization": true/false is deprecated in DeepSpeed; write "zero_optimization": '
            '{"stage": 1} (or 0) instead',
            FutureWarning,
            stacklevel=3,
        )
        new_zero: dict = {"stage": 1 if zero else 0}
        if zero and "allgather_size" in config:
            new_zero["allgather_bucket_size"] = config.pop("allgather_size")
        config["zero_optimization"] = new_zero
        out.note("zero_optimization", f"deprecated boolean form -> stage {new_zero['stage']}")
    if "bfloat16" in config:
        if "bf16" in config:
            raise DeepSpeedConfigError('both "bf16" and its deprecated spelling "bfloat16" are set: keep only "bf16"')
        warnings.warn(
            '"bfloat16" is deprecated in DeepSpeed; rename the section to "bf16"', FutureWarning, stacklevel=3
        )
        config["bf16"] = config.pop("bfloat16")
        out.note("bfloat16", 'deprecated spelling -> "bf16"')
        out.written_as["bf16"] = "bfloat16"
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        _rename_field_names(zero, out)
        for old, new in schema.DEPRECATED_ZERO_KEYS.items():
            if old not in zero:
                continue
            value = zero.pop(old)
            warnings.warn(
                f'"zero_optimization.{old}" is deprecated in DeepSpeed; use "{new}" instead',
                FutureWarning,
                stacklevel=3,
            )
            out.note(f"zero_optimization.{old}", f"deprecated -> {new}")
            if old == "cpu_offload" and value:
                zero.setdefault("offload_optimizer", {"device": "cpu"})
            elif old == "cpu_offload_param" and value:
                zero.setdefault("offload_param", {"device": "cpu"})
            elif old == "cpu_offload_use_pin_memory" and value is not None:
                for sub in ("offload_optimizer", "offload_param"):
                    if isinstance(zero.get(sub), dict):
                        zero[sub].setdefault("pin_memory", bool(value))
            elif old == "stage3_gather_fp16_weights_on_model_save":
                zero.setdefault("stage3_gather_16bit_weights_on_model_save", value)
    return config


def _rename_field_names(zero: dict, out: Collector) -> None:
    """DeepSpeed's field names of the stage-3 keys (``prefetch_bucket_size`` for ``stage3_prefetch_bucket_size``...)
    -> the documented names: both are DeepSpeed keys for one setting, so no warning; both at once is ambiguous."""
    for field_name, name in schema.ZERO_FIELD_NAMES.items():
        if field_name not in zero:
            continue
        if name in zero:
            raise DeepSpeedConfigError(
                f"zero_optimization.{field_name} and zero_optimization.{name} are one setting "
                "(DeepSpeed's field name and its alias): give only one"
            )
        zero[name] = zero.pop(field_name)
        out.note(f"zero_optimization.{field_name}", f"DeepSpeed's field name of {name} -> {name}")
        out.written_as[f"zero_optimization.{name}"] = f"zero_optimization.{field_name}"


def _translate_zero(config: dict, out: Collector, kwargs: dict) -> tuple[dict, bool]:
    zero = section_of(config, "zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage == AUTO or isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise DeepSpeedConfigError(
            f'zero_optimization.stage must be 0, 1, 2 or 3 ("auto" is not allowed), got {stage!r}'
        )
    kwargs["stage"] = stage
    scalar_user = {k: v for k, v in zero.items() if k not in ("offload_optimizer", "offload_param")}
    merged = merge_section(scalar_user, schema.ZERO_KEYS, "zero_optimization", out)
    if stage <= 1 and "reduce_bucket_size" in zero:
        # Stages 0-1 run DDP, whose gradient bucket this is (see lightning_zero.distributed.ddp).
        path = "zero_optimization.reduce_bucket_size"
        out.notes = [(key, text) for key, text in out.notes if key != path]
        out.no_effect_non_default = [item for item in out.no_effect_non_default if not item.startswith(path + "=")]
        out.note(path, "-> DDP bucket_cap_mb (elements x gradient bytes, in MiB) at stages 0-1, unless given")
    merged.update(translate_offload(zero, stage, out, kwargs))
    merged["overlap_comm"] = zero.get("overlap_comm", stage == 3)  # DeepSpeed: on by default only at stage 3
    if zero.get("overlap_comm") is False:  # a written False asks for what the engines never do: said by name
        out.no_effect_non_default.append("zero_optimization.overlap_comm=False")
    for key in (
        "reduce_bucket_size",
        "allgather_bucket_size",
        "sub_group_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_model_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
    ):
        merged[key] = check_number(f"zero_optimization.{key}", merged[key], integer=True)
    _translate_units(zero, merged, stage, out, kwargs)
    hpz = check_number(
        "zero_optimization.zero_hpz_partition_size", merged["zero_hpz_partition_size"], integer=True, allow_auto=False
    )
    if hpz > 1:
        if stage != 3:
            raise DeepSpeedConfigError(
                f"zero_optimization.zero_hpz_partition_size={hpz} (ZeRO++ hpZ) needs stage 3, got stage {stage}"
            )
        kwargs["reshard_after_forward"] = hpz
    mics = check_number(
        "zero_optimization.mics_shard_size", merged["mics_shard_size"], integer=True, allow_auto=False, minimum=-1
    )
    if mics > 0:  # MiCS is HSDP; hpZ above is not (see docs/ds_config.md, "Hybrid sharding")
        kwargs["hybrid_shard_size"] = mics
    # "auto" as Hugging Face/accelerate configs write it; resolve_auto turns it into accelerate's default (false)
    gather = check_flag(
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        merged["stage3_gather_16bit_weights_on_model_save"],
        allow_auto=True,
    )
    return merged, gather


def _translate_units(zero: dict, merged: dict, stage: int, out: Collector, kwargs: dict) -> None:
    """DeepSpeed's bucket keys -> the FSDP2 unit knobs (:mod:`lightning_zero.distributed.units`), only where the
    config wrote a number (a DeepSpeed default is tuned for DeepSpeed's buckets, not carried over). At stage 2 one
    FSDP2 unit is both DeepSpeed's reduce bucket and all-gather bucket: the smaller written size wins; at stage 3
    DeepSpeed fetches parameters by module (``allgather_bucket_size`` is a stage 1-2 key), so units follow
    ``reduce_bucket_size`` and the prefetch and persistence keys apply. Sizes in elements x 4 bytes (fp32 at rest).
    ``"auto"`` is not mapped: the units are planned from the constructor's settings, before setup resolves it."""
    if stage < 2:
        return
    element = DS_BUCKET_ELEMENT_BYTES
    unit_keys = ("reduce_bucket_size", "allgather_bucket_size") if stage == 2 else ("reduce_bucket_size",)
    targets = (
        {
            "stage3_prefetch_bucket_size": ("prefetch_bytes", element),
            "stage3_param_persistence_threshold": ("param_persistence_threshold", 1),
        }
        if stage == 3
        else {}
    )
    for key in unit_keys + tuple(targets):
        path = f"zero_optimization.{key}"
        if key not in zero:
            continue
        if zero[key] == AUTO:
            honoured(
                out,
                path,
                '"auto" -> not mapped: the FSDP2 units are planned before setup resolves "auto", '
                "so the strategy's default applies (docs/units.md)",
            )
        elif key in unit_keys:
            written = [merged[k] for k in unit_keys if k in zero and zero[k] != AUTO]
            kwargs["unit_bytes"] = min(written) * element
            honoured(
                out,
                path,
                f"-> unit_bytes={kwargs['unit_bytes']} (FSDP2 units grouped to this many bytes: "
                f"the smaller of {' and '.join(unit_keys)} as written, x {element} bytes)",
            )
        else:
            name, scale = targets[key]
            kwargs[name] = merged[key] * scale
            honoured(out, path, f"-> {name}={kwargs[name]}")


def _translate_precision(config: dict, out: Collector, kwargs: dict) -> tuple[Optional[str], dict]:
    effective: dict = {}
    enabled: dict[str, Any] = {}
    for name, keys in (
        ("fp16", schema.FP16_KEYS),
        ("bf16", schema.BF16_KEYS),
        ("torch_autocast", schema.TORCH_AUTOCAST_KEYS),
    ):
        user = section_of(config, name)
        if user is None:
            continue
        merged = merge_section(user, keys, name, out)
        enabled[name] = check_flag(f"{name}.enabled", merged["enabled"], allow_auto=name != "torch_autocast")
        effective[name] = merged
    if "torch_autocast" in effective and enabled["torch_autocast"]:
        written = effective["torch_autocast"]["dtype"]  # absent: torch.autocast's CUDA default, as DeepSpeed gets it
        dtype = "float16" if written is None else str(written).replace("torch.", "").lower()
        target = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16"}.get(dtype)
        if target is None:
            raise DeepSpeedConfigError(f"torch_autocast.dtype must be bfloat16 or float16, got {dtype!r}")
        if enabled.get(target) is False or any(enabled.get(o) is True for o in ("fp16", "bf16") if o != target):
            raise DeepSpeedConfigError(
                f"torch_autocast asks for {dtype} but the fp16/bf16 sections say otherwise: enable only one precision"
            )
        enabled[target] = True
    if enabled.get("fp16") is True and enabled.get("bf16") is True:
        raise DeepSpeedConfigError(
            'both "fp16.enabled" and "bf16.enabled" are true: DeepSpeed trains in one '
            "precision; set one of them to false"
        )
    if "fp16" in effective and enabled.get("fp16") is True:
        fp16 = effective["fp16"]
        fp16["loss_scale"] = check_number("fp16.loss_scale", fp16["loss_scale"], allow_auto=False)
        fp16["initial_scale_power"] = check_number(
            "fp16.initial_scale_power", fp16["initial_scale_power"], integer=True, allow_auto=False
        )
        fp16["loss_scale_window"] = check_number(
            "fp16.loss_scale_window", fp16["loss_scale_window"], integer=True, allow_auto=False, strictly_positive=True
        )
        fp16["hysteresis"] = check_number(
            "fp16.hysteresis", fp16["hysteresis"], integer=True, minimum=1, allow_auto=False
        )
        fp16["min_loss_scale"] = check_number(
            "fp16.min_loss_scale", fp16["min_loss_scale"], allow_auto=False, strictly_positive=True
        )
        check_flag("fp16.consecutive_hysteresis", fp16["consecutive_hysteresis"])
        kwargs.update({key: fp16[key] for key in _LOSS_SCALE_KWARGS})
    elif "fp16" in effective:  # DeepSpeed ignores them too; a value it would have used is said
        for key in _LOSS_SCALE_KWARGS:
            if key in config["fp16"]:
                no_effect(out, f"fp16.{key}", config["fp16"][key], schema.FP16_KEYS[key].default, "fp16 is not enabled")
    if "torch_autocast" in effective and enabled["torch_autocast"] is False and "dtype" in config["torch_autocast"]:
        no_effect(
            out,
            "torch_autocast.dtype",
            config["torch_autocast"]["dtype"],
            schema.TORCH_AUTOCAST_KEYS["dtype"].default,
            "torch_autocast is not enabled",
        )
    if AUTO in (enabled.get("fp16"), enabled.get("bf16")):
        return None, effective
    if enabled.get("fp16"):
        return "16-mixed", effective
    if enabled.get("bf16"):
        return "bf16-mixed", effective
    return ("32-true" if effective else None), effective


def _translate_named_spec(config: dict, name: str, out: Collector) -> Optional[dict]:
    spec = config.get(name)
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise DeepSpeedConfigError(
            f'{name!r} must be an object like {{"type": "...", "params": {{...}}}}, got {spec!r}'
        )
    params = spec.get("params", {}) or {}
    if not isinstance(params, dict):
        raise DeepSpeedConfigError(f"{name}.params must be a JSON object, got {params!r}")
    allowed = {"type", "params"} | ({"legacy_fusion"} if name == "optimizer" else set())
    for key in spec:
        if key not in allowed:
            out.problem(f"{name}.{key}", f"unknown key; {suggest(key, sorted(allowed), name)}")
    if "legacy_fusion" in spec:
        no_effect(
            out,
            "optimizer.legacy_fusion",
            spec["legacy_fusion"],
            False,
            "a switch of DeepSpeed's fp16 "
            "optimizer wrapper (its fused unscale-and-clip); the loss scaler here has one implementation",
        )
    if name == "optimizer" and "max_grad_norm" in params:
        raise DeepSpeedConfigError(
            "optimizer.params.max_grad_norm is not an optimizer parameter (DeepSpeed rejects "
            'it too): use the top-level "gradient_clipping" instead'
        )
    out.note(name, schema.TOP_LEVEL_KEYS[name].note)
    return {"type": spec["type"], "params": copy.deepcopy(params)}


def _check_top_level_keys(config: dict, out: Collector) -> None:
    """A problem for each top-level key that is neither a known key nor a disabled unsupported section (those get a
    note)."""
    for key, value in config.items():
        if key in schema.TOP_LEVEL_KEYS:
            continue
        if key in schema.UNSUPPORTED_SECTIONS:
            if _is_disabled(value):
                out.note(key, f"disabled, so accepted ({schema.UNSUPPORTED_SECTIONS[key]} is not supported)")
            else:
                written = f" (refused with it: {shown(key, value)})" if isinstance(value, dict) and value else ""
                out.problem(
                    key, f"not supported: {schema.UNSUPPORTED_SECTIONS[key]} is not part of lightning-zero{written}"
                )
            continue
        candidates = list(schema.TOP_LEVEL_KEYS) + list(schema.UNSUPPORTED_SECTIONS)
        out.problem(key, f"unknown top-level key; {suggest(key, candidates, '')}")


def _translate_sections(config: dict, out: Collector, kwargs: dict, effective: dict) -> None:
    """The ``activation_checkpointing``, ``pipeline`` and ``checkpoint`` sections, merged with their defaults into
    ``effective``; a fixed ``pipeline.stages`` becomes ``pipeline_parallel_size`` in ``kwargs``."""
    for name in ("activation_checkpointing", "pipeline", "checkpoint"):
        user = section_of(config, name)
        if user is not None:
            effective[name] = merge_section(user, schema.SECTION_KEYS[name], name, out)
    pipeline_stages = effective.get("pipeline", {}).get("stages", AUTO)
    if pipeline_stages != AUTO:
        kwargs["pipeline_parallel_size"] = check_number(
            "pipeline.stages", pipeline_stages, integer=True, allow_auto=False, strictly_positive=True
        )


def _record_top_level_settings(config: dict, out: Collector, effective: dict) -> None:
    """The top-level keys without a translation of their own in :func:`translate_ds_config` (batch sizes, clipping,
    logging, no-effect switches): each gets its note (or a problem, for an unsupported value) and is copied to
    ``effective`` as given."""
    for key, spec in schema.TOP_LEVEL_KEYS.items():
        if (
            key not in config
            or key in schema.SECTION_KEYS
            or key in ("zero_optimization", "optimizer", "scheduler", "fp16", "bf16", "torch_autocast")
        ):
            continue
        value = config[key]
        if spec.role == schema.NO_EFFECT:
            out.note(key, "no effect: " + spec.note)
            if value != spec.default and key not in schema.PERMISSIONS:
                out.no_effect_non_default.append(f"{key}={value!r}")
        elif spec.role == schema.UNSUPPORTED and not at_default(value, spec.default):
            out.problem(key, f"{value!r} is not supported: {spec.note}")
        else:
            out.note(key, spec.note)
        effective[key] = value


def _find_auto(value: Any, path: str) -> list[str]:
    if value == AUTO and path != "pipeline.stages":  # DeepSpeed's own default: stages come from the model
        return [path]
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in _find_auto(item, f"{path}.{key}" if path else key)]
    return []


def translate_ds_config(config: dict, *, strict: bool = True) -> DeepSpeedTranslation:
    """Translate a DeepSpeed config dict (see :func:`load_ds_config`) for ``ZeroStrategy``.

    Args:
        config: the ds_config as a dict (unchanged by this call).
        strict: unknown keys and features we do not implement raise :class:`DeepSpeedConfigError` (all of them
            listed in one message, each with the closest valid key); ``False`` warns and ignores them instead.

    Raises:
        DeepSpeedConfigError: unknown/unsupported keys (strict), conflicts (fp16 and bf16 both on, offload at
            stage 0, hpZ below stage 3, ...), or values of the wrong type.
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (use load_ds_config for files), got {type(config).__name__}")
    out = Collector(strict)
    config = _normalise_deprecated(config, out)
    effective: dict = {}
    _check_top_level_keys(config, out)

    kwargs: dict = {}
    effective["zero_optimization"], gather = _translate_zero(config, out, kwargs)
    aio = translate_aio(config, out, kwargs)
    if aio is not None:
        effective["aio"] = aio
    precision, precision_effective = _translate_precision(config, out, kwargs)
    effective.update(precision_effective)
    _translate_sections(config, out, kwargs, effective)

    batch = {
        key: check_number(key, config.get(key), integer=True, strictly_positive=True)
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    }
    if isinstance(batch["gradient_accumulation_steps"], int) and "pipeline_parallel_size" in kwargs:
        # DeepSpeed's pipeline engine runs gradient_accumulation_steps micro-batches per optimizer step.
        kwargs["micro_batches"] = batch["gradient_accumulation_steps"]
    clipping = check_number("gradient_clipping", config.get("gradient_clipping"))
    steps_per_print = check_number(
        "steps_per_print", config.get("steps_per_print"), integer=True, allow_auto=False, strictly_positive=True
    )
    wall_clock = check_flag("wall_clock_breakdown", config.get("wall_clock_breakdown", False))

    comm = config.get("communication_data_type")
    if comm is not None:
        if not isinstance(comm, str) or comm.lower() not in COMMUNICATION_DATA_TYPES:
            raise DeepSpeedConfigError(
                f"communication_data_type must be one of {tuple(COMMUNICATION_DATA_TYPES)}, got {comm!r}"
            )
        kwargs["communication_data_type"] = comm.lower()

    optimizer = _translate_named_spec(config, "optimizer", out)
    scheduler = _translate_named_spec(config, "scheduler", out)
    _record_top_level_settings(config, out, effective)
    effective.update({key: value for key, value in batch.items() if value is not None})
    if optimizer is not None:
        effective["optimizer"] = optimizer
    if scheduler is not None:
        effective["scheduler"] = scheduler
    out.finish()
    return DeepSpeedTranslation(
        strategy_kwargs=kwargs,
        precision=precision,
        gradient_clipping=clipping,
        gradient_accumulation_steps=batch["gradient_accumulation_steps"],
        train_batch_size=batch["train_batch_size"],
        train_micro_batch_size_per_gpu=batch["train_micro_batch_size_per_gpu"],
        steps_per_print=steps_per_print,
        wall_clock_breakdown=wall_clock,
        activation_checkpointing=dict(effective.get("activation_checkpointing", {})),
        optimizer=optimizer,
        scheduler=scheduler,
        gather_16bit_weights_on_model_save=gather,
        notes=tuple(out.notes),
        effective=effective,
        unresolved_auto=tuple(_find_auto(effective, "")),
    )
