"""``fabric.save`` / ``fabric.load`` for the Fabric ZeroStrategy, on the Trainer strategy's sharded format.

A Fabric state ``{"model": module, "optimizer": optimizer, "step": 3, ...}`` is written as the Trainer strategy
writes a Lightning checkpoint (:mod:`lightning_zero.checkpoint.states`): the module's weights under
``state_dict`` and the optimizers' states keyed by parameter name under ``optimizer_states`` (DCP, every rank its
shards), everything else in ``meta.pt`` (``weights_only``). So the save is atomic and verified, a load reshards
across world sizes and stages, and ``lightning-zero consolidate`` turns it into one file whose ``state_dict`` loads
straight into the unwrapped module.

Several modules in one state (a GAN's generator and discriminator) are stored as one ``ModuleDict``: their weights
under ``<key>.<name>``. ``meta.pt`` records which state keys held the modules and the optimizers
(``fabric_state_keys``), so a load puts each back into the object of the same key.

[Note: Fabric checkpoint files]
``fabric.load`` also reads one file into the state's sharded objects, each rank reading its slices
(:func:`lightning_zero.checkpoint.load_full.load_full_checkpoint`), as Lightning's FSDP strategy does. Two layouts:
Fabric's own, what ``fabric.save`` writes under a single-device or DDP strategy (each module's state dict and each
optimizer's ``Optimizer.state_dict()`` under its state key, the plain values beside them), which
``ZeroStrategy(state_dict_type="full")`` writes too (:func:`as_fabric_file`, so a single-device Fabric loads it);
and a ZeroStrategy checkpoint consolidated by ``lightning-zero consolidate`` (Lightning's ``state_dict`` and
``optimizer_states``, with ``fabric_state_keys``). A module or optimizer of the state the file lacks is refused by
name; its other entries are returned, or put into the state's plain values.

``fabric.load`` also reads a directory that Fabric's ``DeepSpeedStrategy`` saved (one module, at most one
optimizer, the rest as DeepSpeed's client state): :mod:`lightning_zero.checkpoint.deepspeed_resume`, through the
full-checkpoint loader, each rank reading its slices at any stage and world size.

[Note: async saves under Fabric]
With ``async_save=True`` ``fabric.save`` returns once the state is staged to CPU; DCP writes on a background thread
and rank 0 commits ``zero.json`` (atomic swap) in the background once every rank's shards are written. The write
is awaited, collectively, by the next ``fabric.save`` and by ``fabric.load`` (so every rank sees the committed
directory before reading it), by ``fabric.strategy.wait_for_checkpoints()`` and by ``strategy.teardown()``. A
script that ends without either is covered by an ``atexit`` handler that waits locally on every rank (no collective
can run at exit; none is needed, see :func:`lightning_zero.checkpoint.io.settle_pending_saves`), warns that the
save was still pending and reports a failed one on stderr instead of losing it silently.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.adapters.settings import checkpoint_save_options
from lightning_zero.checkpoint import states as checkpointing
from lightning_zero.checkpoint.atomic import local_path
from lightning_zero.checkpoint.deepspeed_reader import is_deepspeed_checkpoint
from lightning_zero.checkpoint.deepspeed_resume import LOSS_SCALER_KEY
from lightning_zero.checkpoint.directory import checkpoint_directory, is_sharded_checkpoint
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.full_file import FullCheckpoint, Layout
from lightning_zero.checkpoint.full_save import FULL_FILE_MARKER, save_full_file
from lightning_zero.checkpoint.io import pending_save_paths, settle_pending_saves, wait_for_pending_saves
from lightning_zero.checkpoint.load_full import (
    is_full_checkpoint,
    load_full_checkpoint,
    load_raw_module,
    load_raw_optimizer,
)
from lightning_zero.checkpoint.safe_load import load_meta
from lightning_zero.checkpoint.states import model_params_per_group

KEYS = "fabric_state_keys"  # {"modules": [key, ...], "optimizers": [key, ...]} in meta.pt
SCALER = "fabric_loss_scaler"  # the fp16 loss scaler's state (plain numbers)
# Every top-level key the checkpoint holds besides the user's plain values, and what it holds: a plain value under
# one of these names would be written over (or crash the save), so it is refused by name, on save and on load.
# (states.save_states writes the last two; tests/fabric/test_fabric_raw_loads.py checks that this list is complete.)
RESERVED = {
    "state_dict": "the modules' weights",
    "optimizer_states": "the optimizers' states",
    KEYS: "which keys held modules and optimizers",
    SCALER: "the fp16 loss scaler",
    "optimizer_param_groups": "the optimizers' param groups",
    "frozen_parameters_excluded": "the frozen weights left out (exclude_frozen_parameters)",
    FULL_FILE_MARKER: "the mark of a state_dict_type='full' file",
}


def _unwrap(module: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def _split(state: dict[str, Any]) -> tuple[list[str], list[str]]:
    modules = [key for key, value in state.items() if isinstance(value, nn.Module)]
    optimizers = [key for key, value in state.items() if isinstance(value, Optimizer)]
    if optimizers and not modules:
        raise ValueError(
            f"the state holds optimizers {optimizers} but no module: their states are keyed by the "
            "module's parameter names, so put the module in the same state"
        )
    if len(modules) > 1 and any("." in key or not key for key in modules):
        raise ValueError(
            f"with several modules each one's weights are stored under '<key>.', so the keys "
            f"{modules} must be non-empty and hold no '.'"
        )
    return modules, optimizers


def _refuse_reserved_keys(state: dict[str, Any], modules: list[str], optimizers: list[str], call: str) -> None:
    """A plain value whose key the checkpoint uses itself is refused, naming it (modules and optimizers are stored
    by kind, so any key is theirs to take)."""
    taken = [key for key in state if key in RESERVED and key not in modules and key not in optimizers]
    if taken:
        held = "; ".join(f"{key!r} holds {RESERVED[key]}" for key in taken)
        raise ValueError(
            f"{call} with a ZeroStrategy: the state key(s) {taken} are names the checkpoint uses "
            f"itself ({held}), so the value would be lost or break the checkpoint; rename the key(s)"
        )


def _module_view(state: dict[str, Any], keys: list[str]) -> nn.Module:
    """The module whose state dict is the checkpoint's ``state_dict``: the state's one module (its own parameter
    names, so a consolidated file loads straight into it), or several as a ``ModuleDict`` (``<key>.<name>``)."""
    if len(keys) == 1:
        return _unwrap(state[keys[0]])
    return nn.ModuleDict({key: _unwrap(state[key]) for key in keys}) if keys else nn.Module()


def save(
    path: str,
    state: dict[str, Any],
    filter: Optional[dict[str, Callable[[str, Any], bool]]],
    *,
    precision,
    zero_config,
    exclude_frozen_parameters: bool,
    ds_config_report: Optional[dict],
    async_save: bool,
    weights_16bit: Optional[torch.dtype] = None,
    state_dict_type: str = "sharded",
    rank: int = 0,
) -> None:
    """Write ``state`` as a sharded checkpoint directory at ``path`` (collective: every rank calls it), with the fp16
    loss scaler of the strategy's ``precision`` plugin and the run's settings recorded (``zero.json``).
    ``weights_16bit``: also write the saved (filtered) weights unsharded in that dtype, as ``pytorch_model.bin``
    (:func:`lightning_zero.checkpoint.states.save_states`). ``state_dict_type="full"``: one file in Fabric's layout
    instead, written by ``rank`` 0 (:func:`lightning_zero.checkpoint.full_save.save_full_file`)."""
    module_keys, optimizer_keys = _split(state)
    _refuse_reserved_keys(state, module_keys, optimizer_keys, "fabric.save")
    if filter and set(filter) - set(module_keys):
        raise NotImplementedError(
            f"fabric.save(filter=...) applies to modules' weights here; the filter keys "
            f"{sorted(set(filter) - set(module_keys))} are not modules"
        )
    module = _module_view(state, module_keys)
    checkpoint: dict[str, Any] = {}
    optimizers = [state[key] for key in optimizer_keys]
    weights = checkpointing.module_state_dict(module, optimizers)
    for key, keep in (filter or {}).items():
        prefix = "" if len(module_keys) == 1 else f"{key}."
        weights = {
            name: tensor
            for name, tensor in weights.items()
            if not name.startswith(prefix) or keep(name[len(prefix) :], tensor)
        }
    checkpoint["state_dict"] = weights
    checkpoint["optimizer_states"] = [checkpointing.optimizer_state_dict(module, o) for o in optimizers]
    for key, value in state.items():
        if key in module_keys or key in optimizer_keys:
            continue
        checkpoint[key] = value.state_dict() if callable(getattr(value, "state_dict", None)) else value
    checkpoint[KEYS] = {"modules": module_keys, "optimizers": optimizer_keys}
    if precision.scaler is not None:
        checkpoint[SCALER] = precision.state_dict()

    def save_sharded(states: dict[str, Any], directory: str) -> None:
        checkpointing.save_states(
            states,
            directory,
            module=module,
            optimizers=optimizers,
            stage=zero_config.stage,
            offload=zero_config.offload,
            exclude_frozen_parameters=exclude_frozen_parameters,
            ds_config_report=ds_config_report,
            async_save=async_save,
            weights_16bit=weights_16bit,
        )

    if state_dict_type == "full":  # one file in Fabric's layout, streamed out of the shards (full_save.py)
        save_full_file(
            checkpoint, path, save_sharded, rank=rank, with_optimizer=bool(optimizers), layout=as_fabric_file
        )
        return
    save_sharded(checkpoint, path)
    if async_save:
        _await_at_exit()


def save_with_settings(
    path: str, state: dict[str, Any], filter: Optional[dict], settings: Any, precision, rank: int
) -> None:
    """:func:`save` with what the strategy's ``settings`` (``ZeroSettings``) say of a save: stage and offload, frozen
    parameters, async, ``state_dict_type`` and the ds_config's save options at the ``precision`` plugin's flag."""
    save(
        path,
        state,
        filter,
        precision=precision,
        zero_config=settings.zero_config,
        exclude_frozen_parameters=settings.exclude_frozen_parameters,
        async_save=settings.async_save,
        state_dict_type=settings.state_dict_type,
        rank=rank,
        **checkpoint_save_options(settings.ds_config, precision.precision),
    )


def as_fabric_file(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The Lightning checkpoint dict a consolidation builds (weights under ``state_dict``, optimizer states in
    ``Optimizer.state_dict()`` form under ``optimizer_states``) laid out as Fabric's one-file checkpoint: each module's
    state dict and each optimizer's state under the key the state gave it, the plain values beside them (see
    [Note: Fabric checkpoint files])."""
    keys = checkpoint.pop(KEYS)
    weights = checkpoint.pop("state_dict")
    states = checkpoint.pop("optimizer_states", None) or []
    checkpoint.pop("optimizer_param_groups", None)  # lightning-zero's own record, now in the optimizers' states
    if not checkpoint.get("frozen_parameters_excluded"):
        checkpoint.pop("frozen_parameters_excluded", None)
    laid_out: dict[str, Any] = {}
    modules = keys["modules"]
    if len(modules) == 1:
        laid_out[modules[0]] = weights
    else:  # several modules are stored under <key>.<name>
        for key in modules:
            laid_out[key] = {
                name[len(key) + 1 :]: value for name, value in weights.items() if name.startswith(key + ".")
            }
    laid_out.update(zip(keys["optimizers"], states))
    laid_out.update(checkpoint)
    return laid_out


