"""Does a checkpoint fit the state it is loaded into? Missing, unexpected and shape-mismatched keys, found from
the DCP metadata before any data is read.

DCP itself refuses a missing key with a bare ``CheckpointException`` (a ``BaseException``), silently skips keys the
target lacks, and fails on a shape mismatch deep inside a ``narrow``; :func:`check_state_matches` replaces all three
with one :class:`CheckpointError` that lists the keys, as ``torch.nn.Module.load_state_dict`` does.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # private, but what DCP's planner uses
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_zero.checkpoint.errors import CheckpointError

SHOWN = 5  # keys named per category; the count says how many more there are


def _listing(kind: str, keys: List[str]) -> str:
    shown = ", ".join(keys[:SHOWN]) + (f", ... ({len(keys) - SHOWN} more)" if len(keys) > SHOWN else "")
    return f"{len(keys)} {kind}: {shown}"


def _top(fqn: str, mappings: Dict[str, Any]) -> str:
    path = mappings.get(fqn)
    return str(path[0]) if path else fqn.split(".", 1)[0]


def check_state_matches(state: Dict[str, Any], metadata: Metadata, *, strict: bool, where: str) -> None:
    """Raise :class:`CheckpointError` when the checkpoint described by ``metadata`` does not fit ``state``.

    Missing keys are in ``state`` but not in the checkpoint; unexpected keys are in the checkpoint under a
    top-level key that ``state`` has (``state_dict``, ``optimizer_states``, ...) but not in ``state`` (top-level
    entries ``state`` does not ask for are not loaded and not reported). ``strict=False`` accepts missing and
    unexpected keys, as ``load_state_dict(strict=False)`` does; a shape mismatch, or a tensor where the target holds
    an object, is always an error.
    """
    flat, _ = flatten_state_dict(state)
    stored = metadata.state_dict_metadata
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    wanted_tops = {str(key) for key in state}
    missing = [fqn for fqn in flat if fqn not in stored]
    unexpected = [fqn for fqn in stored if fqn not in flat and _top(fqn, mappings) in wanted_tops]
    mismatched = []
    for fqn, value in flat.items():
        item = stored.get(fqn)
        if item is None:
            continue
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor != isinstance(item, TensorStorageMetadata):
            mismatched.append(f"{fqn} (checkpoint: {'tensor' if not is_tensor else 'object'}, "
                              f"target: {'tensor' if is_tensor else type(value).__name__})")
        elif is_tensor and tuple(value.shape) != tuple(item.size):
            mismatched.append(f"{fqn} (checkpoint: {list(item.size)}, target: {list(value.shape)})")
    if not mismatched and (not strict or not (missing or unexpected)):
        return
    parts = []
    if missing and strict:
        parts.append(_listing("missing keys (in the target, not in the checkpoint)", missing))
    if unexpected and strict:
        parts.append(_listing("unexpected keys (in the checkpoint, not in the target)", unexpected))
    if mismatched:
        parts.append(_listing("shape mismatches", mismatched))
    hint = " strict=False (LightningModule.strict_loading = False) ignores missing and unexpected keys, never " \
           "shape mismatches." if strict else ""
    raise CheckpointError(f"{where}: the checkpoint does not match the state it is loaded into: "
                          + "; ".join(parts) + "." + hint, where)
