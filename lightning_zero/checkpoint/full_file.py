"""Loading a full (single-file) checkpoint into a sharded model: each rank reads only the slices it holds.

A *full* checkpoint is one file holding every tensor whole: a regular Lightning ``.ckpt`` (what ``DDPStrategy``
writes), a file written by ``lightning-zero consolidate``, a ``torch.save(model.state_dict())`` file, or a
``.safetensors`` file. This is what DeepSpeed's ``load_full_weights=True`` and Lightning's FSDP/ModelParallel
strategies accept; here it works at every ZeRO stage, optimizer states included.

[Note: bounded memory]
Nothing is read whole. A torch file is opened with ``torch.load(mmap=True, weights_only=True)``: only its pickle is
parsed, and every tensor is a view of the memory-mapped file, so copying a rank's slice out of it reads only the
pages of that slice. A safetensors file is read with ``safe_open(...).get_slice(name)[...]``, which reads only the
requested range. A rank's local part of each target tensor is found from the tensor itself
(``DTensor.__create_chunk_list__``, the chunk DCP would read for it; the whole tensor for a plain one), so the
reading follows whatever layout the model has: FSDP2's dim-0 shards with an uneven (possibly empty) last shard at
stages 2-3, whole tensors at stages 0-1, only the owned parameters' optimizer states at stage 1.

Hand-written because torch's own full-state loaders (``set_model_state_dict(..., full_state_dict=True,
broadcast_from_rank0=True)``) need the whole state dict in rank 0's memory and cannot read a safetensors slice.

[Note: optimizer states of a full checkpoint]
``torch.optim.Optimizer.state_dict()`` keys a state by the parameter's position (``0, 1, ...`` in param-group
order) and lists positions in each group's ``params``; FSDP's full optimizer state dicts use parameter names
instead. Both are mapped to the current optimizer's parameters group by group, and every disagreement (number of
optimizers, of groups, of parameters in a group, an unknown name, a state tensor whose shape is not the
parameter's, state keys of another optimizer type) is refused naming the file: loading such states would step the
wrong parameters silently.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from lightning_zero.checkpoint.atomic import PathLike
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.matching import raise_on_mismatch
from lightning_zero.checkpoint.safe_load import safe_torch_load
from lightning_zero.torch_compat import local_part

#: How a torch file's dict holds a checkpoint: ``layout(loaded) -> (model state, optimizer states or None, rest)``.
Layout = Callable[[Any], Tuple[Dict[str, Any], Optional[List[Any]], Dict[str, Any]]]

_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = b"\x80\x02"  # a pickle (protocol 2): torch's pre-1.6 serialization format


def check_load_full_weights(value: Any) -> bool:
    """Validate the ``load_full_weights`` argument (``ZeroStrategy`` and the Fabric strategy share it)."""
    if not isinstance(value, bool):
        raise TypeError(f"load_full_weights must be True or False, got {value!r}")
    return value


def is_safetensors_file(path: str) -> bool:
    """A safetensors file starts with an 8-byte little-endian header length, then the JSON header."""
    with open(path, "rb") as file:
        head = file.read(9)
    return len(head) == 9 and head[8:9] == b"{" and head[:4] != _ZIP_MAGIC


def describe_full_checkpoint_file(path: PathLike) -> Optional[str]:
    """``None`` when ``path`` looks like a loadable full checkpoint (a torch.save file or a safetensors file), else
    why not. A cheap look at the first bytes, for the check before any process starts."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as file:
            head = file.read(9)
    except OSError as err:
        return f"{path}: cannot be read ({err})"
    if head[:4] == _ZIP_MAGIC or head[:2] == _LEGACY_MAGIC or is_safetensors_file(path):
        return None
    return (
        f"{path}: not a checkpoint file (neither a torch.save file nor safetensors); pass a Lightning .ckpt, "
        "a consolidated file, a .safetensors file or a lightning-zero sharded checkpoint directory"
    )


