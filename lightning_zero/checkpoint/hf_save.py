"""Hugging Face weights written by the training ranks themselves, through DCP's ``HuggingFaceStorageWriter``.

:func:`save_hf_pretrained` is collective: every rank hands ``torch.distributed.checkpoint.save`` what it holds of the
model (its FSDP2 shards at stages 2-3; at stages 0-1 the replicated tensors, which DCP's planner gives to one rank
each) and torch's writer, as shipped with ``save_distributed=True, enable_consolidation=True``, writes each rank's
part as safetensors under ``DIR/sharded/`` and then joins them into ``DIR/model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``. Rank 0 adds ``config.json`` and removes the pieces in ``DIR/sharded/`` (a folder
holding anything else is refused), so ``AutoModelForCausalLM.from_pretrained(DIR)`` reads the directory with no
missing or unexpected keys.

The names, tied weights and config come from the ``transformers.PreTrainedModel`` inside the module, found as a
checkpoint records it (:func:`~lightning_zero.checkpoint.hf_export.describe_hf_models`): keys under its prefix, the
prefix stripped, a tied weight written once under the name ``save_pretrained`` keeps. Where an optimizer keeps fp32
masters of lower-precision parameters, the masters are written (:func:`~lightning_zero.checkpoint.states.
module_state_dict`), as in a checkpoint.

The offline export (:func:`~lightning_zero.checkpoint.hf_export.export_hf`, ``lightning-zero consolidate --hf``)
stays hand-written: it runs without a process group on a finished checkpoint and holds one tensor at a time, where
DCP's writer takes the state dict whole.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from lightning_zero.checkpoint.hf_export import (
    CONFIG_NAME,
    INFO_KEY,
    check_output_dir,
    describe_hf_models,
    shard_numbers,
)
from lightning_zero.checkpoint.states import module_state_dict
from lightning_zero.checkpoint.tensor_sources import parse_dtype
from lightning_zero.diagnostics.byte_sizes import parse_size

SHARDED_DIR = "sharded"  # where HuggingFaceStorageWriter puts each rank's files before it consolidates them
_PIECE = re.compile(r"shard-\d+-model-\d+-of-\d+\.safetensors")  # how it names them (torch's _hf_utils)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _the_model(module: torch.nn.Module) -> dict[str, Any]:
    models = describe_hf_models(module).get(INFO_KEY, [])
    if len(models) != 1:
        found = f"{len(models)} models, at prefixes {[m['prefix'] for m in models]}" if models else "none"
        raise ValueError(
            f"save_hf_pretrained writes one transformers.PreTrainedModel; {type(module).__name__} holds {found}"
        )
    return models[0]


def _check_pieces_folder(output_dir: str) -> None:
    """Refuse a ``DIR/sharded/`` holding anything but the writer's own pieces: its consolidation joins every
    safetensors file there, and the save removes the folder afterwards, so another file would be merged or lost."""
    folder = os.path.join(output_dir, SHARDED_DIR)
    foreign = sorted(name for name in os.listdir(folder) if not _PIECE.fullmatch(name)) if os.path.isdir(folder) else []
    if foreign:
        raise ValueError(
            f"{folder} holds {foreign[:5]}, which are not pieces of a save_hf_pretrained: the save would merge or "
            "remove them; choose another directory"
        )


def _remove_pieces(output_dir: str) -> None:
    """Remove the writer's pieces (an interrupted save's, or this one's once joined), and their folder if empty."""
    folder = os.path.join(output_dir, SHARDED_DIR)
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if _PIECE.fullmatch(name):
            os.remove(os.path.join(folder, name))
    if not os.listdir(folder):
        os.rmdir(folder)


