"""The offload sections of a ds_config (``zero_optimization.offload_optimizer`` / ``offload_param``, NVMe swapping)
and its ``aio`` section -> ``ZeroStrategy``'s offload, NVMe and ``aio`` arguments; part of
:func:`lightning_zero.ds_config.translate.translate_ds_config`, split from it to keep each file readable.
"""

from __future__ import annotations

import warnings
from typing import Optional

from lightning_zero.ds_config import schema
from lightning_zero.ds_config.loading import DeepSpeedConfigError, DeepSpeedConfigWarning
from lightning_zero.ds_config.translate_checks import (
    Collector,
    check_flag,
    check_number,
    honoured,
    merge_section,
    no_effect,
    section_of,
)


def translate_offload(zero: dict, stage: int, out: Collector, kwargs: dict) -> dict:
    """DeepSpeed's two offload sections -> the strategy's ``offload_optimizer`` and ``offload_params`` (each
    honoured separately; ``offload`` also carries the shorthand, for reports)."""
    devices: dict[str, str] = {}
    pins: list[bool] = []
    effective: dict = {}
    for sub, keys in (
        ("offload_optimizer", schema.OFFLOAD_OPTIMIZER_KEYS),
        ("offload_param", schema.OFFLOAD_PARAM_KEYS),
    ):
        user = zero.get(sub)
        if user is None:
            continue
        if not isinstance(user, dict):
            raise DeepSpeedConfigError(f"zero_optimization.{sub} must be a JSON object, got {user!r}")
        merged = merge_section(user, keys, f"zero_optimization.{sub}", out)
        device = str(merged["device"]).lower()
        if device not in ("none", "cpu", "nvme"):
            raise DeepSpeedConfigError(
                f"zero_optimization.{sub}.device must be 'none', 'cpu' or 'nvme', got {merged['device']!r}"
            )
        merged["device"] = device
        pin = check_flag(f"zero_optimization.{sub}.pin_memory", merged["pin_memory"])
        effective[sub] = merged
        if device == "none":
            for key, value in user.items():  # DeepSpeed ignores them too; a value it would have used is said
                if key != "device":
                    no_effect(
                        out,
                        f"zero_optimization.{sub}.{key}",
                        value,
                        keys[key].default if key in keys else None,
                        f"zero_optimization.{sub}.device is 'none'",
                    )
            continue
        if sub == "offload_param" and stage < 3:
            out.note(
                "zero_optimization.offload_param",
                f"no effect at stage {stage}: parameters are only offloaded at stage 3 (DeepSpeed ignores it too)",
            )
            warnings.warn(
                f"zero_optimization.offload_param has no effect at stage {stage} (only stage 3 offloads "
                "parameters); it is ignored, as DeepSpeed does",
                DeepSpeedConfigWarning,
                stacklevel=4,
            )
            continue
        devices[sub] = device
        pins.append(pin)
    if not devices:
        kwargs["offload"] = None
        return effective
    if stage == 0:
        raise DeepSpeedConfigError(
            f"zero_optimization.{next(iter(devices))} asks for offload but stage is 0: offload needs ZeRO stage 1, 2 "
            "or 3 (stage 0 keeps everything replicated on the device). Set zero_optimization.stage or remove it."
        )
    # The shorthand is kept for reports; the precise pair is what the strategy applies (docs/offload.md).
    kwargs["offload"] = "nvme" if "nvme" in devices.values() else "cpu"
    kwargs["offload_optimizer"] = devices.get("offload_optimizer", "none")
    kwargs["offload_params"] = devices.get("offload_param", "none") if stage == 3 else None
    if "nvme" in devices.values():
        _translate_nvme(zero, stage, devices, effective, out, kwargs)
    if "offload_param" not in devices:
        out.note(
            "zero_optimization.offload_optimizer",
            f"-> offload_optimizer={kwargs['offload_optimizer']!r}: only "
            "optimizer states and fp32 masters move to CPU; parameters and gradients stay on the accelerator "
            "(DeepSpeed's ZeRO-Offload)",
        )
    elif "offload_optimizer" not in devices:
        out.note(
            "zero_optimization.offload_param",
            f"-> offload_params={kwargs['offload_params']!r} without "
            "offload_optimizer: refused by the strategy (here the sharded fp32 parameters are the optimizer's "
            "masters, so they cannot leave without the optimizer step); add offload_optimizer",
        )
    if not all(pins):
        kwargs["pin_memory"] = False
    return effective