class RangeTensor:
    """A checkpoint tensor read one range at a time, never whole: ``shape``, ``dtype`` and ``read_flat(start,
    length)``, the elements ``[start, start + length)`` of the tensor flattened. A DeepSpeed checkpoint's weights
    and optimizer states are these: each parameter's part of flat buffers partitioned over the saving ranks
    (:mod:`lightning_zero.checkpoint.deepspeed_resume`)."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, read_flat: Callable[[int, int], Tensor]) -> None:
        self.shape, self.dtype, self.read_flat = tuple(shape), dtype, read_flat

    def dim(self) -> int:
        return len(self.shape)

    def rect(self, offsets: Sequence[int], sizes: Sequence[int]) -> Tensor:
        """``tensor[offsets : offsets + sizes]`` per dimension: the rows of the range are one flat range (every
        layout here cuts dimension 0 only), the other dimensions are cut from them."""
        if not self.shape:
            return self.read_flat(0, 1).reshape(())
        row = math.prod(self.shape[1:])
        rows = self.read_flat(offsets[0] * row, sizes[0] * row).reshape(sizes[0], *self.shape[1:])
        return rows[(slice(None),) + tuple(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:]))]


def _is_array(value: Any) -> bool:
    """A state value with the parameter's shape (``exp_avg``), as opposed to a scalar (``step``)."""
    return isinstance(value, RangeTensor) or (isinstance(value, Tensor) and value.dim() > 0)


