"""Read DeepSpeed ZeRO checkpoints (stages 1-3) without deepspeed and without executing pickled code.

Layout of ``DIR`` as written by ``DeepSpeedEngine.save_checkpoint(DIR, tag)`` (and read by DeepSpeed's
``zero_to_fp32.py``):

* ``DIR/latest`` holds the tag; ``DIR/<tag>/`` the files. ``path`` may be ``DIR`` or ``DIR/<tag>``.
* model states: ``mp_rank_00_model_states.pt`` (stages 1-2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  (stage 3): ``module`` (the module's state dict; at stage 3 parameters are empty placeholders), ``buffer_names``,
  ``param_shapes`` (one ordered ``{name: torch.Size}`` per optimizer param group), ``shared_params``
  (``{alias: source}``), ``frozen_param_shapes``/``frozen_param_fragments`` and the client state (for checkpoints
  written by Lightning: ``epoch``, ``global_step``, ``hyper_parameters``, ...).
* ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: ``optimizer_state_dict`` with ``zero_stage``,
  ``partition_count`` and the fp32 master weights of rank ``r``:
  - stages 1-2, ``single_partition_of_fp32_groups[g]``: rank r's contiguous slice of group g's flat buffer (all
    parameters of g back to back, optionally separated by ``param_alignment_paddings[g]``, padded at the end);
  - stage 3, ``fp32_flat_groups[g]``: for every parameter of g in order, rank r's ``ceil(numel / world)``
    elements of it (the last rank's piece zero-padded).

DeepSpeed pickles a few of its own classes into these files (``LossScaler``/``DynamicLossScaler``,
``ZeroStageEnum``, ``fragment_address``). We load with ``torch.load(weights_only=True, mmap=True)`` and allow-list
those names mapped to inert stand-ins (:class:`DeepSpeedObject`) that only record their arguments and state, so
no DeepSpeed code runs and no deepspeed import is needed. ``mmap=True`` means only the slices we copy are read.

Hand-written because no maintained library reads DeepSpeed checkpoints without deepspeed itself.
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from lightning_zero.checkpoint.safe_load import safe_torch_load
from lightning_zero.checkpoint.streaming import TensorEntry

PathLike = Union[str, os.PathLike]


class DeepSpeedObject:
    """Inert stand-in for a DeepSpeed class found in a checkpoint pickle: keeps constructor args and state only."""

    def __new__(cls, *args: Any) -> "DeepSpeedObject":
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __int__(self) -> int:  # ZeroStageEnum(2) becomes a stand-in whose int() is 2
        return int(self.args[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args}"


# Fully-qualified names of the DeepSpeed classes seen in ZeRO checkpoints (deepspeed 0.19). Each gets its own
# stand-in subclass, allow-listed under that name only while a DeepSpeed file is being read.
DEEPSPEED_PICKLED_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
)
_STANDINS = [(type(name.rsplit(".", 1)[1], (DeepSpeedObject,), {}), name) for name in DEEPSPEED_PICKLED_CLASSES]

# Keys DeepSpeed itself writes into the model states file; everything else there is client state.
_DEEPSPEED_MODEL_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps",
    "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "ds_autotp_universal_checkpoint_meta", "universal_checkpoint_info", "ds_autoep_layers", "autoep_layers",
    "checkpoint_parallel_dimensions",
}
# Lightning's DeepSpeedStrategy wraps the LightningModule; its keys carry this prefix in the engine's module.
_LIGHTNING_WRAPPER_PREFIX = "_forward_module."


def _natural_key(text: str) -> List[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _load(path: str) -> Any:
    with torch.serialization.safe_globals(_STANDINS):
        return safe_torch_load(path, what=f"DeepSpeed file {path}", mmap=True)


def resolve_deepspeed_dir(path: PathLike) -> Optional[str]:
    """The ``<tag>`` directory of a DeepSpeed checkpoint at ``path`` (the parent with ``latest``, or the tag dir)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as file:
            tag = file.read().strip()
        path = os.path.join(path, tag)
    if glob.glob(os.path.join(path, "*_optim_states.pt")) and glob.glob(os.path.join(path, "*_model_states.pt")):
        return path
    return None


def is_deepspeed_checkpoint(path: PathLike) -> bool:
    return resolve_deepspeed_dir(path) is not None


