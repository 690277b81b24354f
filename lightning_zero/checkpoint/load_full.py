"""Loading one checkpoint file (a DDP ``.ckpt``, a consolidated file, ``.safetensors``) into a sharded module and its
optimizers, collectively, over :mod:`lightning_zero.checkpoint.full_file`, which reads each rank's slices only.

Which path is a full checkpoint: a file; with ``ZeroStrategy(load_full_weights=True)`` (DeepSpeed's flag) it must
be one, and a directory is refused naming the flag. A file inside a sharded checkpoint directory is refused naming
the directory to pass instead.

A DeepSpeed ZeRO checkpoint directory is loaded the same way, read by
:class:`~lightning_zero.checkpoint.deepspeed_resume.DeepSpeedCheckpoint` (its client state is the rest).

What comes back is the rest of the file: for Lightning, what ``DDPStrategy`` would hand it (loops, callbacks, LR
schedulers and hyper-parameters; the Trainer adapter adds ``state_dict``, the loaded sharded weights, for
``on_load_checkpoint`` hooks).

Fabric's ``fabric.load_raw(path, module_or_optimizer)`` goes through the same readers: :func:`load_raw_module` (a
``torch.save(model.state_dict())`` file or ``.safetensors``) and :func:`load_raw_optimizer` (a
``torch.save(optimizer.state_dict())`` file, or a full optimizer state dict keyed by parameter names).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from lightning_zero.checkpoint.atomic import local_path
from lightning_zero.checkpoint.deepspeed_reader import is_deepspeed_checkpoint
from lightning_zero.checkpoint.deepspeed_resume import DeepSpeedCheckpoint
from lightning_zero.checkpoint.directory import is_sharded_checkpoint
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.full_file import (
    FullCheckpoint,
    Layout,
    OptimizerTarget,
    PathLike,
    apply_full_optimizer_states,
    check_full_optimizer_states,
    check_full_state_dict,
    copy_full_state_dict,
    describe_full_checkpoint_file,
    is_safetensors_file,
)
from lightning_zero.checkpoint.safe_load import safe_torch_load
from lightning_zero.checkpoint.save_guards import all_gather, control_group
from lightning_zero.checkpoint.states import (
    frozen_parameter_names,
    held_tensor,
    initialise_optimizer_state,
    model_params_per_group,
    module_state_dict,
    param_names,
)
from lightning_zero.distributed.optimizer import get_sharding


def sharded_parent(path: str) -> Optional[str]:
    """The sharded checkpoint directory ``path`` is a file of, if it is one."""
    parent = os.path.dirname(path.rstrip(os.sep))
    return parent if os.path.isfile(path) and is_sharded_checkpoint(parent) else None


def is_full_checkpoint(path: str, load_full_weights: bool) -> bool:
    """Whether ``path`` is loaded as a single-file checkpoint (see the module docstring for the refusals)."""
    path = local_path(path)
    parent = sharded_parent(path)
    if parent is not None:
        raise CheckpointError(
            f"ckpt_path={path!r} is a file inside the sharded checkpoint {parent}: pass the "
            f"directory, ckpt_path={parent!r}",
            path,
        )
    if load_full_weights and os.path.isdir(path):
        raise CheckpointError(
            f"ckpt_path={path!r} is a directory, but ZeroStrategy(load_full_weights=True) loads a "
            "single checkpoint file: pass the file, or load_full_weights=False to load a sharded "
            "checkpoint directory",
            path,
        )
    return os.path.isfile(path)


def open_full_checkpoint(path: str, layout: Optional[Layout] = None) -> Union[FullCheckpoint, DeepSpeedCheckpoint]:
    """The reader of ``path``: a DeepSpeed ZeRO checkpoint directory, or one file (read through ``layout``, see
    :class:`~lightning_zero.checkpoint.full_file.FullCheckpoint`)."""
    if os.path.isdir(path) and is_deepspeed_checkpoint(path):
        return DeepSpeedCheckpoint(path)
    return FullCheckpoint(path, layout)


def optimizer_target(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> OptimizerTarget:
    """The optimizer as :func:`check_full_optimizer_states` sees it: every module parameter per group, its name,
    and the tensor this rank keeps its state for (``None`` for a parameter another rank steps at stage 1)."""
    names = param_names(module)
    sharding = get_sharding(optimizer)
    params = model_params_per_group(optimizer)
    held = {}
    owners = sharding.owners if sharding is not None else [[-1] * len(group) for group in params]
    rank = sharding.rank if sharding is not None else 0
    for group, group_owners in zip(params, owners):
        for param, owner in zip(group, group_owners):
            if owner in (-1, rank):
                held[id(param)] = held_tensor(sharding, param)
    return OptimizerTarget(
        optimizer, params, [[names[id(p)] for p in group] for group in params], lambda param: held.get(id(param))
    )


def _all_ranks(value: Any) -> list:
    """``value`` from every rank (``[value]`` without a process group), over the gloo control group: Python
    objects on the training group would pickle through device tensors on NCCL (``save_guards.control_group``)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    return all_gather(value, control_group(None))


