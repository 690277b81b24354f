"""Sharded checkpoints for ZeroStrategy: every rank writes only what it holds, keyed by parameter name.

A checkpoint is a directory. Its tensors (module weights, optimizer states) are a ``torch.distributed.checkpoint``
(DCP) checkpoint of ``{"state_dict": {<LightningModule key>: tensor}, "optimizer_states": {"<i>": {"state":
{<parameter name>: {<state key>: tensor}}}}}``; everything else Lightning saves (loops, callbacks, hyper-parameters,
param-group hyper-parameters, LR schedulers) is ``meta.pt``, read back with ``weights_only=True``.

[Note: one layout for every stage]
Optimizer states are keyed by the parameter's name, never by its position in a (possibly partitioned) param group,
and hold DTensors at stages 2-3 and plain tensors at stages 0-1. DCP reshards on load, so a checkpoint written at
any stage and world size loads at any other.

[Note: whose optimizer state dict]
The layout is the one torch's ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` returns with its
default options (``{"state": {name: {key: tensor}}, "param_groups": [{..., "params": [name, ...]}]}``), and where
an optimizer's groups hold exactly the module's parameters (stage 0, stages 2-3 over the FSDP2 shards, stage 3 with
``offload_params``, whose shards are the masters) the states are read and loaded by torch's
``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` as shipped, around the DCP load, as Lightning's
``fabric/strategies/model_parallel.py:_load_checkpoint`` does. Two kinds of optimizer need the name-keyed code
here, because torch's API names only what the groups hold and maps it through ``model.named_parameters()``:
  - fp32 *masters* (optimizer offload, ``bf16-true`` replicas) are no module parameter: its name lookup fails
    (``KeyError``);
  - a stage-1 group holds this rank's partition only, and a rank owning no parameter of a group has an empty
    group, which ``set_optimizer_state_dict`` refuses (``ValueError``, "param groups that have zero parameters").
The name-keyed code also serves where torch's names are not the module's: torch drops a wrapper's prefix
(``_orig_mod.`` of a ``torch.compile``d submodule) that ``module.state_dict()`` keeps, and the optimizer's states
must be keyed as the weights of the same checkpoint and of checkpoints written at any other stage.
Torch's load goes through ``Optimizer.load_state_dict``, which replaces the param-group dicts and the state dict
with new ones: nothing in the package keeps a reference to either (LR schedulers and Lightning's and Fabric's
optimizer wrappers read them through the optimizer).
One exception to "as shipped": a save before the optimizer's first step reads no state at all, where torch's API
would first create the states with a zero step (``_init_optim_state``) that counts as a step in Adam's bias
correction and changes the training that follows.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from lightning_zero.checkpoint.consolidate import WEIGHTS_16BIT_FILE, write_16bit_weights
from lightning_zero.checkpoint.directory import read_checkpoint_info
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.hf_export import describe_hf_models
from lightning_zero.checkpoint.io import load_sharded_states, save_sharded_checkpoint
from lightning_zero.checkpoint.safe_load import read_dcp_metadata
from lightning_zero.distributed.optimizer import get_sharding, master_holders
from lightning_zero.offload.optimizer_swapper import resident_states
from lightning_zero.torch_compat import optimizer_step_hooks_suspended


def module_state_dict(module: torch.nn.Module, optimizers=(), *, for_load: bool = False) -> dict[str, Tensor]:
    """The module's state dict: sharded DTensors at stages 2-3, plain tensors at stages 0-1.

    Where ``optimizers`` keep fp32 masters of lower-precision parameters (``bf16-true`` at stages 0-1, the
    ``[Note: where the fp32 values live under bf16-true at stages 0-1]``), a parameter's entry is its master: what
    the run trains and what a checkpoint must hold. At stage 1 a rank holds only the masters it steps, so the entries
    of the others are left to their owners (``for_load=False``: a save, which DCP assembles from every rank) or kept
    as the replicas (``for_load=True``: a load target, which DCP casts into). The optimizers holding masters of
    ``module`` are found without ``optimizers`` too (:func:`~lightning_zero.distributed.optimizer.master_holders`)."""
    state = module.state_dict()
    shardings = [get_sharding(getattr(optimizer, "_optimizer", optimizer)) for optimizer in optimizers]
    shardings += [s for s in master_holders(module) if all(s is not f for f in shardings)]
    names = _all_names(module)
    for sharding in shardings:
        if sharding is None or not (sharding.masters or sharding.masters_elsewhere) or sharding.swaps_masters():
            continue  # swapped masters are on disk between steps; their parameters are saved
        for param in sharding.all_model_params():
            if param.dtype == torch.float32:
                continue  # an fp32 parameter equals its master after every step
            for name in names.get(id(param), ()):
                if name not in state:
                    continue
                if id(param) in sharding.masters:
                    state[name] = sharding.masters[id(param)].detach()
                elif id(param) in sharding.masters_elsewhere and not for_load:
                    del state[name]  # its owner saves the fp32 value
    return state


def _all_names(module: torch.nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def frozen_parameter_names(module: torch.nn.Module) -> list[str]:
    """State-dict keys of the parameters with ``requires_grad=False`` (every name of a shared one)."""
    return sorted({name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad})


def param_names(module: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def held_tensor(sharding, param):
    """The tensor the optimizer steps for a module parameter (itself, or its offloaded master)."""
    if sharding is not None and id(param) in sharding.masters:
        return sharding.masters[id(param)]
    return param


def model_params_per_group(optimizer) -> list[list[Tensor]]:
    sharding = get_sharding(optimizer)
    if sharding is not None:
        return sharding.model_params
    return [list(g["params"]) for g in optimizer.param_groups]


def holds_module_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the groups of ``optimizer`` hold exactly the module's parameters, each where the module has it (no
    stage-1 partition, no fp32 masters): torch's optimizer state-dict API serves it
    (``[Note: whose optimizer state dict]``)."""
    sharding = get_sharding(optimizer)
    if sharding is None:
        return True
    if sharding.masters or sharding.masters_elsewhere:
        return False
    held = [[id(p) for p in group["params"]] for group in optimizer.param_groups]
    return held == [[id(p) for p in params] for params in sharding.model_params]


