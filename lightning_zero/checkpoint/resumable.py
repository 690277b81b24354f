"""A sharded checkpoint as one regular Lightning checkpoint that any strategy (e.g. ``DDPStrategy``) resumes from.

A lightning-zero checkpoint keys optimizer states by parameter *name* (``[Note: one layout for every stage]`` in
:mod:`lightning_zero.checkpoint.states`) and records, in ``meta.pt``'s ``optimizer_param_groups``, each param
group's hyper-parameters and the names of its parameters in the order the optimizer was built with. Lightning's
format is ``torch.optim.Optimizer.state_dict()``: states keyed by an integer that counts the parameters through the
param groups in order. :func:`resumable_checkpoint` renumbers the names that way, so
``Optimizer.load_state_dict`` on a freshly configured optimizer (which matches parameters by position) gives every
parameter its own state.

Memory: nothing is loaded here. Every tensor (weights and optimizer states) is a placeholder that
:func:`lightning_zero.checkpoint.streaming.write_torch_checkpoint` loads, writes and drops one at a time.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Tuple

import torch

from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.streaming import TensorEntry, tensor_slot

# meta.pt keys that only lightning-zero's own loader reads; the resumable file has Lightning's keys instead.
_ZERO_ONLY_KEYS = ("optimizer_param_groups", "frozen_parameters_excluded")


def _stored_states(source) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """``{optimizer index: {parameter name: {state key: TensorEntry or value}}}`` from the DCP metadata."""
    states: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for path, value in source.items_under("optimizer_states"):
        if len(path) != 4 or path[1] != "state":
            raise CheckpointError(
                f"{source.path}: unexpected optimizer entry {'.'.join(path)!r} (expected "
                "<optimizer>.state.<parameter>.<state key>)",
                source.path,
            )
        index, _, name, key = path
        states.setdefault(index, {}).setdefault(name, {})[key] = value
    return states


def _renumbered(where: str, index: int, groups: List[dict], states: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """One optimizer's ``{"state": {int: ...}, "param_groups": [...]}`` in ``Optimizer.state_dict()`` form."""
    state: Dict[int, Dict[str, Any]] = {}
    param_groups = []
    position = 0
    placed = set()
    for group in groups:
        ids = []
        for name in group["params"]:
            if name in placed:
                raise CheckpointError(
                    f"{where}: parameter {name!r} is listed twice in optimizer {index}'s param groups", where
                )
            placed.add(name)
            if name in states:
                state[position] = OrderedDict(
                    (key, tensor_slot(value) if isinstance(value, TensorEntry) else value)
                    for key, value in states[name].items()
                )
            ids.append(position)
            position += 1
        param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    orphans = sorted(set(states) - placed)
    if orphans:
        raise CheckpointError(
            f"{where}: optimizer {index} holds states for {orphans[:5]} which are in none of its "
            "recorded param groups; the checkpoint is inconsistent",
            where,
        )
    return {"state": state, "param_groups": param_groups}


def resumable_checkpoint(
    source, state_dict: Dict[str, Any], load_weight: Callable[[TensorEntry], torch.Tensor]
) -> Tuple[Dict[str, Any], Callable[[TensorEntry], torch.Tensor]]:
    """Lightning's checkpoint dict for the sharded checkpoint read by ``source`` (a ``DCPTensorSource``), with
    ``state_dict`` (placeholders for the weights) and ``optimizer_states`` in ``Optimizer.state_dict()`` form.

    Returns the dict and the ``load(entry)`` for all its placeholders: ``load_weight`` for the weights', the
    source for the optimizer states'. Refuses (:class:`CheckpointError`) a checkpoint without optimizer states, one
    whose param groups were not recorded (written before they were), and one that left frozen weights out
    (``exclude_frozen_parameters``): Lightning's strict resume would fail on the missing weights.
    """
    where = source.path
    meta = dict(source.meta())
    groups = meta.get("optimizer_param_groups")
    if not isinstance(groups, list):
        raise CheckpointError(
            f"{where}: the checkpoint does not record its optimizers' param groups (written by an "
            "older lightning-zero?), so its optimizer states cannot be put in Lightning's order; "
            "consolidate without --with-optimizer for the weights only",
            where,
        )
    if not groups:
        raise CheckpointError(
            f"{where}: the checkpoint holds no optimizer states (saved with save_weights_only=True, "
            "or before configure_optimizers); consolidate without --with-optimizer",
            where,
        )
    excluded = meta.get("frozen_parameters_excluded") or []
    if excluded:
        raise CheckpointError(
            f"{where}: the checkpoint left out {len(excluded)} frozen weight(s) "
            f"(exclude_frozen_parameters=True, e.g. {excluded[0]!r}); a resumable single file needs "
            "every weight",
            where,
        )
    scaler = (
        (meta.get("ZeroPrecision") or {}).get("loss_scaler") if isinstance(meta.get("ZeroPrecision"), dict) else None
    )
    if scaler:
        # Kept in the file (ZeroStrategy resumes from it too), but no other precision plugin reads it: say so.
        warnings.warn(
            f"{where}: the fp16 loss-scaler state (lightning-zero's DeepSpeed-style scaler, scale "
            f"{scaler.get('cur_scale')}) is kept under 'ZeroPrecision'; Lightning's own precision plugins "
            "(e.g. MixedPrecision under DDPStrategy) do not read it and start their GradScaler afresh",
            stacklevel=3,
        )
    stored = _stored_states(source)
    unknown = sorted(set(stored) - {str(i) for i in range(len(groups))})
    if unknown:
        raise CheckpointError(f"{where}: optimizer states {unknown} have no recorded param groups", where)
    checkpoint = {k: v for k, v in meta.items() if k not in _ZERO_ONLY_KEYS and k != "state_dict"}
    checkpoint["state_dict"] = state_dict
    checkpoint["optimizer_states"] = [_renumbered(where, i, g, stored.get(str(i), {})) for i, g in enumerate(groups)]
    # The writer hands back the very entry object of each placeholder: identity tells the two kinds apart (a weight
    # key and a DCP name could be equal strings).
    optimizer_entries = {
        id(value)
        for states in stored.values()
        for state in states.values()
        for value in state.values()
        if isinstance(value, TensorEntry)
    }

    def load(entry: TensorEntry) -> torch.Tensor:
        return source.load_fqn(entry.key) if id(entry) in optimizer_entries else load_weight(entry)

    return checkpoint, load
