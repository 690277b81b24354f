"""Does a checkpoint fit the state it is loaded into? Missing, unexpected and shape-mismatched keys, found from
the DCP metadata before any data is read.

DCP itself refuses a missing key with a bare ``CheckpointException`` (a ``BaseException``), silently skips keys the
target lacks, and fails on a shape mismatch deep inside a ``narrow``; :func:`check_state_matches` replaces all three
with one :class:`CheckpointError` that lists the keys, as ``torch.nn.Module.load_state_dict`` does.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.torch_compat import flatten_state_dict

SHOWN = 5  # keys named per category; the count says how many more there are


def _listing(kind: str, keys: List[str]) -> str:
    shown = ", ".join(keys[:SHOWN]) + (f", ... ({len(keys) - SHOWN} more)" if len(keys) > SHOWN else "")
    return f"{len(keys)} {kind}: {shown}"


def _top(fqn: str, mappings: Dict[str, Any]) -> str:
    path = mappings.get(fqn)
    return str(path[0]) if path else fqn.split(".", 1)[0]


def describe_state(state: Dict[str, Any], metadata: Metadata) -> Dict[str, List[str]]:
    """This rank's side of the comparison: its flattened keys, its top-level keys, its missing and
    shape-mismatched keys. Plain lists, so that ranks can exchange them (see :func:`merge_descriptions`)."""
    flat, _ = flatten_state_dict(state)
    stored = metadata.state_dict_metadata
    mismatched = []
    for fqn, value in flat.items():
        item = stored.get(fqn)
        if item is None:
            continue
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor != isinstance(item, TensorStorageMetadata):
            mismatched.append(
                f"{fqn} (checkpoint: {'tensor' if not is_tensor else 'object'}, "
                f"target: {'tensor' if is_tensor else type(value).__name__})"
            )
        elif is_tensor and tuple(value.shape) != tuple(item.size):
            mismatched.append(f"{fqn} (checkpoint: {list(item.size)}, target: {list(value.shape)})")
    return {
        "keys": list(flat),
        "tops": [str(key) for key in state],
        "missing": [fqn for fqn in flat if fqn not in stored],
        "mismatched": mismatched,
    }


def merge_descriptions(descriptions: List[Dict[str, List[str]]]) -> Dict[str, List[str]]:
    """The union of every rank's description, in order. [Note: a rank may hold part of the state] At ZeRO stage 1
    a rank's target holds only the optimizer states of the parameters it owns, so a key is unexpected only when no
    rank asks for it, and every rank must reach the same verdict (a rank raising alone would hang the others)."""
    return {
        field: list(dict.fromkeys(item for d in descriptions for item in d[field]))
        for field in ("keys", "tops", "missing", "mismatched")
    }


def check_state_matches(description: Dict[str, List[str]], metadata: Metadata, *, strict: bool, where: str) -> None:
    """Raise :class:`CheckpointError` when the checkpoint described by ``metadata`` does not fit the target
    ``description`` (from :func:`describe_state`, merged over ranks).

    Missing keys are in the target but not in the checkpoint; unexpected keys are in the checkpoint under a
    top-level key that the target has (``state_dict``, ``optimizer_states``, ...) but not in the target (top-level
    entries it does not ask for are not loaded and not reported). ``strict=False`` accepts missing and
    unexpected keys, as ``load_state_dict(strict=False)`` does; a shape mismatch, or a tensor where the target holds
    an object, is always an error.
    """
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    keys, tops = set(description["keys"]), set(description["tops"])
    missing, mismatched = description["missing"], description["mismatched"]
    unexpected = [fqn for fqn in metadata.state_dict_metadata if fqn not in keys and _top(fqn, mappings) in tops]
    raise_on_mismatch(where, missing, unexpected, mismatched, strict=strict, target="target", loaded_into="state")


def raise_on_mismatch(
    where: str,
    missing: List[str],
    unexpected: List[str],
    mismatched: List[str],
    *,
    strict: bool,
    target: str,
    loaded_into: str,
) -> None:
    """The one error for a checkpoint that does not fit what it is loaded into (a sharded state or, for full-file
    loading, the model): shape mismatches always; missing and unexpected keys only when ``strict``."""
    if not mismatched and (not strict or not (missing or unexpected)):
        return
    parts = []
    if missing and strict:
        parts.append(_listing(f"missing keys (in the {target}, not in the checkpoint)", missing))
    if unexpected and strict:
        parts.append(_listing(f"unexpected keys (in the checkpoint, not in the {target})", unexpected))
    if mismatched:
        parts.append(_listing("shape mismatches", mismatched))
    hint = (
        " strict=False (LightningModule.strict_loading = False) ignores missing and unexpected keys, never "
        "shape mismatches."
        if strict
        else ""
    )
    raise CheckpointError(
        f"{where}: the checkpoint does not match the {loaded_into} it is loaded into: " + "; ".join(parts) + "." + hint,
        where,
    )