def _every_ranks_weights(
    module: torch.nn.Module, prefix: str, state: dict[str, torch.Tensor], refusal: Optional[str]
) -> dict[str, tuple[int, torch.dtype]]:
    """``{name: (bytes, dtype)}`` of every weight some rank writes, in the module's order, the same on every rank:
    at stage 1 a weight kept as an fp32 master is written by its owner alone, and DCP's coordinator hands every rank
    its own ``fqn_to_index_mapping``, which must name them all. ``refusal``: why this rank refuses the output
    directory, raised on every rank when any rank has one (a rank raising alone would leave the others waiting)."""
    found = {
        name: (value.numel() * value.element_size(), value.dtype) for name, value in state.items()
    }  # DTensor: full
    refusals = [refusal] if refusal else []
    if dist.is_initialized():
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, (refusal, found))
        refusals = [part[0] for part in every if part[0]]
        found = {name: entry for part in every for name, entry in part[1].items()}
    if refusals:
        raise ValueError(refusals[0])
    order = [key[len(prefix) :] for key in module.state_dict() if key.startswith(prefix)]
    return {name: found[name] for name in order if name in found}


def save_hf_pretrained(
    module: torch.nn.Module,
    output_dir: Union[str, os.PathLike],
    dtype: Union[None, str, torch.dtype] = None,
    max_shard_size: Union[None, int, str] = None,
) -> None:
    """Write the ``transformers`` model inside ``module`` to ``output_dir`` as ``from_pretrained`` reads it; called
    on every rank (see the module docstring). ``dtype`` (``"fp32"``, ``"bf16"``, ``"fp16"``) converts floating-point
    weights and is written into ``config.json``; ``max_shard_size`` (bytes, or ``"2GB"``) caps each output file."""
    try:
        import safetensors.torch  # noqa: F401  (DCP's writer serialises with it)
    except ImportError as error:
        raise ImportError("save_hf_pretrained writes safetensors: pip install safetensors") from error
    dtype = parse_dtype(dtype)
    max_bytes = None if max_shard_size is None else parse_size(max_shard_size, "max_shard_size")
    output_dir = os.fspath(output_dir)
    try:
        check_output_dir(output_dir, sharded=True)
        _check_pieces_folder(output_dir)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    model = _the_model(module)
    prefix, tied = model["prefix"], model["tied"]
    state: dict[str, torch.Tensor] = {}
    for key, value in module_state_dict(module).items():
        name = key[len(prefix) :]
        if key.startswith(prefix) and name not in tied and isinstance(value, torch.Tensor):
            state[name] = value.detach().to(dtype) if dtype is not None and value.is_floating_point() else value
    weights = _every_ranks_weights(module, prefix, state, refusal)
    if not weights:  # e.g. Fabric's wrapper: its modules are named under _forward_module, its state dict is not
        raise ValueError(
            f"save_hf_pretrained: no weight of {type(module).__name__}'s state dict is under {prefix!r}, where its "
            f"{model['class']} sits; pass the module that holds it (under Fabric: model.module)"
        )
    if not dist.is_initialized() or dist.get_rank() == 0:
        _remove_pieces(output_dir)  # an interrupted save's
    if dist.is_initialized():
        dist.barrier()
    writer = HuggingFaceStorageWriter(
        output_dir,
        fqn_to_index_mapping=dict(zip(weights, shard_numbers([size for size, _ in weights.values()], max_bytes))),
        save_distributed=True,
        enable_consolidation=True,
    )
    dcp.save(state, storage_writer=writer)
    if not dist.is_initialized() or dist.get_rank() == 0:
        _remove_pieces(output_dir)
        if model.get("config") is not None:
            config = {**model["config"], "architectures": [model["class"]]}
            floating = {dtype for _, dtype in weights.values() if dtype.is_floating_point}
            if len(floating) == 1 and next(iter(floating)) in _DTYPE_NAMES:
                config["dtype"] = _DTYPE_NAMES[next(iter(floating))]
            with open(os.path.join(output_dir, CONFIG_NAME), "w") as file:
                json.dump(config, file, indent=2, sort_keys=True)
    if dist.is_initialized():
        dist.barrier()
