"""``fabric.save`` / ``fabric.load`` for the Fabric ZeroStrategy, on the Trainer strategy's sharded format.

A Fabric state ``{"model": module, "optimizer": optimizer, "step": 3, ...}`` is written as the Trainer strategy
writes a Lightning checkpoint (:mod:`lightning_zero.strategies.checkpointing`): the module's weights under
``state_dict`` and the optimizers' states keyed by parameter name under ``optimizer_states`` (DCP, every rank its
shards), everything else in ``meta.pt`` (``weights_only``). So the save is atomic and verified, a load reshards
across world sizes and stages, and ``lightning-zero consolidate`` turns it into one file whose ``state_dict`` loads
straight into the unwrapped module.

``meta.pt`` also records which state keys held the module and the optimizers (``fabric_state_keys``), so a load
puts each back into the object of the same key.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Optional

from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.io import checkpoint_directory, wait_for_pending_saves
from lightning_zero.checkpoint.safe_load import load_meta
from lightning_zero.strategies import checkpointing

KEYS = "fabric_state_keys"  # {"module": key, "optimizers": [key, ...]} in meta.pt
SCALER = "fabric_loss_scaler"  # the fp16 loss scaler's state (plain numbers)


def _unwrap(module: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def _split(state: dict[str, Any]) -> tuple[Optional[str], list[str]]:
    modules = [key for key, value in state.items() if isinstance(value, nn.Module)]
    optimizers = [key for key, value in state.items() if isinstance(value, Optimizer)]
    if len(modules) > 1:
        raise NotImplementedError(f"the state holds {len(modules)} modules ({modules}); a ZeroStrategy checkpoint "
                                  "holds one module (its weights are the checkpoint's state_dict): save each module "
                                  "with its optimizers to its own path")
    if optimizers and not modules:
        raise ValueError(f"the state holds optimizers {optimizers} but no module: their states are keyed by the "
                         "module's parameter names, so put the module in the same state")
    return (modules[0] if modules else None), optimizers


def save(strategy, path: str, state: dict[str, Any],
         filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
    """Write ``state`` as a sharded checkpoint directory at ``path`` (collective: every rank calls it)."""
    module_key, optimizer_keys = _split(state)
    if filter and set(filter) - ({module_key} if module_key else set()):
        raise NotImplementedError(f"fabric.save(filter=...) applies to the module's weights here; the filter keys "
                                  f"{sorted(set(filter) - {module_key})} are not the module's")
    module = _unwrap(state[module_key]) if module_key else nn.Module()
    checkpoint: dict[str, Any] = {}
    weights = checkpointing.module_state_dict(module)
    if filter:
        weights = {name: tensor for name, tensor in weights.items() if filter[module_key](name, tensor)}
    checkpoint["state_dict"] = weights
    optimizers = [state[key] for key in optimizer_keys]
    checkpoint["optimizer_states"] = [checkpointing.optimizer_state_dict(module, o) for o in optimizers]
    for key, value in state.items():
        if key == module_key or key in optimizer_keys:
            continue
        checkpoint[key] = value.state_dict() if callable(getattr(value, "state_dict", None)) else value
    checkpoint[KEYS] = {"module": module_key, "optimizers": optimizer_keys}
    if strategy.precision.scaler is not None:
        checkpoint[SCALER] = strategy.precision.state_dict()
    # The Trainer strategy's save, given this state's module and optimizers.
    view = SimpleNamespace(exclude_frozen_parameters=strategy.exclude_frozen_parameters, lightning_module=module,
                           stage=strategy.stage, zero_config=strategy.zero_config, optimizers=optimizers,
                           ds_config=strategy.ds_config, async_save=strategy.async_save)
    checkpointing.save(view, checkpoint, path)


def load(strategy, path: str, state: Optional[dict[str, Any]], strict: bool = True) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into the objects of ``state`` in place; return what was not loaded.

    Plain values in ``state`` are replaced by the saved ones (Fabric copies them back into the caller's dict)."""
    if not state:
        raise ValueError("fabric.load with a ZeroStrategy loads sharded states into existing objects: pass them, "
                         "e.g. fabric.load(path, {'model': model, 'optimizer': optimizer}); to read the whole "
                         "checkpoint in one process use `lightning-zero consolidate` and torch.load")
    wait_for_pending_saves(barrier=False)
    directory = checkpoint_directory(path)
    meta = load_meta(directory)
    saved = meta.pop(KEYS, None)
    if saved is None:
        raise CheckpointError(f"{directory} was not written by fabric.save (no {KEYS!r}); a Trainer checkpoint "
                              "loads with Trainer.fit(ckpt_path=...) or LightningModule.load_from_checkpoint",
                              directory)
    scaler_state = meta.pop(SCALER, None)
    module_key, optimizer_keys = _split(state)
    if module_key is not None and module_key != saved["module"]:
        raise KeyError(f"the state's module is under {module_key!r}, the checkpoint's under {saved['module']!r}")
    if optimizer_keys and optimizer_keys != saved["optimizers"]:
        raise KeyError(f"the state's optimizers are {optimizer_keys}, the checkpoint holds {saved['optimizers']} "
                       "(pass all of them, under the same keys, or none)")
    if module_key is not None:
        optimizers = [state[key] for key in optimizer_keys]
        if not optimizers:
            meta.pop("optimizer_param_groups", None)  # weights only
        checkpointing.load_states(directory, meta, _unwrap(state[module_key]), optimizers, strict=strict)
    else:
        meta.pop("optimizer_param_groups", None)
    if scaler_state is not None and strategy.precision.scaler is not None:
        strategy.precision.load_state_dict(scaler_state)
    for key, target in state.items():
        if key == module_key or key in optimizer_keys:
            continue
        if key not in meta:
            if strict:
                raise KeyError(f"{key!r} is not in the checkpoint {directory} (it holds {sorted(meta)})")
            continue
        value = meta.pop(key)
        if callable(getattr(target, "load_state_dict", None)):
            target.load_state_dict(value)
        else:
            state[key] = value
    return meta