def _await_at_exit() -> None:
    # Registered again after every async save, so it is the newest handler and runs first (atexit is last-in
    # first-out): before the checkpoint module's release of its gloo groups and Lightning's destroy_process_group,
    # both registered earlier, which the background write still needs.
    atexit.unregister(settle_saves_at_exit)
    atexit.register(settle_saves_at_exit)


def settle_saves_at_exit() -> None:
    """Finish this process's pending async saves at interpreter exit (see the note above); never silent."""
    pending = pending_save_paths()
    if not pending:
        return
    print(
        f"lightning-zero: the process is exiting with async checkpoint save(s) still pending ({pending}); waiting "
        "for them here. Call fabric.strategy.wait_for_checkpoints() or strategy.teardown() before the end of the "
        "script to wait collectively and get a failure as an exception",
        file=sys.stderr,
        flush=True,
    )
    for message in settle_pending_saves():
        print(f"lightning-zero: an async checkpoint save FAILED: {message}", file=sys.stderr, flush=True)


def load(
    path: str,
    state: Optional[dict[str, Any]],
    strict: bool,
    *,
    precision,
    async_save: bool,
    exclude_frozen_parameters: bool,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` (a sharded directory, one file: see [Note: Fabric checkpoint files], or a
    DeepSpeed directory) into the objects of ``state`` in place (and the fp16 loss scaler into the strategy's
    ``precision`` plugin); return what was not loaded. ``async_save``: saves may still be pending.

    Plain values in ``state`` are replaced by the saved ones (Fabric copies them back into the caller's dict)."""
    if not state:
        raise ValueError(
            "fabric.load with a ZeroStrategy loads sharded states into existing objects: pass them, "
            "e.g. fabric.load(path, {'model': model, 'optimizer': optimizer}); to read the whole "
            "checkpoint in one process use `lightning-zero consolidate` and torch.load"
        )
    _refuse_reserved_keys(state, *_split(state), "fabric.load")
    # Collective with async_save (fabric.load runs on every rank): rank 0 commits an async save in the background,
    # so another rank must not read the path before that commit, or it would load the checkpoint the save replaces.
    wait_for_pending_saves(barrier=bool(async_save))
    _refuse_a_file_inside_a_checkpoint(path)
    if is_deepspeed_checkpoint(path):
        return _load_deepspeed(
            path, state, strict, precision=precision, exclude_frozen_parameters=exclude_frozen_parameters
        )
    if is_full_checkpoint(path, load_full_weights=False):
        return _load_file(
            local_path(path), state, strict, precision=precision, exclude_frozen_parameters=exclude_frozen_parameters
        )
    directory = checkpoint_directory(path)
    meta = load_meta(directory)
    saved = meta.pop(KEYS, None)
    if saved is None:
        raise CheckpointError(
            f"{directory} was not written by fabric.save (no {KEYS!r}); a Trainer checkpoint "
            "loads with Trainer.fit(ckpt_path=...) or LightningModule.load_from_checkpoint",
            directory,
        )
    scaler_state = meta.pop(SCALER, None)
    module_keys, optimizer_keys = _split(state)
    if module_keys and module_keys != saved["modules"]:
        raise KeyError(
            f"the state's modules are {module_keys}, the checkpoint holds {saved['modules']} (pass all "
            "of them, under the same keys)"
        )
    if optimizer_keys and optimizer_keys != saved["optimizers"]:
        raise KeyError(
            f"the state's optimizers are {optimizer_keys}, the checkpoint holds {saved['optimizers']} "
            "(pass all of them, under the same keys, or none)"
        )
    if not optimizer_keys:
        meta.pop("optimizer_param_groups", None)  # weights only
    if module_keys:
        optimizers = [state[key] for key in optimizer_keys]
        checkpointing.load_states(directory, meta, _module_view(state, module_keys), optimizers, strict=strict)
    if scaler_state is not None and precision.scaler is not None:
        precision.load_state_dict(scaler_state)
    _restore_values(directory, state, meta, module_keys + optimizer_keys, strict)
    return meta


def _refuse_a_file_inside_a_checkpoint(path: str) -> None:
    """A file inside a checkpoint directory (a shard or ``meta.pt`` of a sharded checkpoint, a file in a DeepSpeed
    checkpoint's tag folder) is refused naming the directory to pass."""
    local = local_path(path)
    if not os.path.isfile(local):
        return
    parent = os.path.dirname(local)
    grandparent = os.path.dirname(parent)
    for directory in (
        parent if is_sharded_checkpoint(parent) else None,
        grandparent if is_deepspeed_checkpoint(grandparent) else None,
        parent if is_deepspeed_checkpoint(parent) else None,
    ):
        if directory is not None:
            raise CheckpointError(
                f"fabric.load({path!r}): a file inside the checkpoint {directory}; pass the "
                f"directory: fabric.load({directory!r}, state)",
                local,
            )


def _file_layout(path: str, module_keys: list[str], optimizer_keys: list[str]) -> Layout:
    """How one checkpoint file holds the state's objects (see [Note: Fabric checkpoint files])."""

    def layout(loaded: Any) -> tuple[dict[str, Any], Optional[list], dict[str, Any]]:
        if not isinstance(loaded, dict):
            raise CheckpointError(
                f"{path}: not a Fabric checkpoint (a dict of the saved objects), got {type(loaded).__name__}", path
            )
        if isinstance(loaded.get(KEYS), dict) and isinstance(loaded.get("state_dict"), dict):
            return _consolidated_layout(path, loaded, module_keys, optimizer_keys)
        absent = [key for key in module_keys + optimizer_keys if not isinstance(loaded.get(key), dict)]
        if absent:
            raise CheckpointError(
                f"{path} holds no state dict under {absent} (its keys: {sorted(map(str, loaded))[:8]}"
                "); fabric.load(path, state) needs each module and optimizer under the key it was "
                "saved with, and fabric.load_raw(path, model) reads a bare state dict file",
                path,
            )
        if len(module_keys) == 1:
            weights = loaded[module_keys[0]]
        else:  # several modules: as the sharded layout's ModuleDict view, <key>.<name>
            weights = {f"{key}.{name}": value for key in module_keys for name, value in loaded[key].items()}
        states = [loaded[key] for key in optimizer_keys] if optimizer_keys else None
        rest = {key: value for key, value in loaded.items() if key not in module_keys and key not in optimizer_keys}
        return weights, states, rest

    return layout


def _consolidated_layout(path: str, loaded: dict, module_keys: list[str], optimizer_keys: list[str]):
    """A ZeroStrategy checkpoint consolidated into one file: Lightning's keys, and which state keys held what."""
    saved = loaded[KEYS]
    if (module_keys and module_keys != saved.get("modules")) or (
        optimizer_keys and optimizer_keys != saved.get("optimizers")
    ):
        raise CheckpointError(
            f"{path} holds the modules {saved.get('modules')} and optimizers "
            f"{saved.get('optimizers')}; the state passes {module_keys} and {optimizer_keys} (pass "
            "all the modules or none, and all the optimizers or none, under the same keys)",
            path,
        )
    states = loaded.get("optimizer_states")
    if optimizer_keys and not isinstance(states, list):
        raise CheckpointError(
            f"{path} holds no optimizer states (consolidated without with_optimizer=True): load the modules alone", path
        )
    rest = {key: value for key, value in loaded.items() if key not in ("state_dict", "optimizer_states", KEYS)}
    return loaded["state_dict"], (states if optimizer_keys else None), rest


def _load_file(
    path: str, state: dict[str, Any], strict: bool, *, precision, exclude_frozen_parameters: bool
) -> dict[str, Any]:
    """``fabric.load`` of one file into the state's (sharded) objects, each rank reading its slices; returns the
    file's other entries."""
    module_keys, optimizer_keys = _split(state)
    layout = _file_layout(path, module_keys, optimizer_keys)
    if module_keys:
        rest, _ = load_full_checkpoint(
            path,
            _module_view(state, module_keys),
            [state[key] for key in optimizer_keys],
            strict=strict,
            exclude_frozen_parameters=exclude_frozen_parameters,
            load_full_weights=False,
            layout=layout,
        )
        rest.pop("state_dict")
    else:
        source = FullCheckpoint(path, layout)
        rest = source.rest()
        source.close()
    rest.pop(FULL_FILE_MARKER, None)
    scaler_state = rest.pop(SCALER, None)
    if scaler_state is not None and precision.scaler is not None:
        precision.load_state_dict(scaler_state)
    _restore_values(path, state, rest, module_keys + optimizer_keys, strict)
    return rest


def _restore_values(where: str, state: dict[str, Any], saved: dict[str, Any], loaded: list[str], strict: bool) -> None:
    """Put the saved values into ``state``'s other entries (stateful objects through ``load_state_dict``), popping
    them from ``saved``; with ``strict``, one the checkpoint lacks is an error."""
    for key, target in state.items():
        if key in loaded:
            continue
        if key not in saved:
            if strict:
                raise KeyError(f"{key!r} is not in the checkpoint {where} (it holds {sorted(saved)})")
            continue
        value = saved.pop(key)
        if callable(getattr(target, "load_state_dict", None)):
            target.load_state_dict(value)
        else:
            state[key] = value


def _load_deepspeed(
    path: str, state: dict[str, Any], strict: bool, *, precision, exclude_frozen_parameters: bool
) -> dict[str, Any]:
    """A directory that Fabric's ``DeepSpeedStrategy`` saved: its one engine's weights and optimizer states into the
    state's one module and optimizer, its client state into the other entries."""
    module_keys, optimizer_keys = _split(state)
    if len(module_keys) != 1 or len(optimizer_keys) > 1:
        raise ValueError(
            f"{path} is a DeepSpeed checkpoint, which holds one module and at most one optimizer: pass "
            f"exactly those (the state holds the modules {module_keys} and optimizers {optimizer_keys})"
        )
    rest, _ = load_full_checkpoint(
        path,
        _unwrap(state[module_keys[0]]),
        [state[key] for key in optimizer_keys],
        strict=strict,
        exclude_frozen_parameters=exclude_frozen_parameters,
        load_full_weights=False,
    )
    rest.pop("state_dict")
    scaler_state = rest.pop(LOSS_SCALER_KEY, None)
    if scaler_state is not None and precision.scaler is not None:
        precision.load_state_dict({"loss_scaler": scaler_state})
    _restore_values(path, state, rest, module_keys + optimizer_keys, strict)
    return rest


def load_raw(path: str, obj: Union[nn.Module, Optimizer], strict: bool, modules: list[nn.Module]) -> None:
    """``fabric.load_raw(path, obj)``: one file's state dict into a module or an optimizer set up by the strategy
    (``modules``: the modules set up so far, one of which owns the optimizer's parameters), each rank reading its
    slices (:func:`lightning_zero.checkpoint.load_full.load_raw_module` and ``load_raw_optimizer``). ``strict``
    applies to modules, as in Fabric."""
    if isinstance(obj, nn.Module):
        load_raw_module(path, _unwrap(obj), strict=strict)
        return
    held = {id(param) for group in model_params_per_group(obj) for param in group}
    owners = [module for module in modules if any(id(param) in held for param in module.parameters())]
    if not owners:
        raise ValueError(
            "fabric.load_raw(path, optimizer): the optimizer holds no parameter of a module set up with "
            "fabric.setup; set up the model (and the optimizer with it) first"
        )
    load_raw_optimizer(path, owners[0], obj)
