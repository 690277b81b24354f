"""Resolve ``"auto"`` values of a ds_config from what Lightning knows, and DeepSpeed's batch-size arithmetic.

``"auto"`` is the Hugging Face convention for "fill this from the trainer": we follow the same sources (batch sizes
from the DataLoader and Trainer, clipping and precision from the Trainer, optimizer hyperparameters from the
LightningModule, step counts from ``trainer.estimated_stepping_batches``, bucket sizes from the hidden size) so
HF-style configs work unchanged. Everything here is pure: the strategy builds an :class:`AutoContext` at setup.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from lightning_zero.ds_config.loading import DeepSpeedConfigError
from lightning_zero.ds_config.translate import AUTO

# Precision strings Lightning accepts, grouped by the DeepSpeed section they enable.
_FP16_PRECISIONS = {"16-mixed", "16", "16-true", 16}
_BF16_PRECISIONS = {"bf16-mixed", "bf16", "bf16-true"}
_FP32_PRECISIONS = {"32-true", "32", 32, "64-true", "64", 64}

# Hyperparameter names looked up on the LightningModule, in order (Lightning, Hugging Face and common spellings).
_LR_NAMES = ("lr", "learning_rate")
_WEIGHT_DECAY_NAMES = ("weight_decay", "wd")
_EPS_NAMES = ("eps", "adam_epsilon", "adam_eps", "epsilon")
_BETAS_NAMES = ("betas",)
_BETA_PAIRS = (("adam_beta1", "adam_beta2"), ("beta1", "beta2"))
_WARMUP_STEP_NAMES = ("warmup_num_steps", "warmup_steps", "num_warmup_steps")
_WARMUP_RATIO_NAMES = ("warmup_ratio",)
_HIDDEN_SIZE_NAMES = ("hidden_size", "d_model", "n_embd", "hidden_dim", "embed_dim", "dim")


@dataclass(frozen=True)
class AutoContext:
    """What Lightning knows at setup, as sources for ``"auto"`` values. ``None`` means unknown.

    Args:
        world_size: data-parallel size (world size divided by pipeline stages).
        micro_batch_size: the training DataLoader's ``batch_size`` on one rank.
        accumulate_grad_batches: the Trainer's ``accumulate_grad_batches``.
        gradient_clip_val: the Trainer's ``gradient_clip_val`` (``None`` = the Trainer does not clip).
        precision: the Trainer's precision (``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"``...).
        hyperparameters: the LightningModule's ``hparams`` (``lr``/``learning_rate``, ``weight_decay``, ``betas``,
            ``eps``, ``warmup_steps``/``warmup_ratio``...).
        estimated_stepping_batches: ``trainer.estimated_stepping_batches`` (optimizer steps in the whole fit).
        hidden_size: the model's hidden size (see :func:`infer_hidden_size`).
    """

    world_size: int = 1
    micro_batch_size: Optional[int] = None
    accumulate_grad_batches: Optional[int] = None
    gradient_clip_val: Optional[float] = None
    precision: Any = None
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    estimated_stepping_batches: Optional[float] = None
    hidden_size: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int (the data-parallel size), got {self.world_size!r}")
        for name in ("micro_batch_size", "accumulate_grad_batches", "hidden_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.gradient_clip_val is not None and (
            not isinstance(self.gradient_clip_val, (int, float)) or self.gradient_clip_val < 0
        ):
            raise ValueError(f"gradient_clip_val must be a number >= 0 or None, got {self.gradient_clip_val!r}")
        object.__setattr__(self, "hyperparameters", dict(self.hyperparameters or {}))


def _unresolvable(path: str, looked: str) -> DeepSpeedConfigError:
    return DeepSpeedConfigError(
        f'cannot resolve "{path}": "auto" — looked at {looked}; set a value in the config or provide it there'
    )


def _first_hparam(hparams: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if hparams.get(name) is not None:
            return hparams[name]
    return None


def _hparam_list(names: tuple[str, ...]) -> str:
    return "the LightningModule hyperparameters " + "/".join(repr(n) for n in names)


def resolve_batch_sizes(
    train_batch_size: Optional[int],
    micro_batch_size: Optional[int],
    gradient_accumulation_steps: Optional[int],
    world_size: int,
) -> tuple[int, int, int]:
    """DeepSpeed's rule ``train_batch_size = micro x accumulation x data-parallel size``: derive what is missing.

    Given all three, check them; given two, derive the third (integer division, as DeepSpeed does, then check);
    given only the global batch, accumulation is 1; given only the micro batch, accumulation is 1.

    Returns:
        ``(train_batch_size, micro_batch_size, gradient_accumulation_steps)``.

    Raises:
        DeepSpeedConfigError: neither batch size is known, or the three do not multiply out (message shows numbers).
    """
    train, micro, accum = train_batch_size, micro_batch_size, gradient_accumulation_steps
    if train is None and micro is None:
        raise DeepSpeedConfigError(
            "either train_batch_size or train_micro_batch_size_per_gpu must be known "
            "(from the config or the DataLoader)"
        )
    if train is not None and micro is not None and accum is None:
        accum = train // micro // world_size
    elif train is not None and accum is not None and micro is None:
        micro = train // world_size // accum
    elif micro is not None and accum is not None and train is None:
        train = micro * accum * world_size
    elif train is not None and micro is None and accum is None:
        accum, micro = 1, train // world_size
    elif micro is not None and train is None and accum is None:
        accum, train = 1, micro * world_size
    if micro < 1 or accum < 1 or train != micro * accum * world_size:
        raise DeepSpeedConfigError(
            f"batch sizes do not add up: train_batch_size ({train}) must equal train_micro_batch_size_per_gpu "
            f"({micro}) x gradient_accumulation_steps ({accum}) x data-parallel world size ({world_size}) = "
            f"{micro * accum * world_size}"
        )
    return train, micro, accum


def _resolve_batches(config: dict, context: AutoContext) -> None:
    values: dict[str, Optional[int]] = {}
    sources = {
        "train_micro_batch_size_per_gpu": (context.micro_batch_size, "the DataLoader's batch_size"),
        "gradient_accumulation_steps": (context.accumulate_grad_batches, "the Trainer's accumulate_grad_batches"),
    }
    for key, (known, where) in sources.items():
        value = config.get(key)
        if value == AUTO:
            if known is None:
                field = "micro_batch_size" if "micro" in key else "accumulate_grad_batches"
                raise _unresolvable(key, f"{where} (AutoContext.{field})")
            value = known
        elif value is not None and known is not None and value != known:
            raise DeepSpeedConfigError(
                f"{key}={value} in the DeepSpeed config does not match {where} ({known}): make them equal, or set "
                f'the config value to "auto"'
            )
        elif value is None:
            value = known  # not in the config: what Lightning actually does is the truth
        values[key] = value
    train = config.get("train_batch_size")
    if train == AUTO:
        train = None
    train, micro, accum = resolve_batch_sizes(
        train, values["train_micro_batch_size_per_gpu"], values["gradient_accumulation_steps"], context.world_size
    )
    config["train_batch_size"], config["train_micro_batch_size_per_gpu"] = train, micro
    config["gradient_accumulation_steps"] = accum


def _resolve_precision(config: dict, context: AutoContext) -> None:
    for section, family in (("fp16", _FP16_PRECISIONS), ("bf16", _BF16_PRECISIONS)):
        if isinstance(config.get(section), dict) and config[section].get("enabled") == AUTO:
            if context.precision is None:
                raise _unresolvable(f"{section}.enabled", "the Trainer's precision (AutoContext.precision)")
            known = _FP16_PRECISIONS | _BF16_PRECISIONS | _FP32_PRECISIONS
            if context.precision not in known:
                raise DeepSpeedConfigError(
                    f'cannot resolve "{section}.enabled": "auto" from Trainer precision '
                    f"{context.precision!r}; expected one of {sorted(map(str, known))}"
                )
            config[section]["enabled"] = context.precision in family


def resolve_optimizer(config: dict, hparams: Mapping[str, Any]) -> None:
    params = (config.get("optimizer") or {}).get("params") or {}
    lookups = {"lr": _LR_NAMES, "weight_decay": _WEIGHT_DECAY_NAMES, "eps": _EPS_NAMES}
    for key, value in list(params.items()):
        if value == AUTO and key in lookups:
            found = _first_hparam(hparams, lookups[key])
            if found is None:
                raise _unresolvable(f"optimizer.params.{key}", _hparam_list(lookups[key]))
            params[key] = found
        elif key == "betas" and (value == AUTO or (isinstance(value, list) and AUTO in value)):
            found = _first_hparam(hparams, _BETAS_NAMES)
            if found is None:
                for first, second in _BETA_PAIRS:
                    if hparams.get(first) is not None and hparams.get(second) is not None:
                        found = [hparams[first], hparams[second]]
                        break
            if found is None:
                raise _unresolvable(
                    "optimizer.params.betas",
                    _hparam_list(_BETAS_NAMES) + " and the pairs " + ", ".join(f"{a!r}+{b!r}" for a, b in _BETA_PAIRS),
                )
            params[key] = list(found)
        elif value == AUTO:
            raise _unresolvable(
                f"optimizer.params.{key}", 'nothing: only lr, weight_decay, betas and eps can be "auto"'
            )


def _total_steps(context: AutoContext, path: str) -> int:
    total = context.estimated_stepping_batches
    if total is None or not math.isfinite(total):
        raise _unresolvable(
            path,
            "trainer.estimated_stepping_batches (AutoContext.estimated_stepping_batches), "
            f"which is {total!r}; set max_steps or max_epochs on the Trainer",
        )
    return int(total)


# Hugging Face's TrainingArguments.warmup_steps default, used when the LightningModule names no warm-up.
HF_DEFAULT_WARMUP_STEPS = 0
HF_DEFAULT = "Hugging Face's default"  # the label the startup table shows next to such a value


def _warmup_steps(hparams: Mapping[str, Any], context: AutoContext, path: str, defaults: dict[str, str]) -> int:
    """Hugging Face's resolution of ``warmup_num_steps: "auto"``: ``max(1, TrainingArguments.get_warmup_steps(n))``,
    where ``warmup_steps >= 1`` is a step count, ``0 <= warmup_steps < 1`` a fraction of the total steps (rounded
    up), and the ``max(1, ...)`` keeps DeepSpeed's schedulers, which refuse 0 warm-up steps, working. ``warmup_ratio``
    (the older HF name) is a fraction too. A LightningModule without any of these hyperparameters gets what Hugging
    Face gets without the argument: its default ``warmup_steps=0``, so 1 step (recorded in ``defaults``)."""
    found = _first_hparam(hparams, _WARMUP_STEP_NAMES)
    ratio = _first_hparam(hparams, _WARMUP_RATIO_NAMES) if found is None else None
    if found is None and ratio is None:
        steps = max(1, HF_DEFAULT_WARMUP_STEPS)
        defaults[path] = (
            f"TrainingArguments.warmup_steps={HF_DEFAULT_WARMUP_STEPS} -> max(1, "
            f"{HF_DEFAULT_WARMUP_STEPS}) = {steps} step: the LightningModule has no hyperparameter "
            + "/".join(repr(n) for n in _WARMUP_STEP_NAMES + _WARMUP_RATIO_NAMES)
        )
        return steps
    value = found if found is not None else ratio
    name = "warmup steps" if found is not None else "warmup_ratio"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise DeepSpeedConfigError(
            f'cannot resolve "{path}": "auto" from the {name} hyperparameter {value!r}: it must be a number >= 0'
        )
    if found is not None and value >= 1:
        steps = int(value)
    else:
        if ratio is not None and value > 1:
            raise DeepSpeedConfigError(f'cannot resolve "{path}": "auto": warmup_ratio={value!r} must be <= 1')
        steps = math.ceil(value * _total_steps(context, path)) if value else 0
    return max(1, steps)


def _resolve_scheduler(config: dict, context: AutoContext, defaults: dict[str, str]) -> None:
    params = (config.get("scheduler") or {}).get("params") or {}
    hparams = context.hyperparameters
    optimizer_lr = ((config.get("optimizer") or {}).get("params") or {}).get("lr")
    for key, value in list(params.items()):
        if value != AUTO:
            continue
        path = f"scheduler.params.{key}"
        if key in ("warmup_max_lr", "cycle_max_lr"):
            found = optimizer_lr if optimizer_lr not in (None, AUTO) else _first_hparam(hparams, _LR_NAMES)
            if found is None:
                raise _unresolvable(path, "optimizer.params.lr and " + _hparam_list(_LR_NAMES))
            params[key] = found
        elif key == "warmup_min_lr":
            params[key] = 0.0  # Hugging Face's choice: warm up from zero (no TrainingArguments field feeds it)
            defaults[path] = "warm up from 0 (Hugging Face fills 0: no TrainingArguments field feeds it)"
        elif key == "total_num_steps":
            params[key] = _total_steps(context, path)
        elif key == "warmup_num_steps":
            params[key] = _warmup_steps(hparams, context, path, defaults)
        else:
            raise _unresolvable(
                path,
                "nothing: only warmup_min_lr, warmup_max_lr, cycle_max_lr, warmup_num_steps "
                'and total_num_steps can be "auto"',
            )


def _resolve_zero(config: dict, context: AutoContext) -> None:
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    hidden = context.hidden_size
    # Hugging Face's rules: buckets sized to one hidden x hidden matrix, persistence for vectors of ~10 x hidden.
    rules = {
        "reduce_bucket_size": lambda h: h * h,
        "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
        "stage3_param_persistence_threshold": lambda h: 10 * h,
    }
    for key, value in list(zero.items()):
        if value != AUTO:
            continue
        if key == "stage3_gather_16bit_weights_on_model_save":
            # accelerate fills it from its zero3_save_16bit_model flag, which is false unless the user turns it on
            zero[key] = False
            continue
        if key not in rules:
            raise _unresolvable(
                f"zero_optimization.{key}",
                "nothing: only reduce_bucket_size, "
                "stage3_prefetch_bucket_size, stage3_param_persistence_threshold and "
                'stage3_gather_16bit_weights_on_model_save can be "auto"',
            )
        if hidden is None:
            raise _unresolvable(
                f"zero_optimization.{key}",
                "the model's hidden size (AutoContext.hidden_size; "
                "infer_hidden_size checks model/model.config attributes "
                + "/".join(_HIDDEN_SIZE_NAMES)
                + " and the hyperparameters)",
            )
        zero[key] = rules[key](hidden)


def resolve_auto(config: dict, context: AutoContext) -> dict:
    """Return a copy of ``config`` with every ``"auto"`` replaced, and the batch sizes completed and checked.

    Sources: batch sizes from ``context.micro_batch_size``/``accumulate_grad_batches``/``world_size`` (DeepSpeed's
    arithmetic fills the rest; explicit config values must agree with them); ``gradient_clipping`` from
    ``gradient_clip_val`` (``None`` -> 0.0, no clipping); ``fp16/bf16.enabled`` from ``precision``; optimizer
    ``lr``/``weight_decay``/``betas``/``eps`` from ``hyperparameters``; scheduler warm-up/total steps from
    ``hyperparameters`` and ``estimated_stepping_batches`` (Hugging Face's defaults where the module has no warm-up
    hyperparameter); ZeRO bucket sizes from ``hidden_size``. :func:`resolve_auto_with_defaults` also says which
    values are such defaults.

    Raises:
        DeepSpeedConfigError: an ``"auto"`` that cannot be resolved (naming the key and where it looked), or batch
            sizes that contradict each other or the Trainer/DataLoader.
    """
    return resolve_auto_with_defaults(config, context)[0]


def resolve_auto_with_defaults(config: dict, context: AutoContext) -> tuple[dict, dict[str, str]]:
    """:func:`resolve_auto`, and ``{dotted key: why}`` for each ``"auto"`` filled with Hugging Face's default
    rather than from something Lightning knows (the startup table shows these)."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    if not isinstance(context, AutoContext):
        raise TypeError(f"context must be an AutoContext, got {type(context).__name__}")
    config = copy.deepcopy(config)
    defaults: dict[str, str] = {}
    _resolve_batches(config, context)
    if config.get("gradient_clipping") == AUTO:
        config["gradient_clipping"] = float(context.gradient_clip_val or 0.0)
    elif (
        config.get("gradient_clipping") is not None
        and context.gradient_clip_val is not None
        and float(config["gradient_clipping"]) != float(context.gradient_clip_val)
    ):
        raise DeepSpeedConfigError(
            f"gradient_clipping={config['gradient_clipping']} in the DeepSpeed config does not match the Trainer's "
            f'gradient_clip_val={context.gradient_clip_val}: remove one of them or set the config value to "auto"'
        )
    _resolve_precision(config, context)
    resolve_optimizer(config, context.hyperparameters)
    _resolve_scheduler(config, context, defaults)
    _resolve_zero(config, context)
    return config, defaults


def infer_hidden_size(model: Any, hyperparameters: Optional[Mapping[str, Any]] = None) -> Optional[int]:
    """The model's hidden size for the bucket rules, or ``None``: checks ``model`` and ``model.config`` attributes
    ``hidden_size``/``d_model``/``n_embd``/``hidden_dim``/``embed_dim``/``dim``, then the same names in
    ``hyperparameters``. Sub-modules are searched one level deep (a LightningModule usually wraps the network)."""
    candidates = [model, getattr(model, "config", None)]
    children = getattr(model, "children", None)
    if callable(children):
        for child in children():
            candidates.extend([child, getattr(child, "config", None)])
    for obj in candidates:
        if obj is None:
            continue
        for name in _HIDDEN_SIZE_NAMES:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    value = _first_hparam(hyperparameters or {}, _HIDDEN_SIZE_NAMES)
    return int(value) if isinstance(value, int) and value > 0 else None
