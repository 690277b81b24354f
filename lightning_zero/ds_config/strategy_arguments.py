"""``DeepSpeedStrategy``'s constructor arguments that have no ZeroStrategy argument of the same name, as ds_config keys.

Lightning's ``DeepSpeedStrategy`` turns these arguments into a ds_config when it is given none
(``_create_default_config``). ZeroStrategy takes the same arguments, with the same names and types, and turns each
one a user *passes* into the same key, merged over the config (``config=`` or ``PL_DEEPSPEED_CONFIG_PATH``): the
ds_config translator then honours, warns about or refuses it exactly as it would the key written in a config, so a
switching user's call and the equivalent config cannot mean two things. Arguments left at ``None`` write nothing:
the config's value, else DeepSpeed's default, applies.

Three arguments are no config key: ``zero_optimization=False`` is ``stage=0``; ``remote_device`` is where
DeepSpeed's ``zero.Init`` keeps ZeRO-3 partitions, checked against the parameter offload once the stage is known
(:meth:`DeepSpeedArguments.check_remote_device`); ``logging_level`` sets the level of the ``lightning_zero``
loggers, as DeepSpeedStrategy sets the ``deepspeed`` logger's. ``docs/deepspeed_arguments.md`` lists all 46
arguments of ``DeepSpeedStrategy`` and what each becomes.
"""

from __future__ import annotations

import copy
import logging
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Iterator, Optional, Union

from lightning_zero.distributed.config import OFFLOAD_DEVICES
from lightning_zero.ds_config.loading import DeepSpeedConfigError, DeepSpeedConfigWarning

# DeepSpeedStrategy's arguments that each write the zero_optimization (activation_checkpointing, aio) key of their
# own name (values as given).
ZERO_ARGUMENTS = (
    "contiguous_gradients",
    "overlap_comm",
    "allgather_partitions",
    "reduce_scatter",
    "allgather_bucket_size",
    "reduce_bucket_size",
)
ACTIVATION_ARGUMENTS = (
    "partition_activations",
    "contiguous_memory_optimization",
    "synchronize_checkpoint_boundary",
    "cpu_checkpointing",
)
AIO_ARGUMENTS = ("block_size", "queue_depth", "single_submit", "overlap_events", "thread_count")
# argument -> (offload section, key in it)
OFFLOAD_KEYS = {
    "offload_optimizer_device": ("offload_optimizer", "device"),
    "optimizer_buffer_count": ("offload_optimizer", "buffer_count"),
    "offload_params_device": ("offload_param", "device"),
    "params_buffer_count": ("offload_param", "buffer_count"),
    "params_buffer_size": ("offload_param", "buffer_size"),
}
_SWITCHES = {"offload_optimizer": "offload_optimizer", "offload_param": "offload_parameters"}
_BOOLS = (
    "zero_optimization",
    "offload_optimizer",
    "offload_parameters",
    "zero_allow_untested_optimizer",
    "contiguous_gradients",
    "overlap_comm",
    "allgather_partitions",
    "reduce_scatter",
    "single_submit",
    "overlap_events",
    *ACTIVATION_ARGUMENTS,
)
_COUNTS = (
    "optimizer_buffer_count",
    "params_buffer_count",
    "params_buffer_size",
    "allgather_bucket_size",
    "reduce_bucket_size",
    "block_size",
    "queue_depth",
    "thread_count",
)


