"""``torch.distributed.checkpoint``'s nested state dicts: flattening and writing back by path.

DCP flattens a nested state dict into dotted keys with a path per key (``DefaultSavePlanner`` /
``DefaultLoadPlanner`` with ``flatten_state_dict=True``), in the private ``_nested_dict``; matching checkpoint keys
and loading non-tensor items must use the same mapping, so they call the same functions (imported when first
called: DCP is heavy and most of the package never loads a checkpoint). A rename breaks checkpoint loading.
"""

from __future__ import annotations


def flatten_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """``(flat, mappings)``: ``state_dict`` with nested dicts and lists flattened to dotted keys, and each flat
    key's path in the original (``_nested_dict.flatten_state_dict``, what DCP's default planners call)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state_dict)


def set_element(root: dict, path, value) -> None:
    """Write ``value`` at ``path`` (a mapping of :func:`flatten_state_dict`) inside the nested ``root``
    (``_nested_dict.set_element``, what ``DefaultLoadPlanner`` writes loaded items back with)."""
    from torch.distributed.checkpoint._nested_dict import set_element as set_at

    set_at(root, path, value)
