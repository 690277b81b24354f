"""Read DeepSpeed ZeRO checkpoints (stages 1-3) without deepspeed and without executing pickled code.

Layout of ``DIR`` as written by ``DeepSpeedEngine.save_checkpoint(DIR, tag)`` (and read by DeepSpeed's
``zero_to_fp32.py``):

* ``DIR/latest`` holds the tag; ``DIR/<tag>/`` the files. ``path`` may be ``DIR`` or ``DIR/<tag>``.
* model states: ``mp_rank_00_model_states.pt`` (stages 1-2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  (stage 3): ``module`` (the module's state dict; at stage 3 parameters are empty placeholders), ``buffer_names``,
  ``param_shapes`` (one ordered ``{name: torch.Size}`` per flat group, see below), ``shared_params``
  (``{alias: source}``), ``frozen_param_shapes``/``frozen_param_fragments`` and the client state (for checkpoints
  written by Lightning: ``epoch``, ``global_step``, ``hyper_parameters``, ...).
* ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: ``optimizer_state_dict`` with ``zero_stage``,
  ``partition_count`` and the fp32 master weights of rank ``r``:
  - stages 1-2, ``single_partition_of_fp32_groups[g]``: rank r's contiguous slice of group g's flat buffer (all
    parameters of g back to back, optionally separated by ``param_alignment_paddings[g]``, padded at the end);
  - stage 3, ``fp32_flat_groups[s]`` per sub-group ``s`` (a param group cut into pieces of at most
    ``sub_group_size`` elements; ``param_shapes`` then holds one entry per sub-group): for every parameter of s in
    order, rank r's ``ceil(numel / world)`` elements of it (the last rank's piece zero-padded).

  The optimizer's own state follows the same layout: the wrapped torch optimizer steps one flat tensor per flat
  group, so its ``exp_avg``/``exp_avg_sq`` are flat pieces like the masters (``base_optimizer_state`` at stages 1-2,
  with the group's end padding; ``optimizer_state_dict`` at stage 3). :class:`DeepSpeedFiles` records where each
  parameter lies (:class:`Slot`), for the masters here and for those states in
  :mod:`lightning_zero.checkpoint.deepspeed_resume`.

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
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from lightning_zero.checkpoint.atomic import PathLike
from lightning_zero.checkpoint.safe_load import safe_torch_load
from lightning_zero.checkpoint.streaming import TensorEntry


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
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "ds_autotp_universal_checkpoint_meta",
    "universal_checkpoint_info",
    "ds_autoep_layers",
    "autoep_layers",
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
            out[written : written + hi - lo].copy_(piece[lo:hi])
            written += hi - lo
        base = end
    if written != length:
        raise ValueError(f"checkpoint too short: wanted elements [{start}, {start + length}), found {written}")
    return out


@dataclass(frozen=True)
class Slot:
    """Where one parameter lies in the ranks' 1-D pieces of its flat group (``group``).

    Stages 1-2 (``part == 0``): the pieces concatenated in rank order are the group's flat buffer, and the parameter
    is ``offset`` elements into it. Stage 3: every rank holds ``part = ceil(numel / world)`` elements of it at
    ``offset`` in its own piece, rank ``r`` the elements ``[r * part, (r + 1) * part)`` (the last rank's zero-padded).
    """

    group: int
    offset: int
    part: int = 0

    def read(self, pieces: List[torch.Tensor], start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of the flattened parameter, copied out of ``pieces`` (one per rank;
        memory-mapped, so only the pages of that range are read)."""
        if not self.part:
            return _slice_of(pieces, self.offset + start, length)
        out = torch.empty(length, dtype=pieces[0].dtype)
        position, end = start, start + length
        while position < end:
            rank, within = divmod(position, self.part)
            take = min(self.part - within, end - position)
            out[position - start : position - start + take].copy_(
                pieces[rank][self.offset + within : self.offset + within + take]
            )
            position += take
        return out


class DeepSpeedFiles:
    """The files of one DeepSpeed ZeRO checkpoint, memory-mapped, and where each trainable parameter lies in them.

    ``stage``, ``world_size``; ``model_states`` (one per rank at stage 3, else one); ``optimizer``: each rank's
    ``optimizer_state_dict``; ``fp32``: ``[rank][flat group]`` master pieces; ``slots``: ``{name: Slot}`` for every
    trainable parameter, in DeepSpeed's order. A flat group is a param group at stages 1-2 and a sub-group (of at
    most ``sub_group_size`` elements) at stage 3. Names are the engine module's (see ``public_name``).
    """

    def __init__(self, path: PathLike) -> None:
        directory = resolve_deepspeed_dir(path)
        if directory is None:
            raise FileNotFoundError(f"{path} is not a DeepSpeed checkpoint (no latest tag / *_optim_states.pt)")
        self.path = directory
        optim_files = sorted(glob.glob(os.path.join(directory, "*_optim_states.pt")), key=_natural_key)
        self.optimizer = [_load(f)["optimizer_state_dict"] for f in optim_files]
        first = self.optimizer[0]
        if "zero_stage" not in first:
            raise ValueError(f"{optim_files[0]} is not a ZeRO optimizer state file (no zero_stage)")
        self.stage = int(first["zero_stage"])
        world = first["partition_count"]
        self.world_size = max(world) if isinstance(world, (list, tuple)) else int(world)
        if self.world_size != len(optim_files):
            raise ValueError(
                f"{directory}: partition_count is {self.world_size} but {len(optim_files)} optimizer "
                "state files exist (an incomplete or overwritten checkpoint)"
            )
        if self.stage == 3:
            model_files = [
                os.path.join(directory, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(self.world_size)
            ]
            groups_key = "fp32_flat_groups"
        elif self.stage in (1, 2):
            model_files = [os.path.join(directory, "mp_rank_00_model_states.pt")]
            groups_key = "single_partition_of_fp32_groups"
        else:
            raise ValueError(f"{directory}: unsupported ZeRO stage {self.stage} (stages 1-3 are supported)")
        self.model_states = [_load(f) for f in model_files]
        self._refuse_other_parallelism()
        self.fp32 = [[g.reshape(-1) for g in state[groups_key]] for state in self.optimizer]  # [rank][group]
        self.slots: Dict[str, Slot] = {}
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        if self.stage == 3:
            self._lay_out_stage3()
        else:
            self._lay_out_stages12()

    def _refuse_other_parallelism(self) -> None:
        """Only data parallelism is read: a tensor- or pipeline-parallel checkpoint, or ZeRO-3 sub-groups
        partitioned over other process groups (expert parallelism), would be silently misread."""
        model = self.model_states[0]
        if int(model.get("mp_world_size") or 1) != 1:
            raise ValueError(
                f"{self.path}: written with model (tensor) parallelism, mp_world_size="
                f"{model['mp_world_size']}; only data-parallel ZeRO checkpoints are read"
            )
        pipeline = (model.get("checkpoint_parallel_dimensions") or {}).get("pp_degree", 1)
        if int(pipeline or 1) != 1:
            raise ValueError(
                f"{self.path}: written with pipeline parallelism (pp_degree={pipeline}); only "
                "data-parallel ZeRO checkpoints are read"
            )
        if self.optimizer[0].get("ds_zero_partition_groups") is not None:
            raise ValueError(
                f"{self.path}: ZeRO-3 sub-groups partitioned over other process groups (expert "
                "parallelism); only data-parallel ZeRO checkpoints are read"
            )

    def _lay_out_stages12(self) -> None:
        paddings = self.optimizer[0].get("param_alignment_paddings")
        for group, shapes in enumerate(self.model_states[0]["param_shapes"]):
            offset = 0
            for index, (name, shape) in enumerate(shapes.items()):
                self.slots[name], self.shapes[name] = Slot(group, offset), tuple(shape)
                offset += math.prod(shape) + (paddings[group][index] if paddings is not None else 0)
            available = sum(ranks[group].numel() for ranks in self.fp32)
            if offset > available:
                raise ValueError(f"{self.path}: group {group} needs {offset} elements, the partitions hold {available}")

    def _lay_out_stage3(self) -> None:
        """Parameters fill the sub-groups in order, each taking ``ceil(numel / world)`` elements of every rank's
        piece (``param_shapes`` holds one entry per sub-group; walked as one sequence so either layout reads)."""
        sizes = [piece.numel() for piece in self.fp32[0]]
        if any([piece.numel() for piece in ranks] != sizes for ranks in self.fp32):
            raise ValueError(f"{self.path}: the ranks' fp32 partitions differ in size")
        group, offset = 0, 0
        for shapes in self.model_states[0]["param_shapes"]:
            for name, shape in shapes.items():
                while group < len(sizes) and offset == sizes[group]:
                    group, offset = group + 1, 0
                part = math.ceil(math.prod(shape) / self.world_size)
                if group == len(sizes) or offset + part > sizes[group]:
                    raise ValueError(
                        f"{self.path}: parameter {name} does not fit the fp32 partitions: "
                        "param_shapes and optimizer files disagree"
                    )
                self.slots[name], self.shapes[name] = Slot(group, offset, part), tuple(shape)
                offset += part
        if group != len(sizes) - 1 or offset != sizes[group]:
            raise ValueError(
                f"{self.path}: the parameters use {sum(sizes[:group]) + offset} elements per rank, the "
                f"files hold {sum(sizes)}: param_shapes and optimizer files disagree"
            )

    def pieces(self, per_rank: List[List[torch.Tensor]], group: int) -> List[torch.Tensor]:
        """The ranks' pieces of flat group ``group`` of ``per_rank`` (``[rank][group]``, such as :attr:`fp32`)."""
        return [groups[group] for groups in per_rank]

    def client_state(self) -> Dict[str, Any]:
        """What the saving script added to the model file (Lightning's loops, epoch, global_step, ...)."""
        return OrderedDict((k, v) for k, v in self.model_states[0].items() if k not in _DEEPSPEED_MODEL_KEYS)


def public_name(key: str) -> str:
    """``key`` of the engine's module as the user's module names it (without Lightning's Fabric wrapper prefix)."""
    return key[len(_LIGHTNING_WRAPPER_PREFIX) :] if key.startswith(_LIGHTNING_WRAPPER_PREFIX) else key


class DeepSpeedTensorSource:
    """Full fp32 weights of a DeepSpeed ZeRO checkpoint, one tensor at a time (same interface as DCPTensorSource);
    :meth:`read_range` reads any range of one, flattened."""

    def __init__(self, path: PathLike) -> None:
        self.files = files = DeepSpeedFiles(path)
        self.path, self.stage, self.world_size = files.path, files.stage, files.world_size
        model = files.model_states[0]
        self._sources: Dict[str, Tuple[str, Any]] = {}
        entries: Dict[str, TensorEntry] = {}
        module = model.get("module") or {}
        for name in model.get("buffer_names", []):
            tensor = module[name]
            dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
            entries[name] = TensorEntry(name, dtype, tuple(tensor.shape))
            self._sources[name] = ("tensor", tensor)
        self._add_frozen(model, entries)
        for name, slot in files.slots.items():
            entries[name] = TensorEntry(name, torch.float32, files.shapes[name])
            self._sources[name] = ("slot", (slot, files.pieces(files.fp32, slot.group)))
        for alias, source in (model.get("shared_params") or {}).items():
            if source in entries:
                entries[alias] = TensorEntry(alias, entries[source].dtype, entries[source].shape)
                self._sources[alias] = ("alias", source)
        order = [k for k in module if k in entries] + [k for k in entries if k not in module]
        self._renamed = {public_name(k): k for k in order}
        self.entries = [TensorEntry(public_name(k), entries[k].dtype, entries[k].shape) for k in order]
        self._extras = {public_name(k): v for k, v in module.items() if not isinstance(v, torch.Tensor)}

    def _add_frozen(self, model: dict, entries: Dict[str, TensorEntry]) -> None:
        for name, shape in (model.get("frozen_param_shapes") or {}).items():
            entries[name] = TensorEntry(name, torch.float32, tuple(shape))
            if self.stage == 3:  # every rank holds its ceil(numel / world) elements, as for trainable ones
                pieces = [state["frozen_param_fragments"][name].reshape(-1) for state in self.files.model_states]
                self._sources[name] = ("slot", (Slot(0, 0, math.ceil(math.prod(shape) / self.world_size)), pieces))
            else:
                self._sources[name] = ("tensor", model["frozen_param_fragments"][name])

    def read_range(self, key: str, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of tensor ``key`` (a public name) flattened, in its stored dtype."""
        kind, data = self._sources[self._renamed[key]]
        while kind == "alias":
            kind, data = self._sources[data]
        if kind == "tensor":
            return data.reshape(-1)[start : start + length].clone()
        slot, pieces = data
        return slot.read(pieces, start, length)

    def load(self, entry: TensorEntry) -> torch.Tensor:
        tensor = self.read_range(entry.key, 0, math.prod(entry.shape)).reshape(entry.shape)
        return tensor.float() if tensor.is_floating_point() else tensor

    def extras(self) -> Dict[str, Any]:
        return dict(self._extras)

    def meta(self) -> Dict[str, Any]:
        """Client state of the model file (Lightning's epoch, global_step, hyper_parameters, ... when present)."""
        return self.files.client_state()

    def close(self) -> None:
        self.files = None
        self._sources = {}