@dataclass(frozen=True)
class DeepSpeedArguments:
    """The DeepSpeedStrategy-only constructor arguments a ZeroStrategy was given (``None``: not given).

    ``offload_optimizer`` is here only as DeepSpeedStrategy's bool; ZeroStrategy's own device-name form
    (``offload_optimizer="cpu"``) stays a ZeroStrategy argument. ``cpu_checkpointing`` is here only when given
    without ``activation_checkpointing``: then it is DeepSpeedStrategy's ``activation_checkpointing`` key, whose
    section turns checkpointing of the repeated blocks on, as the same config would. Bucket sizes may be floats
    written as DeepSpeed's docs write them (``5e8``) when they are whole numbers.
    """

    zero_optimization: Optional[bool] = None
    remote_device: Optional[str] = None
    offload_optimizer: Optional[bool] = None
    offload_parameters: Optional[bool] = None
    offload_params_device: Optional[str] = None
    params_buffer_count: Optional[int] = None
    params_buffer_size: Optional[int] = None
    offload_optimizer_device: Optional[str] = None
    optimizer_buffer_count: Optional[int] = None
    block_size: Optional[int] = None
    queue_depth: Optional[int] = None
    single_submit: Optional[bool] = None
    overlap_events: Optional[bool] = None
    thread_count: Optional[int] = None
    contiguous_gradients: Optional[bool] = None
    overlap_comm: Optional[bool] = None
    allgather_partitions: Optional[bool] = None
    reduce_scatter: Optional[bool] = None
    allgather_bucket_size: Optional[Union[int, float]] = None
    reduce_bucket_size: Optional[Union[int, float]] = None
    zero_allow_untested_optimizer: Optional[bool] = None
    logging_batch_size_per_gpu: Optional[Union[str, int]] = None
    logging_level: Optional[int] = None
    partition_activations: Optional[bool] = None
    contiguous_memory_optimization: Optional[bool] = None
    synchronize_checkpoint_boundary: Optional[bool] = None
    cpu_checkpointing: Optional[bool] = None  # only when no activation_checkpointing argument is given: see below

    def __post_init__(self) -> None:
        for name in _BOOLS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False (as in DeepSpeedStrategy), got {value!r}")
        for name in _COUNTS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
                raise ValueError(f"{name} must be a positive whole number, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("remote_device", "offload_params_device", "offload_optimizer_device"):
            value = getattr(self, name)
            if value is not None and value not in OFFLOAD_DEVICES:
                raise ValueError(f"{name} must be one of {OFFLOAD_DEVICES} (as in DeepSpeedStrategy), got {value!r}")
        batch = self.logging_batch_size_per_gpu
        if (
            batch is not None
            and batch != "auto"
            and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1)
        ):
            raise ValueError(f'logging_batch_size_per_gpu must be "auto" or a positive int, got {batch!r}')
        level = self.logging_level
        if level is not None and (isinstance(level, bool) or not isinstance(level, int) or level < 0):
            raise ValueError(f"logging_level must be a logging level such as logging.WARN (an int), got {level!r}")
        if self.zero_optimization is False and (self.offload_optimizer or self.offload_parameters):
            raise ValueError(
                "zero_optimization=False turns ZeRO off, so offload_optimizer/offload_parameters=True "
                "cannot apply: drop one"
            )

    def given(self) -> dict:
        """The arguments a user passed, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def stage_over(self, stage: Optional[int]) -> Optional[int]:
        """The explicit ``stage``, or ``0`` when ``zero_optimization=False`` (DeepSpeedStrategy then writes no
        ``zero_optimization`` section: DeepSpeed runs stage 0)."""
        if self.zero_optimization is not False:
            return stage
        if stage not in (None, 0):
            raise ValueError(f"zero_optimization=False turns ZeRO off, but stage={stage} asks for it: drop one")
        return 0

    def config_overrides(
        self, base: Optional[dict], stage: Optional[int] = None, nvme_path: Optional[str] = None
    ) -> tuple[dict, dict]:
        """``(overrides, aliases)``: the ds_config keys the given arguments write, to merge over ``base`` (the
        loaded config, ``None`` without one), and each written dotted key -> the argument that wrote it, for
        messages. The explicit ``stage`` goes with them, so the translator reads each key at the stage that runs
        (an ``offload_param`` only applies at 3); without a config, as DeepSpeedStrategy's, the stage is 2 unless
        given. ``nvme_path`` (ZeroStrategy's argument too) goes into each offload section they write, as
        DeepSpeedStrategy writes it there."""
        overrides: dict = {}
        aliases: dict = {}

        def put(path: str, value: Any, argument: str) -> None:
            *parents, leaf = path.split(".")
            node = overrides
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
            aliases[path] = f"{argument}={value!r}"

        for name in ZERO_ARGUMENTS:
            if getattr(self, name) is not None:
                if self.zero_optimization is False:
                    _no_effect(
                        name,
                        "zero_optimization=False turns ZeRO off (DeepSpeedStrategy then writes no "
                        "zero_optimization section)",
                    )
                else:
                    put(f"zero_optimization.{name}", getattr(self, name), name)
        self._offload_overrides(base or {}, put, nvme_path)
        for name in ACTIVATION_ARGUMENTS:
            if getattr(self, name) is not None:
                put(f"activation_checkpointing.{name}", getattr(self, name), name)
        for name in AIO_ARGUMENTS:
            if getattr(self, name) is not None:
                put(f"aio.{name}", getattr(self, name), name)
        if self.zero_allow_untested_optimizer is not None:
            put("zero_allow_untested_optimizer", self.zero_allow_untested_optimizer, "zero_allow_untested_optimizer")
        if self.logging_batch_size_per_gpu not in (None, "auto"):
            put("train_micro_batch_size_per_gpu", self.logging_batch_size_per_gpu, "logging_batch_size_per_gpu")
        if overrides and (stage is not None or base is None):
            written = ((base or {}).get("zero_optimization") or {}).get("stage")
            if stage is not None and written not in (None, stage) and isinstance(written, int):
                warnings.warn(
                    f"explicit ZeroStrategy arguments win over the DeepSpeed config: stage={stage} over the "
                    f"config's {written}. DeepSpeedStrategy would have used the config's values; drop the "
                    "argument to follow the config",
                    DeepSpeedConfigWarning,
                    stacklevel=4,
                )
            overrides.setdefault("zero_optimization", {})["stage"] = stage if stage is not None else 2
        return overrides, aliases

    def _offload_overrides(self, base: dict, put, nvme_path: Optional[str]) -> None:
        """``offload_optimizer``/``offload_parameters=True`` write their section (device from the ``*_device``
        argument, else the config's, else ``"cpu"``); the device and buffer arguments apply to a section the
        switch or the config opened, and have no effect otherwise, as in DeepSpeedStrategy (warned)."""
        base_zero = base.get("zero_optimization") if isinstance(base.get("zero_optimization"), dict) else {}
        for section, switch in _SWITCHES.items():
            device_argument = "offload_optimizer_device" if section == "offload_optimizer" else "offload_params_device"
            knobs = {argument: key for argument, (sec, key) in OFFLOAD_KEYS.items() if sec == section}
            opened = getattr(self, switch) is True
            in_base = isinstance(base_zero.get(section), dict)
            if opened and not in_base and getattr(self, device_argument) is None:
                put(f"zero_optimization.{section}.device", "cpu", switch)
            if (opened or in_base) and nvme_path is not None:
                put(f"zero_optimization.{section}.nvme_path", str(nvme_path), "nvme_path")
            for argument, key in knobs.items():
                value = getattr(self, argument)
                if value is None:
                    continue
                if opened or in_base:
                    put(f"zero_optimization.{section}.{key}", value, argument)
                else:
                    _no_effect(
                        argument,
                        f"nothing is offloaded there: pass {switch}=True (or write "
                        f"zero_optimization.{section} in the config)",
                    )

    def check_remote_device(self, stage: int, offload_params: Optional[str]) -> None:
        """``remote_device`` once the stage and the parameter offload are known, as DeepSpeed's ``zero.Init`` reads
        it: ignored below stage 3 (warned); at stage 3 the config's ``offload_param.device`` wins over it, and on
        its own it keeps the partitions off the accelerator, which is ``offload_parameters=True`` here."""
        remote = self.remote_device
        if remote in (None, "none"):
            return
        if stage < 3:
            _no_effect("remote_device", f"DeepSpeed's zero.Init, where it applies, is off at stage {stage}")
            return
        if offload_params in (None, "none"):
            raise ValueError(
                f"remote_device={remote!r} without parameter offload keeps ZeRO-3's parameter "
                "partitions in that memory under DeepSpeed; ZeroStrategy does it with "
                f"offload_parameters=True, offload_params_device={remote!r} (and the optimizer "
                "offloaded too): pass those instead"
            )
        if remote != offload_params:
            if offload_params == "nvme":  # DeepSpeed's zero.Init asserts on this pair
                raise ValueError(
                    f"remote_device={remote!r} contradicts the parameter offload to 'nvme' (DeepSpeed "
                    "refuses the pair too): drop remote_device or make it 'nvme'"
                )
            _no_effect(
                "remote_device",
                f"the parameters are offloaded to {offload_params!r}, which wins, as in DeepSpeed's zero.Init",
            )

    def apply_logging_level(self) -> None:
        """Set the ``lightning_zero`` loggers' level, as DeepSpeedStrategy sets the ``deepspeed`` logger's."""
        if self.logging_level is not None:
            logging.getLogger("lightning_zero").setLevel(self.logging_level)


DEEPSPEED_ARGUMENT_NAMES = tuple(f.name for f in fields(DeepSpeedArguments))


def merge_overrides(config: dict, overrides: dict) -> dict:
    """``config`` with ``overrides`` merged in, section by section (a new dict; the overrides win)."""
    merged = copy.deepcopy(config)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


@contextmanager
def naming_arguments(aliases: dict) -> Iterator[None]:
    """Messages about config keys an argument wrote (warnings, config errors) name the argument beside the key."""
    if not aliases:
        yield
        return

    def named(text: str) -> str:
        for path in sorted(aliases, key=len, reverse=True):
            text = text.replace(path, f"{path} (from the argument {aliases[path]})", 1) if path in text else text
        return text

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except (DeepSpeedConfigError, ValueError, TypeError) as error:
            raise type(error)(named(str(error))) from error
    for warning in caught:
        warnings.warn_explicit(named(str(warning.message)), warning.category, warning.filename, warning.lineno)


def _no_effect(argument: str, why: str) -> None:
    warnings.warn(f"{argument} has no effect: {why}; it is ignored", DeepSpeedConfigWarning, stacklevel=4)
