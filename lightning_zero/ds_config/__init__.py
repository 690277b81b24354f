"""DeepSpeed ``ds_config`` compatibility: load, translate for ``ZeroStrategy``, resolve ``"auto"``, report.

See ``docs/ds_config.md`` for the key-by-key mapping.
"""

from lightning_zero.ds_config.auto import (
    AutoContext,
    infer_hidden_size,
    resolve_auto,
    resolve_auto_with_defaults,
    resolve_batch_sizes,
)
from lightning_zero.ds_config.loading import (
    DeepSpeedConfigError,
    DeepSpeedConfigWarning,
    load_ds_config,
)
from lightning_zero.ds_config.report import effective_config_dict, effective_config_table, save_effective_config
from lightning_zero.ds_config.translate import DeepSpeedTranslation, translate_ds_config

__all__ = [
    "AutoContext",
    "DeepSpeedConfigError",
    "DeepSpeedConfigWarning",
    "DeepSpeedTranslation",
    "effective_config_dict",
    "effective_config_table",
    "infer_hidden_size",
    "load_ds_config",
    "resolve_auto",
    "resolve_auto_with_defaults",
    "resolve_batch_sizes",
    "save_effective_config",
    "translate_ds_config",
]
