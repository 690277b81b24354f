"""Validated NVMe offload settings (``nvme_path`` and DeepSpeed's swap knobs), and the one function that builds
them from constructor arguments: :func:`nvme_config_from_arguments` (shared by the Trainer and Fabric strategies).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_zero.offload.aio import AioSettings

# These knobs only drive parameter swapping (stage-3 offload_params="nvme"): ZeroConfig refuses them otherwise.
PARAM_ONLY_KNOBS = {"buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000}
AIO_SETTING_KEYS = ("block_size", "queue_depth", "thread_count", "single_submit", "overlap_events", "use_direct")


@dataclass(frozen=True)
class NvmeConfig:
    """Where and how optimizer states and (stage 3) parameters are swapped to disk.

    Args:
        nvme_path: an existing, writable directory on a fast local disk. Each run creates its own folder
            ``nvme_path/lz-swap-<unique>/rank<k>/`` and removes it at teardown (and on exceptions).
        buffer_count: sub-groups resident in host memory at once during the swapped step (at least 3: one being
            read ahead, one stepping, one being written back). Host memory for swapped states is bounded by
            ``buffer_count`` x the largest sub-group's state bytes. Parameter swapping uses as many staging
            buffers of ``buffer_size`` elements.
        sub_group_size: elements per sub-group: the optimizer step streams its parameters in groups of about this
            many elements (a larger parameter is a sub-group of its own).
        buffer_size: parameter swapping's staging buffers, in 4-byte elements (a unit's shards stream through
            them in pieces of this size).
        max_in_cpu: parameter elements (this rank's padded FSDP2 shards) kept in host memory between uses under
            parameter swapping, as DeepSpeed means it: units that fit stay resident and are not read again; the
            units in use are read whatever their size, and each optimizer step ends within the budget (see
            :mod:`lightning_zero.offload.param_swapper`).
        aio: the I/O engine's knobs (see :class:`~lightning_zero.offload.aio.AioSettings`).
    """

    nvme_path: str
    buffer_count: int = 4
    sub_group_size: int = 1_000_000_000
    buffer_size: int = PARAM_ONLY_KNOBS["buffer_size"]
    max_in_cpu: int = PARAM_ONLY_KNOBS["max_in_cpu"]
    aio: AioSettings = field(default_factory=AioSettings)

    def __post_init__(self) -> None:
        path = self.nvme_path
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise TypeError(f"nvme_path must be a directory path, got {self.nvme_path!r}")
        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isdir(path):
            raise ValueError(
                f"nvme_path={path!r} is not an existing directory: create it on a local fast disk "
                "(NVMe offload writes its swap files there)"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(
                f"nvme_path={path!r} is not writable by this process: NVMe offload writes its swap files there"
            )
        object.__setattr__(self, "nvme_path", path)
        for name in ("buffer_count", "sub_group_size", "buffer_size", "max_in_cpu"):
            value = getattr(self, name)
            least = 0 if name == "max_in_cpu" else 1  # keeping nothing resident is DeepSpeed's max_in_cpu: 0 too
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if self.buffer_count < 3:
            raise ValueError(f"buffer_count must be at least 3 (read ahead, step, write back), got {self.buffer_count}")
        if isinstance(self.aio, dict):
            object.__setattr__(self, "aio", aio_settings(self.aio))
        if not isinstance(self.aio, AioSettings):
            raise TypeError(f"aio must be a dict of {AIO_SETTING_KEYS} or an AioSettings, got {self.aio!r}")


def aio_settings(aio: Optional[dict]) -> AioSettings:
    """DeepSpeed's ``aio`` knobs as this engine's settings; an unknown key is refused, naming it."""
    if aio is None:
        return AioSettings()
    if not isinstance(aio, dict):
        raise TypeError(f"aio must be a dict with keys among {AIO_SETTING_KEYS}, got {aio!r}")
    unknown = sorted(set(aio) - set(AIO_SETTING_KEYS))
    if unknown:
        raise ValueError(f"aio has unknown keys {unknown}; this engine understands {AIO_SETTING_KEYS}")
    return AioSettings(**aio)


def nvme_config_from_arguments(
    nvme_path: Any = None,
    buffer_count: Optional[int] = None,
    sub_group_size: Optional[int] = None,
    buffer_size: Optional[int] = None,
    max_in_cpu: Optional[int] = None,
    aio: Optional[dict] = None,
) -> Optional[NvmeConfig]:
    """The strategy arguments as an :class:`NvmeConfig`; ``None`` when none of them is given.

    A knob given without ``nvme_path`` is refused (it would have no effect), so is ``nvme_path`` given while no
    offload goes to NVMe (checked by :class:`~lightning_zero.distributed.config.ZeroConfig`).
    """
    knobs = {
        "buffer_count": buffer_count,
        "sub_group_size": sub_group_size,
        "buffer_size": buffer_size,
        "max_in_cpu": max_in_cpu,
    }
    given = {k: v for k, v in knobs.items() if v is not None}
    if nvme_path is None:
        if given or aio is not None:
            names = sorted(given) + (["aio"] if aio is not None else [])
            raise ValueError(f"{', '.join(names)} only apply to NVMe offload, which needs nvme_path")
        return None
    return NvmeConfig(nvme_path=nvme_path, aio=aio_settings(aio), **given)


NVME_ARGUMENTS = ("nvme_path", "buffer_count", "sub_group_size", "buffer_size", "max_in_cpu", "aio")


def offload_arguments(
    from_config: dict,
    offload: Any = None,
    offload_optimizer: Any = None,
    offload_params: Any = None,
    nvme_path: Any = None,
    buffer_count: Optional[int] = None,
    sub_group_size: Optional[int] = None,
    buffer_size: Optional[int] = None,
    max_in_cpu: Optional[int] = None,
    aio: Optional[dict] = None,
) -> dict:
    """The strategy's offload arguments (``offload``, ``offload_optimizer``, ``offload_params`` and the
    :data:`NVME_ARGUMENTS`) over those a translated ds_config gives (``from_config``; explicit arguments win), as
    keyword arguments for :class:`~lightning_zero.distributed.config.ZeroConfig`: ``offload``, ``offload_optimizer``,
    ``offload_params`` and ``nvme`` (an :class:`NvmeConfig` or ``None``). Used by both strategies.

    An explicit shorthand ``offload`` replaces the config's precise pair and vice versa, so the two forms never
    meet silently.
    """
    nvme = {
        "nvme_path": nvme_path,
        "buffer_count": buffer_count,
        "sub_group_size": sub_group_size,
        "buffer_size": buffer_size,
        "max_in_cpu": max_in_cpu,
        "aio": aio,
    }
    explicit_precise = offload_optimizer is not None or offload_params is not None
    if offload is None and not explicit_precise:
        offload_optimizer = from_config.get("offload_optimizer")
        offload_params = from_config.get("offload_params")
        # a config with the precise pair also carries the shorthand (for reports): the pair is what it means
        offload = None if offload_optimizer is not None or offload_params is not None else from_config.get("offload")
    # The config's NVMe knobs follow its NVMe device: an explicit non-NVMe offload drops them with it.
    config_nvme = "nvme" in (from_config.get("offload_optimizer"), from_config.get("offload_params")) and (
        "nvme" in (offload_optimizer, offload_params, offload) or (offload is None and not explicit_precise)
    )
    merged = {
        name: nvme[name] if nvme[name] is not None else (from_config.get(name) if config_nvme else None)
        for name in NVME_ARGUMENTS
    }
    return {
        "offload": offload,
        "offload_optimizer": offload_optimizer,
        "offload_params": offload_params,
        "nvme": nvme_config_from_arguments(**merged),
    }


def config_params_offload_at_stage(offloads: dict, stage: int, explicit_offload_params: Any) -> dict:
    """``offloads`` (from :func:`offload_arguments`) once the stage is known: a ds_config's ``offload_param`` has no
    effect when an explicit ``stage`` below 3 overrides the config's stage 3, as DeepSpeed ignores ``offload_param``
    below stage 3 (and the translator does when the config itself says so); it is dropped with a warning. An
    explicit ``offload_params`` is left to :class:`~lightning_zero.distributed.config.ZeroConfig`, which refuses it."""
    if (
        not isinstance(stage, int)
        or stage >= 3
        or explicit_offload_params is not None
        or offloads.get("offload_params") in (None, "none")
    ):  # a bad stage is ZeroConfig's to refuse, naming it
        return offloads
    warnings.warn(
        f"the ds_config's zero_optimization.offload_param has no effect at stage {stage} (only stage 3 "
        "offloads parameters); it is ignored, as DeepSpeed does",
        UserWarning,
        stacklevel=3,
    )
    return {**offloads, "offload_params": "none"}