def _named_groups(names: dict[int, str], optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups' hyper-parameters, each group's ``params`` as the names of every module parameter in it."""
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in params]}
        for group, params in zip(optimizer.param_groups, model_params_per_group(optimizer))
    ]


def _torch_state_dict(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> Optional[dict[str, Any]]:
    """``get_optimizer_state_dict(module, optimizer)`` where torch's API serves ``optimizer`` and names its
    parameters as the module does (``[Note: whose optimizer state dict]``); ``None`` where the name-keyed code must."""
    if not holds_module_parameters(optimizer) or not optimizer.state:
        return None
    theirs = get_optimizer_state_dict(module, optimizer)
    ours = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    if [group["params"] for group in theirs["param_groups"]] != ours:
        return None  # torch's names drop a wrapper's prefix (_orig_mod., _checkpoint_wrapped_module.) the weights keep
    return theirs


def _read_optimizer_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> tuple[dict[str, Any], bool]:
    """:func:`optimizer_state_dict`, and whether torch's API read it (its load must then be torch's too)."""
    resident_states(optimizer)  # NVMe-swapped states are read back (the next step writes them out again)
    theirs = _torch_state_dict(module, optimizer, names)
    if theirs is not None:
        return theirs, True
    sharding = get_sharding(optimizer)
    state: dict[str, dict[str, Any]] = {}
    for params in model_params_per_group(optimizer):
        for param in params:
            held = held_tensor(sharding, param)
            if held in optimizer.state:
                state[names[id(param)]] = dict(optimizer.state[held])
    return {"state": state, "param_groups": _named_groups(names, optimizer)}, False


def optimizer_state_dict(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Optimizer state keyed by parameter name; param groups list names instead of positions
    (``[Note: whose optimizer state dict]``)."""
    return _read_optimizer_state(module, optimizer, param_names(module))[0]