def _translate_nvme(zero: dict, stage: int, devices: dict, effective: dict, out: Collector, kwargs: dict) -> None:
    """NVMe offload keeps DeepSpeed's two sections apart: ``offload_optimizer``/``offload_params`` (precise form)
    plus ``nvme_path`` and ``buffer_count`` of the section(s) on NVMe, ``sub_group_size`` of the optimizer's
    swapping, and ``buffer_size``/``max_in_cpu`` of the parameters' swapping (stage 3).

    The strategy has one ``nvme_path`` and one ``buffer_count``: two NVMe sections naming different paths are
    refused; with different buffer counts the optimizer section's is used for both (the parameter section's is
    reported as having no effect)."""
    on_nvme = [sub for sub in ("offload_optimizer", "offload_param") if devices.get(sub) == "nvme"]
    if not on_nvme:
        return
    paths = {}
    for sub in on_nvme:
        if effective[sub].get("nvme_path") is None:
            raise DeepSpeedConfigError(
                f"zero_optimization.{sub}.device is 'nvme' but nvme_path is missing: give the "
                "directory on a fast local disk where the swapped states live"
            )
        paths[sub] = str(effective[sub]["nvme_path"])
    if len(set(paths.values())) > 1:
        raise DeepSpeedConfigError(
            f"zero_optimization.offload_optimizer.nvme_path ({paths['offload_optimizer']!r}) "
            f"and offload_param.nvme_path ({paths['offload_param']!r}) differ: this strategy "
            "swaps both under one nvme_path; give the same directory"
        )
    kwargs["nvme_path"] = paths[on_nvme[0]]
    counts = {
        sub: check_number(f"zero_optimization.{sub}.buffer_count", effective[sub]["buffer_count"], integer=True)
        for sub in on_nvme
    }
    kwargs["buffer_count"] = counts[on_nvme[0]]
    for sub in on_nvme:
        honoured(out, f"zero_optimization.{sub}.nvme_path", "-> nvme_path")
        if counts[sub] == kwargs["buffer_count"]:
            honoured(out, f"zero_optimization.{sub}.buffer_count", "-> buffer_count (swap buffers resident)")
        else:
            # stays a no-effect key (warned, or refused under strict, when it is not DeepSpeed's default)
            path = f"zero_optimization.{sub}.buffer_count"
            out.notes = [(key, note) for key, note in out.notes if key != path]
            out.note(
                path,
                f"no effect: the strategy has one buffer_count for both swappers; the optimizer "
                f"section's ({kwargs['buffer_count']}) is used",
            )
    if "offload_param" in on_nvme:
        section = effective["offload_param"]
        for key in ("buffer_size", "max_in_cpu"):
            kwargs[key] = check_number(f"zero_optimization.offload_param.{key}", section[key], integer=True)
            honoured(out, f"zero_optimization.offload_param.{key}", f"-> {key} (parameter swapping)")
    if "sub_group_size" in zero and "offload_optimizer" in on_nvme:
        kwargs["sub_group_size"] = check_number(
            "zero_optimization.sub_group_size", zero["sub_group_size"], integer=True
        )
        honoured(out, "zero_optimization.sub_group_size", "-> sub_group_size (elements per swapped sub-group)")


AIO_TRANSLATION = {
    "block_size": "block_size",
    "queue_depth": "queue_depth",
    "thread_count": "thread_count",
    "intra_op_parallelism": "thread_count",
    "single_submit": "single_submit",
    "overlap_events": "overlap_events",
}


def translate_aio(config: dict, out: Collector, kwargs: dict) -> Optional[dict]:
    """DeepSpeed's ``aio`` section -> the swap engine's knobs with an offload device on NVMe; without one it has no
    effect (in DeepSpeed neither), and a key set to another value than DeepSpeed's default is warned about."""
    aio = section_of(config, "aio")
    if aio is None:
        return None
    nvme = "nvme" in (kwargs.get("offload_optimizer"), kwargs.get("offload_params"))
    merged = merge_section(aio, schema.AIO_KEYS, "aio", out)  # notes, unknown keys, use_gds refused
    mapped = {}
    for key in aio:
        if key not in AIO_TRANSLATION:
            continue
        path = f"aio.{key}"
        if nvme:
            mapped[AIO_TRANSLATION[key]] = merged[key]
            honoured(out, path, f"-> aio {AIO_TRANSLATION[key]}")
        else:
            no_effect(
                out,
                path,
                aio[key],
                schema.AIO_KEYS[key].default,
                "only NVMe offload does file I/O (no offload device is 'nvme')",
            )
    if nvme:
        kwargs["aio"] = mapped
    return merged
