"""Show and save the effective DeepSpeed configuration (printed on rank 0 at setup, saved next to checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from lightning_zero.ds_config.auto import HF_DEFAULT
from lightning_zero.ds_config.translate import DeepSpeedTranslation

EFFECTIVE_CONFIG_FILENAME = "ds_config.effective.json"
_DEFAULT_NOTE = "default (not in the config)"


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
    return _DEFAULT_NOTE


def effective_config_rows(
    translation: DeepSpeedTranslation,
    *,
    only_set: bool = False,
    auto_paths: Sequence[str] = (),
    auto_defaults: Mapping[str, str] = {},
) -> list[tuple[str, str, str]]:
    """``(key, value, what lightning-zero does with it)`` per effective key, then the strategy keyword arguments.

    Args:
        only_set: keep only the keys the config wrote (every such key has a translation note) and those that were
            ``"auto"`` (``auto_paths``); the DeepSpeed defaults that fill the rest of the effective config are left
            out (they are most of it).
        auto_paths: dotted keys that were ``"auto"`` before resolution; their value shows as ``"auto" -> value``.
        auto_defaults: ``{dotted key: why}`` for the ``"auto"`` values filled with Hugging Face's default (see
            :func:`~lightning_zero.ds_config.auto.resolve_auto_with_defaults`): the value says so, the note says why.
    """
    notes: dict[str, str] = {}
    for key, text in translation.notes:
        notes[key] = f"{notes[key]}; {text}" if key in notes else text
    auto = set(auto_paths)
    rows = []
    for key, value in _flatten(translation.effective):
        note = _note_for(key, notes)
        if only_set and note == _DEFAULT_NOTE and key not in auto:
            continue
        shown = json.dumps(value)
        if key in auto and value != "auto":
            shown = f'"auto" -> {shown}'
            if key in auto_defaults:
                shown, note = f"{shown} ({HF_DEFAULT})", f"{auto_defaults[key]}; {note}"
        rows.append((key, shown, note))
    for key, value in translation.strategy_kwargs.items():
        rows.append((f"ZeroStrategy({key}=...)", json.dumps(value), "strategy keyword argument"))
    return rows


def effective_config_table(
    translation: DeepSpeedTranslation,
    title: str = "DeepSpeed config (effective)",
    *,
    verbose: bool = True,
    auto_paths: Sequence[str] = (),
    caption: Optional[str] = None,
    auto_defaults: Mapping[str, str] = {},
):
    """A ``rich.table.Table`` of :func:`effective_config_rows`: every key (``verbose``) or only those the config set
    or that ``"auto"`` resolved, with a caption saying how many defaults were left out."""
    from rich import box
    from rich.table import Table

    rows = effective_config_rows(translation, only_set=not verbose, auto_paths=auto_paths, auto_defaults=auto_defaults)
    if not verbose:
        left_out = len(effective_config_rows(translation)) - len(rows)
        hidden = (
            f"{left_out} DeepSpeed defaults not shown (ZeroStrategy(verbose=True) prints them; every "
            "checkpoint's zero.json holds them)"
        )
        caption = f"{caption}; {hidden}" if caption else hidden
    table = Table(
        title=title, caption=caption, box=box.HEAVY_HEAD if verbose else None, pad_edge=False, expand=not verbose
    )
    # Keys and values are never cut (two keys sharing a prefix would look alike); in the compact view each note takes
    # the width left over, one line each (the full text is in the verbose table and zero.json).
    table.add_column("key", no_wrap=True)
    table.add_column("value", no_wrap=True)
    if verbose:
        table.add_column("lightning-zero")
    else:
        table.add_column("lightning-zero", ratio=1, no_wrap=True, overflow="ellipsis")
    for row in rows:
        table.add_row(*row)
    return table


def effective_config_dict(
    translation: DeepSpeedTranslation, auto_paths: Sequence[str] = (), auto_defaults: Mapping[str, str] = {}
) -> dict:
    """JSON-serialisable record: the effective config, the strategy kwargs, the Trainer settings, the notes and the
    full table (every row, defaults included) that the startup report shortens."""
    return {
        "effective": translation.effective,
        "strategy_kwargs": translation.strategy_kwargs,
        "trainer_settings": translation.trainer_settings(),
        "notes": [list(note) for note in translation.notes],
        "table": [
            list(row) for row in effective_config_rows(translation, auto_paths=auto_paths, auto_defaults=auto_defaults)
        ],
    }


def save_effective_config(translation: DeepSpeedTranslation, directory: Union[str, Path]) -> Path:
    """Write :func:`effective_config_dict` as ``ds_config.effective.json`` into ``directory``; returns the path."""
    path = Path(directory) / EFFECTIVE_CONFIG_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(effective_config_dict(translation), indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8"
    )
    return path