def initialise_optimizer_state(optimizer: torch.optim.Optimizer, frozen_with_states: frozenset = frozenset()) -> None:
    """Create state tensors (zeros) so DCP has something to load into: one step with lr 0 on zero gradients, for
    the tensors that require a gradient and those of ``frozen_with_states`` (ids: frozen after they had states,
    which the checkpoint holds).

    The partition/offload step hooks are bypassed: the step touches only what the optimizer holds. Masters swapped
    to NVMe (optimizer-only NVMe offload) are empty between steps and the swapped step takes their gradients from
    their module parameters, so those get the zero gradients instead.
    """
    sharding = get_sharding(optimizer)
    companions = sharding.swapper.companions if sharding is not None and sharding.swaps_masters() else {}
    given: list[Tensor] = []
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    with optimizer_step_hooks_suspended(optimizer):
        try:
            for group in optimizer.param_groups:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], Tensor) else 0.0
                for p in group["params"]:
                    target = companions.get(id(p), p)  # a swapped master reads its module parameter's gradient
                    if target.grad is None and (p.requires_grad or id(p) in frozen_with_states):
                        target.grad = torch.zeros_like(target)
                        given.append(target)
            optimizer.step()
        finally:
            for target in given:
                target.grad = None
            for group, lr in zip(optimizer.param_groups, saved_lr):
                group["lr"] = lr
                for p in group["params"]:
                    p.grad = None


def save_states(
    checkpoint: dict[str, Any],
    filepath: str,
    *,
    module: torch.nn.Module,
    optimizers: list,
    stage: int,
    offload: Any,
    exclude_frozen_parameters: bool,
    ds_config_report: Optional[dict],
    async_save: bool,
    weights_16bit: Optional[torch.dtype] = None,
) -> None:
    """Write ``checkpoint`` (a dict holding ``state_dict`` and ``optimizer_states`` as :func:`module_state_dict` and
    :func:`optimizer_state_dict` return them, and plain values) as a sharded directory; the twin of
    :func:`load_states`, called by both adapters. ``module`` and ``optimizers`` are those the states come from
    (recorded: frozen parameter names, optimizer types, Hugging Face models); ``stage``, ``offload`` and
    ``ds_config_report`` (the effective DeepSpeed config) are recorded in ``zero.json``; see the module docstring
    for the layout.

    Goes through :func:`lightning_zero.checkpoint.save_sharded_checkpoint`, so the save is atomic (a crash leaves the
    previous checkpoint at ``filepath`` loadable) and asynchronous with ``async_save=True``.

    ``weights_16bit`` (a ds_config's ``stage3_gather_16bit_weights_on_model_save``): the checkpoint also holds
    ``pytorch_model.bin``, the saved weights unsharded in that dtype
    (:func:`~lightning_zero.checkpoint.consolidate.write_16bit_weights`, rank 0, streamed from the shards just
    written: with ``async_save`` it is written in the background too).
    """
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    if exclude_frozen_parameters:  # as DeepSpeed's exclude_frozen_parameters; recorded for load
        excluded = [k for k in frozen_parameter_names(module) if k in tensors["state_dict"]]
        tensors["state_dict"] = {k: v for k, v in tensors["state_dict"].items() if k not in excluded}
        checkpoint["frozen_parameters_excluded"] = excluded
    optimizer_states = checkpoint.pop("optimizer_states", [])
    tensors["optimizer_states"] = {str(i): {"state": osd["state"]} for i, osd in enumerate(optimizer_states)}
    checkpoint["optimizer_param_groups"] = [osd["param_groups"] for osd in optimizer_states]
    info = {"stage": stage, "offload": offload, "optimizers": [optimizer_type(o) for o in optimizers]}
    if ds_config_report is not None:
        info["ds_config"] = ds_config_report  # the effective DeepSpeed config, next to the weights
    info.update(describe_hf_models(module))  # for `consolidate --hf` (prefix, config, ties)
    extra_files, extra_bytes = None, 0
    if weights_16bit is not None:
        info["weights_16bit"] = {"file": WEIGHTS_16BIT_FILE, "dtype": str(weights_16bit).replace("torch.", "")}
        extra_files = functools.partial(write_16bit_weights, dtype=weights_16bit)
        extra_bytes = sum(
            value.numel() * weights_16bit.itemsize
            for value in tensors["state_dict"].values()
            if isinstance(value, Tensor)
        )  # DTensor.numel(): the full tensor's
    save_sharded_checkpoint(
        filepath,
        tensors,
        checkpoint,
        async_save=async_save,
        info=info,
        extra_files=extra_files,
        extra_bytes=extra_bytes,
    )


