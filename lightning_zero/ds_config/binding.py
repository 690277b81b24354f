"""What ``ZeroStrategy(config=...)`` does with a DeepSpeed ``ds_config``: one :class:`DeepSpeedConfigBinding`.

At construction the config is loaded and translated (errors before any process group); its strategy arguments are
merged under the explicit ones (the ``*_over_config`` functions). At setup, when the Trainer, DataLoader and
LightningModule are known, every ``"auto"`` is resolved (:meth:`DeepSpeedConfigBinding.resolve`), the config is
translated again, and the Trainer adapter applies or checks its Trainer-level settings
(:mod:`lightning_zero.strategies.ds_config_fit`):

===========================  =========================================================================================
config key                   what happens at setup
===========================  =========================================================================================
``fp16`` / ``bf16``          the Trainer left precision at ``32-true``: the config's precision is adopted
                             (``16-mixed``/``bf16-mixed``); otherwise the Trainer's precision must agree (error)
``gradient_clipping``        applied when the Trainer does not clip; must equal ``gradient_clip_val`` otherwise
``gradient_accumulation``    applied when the Trainer keeps ``accumulate_grad_batches=1``; must agree otherwise
``train_*batch_size``        DeepSpeed's arithmetic against the DataLoader's batch size and the data-parallel size
``steps_per_print``          applied as ``log_every_n_steps`` when the Trainer keeps its default (50)
``optimizer`` / ``scheduler``  built by the strategy; a ``configure_optimizers`` is then not called (warning)
``pipeline.stages``          ``pipeline_parallel_size`` (and accumulation steps as ``micro_batches``), at construction
===========================  =========================================================================================

The keys the config set (and the ``"auto"`` values resolved) are printed on rank 0 as one rich table
(``ZeroStrategy(verbose=True)``: every key, DeepSpeed defaults included); the full table is saved in every
checkpoint's ``zero.json``.

DeepSpeedStrategy conventions kept: without ``config=`` the file named by ``PL_DEEPSPEED_CONFIG_PATH`` is read
(:func:`bind_ds_config`), and ``strategy.config`` is the effective config as a dict (:func:`effective_ds_config`).
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Optional

from lightning_zero.distributed.activation_checkpointing import activation_checkpoint_config
from lightning_zero.ds_config import (
    AutoContext,
    DeepSpeedConfigError,
    DeepSpeedConfigWarning,
    DeepSpeedTranslation,
    effective_config_dict,
    effective_config_table,
    load_ds_config,
    resolve_auto_with_defaults,
    translate_ds_config,
)
from lightning_zero.ds_config.dry_build import dry_build
from lightning_zero.ds_config.strategy_arguments import DeepSpeedArguments, merge_overrides, naming_arguments
from lightning_zero.offload.nvme_config import NVME_ARGUMENTS

UNIT_KNOBS = ("unit_bytes", "param_persistence_threshold", "prefetch_bytes")  # lightning_zero.distributed.units
LOSS_SCALE_KEYS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
)
# Strategy arguments a config may set; every key a translation produces must be one of these or refused.
CONFIG_STRATEGY_KEYS = (
    "stage",
    "offload",
    "pin_memory",
    "reshard_after_forward",
    "communication_data_type",
    "pipeline_parallel_size",
    "micro_batches",
    "hybrid_shard_size",
    *LOSS_SCALE_KEYS,
    "offload_optimizer",
    "offload_params",
    *NVME_ARGUMENTS,
    *UNIT_KNOBS,
)
# Where Lightning's DeepSpeedStrategy looks for a config file when it is given none; ZeroStrategy does the same.
DEEPSPEED_ENV_VAR = "PL_DEEPSPEED_CONFIG_PATH"


def bind_ds_config(
    config: Any,
    strict: bool,
    arguments: Optional[DeepSpeedArguments] = None,
    stage: Optional[int] = None,
    nvme_path: Any = None,
) -> Optional["DeepSpeedConfigBinding"]:
    """The binding for ``ZeroStrategy(config=...)``; without ``config``, the file ``PL_DEEPSPEED_CONFIG_PATH`` names
    (as ``DeepSpeedStrategy`` reads it), or ``None`` when that is unset too and ``arguments`` write no key. An
    explicit ``config`` wins over the variable (its ``origin`` then names it, for the caller to say where the config
    came from). The variable set to an empty string or a missing file is an error, not a silent fallback.
    ``arguments`` (DeepSpeedStrategy's own constructor arguments) are merged over the config as the keys they stand
    for (:mod:`lightning_zero.ds_config.strategy_arguments`), with the explicit ``stage`` they are read at
    and ``nvme_path``."""
    origin = None
    if config is None:
        path = os.environ.get(DEEPSPEED_ENV_VAR)
        if path is not None and (not path or not os.path.isfile(path)):
            raise DeepSpeedConfigError(
                f"{DEEPSPEED_ENV_VAR}={path!r} does not name a DeepSpeed config file: point it "
                "at one, or unset it (ZeroStrategy reads it when no config= is given)"
            )
        config, origin = path, (f"{DEEPSPEED_ENV_VAR}={path}" if path is not None else None)
    base = None if config is None else load_ds_config(config)
    overrides, aliases = arguments.config_overrides(base, stage, nvme_path) if arguments is not None else ({}, {})
    if config is None and not overrides:
        return None
    if overrides:
        config = merge_overrides(base if base is not None else {}, overrides)
    with naming_arguments(aliases):
        binding = DeepSpeedConfigBinding(config, strict, origin=origin)
    binding.argument_aliases = aliases
    return binding


class DeepSpeedConfigBinding:
    """A ds_config bound to one ZeroStrategy.

    Args:
        source: a dict, a path to a ``.json``/``.yaml`` file, or a JSON string (see :func:`load_ds_config`).
        strict: unknown keys and unsupported features are errors (``False``: warnings).
    """

    def __init__(self, source: Any, strict: bool = True, origin: Optional[str] = None) -> None:
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, got {strict!r}")
        self.raw = load_ds_config(source)
        self.strict = strict
        self.origin = origin  # where the config came from when not from config= (named in the startup report)
        self.argument_aliases: dict = {}  # dotted key -> the DeepSpeedStrategy argument that wrote it (messages)
        self.overridden: dict = {}  # strategy argument -> (explicit value, the config's), for the startup table
        self.translation: DeepSpeedTranslation = translate_ds_config(self.raw, strict=strict)
        self.auto_paths = tuple(self.translation.unresolved_auto)  # shown as "auto" -> value once resolved
        self.auto_defaults: dict[str, str] = {}  # those resolved to Hugging Face's default, and why (resolve)
        self._refuse_unwired(self.translation)
        dry_build(self.translation)  # an unknown optimizer/scheduler or a bad param fails here, not after launch

    @staticmethod
    def _refuse_unwired(translation: DeepSpeedTranslation) -> None:
        unknown = sorted(set(translation.strategy_kwargs) - set(CONFIG_STRATEGY_KEYS))
        if unknown:
            raise DeepSpeedConfigError(f"the DeepSpeed config sets {unknown}, which ZeroStrategy cannot apply yet")

    def strategy_kwargs(self) -> dict:
        """The ZeroStrategy arguments the config determines (explicit arguments are merged over these)."""
        return {k: v for k, v in self.translation.strategy_kwargs.items() if k in CONFIG_STRATEGY_KEYS}

    def loss_scale_kwargs(self) -> dict:
        return {k: v for k, v in self.strategy_kwargs().items() if k in LOSS_SCALE_KEYS}

    @property
    def precision(self) -> Optional[str]:
        """``"16-mixed"``/``"bf16-mixed"``/``"32-true"`` as the config asks, or ``None`` (no precision section)."""
        return self.translation.precision

    # ------------------------------------------------------------------ setup
    def resolve(self, context: AutoContext) -> DeepSpeedTranslation:
        """Resolve every ``"auto"`` from ``context`` (what the Trainer, DataLoader and LightningModule know) and make
        the result the binding's translation. Strategy settings were chosen at construction, before the engines:
        one an ``"auto"`` would now change is refused."""
        with naming_arguments(self.argument_aliases):
            resolved, defaults = resolve_auto_with_defaults(self.raw, context)
            translation = translate_ds_config(resolved, strict=self.strict)
        self._refuse_unwired(translation)
        for name in UNIT_KNOBS:  # "auto" bucket sizes were not mapped at construction, and are not now (see there)
            if name not in self.translation.strategy_kwargs:
                translation.strategy_kwargs.pop(name, None)
        changed = {
            k: (self.translation.strategy_kwargs.get(k), v)
            for k, v in translation.strategy_kwargs.items()
            if k in CONFIG_STRATEGY_KEYS and self.translation.strategy_kwargs.get(k) != v
        }
        if changed:
            raise DeepSpeedConfigError(
                f'strategy settings may not be "auto" (resolved at setup, after the engines were chosen): {changed}'
            )
        self.translation, self.auto_defaults = translation, defaults
        return translation

    def report(self) -> dict:
        """JSON record of the effective configuration (saved in checkpoints)."""
        return effective_config_dict(self.translation, self.auto_paths, self.auto_defaults)

    def print_table(self, verbose: bool = False) -> None:
        """Print the keys the config set and the ``"auto"`` values resolved (``verbose``: every effective key)."""
        from rich.console import Console

        caption = f"read from {self.origin}" if self.origin else None
        if self.overridden:
            said = ", ".join(
                f"{name}={value!r} (config: {config!r})" for name, (value, config) in self.overridden.items()
            )
            caption = (caption + "; " if caption else "") + f"explicit arguments win: {said}"
        Console().print(
            effective_config_table(
                self.translation,
                verbose=verbose,
                auto_paths=self.auto_paths,
                caption=caption,
                auto_defaults=self.auto_defaults,
            )
        )


def precision_from_config(config_precision: Optional[str], trainer_precision: str) -> Optional[str]:
    """The precision flag to adopt (``None``: keep the Trainer's); error when the two disagree.

    The Trainer's ``32-true`` is its default, so a config asking for fp16/bf16 wins over it. On CPU Lightning turns
    ``16-mixed`` into ``bf16-mixed`` before the strategy sees it, so fp16 there needs ``precision="16-true"``.
    """
    if config_precision is None or config_precision == trainer_precision:
        return None
    if trainer_precision == "32-true":
        return config_precision
    family = {"16-mixed": ("16-mixed", "16-true"), "bf16-mixed": ("bf16-mixed", "bf16-true"), "32-true": ()}
    if trainer_precision in family.get(config_precision, ()):
        return None
    raise DeepSpeedConfigError(
        f"the DeepSpeed config asks for {config_precision!r} (its fp16/bf16 sections) but the Trainer runs "
        f"precision={trainer_precision!r}: make them agree (set Trainer(precision={config_precision!r}), or leave "
        "the Trainer's precision at its default and let the config decide, or change the config)"
    )


class ReadOnlyConfig(dict):
    """A dict that refuses changes: ``strategy.config`` reports the configuration in effect, so writing into it
    would change nothing; the error says so instead of the write being silently lost. ``copy.deepcopy(config)``
    and ``config.copy()`` give ordinary, writable dicts."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "strategy.config is a read-only report of the DeepSpeed config in effect; changing it would "
            "change nothing. Pass the changed config as ZeroStrategy(config=...) instead"
        )

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _refuse

    def copy(self) -> dict:
        return copy.deepcopy(self)

    def __deepcopy__(self, memo: dict) -> dict:
        return {key: copy.deepcopy(value, memo) for key, value in self.items()}

    def __reduce__(self):
        return dict, (dict(self.copy()),)


class _ReadOnlyList(list):
    """A list inside :class:`ReadOnlyConfig` (``betas``...): equal to the plain list, but refuses changes."""

    _refuse = ReadOnlyConfig._refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = append = extend = insert = pop = remove = clear = sort = (
        reverse
    ) = _refuse

    def copy(self) -> list:
        return copy.deepcopy(self)

    def __deepcopy__(self, memo: dict) -> list:
        return [copy.deepcopy(item, memo) for item in self]

    def __reduce__(self):
        return list, (self.copy(),)


def _read_only(value: Any) -> Any:
    if isinstance(value, dict):
        return ReadOnlyConfig({key: _read_only(item) for key, item in value.items()})
    if isinstance(value, list):
        return _ReadOnlyList(_read_only(item) for item in value)
    return value


def effective_ds_config(
    binding: Optional[DeepSpeedConfigBinding],
    zero_config: Any,
    *,
    communication_data_type: Optional[str],
    precision: str,
    accumulate_grad_batches: Optional[int] = None,
    gradient_clip_val: Optional[float] = None,
) -> dict:
    """``strategy.config``: the DeepSpeed config in effect, as a (read-only) dict, like ``DeepSpeedStrategy.config``.

    With a ds_config (``binding``) it is the translated config (DeepSpeed's defaults filled in, ``"auto"`` values
    resolved once setup ran), with the strategy's settings (``zero_config``, ``communication_data_type``) written over
    it; without one it holds what those settings mean in DeepSpeed's terms. Both then carry what is known of the run:
    the ``precision`` flag (``""``: not known yet), and once attached to a Trainer its accumulation and norm clipping
    (``gradient_clip_val``: ``None`` when the Trainer clips by value, which DeepSpeed cannot express).
    """
    config = copy.deepcopy(binding.translation.effective) if binding is not None else {}
    stage = zero_config.stage
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = stage
    devices = {"offload_optimizer": zero_config.offload_optimizer, "offload_param": zero_config.offload_params}
    # the two sections as the strategy applies them; offload_param exists only at stage 3
    for section in ("offload_optimizer", "offload_param") if stage == 3 else ("offload_optimizer",):
        device = devices[section]
        if device != "none" or zero.get(section) is not None:
            zero[section] = {**(zero.get(section) or {}), "device": device}
    if communication_data_type is not None:
        config["communication_data_type"] = communication_data_type
    if precision:
        for section, prefix in (("fp16", "16-"), ("bf16", "bf16-")):
            if precision.startswith(prefix) or section in config:
                config.setdefault(section, {})["enabled"] = precision.startswith(prefix)
    if accumulate_grad_batches is not None:
        config["gradient_accumulation_steps"] = accumulate_grad_batches
    if gradient_clip_val is not None:
        config["gradient_clipping"] = float(gradient_clip_val)
    return _read_only(config)


def config_reduce_bucket_size(binding: Optional[DeepSpeedConfigBinding]) -> Optional[int]:
    """``zero_optimization.reduce_bucket_size`` when the ds_config wrote it (resolved if it was ``"auto"``), for the
    DDP of stages 0-1 (:func:`lightning_zero.distributed.ddp.ddp_kwargs_for`).

    A DeepSpeed default is not carried over: DDP's own default bucket (25 MiB) is tuned for DDP, DeepSpeed's
    (5e8 elements) for its own reducer.
    """
    if binding is None:
        return None
    written = binding.raw.get("zero_optimization")
    if not isinstance(written, dict) or "reduce_bucket_size" not in written:
        return None
    value = binding.translation.effective.get("zero_optimization", {}).get("reduce_bucket_size")
    return value if isinstance(value, int) else None


def activation_checkpointing_over_config(
    binding, activation_checkpointing, cpu_checkpointing, activation_checkpointing_policy
):
    """The :class:`~lightning_zero.distributed.activation_checkpointing.ActivationCheckpointConfig` (or ``None``)
    from ZeroStrategy's three arguments over the ds_config's ``activation_checkpointing`` section (explicit
    arguments win; the section's presence turns checkpointing on)."""
    section = binding.translation.activation_checkpointing if binding is not None else None
    return activation_checkpoint_config(
        activation_checkpointing, cpu_checkpointing, activation_checkpointing_policy, ds_section=section
    )


def arguments_over_config(
    binding,
    stage,
    offload,
    pin_memory,
    reshard_after_forward,
    communication_data_type,
    pipeline_parallel_size,
    micro_batches,
) -> tuple:
    """ZeroStrategy's arguments with the ds_config filling those left at ``None`` (explicit arguments win), in the
    order given. Stage defaults to 2; the config's pipeline (and its micro-batches) applies only with > 1 stages."""
    from_config = binding.strategy_kwargs() if binding is not None else {}
    _note_overrides(
        binding,
        from_config,
        stage=stage,
        pin_memory=pin_memory,
        reshard_after_forward=reshard_after_forward,
        communication_data_type=communication_data_type,
    )
    stage = stage if stage is not None else from_config.get("stage", 2)
    offload = offload if offload is not None else from_config.get("offload")
    pin_memory = pin_memory if pin_memory is not None else from_config.get("pin_memory")
    if reshard_after_forward is None:
        reshard_after_forward = from_config.get("reshard_after_forward")
    if communication_data_type is None:
        communication_data_type = from_config.get("communication_data_type")
    if pipeline_parallel_size is None and from_config.get("pipeline_parallel_size", 1) > 1:
        pipeline_parallel_size = from_config["pipeline_parallel_size"]
        micro_batches = micro_batches if micro_batches is not None else from_config.get("micro_batches")
    return (
        stage,
        offload,
        pin_memory,
        reshard_after_forward,
        communication_data_type,
        pipeline_parallel_size,
        micro_batches,
    )


def _note_overrides(binding, from_config: dict, **explicit) -> None:
    """Warn about each explicit argument that overrides a different value the config wrote (explicit arguments win;
    DeepSpeedStrategy would have read the config alone), and keep them for the startup table's caption."""
    overridden = {
        name: (value, from_config[name])
        for name, value in explicit.items()
        if value is not None and name in from_config and from_config[name] != value
    }
    if binding is None or not overridden:
        return
    binding.overridden = overridden
    said = ", ".join(f"{name}={value!r} over the config's {config!r}" for name, (value, config) in overridden.items())
    warnings.warn(
        f"explicit ZeroStrategy arguments (or a registered name such as 'zero_stage_2') win over the "
        f"DeepSpeed config: {said}. DeepSpeedStrategy would have used the config's values; drop the "
        "argument (or use the name 'zero') to follow the config",
        DeepSpeedConfigWarning,
        stacklevel=4,
    )


def hybrid_shard_size_over_config(binding, hybrid_shard_size):
    """``hybrid_shard_size``, or the ds_config's ``zero_optimization.mics_shard_size`` when it is ``None``."""
    if hybrid_shard_size is not None or binding is None:
        return hybrid_shard_size
    return binding.strategy_kwargs().get("hybrid_shard_size")


def unit_knobs_over_config(binding, **explicit) -> dict:
    """``unit_bytes``, ``param_persistence_threshold`` and ``prefetch_bytes``, each from the ds_config's bucket keys
    (see ``_translate_units`` in :mod:`lightning_zero.ds_config.translate`) when left at ``None``."""
    from_config = binding.strategy_kwargs() if binding is not None else {}
    return {name: value if value is not None else from_config.get(name) for name, value in explicit.items()}
