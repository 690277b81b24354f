"""Show and save the effective DeepSpeed configuration (printed on rank 0 at setup, saved next to checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

from lightning_zero.ds_config.translate import DeepSpeedTranslation

EFFECTIVE_CONFIG_FILENAME = "ds_config.effective.json"


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        return [row for key, item in value.items() for row in _flatten(item, f"{prefix}.{key}" if prefix else key)]
    return [(prefix, value)]


def _note_for(key: str, notes: dict[str, str]) -> str:
    # Notes are recorded per key or per section (optimizer, scheduler): use the nearest enclosing one.
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in notes:
            return notes[prefix]
    return "default (not in the config)"


def effective_config_table(translation: DeepSpeedTranslation, title: str = "DeepSpeed config (effective)"):
    """A ``rich.table.Table``: one row per effective key with its value and what lightning-zero does with it."""
    from rich.table import Table

    notes: dict[str, str] = {}
    for key, text in translation.notes:
        notes[key] = f"{notes[key]}; {text}" if key in notes else text
    table = Table(title=title)
    table.add_column("key")
    table.add_column("value")
    table.add_column("lightning-zero")
    for key, value in _flatten(translation.effective):
        table.add_row(key, json.dumps(value), _note_for(key, notes))
    for key, value in translation.strategy_kwargs.items():
        table.add_row(f"ZeroStrategy({key}=...)", json.dumps(value), "strategy keyword argument")
    return table


def effective_config_dict(translation: DeepSpeedTranslation) -> dict:
    """JSON-serialisable record: the effective config, the strategy kwargs, the Trainer settings and the notes."""
    return {
        "effective": translation.effective,
        "strategy_kwargs": translation.strategy_kwargs,
        "trainer_settings": translation.trainer_settings(),
        "notes": [list(note) for note in translation.notes],
    }


def save_effective_config(translation: DeepSpeedTranslation, directory: Union[str, Path]) -> Path:
    """Write :func:`effective_config_dict` as ``ds_config.effective.json`` into ``directory``; returns the path."""
    path = Path(directory) / EFFECTIVE_CONFIG_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(effective_config_dict(translation), indent=2, sort_keys=True, default=str) + "\n",
                    encoding="utf-8")
    return path