def _raise_load_error_on_every_rank(error: Optional[Exception]) -> None:
    """Raise the first problem any rank found, on every rank: at stage 1 or in a pipeline a rank checks only what it
    holds, and a rank raising alone would leave the others waiting in the next collective."""
    mine = (
        None
        if error is None
        else str(error)
        if isinstance(error, CheckpointError)
        else f"{type(error).__name__}: {error}"
    )
    found = [message for message in _all_ranks(mine) if message]
    if error is not None:
        raise error
    if found:
        raise CheckpointError(found[0])


@torch.inference_mode(False)  # as load_states: the loaded weights stay normal tensors
def load_full_checkpoint(
    path: str,
    module: torch.nn.Module,
    optimizers: list,
    *,
    strict: bool,
    exclude_frozen_parameters: bool,
    load_full_weights: bool,
    layout: Optional[Layout] = None,
) -> tuple[dict[str, Any], bool]:
    """Load the single-file checkpoint ``path`` into the (sharded) ``module`` and ``optimizers``; return the rest of
    the file and whether the optimizers start fresh (the file held no optimizer states).

    Collective: every rank reads its own slices, after every rank's checks passed. ``strict`` and
    ``exclude_frozen_parameters`` are honoured as for a sharded checkpoint; weights are cast to the module's dtypes.
    With optimizers (resuming a fit) the file's optimizer states are resharded into them; a file without any
    (``save_weights_only``, safetensors, a consolidated file) is refused unless ``load_full_weights=True``, which
    starts the optimizers fresh from the loaded weights, as DeepSpeed's flag of that name does. ``layout``: how
    the file's dict holds the checkpoint when it is not Lightning's (``fabric.load`` of a Fabric checkpoint file).
    """
    path = local_path(path)
    own = module_state_dict(module, optimizers, for_load=True)
    elsewhere = {key for keys in _all_ranks(sorted(own)) for key in keys}  # pipeline stages hold parts of the model
    source: Optional[Union[FullCheckpoint, DeepSpeedCheckpoint]] = None
    error, plans, rest = None, None, {}
    try:
        source = open_full_checkpoint(path, layout)
        rest = source.rest()
        # Weights a save left out (exclude_frozen_parameters), or frozen weights this strategy excludes, may be absent
        optional = set(rest.pop("frozen_parameters_excluded", ()))
        if exclude_frozen_parameters:
            optional |= set(frozen_parameter_names(module))
        if optimizers and source.optimizer_states is None and not load_full_weights:
            raise CheckpointError(
                f"{path}: the file holds no optimizer states (saved with save_weights_only=True, a consolidated or "
                "safetensors file), so fit cannot resume from it. Pass ZeroStrategy(load_full_weights=True) to start "
                "training from its weights with fresh optimizer and LR scheduler states",
                path,
            )
        if optimizers and source.optimizer_states is not None:  # checked before the weights change
            for optimizer in optimizers:
                if not optimizer.state:
                    initialise_optimizer_state(optimizer)
            targets = [optimizer_target(module, o) for o in optimizers]
            if isinstance(source, DeepSpeedCheckpoint):
                source.align_to(targets)  # its states listed in these optimizers' groups, after checking them
            plans = check_full_optimizer_states(targets, source)
        check_full_state_dict(own, source, strict=strict, optional=optional, elsewhere=elsewhere)
    except Exception as err:  # any failure (an unreadable file too) is shared, so that no rank waits alone
        error = err
    try:
        _raise_load_error_on_every_rank(error)
        copy_full_state_dict(own, source)
        module.load_state_dict(own, strict=strict)
        if plans is not None:
            apply_full_optimizer_states(plans)
    finally:
        if source is not None:
            source.close()
    for optimizer in optimizers:
        if (sharding := get_sharding(optimizer)) is not None:
            sharding.sync_masters()  # offloaded stage-1 masters follow the loaded parameters
    return {**rest, "state_dict": own}, bool(optimizers) and plans is None