def _rect(value: Union[Tensor, RangeTensor], offsets: Sequence[int], sizes: Sequence[int]) -> Tensor:
    if isinstance(value, RangeTensor):
        return value.rect(offsets, sizes)
    return value[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


class FullCheckpoint:
    """A single-file checkpoint opened lazily (see the bounded-memory note).

    ``state_keys`` are the tensor keys of its model state; :meth:`read` copies one rectangular slice of one of them;
    :meth:`extras` are the state's non-tensor entries (a module's ``_extra_state``); :attr:`optimizer_states` is
    Lightning's list (``None`` when the file holds none); :meth:`rest` is everything else (loops, callbacks, LR
    schedulers, hyper-parameters).

    ``layout`` reads a torch file whose dict is laid out otherwise (Fabric's ``{"model": ..., "optimizer": ...}``):
    given the loaded dict, it returns the model state, the optimizer states (or ``None``) and the rest; it raises
    :class:`CheckpointError` for a file it cannot read that way.
    """

    def __init__(self, path: PathLike, layout: Optional[Layout] = None) -> None:
        self.path = os.fspath(path)
        self._safe = None
        self._checkpoint: Dict[str, Any] = {}
        self._rest: Optional[Dict[str, Any]] = None  # what rest() returns, when a layout said
        self._state: Dict[str, Any] = {}
        self.optimizer_states: Optional[List[Any]] = None
        if layout is not None:
            if is_safetensors_file(self.path):
                raise CheckpointError(
                    f"{self.path}: a .safetensors file holds one state dict of tensors, not a "
                    "checkpoint of named objects; load it with fabric.load_raw(path, model)",
                    self.path,
                )
            self._state, self.optimizer_states, self._rest = layout(self._load_torch())
            self.state_keys = [key for key, value in self._state.items() if isinstance(value, Tensor)]
            return
        if is_safetensors_file(self.path):
            from safetensors import safe_open

            try:
                self._safe = safe_open(self.path, framework="pt", device="cpu")
            except Exception as err:  # safetensors reports a damaged header with its own error types
                raise CheckpointError(f"{self.path}: not a readable safetensors file ({err})", self.path) from err
            self.state_keys = list(self._safe.keys())
            return
        loaded = self._load_torch()
        if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
            self._checkpoint, self._state = loaded, loaded["state_dict"]
            states = loaded.get("optimizer_states")
            if states is not None and not isinstance(states, (list, tuple)):
                raise CheckpointError(
                    f"{self.path}: 'optimizer_states' must be a list, got {type(states).__name__}", self.path
                )
            self.optimizer_states = list(states) if states is not None else None
        elif isinstance(loaded, dict) and loaded and all(isinstance(v, Tensor) for v in loaded.values()):
            self._state = loaded  # torch.save(model.state_dict()): the weights alone
        else:
            raise CheckpointError(
                f"{self.path}: not a Lightning checkpoint (no 'state_dict' dict) nor a state dict "
                f"of tensors (got {type(loaded).__name__})",
                self.path,
            )
        self.state_keys = [key for key, value in self._state.items() if isinstance(value, Tensor)]

    def _load_torch(self) -> Any:
        try:
            return safe_torch_load(self.path, what=self.path, mmap=True)
        except CheckpointError as err:
            if "_use_new_zipfile_serialization" not in str(err) and "mmap" not in str(err):
                raise
        # A file in torch's legacy (pre-1.6) format cannot be memory-mapped: it is read whole, on every rank.
        warnings.warn(
            f"{self.path} is in torch's legacy serialization format, which cannot be memory-mapped: every "
            "rank reads the whole file. Re-save it with a current torch to load it slice by slice."
        )
        return safe_torch_load(self.path, what=self.path)

    def shape(self, key: str) -> Tuple[int, ...]:
        if self._safe is not None:
            return tuple(self._safe.get_slice(key).get_shape())
        return tuple(self._state[key].shape)

    def read(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> Tensor:
        """``tensor[offsets : offsets + sizes]`` (per dimension) of model-state tensor ``key``: a view into the
        mapped file (copy it into its destination; no intermediate copy is made) or, for safetensors, a new tensor
        of just that slice."""
        index = tuple(slice(start, start + length) for start, length in zip(offsets, sizes))
        if self._safe is not None:
            part = self._safe.get_slice(key)
            return part[index] if index else part[:]
        return self._state[key][index]

    def extras(self) -> Dict[str, Any]:
        return {key: value for key, value in self._state.items() if not isinstance(value, Tensor)}

    def rest(self) -> Dict[str, Any]:
        if self._rest is not None:
            return dict(self._rest)
        return {k: v for k, v in self._checkpoint.items() if k not in ("state_dict", "optimizer_states")}

    def close(self) -> None:
        self._safe = None
        self._checkpoint, self._state, self.optimizer_states, self._rest = {}, {}, None, None


def copy_into(target: Tensor, read: Callable[[Tuple[int, ...], Tuple[int, ...]], Tensor]) -> None:
    """Fill this rank's part of ``target`` in place with ``read(offsets, sizes)`` (cast to ``target``'s dtype)."""
    local, offsets, sizes = local_part(target)
    if local.numel() == 0:
        return  # an empty last shard (more ranks than rows): nothing to read
    with torch.no_grad():
        local.copy_(read(offsets, sizes).reshape(local.shape))


def check_full_state_dict(
    target: Dict[str, Any],
    source: FullCheckpoint,
    *,
    strict: bool,
    optional: Iterable[str] = (),
    elsewhere: Iterable[str] = (),
) -> None:
    """Refuse a ``source`` that does not fit ``target`` (a module's state dict: DTensors or plain tensors).

    ``optional`` names target keys that may be absent from the file (frozen parameters a save excluded);
    ``elsewhere`` names keys other ranks load (pipeline stages hold parts of the model), which are not unexpected
    here. Missing and unexpected keys are errors unless ``strict=False``; a shape mismatch always is.
    """
    optional, elsewhere = set(optional), set(elsewhere)
    stored = set(source.state_keys) | set(source.extras())
    missing = [k for k in target if k not in stored and k not in optional]
    unexpected = [k for k in source.state_keys if k not in target and k not in elsewhere]
    mismatched = []
    for key, value in target.items():
        if key in source.state_keys and isinstance(value, Tensor) and tuple(value.shape) != source.shape(key):
            mismatched.append(f"{key} (checkpoint: {list(source.shape(key))}, target: {list(value.shape)})")
    raise_on_mismatch(
        str(source.path), missing, unexpected, mismatched, strict=strict, target="model", loaded_into="model"
    )


def copy_full_state_dict(target: Dict[str, Any], source: FullCheckpoint) -> List[str]:
    """Fill this rank's part of every tensor of ``target`` that ``source`` holds, in place (non-tensor entries such
    as ``_extra_state`` are replaced); return the keys loaded. Check first with :func:`check_full_state_dict`."""
    loaded = []
    extras = source.extras()
    for key, value in target.items():
        if key in source.state_keys and isinstance(value, Tensor):
            copy_into(value, lambda offsets, sizes, key=key: source.read(key, offsets, sizes))
            loaded.append(key)
        elif key in extras:
            target[key] = copy.deepcopy(extras[key])
            loaded.append(key)
    return loaded


@dataclass(frozen=True)
class OptimizerTarget:
    """An optimizer as the full-checkpoint loader sees it, framework-free.

    ``params``: per param group, every module parameter in the user's order (also those another rank steps at
    stage 1); ``names``: their state-dict names, same nesting; ``held``: the tensor the optimizer keeps state for,
    given a module parameter (itself, or its offloaded master), or ``None`` when another rank steps it.
    """

    optimizer: torch.optim.Optimizer
    params: List[List[Tensor]]
    names: List[List[str]]
    held: Callable[[Tensor], Optional[Tensor]]


def _saved_positions(source: FullCheckpoint, index: int, saved: Any, target: OptimizerTarget) -> List[List[Any]]:
    """Each saved group's ``params`` (positions or names), checked against the current groups' sizes."""
    where = f"{source.path}: optimizer #{index}"
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
        raise CheckpointError(
            f"{where}: not an optimizer state dict ('state' and 'param_groups' expected)", source.path
        )
    if len(groups) != len(target.params):
        raise CheckpointError(
            f"{where} has {len(groups)} param group(s), the optimizer being resumed has "
            f"{len(target.params)}: configure_optimizers must build the same groups",
            source.path,
        )
    positions = []
    for number, (group, params) in enumerate(zip(groups, target.params)):
        ids = list(group.get("params", ())) if isinstance(group, dict) else []
        if len(ids) != len(params):
            raise CheckpointError(
                f"{where}, param group {number}: the checkpoint has {len(ids)} parameter(s), the "
                f"optimizer being resumed has {len(params)}",
                source.path,
            )
        positions.append(ids)
    return positions


def check_full_optimizer_states(targets: List[OptimizerTarget], source: FullCheckpoint) -> List[list]:
    """Check that ``source.optimizer_states`` line up with ``targets`` (see the optimizer-states note) before
    anything is changed; return the plan :func:`apply_full_optimizer_states` carries out.

    Each optimizer must already hold a state for every parameter it steps (placeholders created by one step of
    learning rate 0): they give each state's layout (a DTensor shard, a CPU master's, a plain tensor) and its keys,
    which must be the checkpoint's (another optimizer type's states are refused).
    """
    saved_states = source.optimizer_states or []
    if len(saved_states) != len(targets):
        raise CheckpointError(
            f"{source.path}: the checkpoint holds the states of {len(saved_states)} optimizer(s), "
            f"the model being resumed has {len(targets)}; configure_optimizers must return as many "
            "optimizers as when it was saved",
            source.path,
        )
    plans = []
    for index, (saved, target) in enumerate(zip(saved_states, targets)):
        positions = _saved_positions(source, index, saved, target)
        where = f"{source.path}: optimizer #{index}"
        plan = []
        for ids, params, names in zip(positions, target.params, target.names):
            for position, param, name in zip(ids, params, names):
                if isinstance(position, str) and position != name:
                    raise CheckpointError(
                        f"{where} holds parameter {position!r} where the optimizer being resumed has {name!r}",
                        source.path,
                    )
                values, held = saved["state"].get(position), target.held(param)
                plan.append((held, values))
                if values is None:
                    continue
                if not isinstance(values, dict):
                    raise CheckpointError(f"{where}: the state of {name!r} is not a dict", source.path)
                for key, value in values.items():
                    if _is_array(value) and tuple(value.shape) != tuple(param.shape):
                        raise CheckpointError(
                            f"{where}: state {key!r} of {name!r} has shape {list(value.shape)}, "
                            f"the parameter {list(param.shape)}",
                            source.path,
                        )
                own = target.optimizer.state.get(held) if held is not None else None
                if own is not None and set(own) != set(values):
                    raise CheckpointError(
                        f"{where}: the state of {name!r} holds {sorted(values)}, the optimizer "
                        f"being resumed keeps {sorted(own)}: the checkpoint is another optimizer "
                        "type's",
                        source.path,
                    )
        plans.append([target.optimizer, plan, saved["param_groups"]])
    return plans


def apply_full_optimizer_states(plans: List[list]) -> None:
    """Copy each rank's part of the checked states (:func:`check_full_optimizer_states`) into the optimizers.

    Parameters the checkpoint has no state for (never stepped) start fresh; param-group hyper-parameters (``lr``,
    ``weight_decay``, ...) are restored as ``Optimizer.load_state_dict`` restores them.
    """
    for optimizer, plan, saved_groups in plans:
        for held, values in plan:
            if held is None:
                continue  # stepped by another rank (stage 1): its state lives there
            if values is None:
                optimizer.state.pop(held, None)  # never stepped when saved: starts fresh, as after load_state_dict
                continue
            own = optimizer.state.setdefault(held, {})
            for key, value in values.items():
                mine = own.get(key)
                if _is_array(value):
                    if not isinstance(mine, Tensor):
                        mine = own[key] = torch.empty_like(held, dtype=value.dtype)  # the parameter's layout
                    copy_into(mine, lambda offsets, sizes, value=value: _rect(value, offsets, sizes))
                elif isinstance(value, Tensor) and isinstance(mine, Tensor):
                    with torch.no_grad():
                        mine.copy_(value)  # a scalar such as Adam's step, kept on the device the optimizer chose
                elif isinstance(value, Tensor) and type(mine) in (int, float):
                    own[key] = type(mine)(value.item())  # an optimizer that counts its steps in a plain number
                else:
                    own[key] = value.clone() if isinstance(value, Tensor) else copy.deepcopy(value)
        for group, saved_group in zip(optimizer.param_groups, saved_groups):
            group.update({k: copy.deepcopy(v) for k, v in saved_group.items() if k != "params"})