def _slice_of(pieces: List[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """Elements ``[start, start + length)`` of the concatenation of 1-D ``pieces``, copying only that range."""
    out = torch.empty(length, dtype=pieces[0].dtype)
    written, base = 0, 0
    for piece in pieces:
        end = base + piece.numel()
        if end > start and base < start + length:
            lo = max(start, base) - base
            hi = min(start + length, end) - base
            out[written:written + hi - lo].copy_(piece[lo:hi])
            written += hi - lo
        base = end
    if written != length:
        raise ValueError(f"checkpoint too short: wanted elements [{start}, {start + length}), found {written}")
    return out


class DeepSpeedTensorSource:
    """Full fp32 weights of a DeepSpeed ZeRO checkpoint, one tensor at a time (same interface as DCPTensorSource)."""

    def __init__(self, path: PathLike) -> None:
        directory = resolve_deepspeed_dir(path)
        if directory is None:
            raise FileNotFoundError(f"{path} is not a DeepSpeed checkpoint (no latest tag / *_optim_states.pt)")
        self.path = directory
        optim_files = sorted(glob.glob(os.path.join(directory, "*_optim_states.pt")), key=_natural_key)
        optim = [_load(f)["optimizer_state_dict"] for f in optim_files]
        first = optim[0]
        if "zero_stage" not in first:
            raise ValueError(f"{optim_files[0]} is not a ZeRO optimizer state file (no zero_stage)")
        self.stage = int(first["zero_stage"])
        world = first["partition_count"]
        self.world_size = max(world) if isinstance(world, (list, tuple)) else int(world)
        if self.world_size != len(optim_files):
            raise ValueError(f"{directory}: partition_count is {self.world_size} but {len(optim_files)} optimizer "
                             "state files exist (an incomplete or overwritten checkpoint)")
        if self.stage == 3:
            model_files = [os.path.join(directory, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
                           for r in range(self.world_size)]
            groups_key = "fp32_flat_groups"
        elif self.stage in (1, 2):
            model_files = [os.path.join(directory, "mp_rank_00_model_states.pt")]
            groups_key = "single_partition_of_fp32_groups"
        else:
            raise ValueError(f"{directory}: unsupported ZeRO stage {self.stage} (stages 1-3 are supported)")
        self._model_states = [_load(f) for f in model_files]
        model = self._model_states[0]
        self._flat = [list(state[groups_key]) for state in optim]  # [rank][group] 1-D fp32, memory-mapped
        self._sources: Dict[str, Tuple[str, Any]] = {}
        entries: Dict[str, TensorEntry] = {}
        module = model.get("module") or {}
        for name in model.get("buffer_names", []):
            tensor = module[name]
            dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
            entries[name] = TensorEntry(name, dtype, tuple(tensor.shape))
            self._sources[name] = ("buffer", tensor)
        self._add_frozen(model, entries)
        self._add_trainable(model, optim, entries)
        for alias, source in (model.get("shared_params") or {}).items():
            if source in entries:
                entries[alias] = TensorEntry(alias, entries[source].dtype, entries[source].shape)
                self._sources[alias] = ("alias", source)
        order = [k for k in module if k in entries] + [k for k in entries if k not in module]
        self._renamed = {self._public(k): k for k in order}
        self.entries = [TensorEntry(self._public(k), entries[k].dtype, entries[k].shape) for k in order]

    @staticmethod
    def _public(key: str) -> str:
        return key[len(_LIGHTNING_WRAPPER_PREFIX):] if key.startswith(_LIGHTNING_WRAPPER_PREFIX) else key

    def _add_frozen(self, model: dict, entries: Dict[str, TensorEntry]) -> None:
        shapes = model.get("frozen_param_shapes") or {}
        for name, shape in shapes.items():
            entries[name] = TensorEntry(name, torch.float32, tuple(shape))
            if self.stage == 3:
                pieces = [state["frozen_param_fragments"][name].reshape(-1) for state in self._model_states]
                self._sources[name] = ("pieces", (pieces, 0))
            else:
                self._sources[name] = ("buffer", model["frozen_param_fragments"][name])

    def _add_trainable(self, model: dict, optim: List[dict], entries: Dict[str, TensorEntry]) -> None:
        param_shapes = model["param_shapes"]
        if self.stage == 3:
            # Every rank's flat buffer is all its groups back to back; each parameter takes ceil(n / world) of it.
            per_rank = [torch.cat([g.reshape(-1) for g in groups]) if len(groups) > 1 else groups[0].reshape(-1)
                        for groups in self._flat]
            offset = 0
            for shapes in param_shapes:
                for name, shape in shapes.items():
                    numel = math.prod(shape)
                    part = math.ceil(numel / self.world_size)
                    entries[name] = TensorEntry(name, torch.float32, tuple(shape))
                    self._sources[name] = ("zero3", (per_rank, offset, part))
                    offset += part
            if offset != per_rank[0].numel():
                raise ValueError(f"{self.path}: parameters use {offset} elements per rank, file has "
                                 f"{per_rank[0].numel()}: param_shapes and optimizer files disagree")
            return
        paddings = optim[0].get("param_alignment_paddings")
        for group, shapes in enumerate(param_shapes):
            pieces = [self._flat[rank][group].reshape(-1) for rank in range(self.world_size)]
            offset = 0
            for index, (name, shape) in enumerate(shapes.items()):
                entries[name] = TensorEntry(name, torch.float32, tuple(shape))
                self._sources[name] = ("pieces", (pieces, offset))
                offset += math.prod(shape)
                if paddings is not None:
                    offset += paddings[group][index]
            available = sum(piece.numel() for piece in pieces)
            if offset > available:
                raise ValueError(f"{self.path}: group {group} needs {offset} elements, the partitions hold {available}")

    def load(self, entry: TensorEntry) -> torch.Tensor:
        key = self._renamed[entry.key]
        kind, data = self._sources[key]
        if kind == "alias":
            return self.load(TensorEntry(self._public(data), entry.dtype, entry.shape))
        if kind == "buffer":
            tensor = data.detach().clone()
            return tensor.float() if tensor.is_floating_point() else tensor
        numel = math.prod(entry.shape)
        if kind == "pieces":
            pieces, offset = data
            return _slice_of(pieces, offset, numel).reshape(entry.shape).float()
        per_rank, offset, part = data
        out = torch.empty(self.world_size * part, dtype=per_rank[0].dtype)
        for rank, flat in enumerate(per_rank):
            out[rank * part:(rank + 1) * part].copy_(flat[offset:offset + part])
        return out[:numel].reshape(entry.shape).float()

    def extras(self) -> Dict[str, Any]:
        return {}

    def meta(self) -> Dict[str, Any]:
        """Client state of the model file (Lightning's epoch, global_step, hyper_parameters, ... when present)."""
        return OrderedDict((k, v) for k, v in self._model_states[0].items() if k not in _DEEPSPEED_MODEL_KEYS)

    def close(self) -> None:
        self._flat, self._model_states = [], []