def optimizer_type(optimizer) -> str:
    """``module.Class`` of the optimizer Lightning wraps, as recorded in ``zero.json``."""
    inner = type(getattr(optimizer, "_optimizer", optimizer))
    return f"{inner.__module__}.{inner.__qualname__}"


def _check_optimizers(directory: str, optimizers: list, saved_groups: list, saved_types) -> None:
    """Refuse a resume whose optimizers differ in number or type from the checkpoint's: loading states of
    another count would silently drop some, and another type's states are not what the optimizer steps with."""
    if len(optimizers) != len(saved_groups):
        hint = (
            " (it holds none: was it saved with save_weights_only=True?)"
            if not saved_groups
            else "; configure_optimizers must return as many optimizers as when it was saved"
        )
        raise CheckpointError(
            f"{directory}: the checkpoint holds the states of {len(saved_groups)} optimizer(s), "
            f"the model being resumed has {len(optimizers)}{hint}",
            directory,
        )
    current = [optimizer_type(o) for o in optimizers]
    if isinstance(saved_types, list) and saved_types != current:
        pairs = [f"#{i}: checkpoint {a}, now {b}" for i, (a, b) in enumerate(zip(saved_types, current)) if a != b]
        raise CheckpointError(
            f"{directory}: optimizer type mismatch ({'; '.join(pairs)}): the stored states are "
            "those of another optimizer",
            directory,
        )


def _params_with_stored_state(metadata: Any, count: int) -> list[set[str]]:
    """For each of ``count`` optimizers, the names of the parameters the checkpoint holds a state for.

    A checkpoint saved before an optimizer's first step (``Tuner.lr_find`` saves one) holds none, and a parameter
    that never received a gradient has none either: those are requested from the checkpoint by no one."""
    stored = metadata.state_dict_metadata  # the checkpoint's DCP .metadata
    found: list[set[str]] = []
    for i in range(count):
        prefix = f"optimizer_states.{i}.state."
        # "<prefix><parameter name>.<state key>"; state keys (exp_avg, step, ...) hold no dots, parameter names do
        found.append({key[len(prefix) :].rsplit(".", 1)[0] for key in stored if key.startswith(prefix)})
    return found


