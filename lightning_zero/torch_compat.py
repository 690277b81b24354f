"""Differences between the torch versions this package supports (``torch>=2.11``), each behind feature detection.

Only torch internals the package has to read live here: every helper names the versions that differ and how.
Imports only torch, so every layer (``distributed/``, ``offload/``, ``checkpoint/``) may use it.
"""

from __future__ import annotations


def fsdp_param_groups(state) -> list:
    """The FSDP2 param groups of one ``fully_shard`` state (``module._get_fsdp_state()``), as a list.

    torch 2.12 turned ``FSDPState._fsdp_param_group`` (one optional group) into ``_fsdp_param_groups`` (a list, one
    group per module of a grouped ``fully_shard([a, b])``) and kept the old name as a property that raises once a
    state holds several groups; torch 2.11 has only the single attribute. Reading the list first and falling back
    to the single group gives every group on both.
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)