def _raw_file(path: PathLike, what: str) -> str:
    path = local_path(os.fspath(path))
    if os.path.isdir(path):
        raise CheckpointError(
            f"fabric.load_raw({path!r}, {what}) reads one file (a torch.save state dict or a "
            ".safetensors file); this is a directory: load a sharded checkpoint with "
            "fabric.load(path, {'model': model, 'optimizer': optimizer})",
            path,
        )
    return path


def load_raw_module(path: PathLike, module: torch.nn.Module, *, strict: bool) -> None:
    """``fabric.load_raw(path, module)``: the weights of one file (``torch.save(model.state_dict())``, a Lightning
    or consolidated checkpoint's ``state_dict``, ``.safetensors``) into the (sharded) ``module``, each rank reading
    its slices. Collective; ``strict`` as ``Module.load_state_dict`` (shape mismatches always refused)."""
    load_full_checkpoint(
        _raw_file(path, "module"), module, [], strict=strict, exclude_frozen_parameters=False, load_full_weights=True
    )


class _OptimizerFile:
    """A ``torch.save(optimizer.state_dict())`` file as :func:`check_full_optimizer_states` reads a full checkpoint:
    its ``path`` and ``optimizer_states`` (a list of one). Read with ``weights_only`` and memory-mapped, so a
    rank copies only the slices of the states it keeps."""

    def __init__(self, path: str) -> None:
        self.path = path
        problem = describe_full_checkpoint_file(path) or (
            f"{path}: a .safetensors file holds no optimizer state; fabric.load_raw(path, optimizer) reads a "
            "torch.save(optimizer.state_dict()) file"
            if is_safetensors_file(path)
            else None
        )
        if problem:
            raise CheckpointError(problem, path)
        loaded = safe_torch_load(path, what=path, mmap=True)
        self._check(loaded)
        self.optimizer_states = [loaded]

    def _check(self, loaded: Any) -> None:
        if not isinstance(loaded, dict) or not {"state", "param_groups"} <= set(loaded):
            keys = sorted(map(str, loaded))[:8] if isinstance(loaded, dict) else type(loaded).__name__
            raise CheckpointError(
                f"{self.path}: not an optimizer state dict ('state' and 'param_groups' expected, "
                f"found {keys}); fabric.load_raw(path, optimizer) reads a "
                "torch.save(optimizer.state_dict()) file",
                self.path,
            )


@torch.inference_mode(False)
def load_raw_optimizer(path: PathLike, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``fabric.load_raw(path, optimizer)``: a full optimizer state dict (positions, as
    ``Optimizer.state_dict()`` writes them, or parameter names) into the partitioned/sharded ``optimizer`` of
    ``module``, as ``Optimizer.load_state_dict`` would load it into the unsharded one: each rank keeps the states
    (slices) of what it steps, parameters the file has no state for start fresh, param-group hyper-parameters are
    restored. Every disagreement is refused naming the file (see [Note: optimizer states of a full checkpoint] in
    :mod:`lightning_zero.checkpoint.full_file`). Collective."""
    error, plans = None, None
    try:
        source = _OptimizerFile(_raw_file(path, "optimizer"))
        if not optimizer.state:
            initialise_optimizer_state(optimizer)  # placeholders give each state's layout (see the check)
        plans = check_full_optimizer_states([optimizer_target(module, optimizer)], source)
    except Exception as err:  # shared, so that no rank waits alone in the next collective
        error = err
    _raise_load_error_on_every_rank(error)
    apply_full_optimizer_states(plans)
