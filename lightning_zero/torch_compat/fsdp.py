"""FSDP2 internals (``torch.distributed.fsdp._fully_shard``): the per-``fully_shard`` state, its param groups and
their ``FSDPParam`` objects.

FSDP2 has no public view of which parameters a unit holds, of the padded flat shard an all-gather reads, or of its
forward/backward state machine; the package needs all three (manual optimization closes a forward by hand, the NVMe
swapper re-points shard memory, memory accounting counts gathered parameters). Each name below is one torch may
rename; its test in ``tests/test_torch_compat.py`` runs the real FSDP2 of the installed torch.
"""

from __future__ import annotations

import functools

import torch


def fsdp_state(module):
    """The ``FSDPState`` of an ``FSDPModule`` (``module._get_fsdp_state()``; shared by the modules of one grouped
    ``fully_shard([a, b])`` call). No public accessor exists; without it nothing below can be reached."""
    return module._get_fsdp_state()


def fsdp_param_groups(state) -> list:
    """The FSDP2 param groups of one ``fully_shard`` state (:func:`fsdp_state`), as a list.

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


def fsdp_param_module(fsdp_param):
    """The module that registers ``fsdp_param`` (``FSDPParam._module_info.module``): the module whose forward uses
    it, which is where manual optimization hooks its pre-forward. A rename fails the hook setup with
    ``AttributeError``."""
    return fsdp_param._module_info.module


def unsharded_param(fsdp_param):
    """The gathered (unsharded) parameter of ``fsdp_param``, or ``None`` before its first all-gather
    (``FSDPParam._unsharded_param``, created lazily). Read to keep its ``requires_grad`` in step with the sharded
    parameter and to count gathered bytes; a rename reads as "never gathered"."""
    return getattr(fsdp_param, "_unsharded_param", None)


def sharded_param_data(fsdp_param, default=None):
    """The padded flat shard (``FSDPParam._sharded_param_data``) that FSDP2's all-gather copies from, of which the
    sharded DTensor's local tensor is a view; ``default`` where this ``FSDPParam`` has none (a rename: the NVMe
    swapper then refuses to read in place)."""
    return getattr(fsdp_param, "_sharded_param_data", default)


def set_sharded_param_data(fsdp_param, data) -> None:
    """Re-point the padded flat shard of ``fsdp_param`` to ``data`` (the NVMe swapper's aligned memory); the caller
    re-points the DTensor's local view too (:func:`lightning_zero.torch_compat.set_dtensor_local`)."""
    fsdp_param._sharded_param_data = data


def all_gather_in_flight(group) -> bool:
    """Whether the ``FSDPParamGroup`` ``group`` holds an all-gather result not yet copied out
    (``_all_gather_result``); a rename reads as "none in flight", so a swapper waits for the next unshard."""
    return getattr(group, "_all_gather_result", None) is not None


def fsdp_in_forward(state) -> bool:
    """Whether the unit of ``state`` is inside its forward (``_training_state == TrainingState.FORWARD``;
    ``TrainingState`` lives in the private ``_fsdp_common``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    return state._training_state == TrainingState.FORWARD


def fsdp_pre_forward(state, module) -> None:
    """Run FSDP2's pre-forward of ``module`` (all-gathers the unit's parameters) outside a forward call: manual
    optimization re-opens the root's forward after a backward it closed by hand (``FSDPState._pre_forward``)."""
    state._pre_forward(module, (), {})


def fsdp_post_forward(state, module, output):
    """Close ``module``'s forward as FSDP2's post-forward hook would (``FSDPState._post_forward``): registers the
    pre-backward hook on ``output`` and returns it (a copy that may differ by a dtype cast)."""
    return state._post_forward(module, (), output)


def post_forward_hook_id(state):
    """The key of FSDP2's post-forward hook in the module's ``_forward_hooks`` (the id of
    ``FSDPState._post_forward_hook_handle``), or ``None`` where this torch keeps no such handle: the root's re-entry
    guard then leaves the hook alone."""
    handle = getattr(state, "_post_forward_hook_handle", None)
    return getattr(handle, "id", None)


@functools.cache
def fsdp_comm_bases() -> tuple[type, type]:
    """``(AllGather, ReduceScatter)``: the protocols ``FSDPModule.set_custom_all_gather`` /
    ``set_custom_reduce_scatter`` take, from the private ``_fsdp_api`` (not exported by ``torch.distributed.fsdp``
    in 2.11-2.13); subclassing them is how a custom ``allocate`` plugs in."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


# [Note: FSDP2's unprefixed internals]
# ``FSDPParamGroup`` and ``FSDPParam`` are private classes whose fields carry no underscore; torch renames them as
# freely as the prefixed ones, so they are read here too, and ``tests/docs/test_layout.py`` refuses the field names
# anywhere else.


def group_fsdp_params(group) -> list:
    """The ``FSDPParam`` objects of an ``FSDPParamGroup`` (``group.fsdp_params``), in registration order."""
    return list(group.fsdp_params)


def sharded_parameter(fsdp_param):
    """The sharded DTensor parameter an ``FSDPParam`` registers on its module (``FSDPParam.sharded_param``): what
    the optimizer steps and the module's ``named_parameters`` yields."""
    return fsdp_param.sharded_param


def padded_shard_size(fsdp_param) -> torch.Size:
    """The size of the padded shard the all-gather reads (``FSDPParam.padded_sharded_param_size``), of which the
    local tensor is the first rows."""
    return fsdp_param.padded_sharded_param_size


def shard_placement(fsdp_param):
    """The ``Shard(dim)`` placement ``fully_shard`` chose for the parameter (``FSDPParam.fsdp_placement``)."""
    return fsdp_param.fsdp_placement


def group_is_unsharded(group) -> bool:
    """Whether the ``FSDPParamGroup``'s parameters are gathered (``is_unsharded``; a rename reads as "not
    gathered", so the NVMe swapper makes the unit resident once more than needed, never once less)."""
    return bool(getattr(group, "is_unsharded", False))


PARAM_GROUP_METHODS = ("unshard", "lazy_init")  # the FSDPParamGroup methods the NVMe swapper wraps


def wrap_param_group_methods(group, wrappers: dict) -> None:
    """Replace ``FSDPParamGroup`` methods of one instance: ``wrappers`` maps each name of :data:`PARAM_GROUP_METHODS`
    to a function taking the bound original and returning its replacement (the NVMe swapper reads a unit's shards
    from disk before FSDP2's lazy init and all-gather touch them; FSDP2 has no hook at either point)."""
    for name, wrap in wrappers.items():
        if name not in PARAM_GROUP_METHODS:
            raise ValueError(f"{name!r} is not one of {PARAM_GROUP_METHODS}")
        setattr(group, name, wrap(getattr(group, name)))


def unwrap_param_group_methods(group) -> None:
    """Undo :func:`wrap_param_group_methods`: the class's own methods are seen again."""
    for name in PARAM_GROUP_METHODS:
        group.__dict__.pop(name, None)