def _restore_optimizer(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loaded: dict[str, Any],
    saved_groups: list,
    directory: str,
    through_torch: bool,
) -> None:
    """Give ``optimizer`` the states DCP loaded (``loaded``, by name: only those the checkpoint holds) and the saved
    param groups' hyper-parameters, group by group in order, with ``set_optimizer_state_dict`` where
    ``through_torch`` (the states were read with torch's API), else by name. A parameter the checkpoint holds no
    state for (a save before the first step, as ``Tuner.lr_find`` makes, or a parameter that never had a gradient)
    starts fresh, as after ``Optimizer.load_state_dict`` without it: the placeholder from
    :func:`initialise_optimizer_state` would step it as if one step had already been taken (Adam's bias
    correction). A group's keys the saved group lacks (one a newer torch added) keep their current values."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{directory}: the checkpoint's {optimizer_type(optimizer)} has {len(saved_groups)} param group(s), "
            f"this one {len(optimizer.param_groups)}: configure_optimizers must build the groups it was saved with",
            directory,
        )
    names = param_names(module)
    if through_torch:
        groups = [
            {**group, **saved, "params": [names[id(p)] for p in group["params"]]}
            for group, saved in zip(optimizer.param_groups, saved_groups)
        ]
        # strict=False: the parameters without a stored state are those that start fresh
        state_dict = {"state": loaded, "param_groups": groups}
        set_optimizer_state_dict(module, optimizer, state_dict, options=StateDictOptions(strict=False))
        # torch's load leaves out the states of parameters that no longer require a gradient; the optimizer's own
        # load_state_dict (DDP's, Lightning's one-file checkpoints) keeps them, so a parameter unfrozen later
        # resumes its moments
        for param in (p for group in optimizer.param_groups for p in group["params"] if not p.requires_grad):
            if names[id(param)] in loaded:
                optimizer.state[param] = loaded[names[id(param)]]
        return
    sharding = get_sharding(optimizer)
    for params in model_params_per_group(optimizer):
        for param in params:
            if names[id(param)] not in loaded:
                optimizer.state.pop(held_tensor(sharding, param), None)
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if sharding is not None:
        sharding.sync_masters()  # the module's parameters were loaded; offloaded masters follow them


def _frozen_with_states(module: torch.nn.Module, optimizer: torch.optim.Optimizer, stored: set[str]) -> frozenset:
    """Ids of the tensors ``optimizer`` steps for the frozen parameters whose states the checkpoint holds."""
    names, sharding = param_names(module), get_sharding(optimizer)
    return frozenset(
        id(held_tensor(sharding, param))
        for params in model_params_per_group(optimizer)
        for param in params
        if not param.requires_grad and names[id(param)] in stored
    )


@torch.inference_mode(False)
def load_states(
    directory: str, meta: dict[str, Any], module: torch.nn.Module, optimizers: list, strict: bool
) -> dict[str, Any]:
    """Load the weights and optimizer states of a sharded checkpoint into ``module`` and ``optimizers`` in place
    (both adapters' loads); pops the entries it consumes from ``meta`` and returns the loaded state dict.

    Always outside inference mode: ``trainer.test(ckpt_path=...)`` called inside ``torch.inference_mode()`` (as
    Lightning's own tests do) loads there, and the weights must stay normal tensors that training can update again;
    detaching a sharded parameter inside it fails ("Cannot set version_counter for inference tensor")."""
    wrapped, optimizers = optimizers, [getattr(o, "_optimizer", o) for o in optimizers]
    own = module_state_dict(module, optimizers, for_load=True)
    # Weights the checkpoint left out (exclude_frozen_parameters) are not in it: the module keeps its own.
    excluded = set(meta.pop("frozen_parameters_excluded", ()))
    target: dict[str, Any] = {"state_dict": {k: v for k, v in own.items() if k not in excluded}}
    saved_groups = meta.pop("optimizer_param_groups", [])
    info = metadata = None  # read once here when needed, and handed to the load (which reads them otherwise)
    if optimizers:
        info, metadata = read_checkpoint_info(directory), read_dcp_metadata(directory)
        _check_optimizers(directory, wrapped, saved_groups, info.get("optimizers"))
        stored_states = _params_with_stored_state(metadata, len(optimizers))
        target["optimizer_states"] = {}
        through_torch: list[bool] = []
        for i, optimizer in enumerate(optimizers):
            if not optimizer.state:
                initialise_optimizer_state(optimizer, _frozen_with_states(module, optimizer, stored_states[i]))
            read, by_torch = _read_optimizer_state(module, optimizer, param_names(module))
            through_torch.append(by_torch)
            states = read["state"]
            # Only the states the checkpoint holds are read; the others start fresh (_restore_optimizer).
            target["optimizer_states"][str(i)] = {
                "state": {name: state for name, state in states.items() if name in stored_states[i]}
            }
    load_sharded_states(directory, target, strict=strict, info=info, metadata=metadata)
    kept = {k: v for k, v in own.items() if k in excluded}
    module.load_state_dict({**target["state_dict"], **kept}, strict=strict)
    for i, (optimizer, groups) in enumerate(zip(optimizers, saved_groups)):
        loaded = target["optimizer_states"][str(i)]["state"]
        _restore_optimizer(module, optimizer, loaded, groups, directory, through_torch=through_torch[i])
    return target["state_dict"]
