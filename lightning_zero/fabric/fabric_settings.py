"""What the Fabric ``ZeroStrategy`` refuses of the settings both adapters share: the Trainer-only ones.

The arguments are validated once, for both adapters (:func:`lightning_zero.adapters.settings.resolve_settings`);
those that only have a meaning inside the Trainer's loop are refused here, in the Fabric strategy's constructor,
with what to do instead.
"""

from __future__ import annotations

import warnings
from typing import Optional

from lightning_zero.adapters.settings import ZeroSettings
from lightning_zero.ds_config import DeepSpeedConfigWarning
from lightning_zero.ds_config.binding import DeepSpeedConfigBinding

# ds_config settings that drive the Trainer's loop; in Fabric the user's loop does these, so they are refused.
LOOP_SETTINGS = (
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "steps_per_print",
    "wall_clock_breakdown",
)


def refuse_trainer_settings(settings: ZeroSettings) -> None:
    """``auto_resume=True``, ``load_full_weights=True`` and a ds_config's loop settings have no Fabric meaning."""
    if settings.auto_resume:
        raise ValueError(
            "auto_resume=True resumes from the Trainer's ModelCheckpoint directories, which Fabric "
            "has not: call fabric.load(path, state) yourself, and leave auto_resume=False"
        )
    if settings.load_full_weights:
        raise NotImplementedError(
            "load_full_weights=True is not supported with Fabric: the state given to "
            "fabric.load says what is loaded (fabric.load(path, {'model': model}) loads the "
            "weights alone, from a checkpoint directory or file); a bare state dict file "
            "loads with fabric.load_raw(path, model). Leave load_full_weights=False"
        )
    refuse_loop_settings(settings.ds_config)


def refuse_loop_settings(binding: Optional[DeepSpeedConfigBinding]) -> None:
    """A ds_config's :data:`LOOP_SETTINGS` are refused by name (``logging_batch_size_per_gpu``, which only sized
    DeepSpeed's samples/s log, is ignored with a warning)."""
    if binding is None:
        return
    translation = binding.translation
    present = []
    for key in LOOP_SETTINGS:
        value = getattr(translation, key, None)
        if key in binding.argument_aliases:  # logging_batch_size_per_gpu: only DeepSpeed's samples/s log used it
            warnings.warn(
                f"{binding.argument_aliases[key]} has no effect with Fabric: your loop sizes the batches "
                "(DeepSpeed only used it for its samples/s log); it is ignored",
                DeepSpeedConfigWarning,
            )
            continue
        if (
            value in (None, "auto", {}, False)
            or (key == "gradient_clipping" and value == 0)
            or (key == "gradient_accumulation_steps" and value == 1)
        ):
            continue
        present.append(f"{key}={value!r}")
    if present:
        raise ValueError(
            f"the ds_config sets {', '.join(present)}, which the Trainer applies to its loop; with "
            "Fabric the loop is yours (create the optimizer/scheduler, call fabric.clip_gradients, "
            "accumulate with fabric.no_backward_sync, size the DataLoader). Remove them from the config "
            'or set them to "auto"'
        )
