"""Every private torch name the package uses, in one place, each behind a small named function or alias that says
why it is needed and what breaks if torch changes it; and the differences between the torch versions the package
supports (``torch>=2.11``), each behind feature detection that names the versions that differ.

No other module of the package names a private torch attribute or module (``tests/docs/test_layout.py`` checks the
source), and each entry has a test in ``tests/test_torch_compat.py`` that calls it on the installed torch; the
supported versions and how they are checked are in ``docs/compatibility.md``. One module per torch area:

* :mod:`.fsdp`: FSDP2's per-unit state, param groups, shards and forward state machine;
* :mod:`.dtensor`: DTensor's local shard;
* :mod:`.ddp`: DDP's keywords across versions and its reducer;
* :mod:`.c10d`: the default store, the flat-tensor collectives and the backend serving a device;
* :mod:`.tensors`: storage identity, version counters, wrapper subclasses, dispatch modes, pytrees;
* :mod:`.ops`: the ``_foreach_*`` kernels and the fused-kernel devices;
* :mod:`.serialization`: the ``torch.save`` zip format pieces of a streaming writer;
* :mod:`.dcp`: DCP's nested-dict flattening;
* :mod:`.modules`: module and optimizer hook tables, wrap-policy classes;
* :mod:`.pipelining`: the pipeline schedules' warm-up and action lowering.

Imports nothing of the package, so every layer (``ops/``, ``offload/``, ``distributed/``, ``checkpoint/``) may use it.
"""

from __future__ import annotations

from lightning_zero.torch_compat.c10d import all_gather_flat, backend_serving, default_store, reduce_scatter_flat
from lightning_zero.torch_compat.dcp import flatten_state_dict, set_element
from lightning_zero.torch_compat.ddp import ddp_buffer_sync_kwargs, prepare_ddp_backward, rebuild_ddp_buckets
from lightning_zero.torch_compat.dtensor import dtensor_local, local_part, local_tensor, set_dtensor_local
from lightning_zero.torch_compat.fsdp import (
    all_gather_in_flight,
    fsdp_comm_bases,
    fsdp_in_forward,
    fsdp_param_groups,
    fsdp_param_module,
    fsdp_post_forward,
    fsdp_pre_forward,
    fsdp_state,
    group_fsdp_params,
    group_is_unsharded,
    padded_shard_size,
    post_forward_hook_id,
    set_sharded_param_data,
    shard_placement,
    sharded_param_data,
    sharded_parameter,
    unsharded_param,
    unwrap_param_group_methods,
    wrap_param_group_methods,
)
from lightning_zero.torch_compat.modules import (
    flag_scheduler_step_wrapper,
    forward_hook_tables,
    is_scheduler_step_wrapper,
    optimizer_step_hooks_suspended,
    record_optimizer_step,
    wrap_policy_module_classes,
)
from lightning_zero.torch_compat.ops import (
    foreach_add,
    foreach_add_,
    foreach_addcmul_,
    foreach_lerp_,
    foreach_maximum_,
    foreach_mul_,
    foreach_norm,
    fused_kernel_devices,
)
from lightning_zero.torch_compat.pipelining import lower_forward_actions, set_stage_warmup_ops, stage_warmup_ops
from lightning_zero.torch_compat.serialization import (
    REBUILD_TENSOR,
    open_zipfile_writer,
    storage_alignment,
    storage_type_names,
)
from lightning_zero.torch_compat.tensors import (
    TENSOR_DATA,
    TorchDispatchMode,
    disable_torch_dispatch,
    make_wrapper_subclass,
    op_schema,
    privateuse1_backend_name,
    storage_identity,
    storage_use_count,
    tensor_has_gradient_hooks,
    tensor_version,
    tree_flatten,
    tree_unflatten,
    view_base,
)

__all__ = [
    "REBUILD_TENSOR",
    "TENSOR_DATA",
    "TorchDispatchMode",
    "all_gather_flat",
    "all_gather_in_flight",
    "backend_serving",
    "ddp_buffer_sync_kwargs",
    "default_store",
    "disable_torch_dispatch",
    "dtensor_local",
    "flag_scheduler_step_wrapper",
    "flatten_state_dict",
    "foreach_add",
    "foreach_add_",
    "foreach_addcmul_",
    "foreach_lerp_",
    "foreach_maximum_",
    "foreach_mul_",
    "foreach_norm",
    "forward_hook_tables",
    "fsdp_comm_bases",
    "fsdp_in_forward",
    "fsdp_param_groups",
    "fsdp_param_module",
    "fsdp_post_forward",
    "fsdp_pre_forward",
    "fsdp_state",
    "fused_kernel_devices",
    "group_fsdp_params",
    "group_is_unsharded",
    "is_scheduler_step_wrapper",
    "local_part",
    "local_tensor",
    "lower_forward_actions",
    "make_wrapper_subclass",
    "op_schema",
    "padded_shard_size",
    "open_zipfile_writer",
    "optimizer_step_hooks_suspended",
    "post_forward_hook_id",
    "prepare_ddp_backward",
    "privateuse1_backend_name",
    "rebuild_ddp_buckets",
    "reduce_scatter_flat",
    "record_optimizer_step",
    "set_dtensor_local",
    "set_element",
    "set_sharded_param_data",
    "set_stage_warmup_ops",
    "shard_placement",
    "sharded_param_data",
    "sharded_parameter",
    "stage_warmup_ops",
    "storage_alignment",
    "storage_identity",
    "storage_type_names",
    "storage_use_count",
    "tensor_has_gradient_hooks",
    "tensor_version",
    "tree_flatten",
    "tree_unflatten",
    "unsharded_param",
    "unwrap_param_group_methods",
    "view_base",
    "wrap_param_group_methods",
    "wrap_policy_module_classes",
]
