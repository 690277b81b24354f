"""Hugging Face export: a checkpoint's model as ``DIR/model.safetensors`` + ``DIR/config.json``, streaming.

Two halves:

* at save time, :func:`describe_hf_models` records in ``zero.json`` where the ``transformers.PreTrainedModel``
  sits in the LightningModule (the state-dict prefix, e.g. ``model.``), its class, its config and which of its
  weights are tied to which (parameters that are one object under several names);
* :func:`export_hf` then writes the tensors under that prefix with the prefix stripped, every tied weight once
  (under the first name, as ``PreTrainedModel.save_pretrained`` keeps the tie's source), and ``config.json``, so
  ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it with no missing or unexpected keys.

Without a recorded model (an older checkpoint, a DeepSpeed one, a model that is not a ``PreTrainedModel``) the
prefix must be given (``strip_prefix``); the error lists the candidates. Keys outside the prefix (a loss module's
buffers, a second model) are left out of the export and returned, never silently: the CLI prints them.

Hand-written because ``save_pretrained`` needs the whole model in memory; here tensors are read and written one at
a time (:mod:`lightning_zero.checkpoint.streaming`). Nothing here imports transformers: the save-time half only
looks at it when the training script already imported its models (``[Note: a save imports none of transformers]``).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from lightning_zero.checkpoint.atomic import PathLike
from lightning_zero.checkpoint.directory import is_sharded_checkpoint, read_checkpoint_info, resolve_checkpoint_dir
from lightning_zero.checkpoint.streaming import TensorEntry, write_safetensors
from lightning_zero.checkpoint.tensor_sources import cast, converted, open_source, parse_dtype
from lightning_zero.diagnostics.byte_sizes import parse_size

INFO_KEY = "hf_models"
WEIGHTS_NAME, CONFIG_NAME = "model.safetensors", "config.json"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _hf_class(model: torch.nn.Module, base: type) -> type:
    """The model's own ``transformers`` class (FSDP2's ``fully_shard`` swaps in a dynamic subclass around it)."""
    for cls in type(model).__mro__:
        if issubclass(cls, base) and not cls.__name__.startswith("FSDP"):
            return cls
    return type(model)


def describe_hf_models(module: torch.nn.Module) -> Dict[str, Any]:
    """``{"hf_models": [...]}`` for ``zero.json``: each outermost ``transformers.PreTrainedModel`` inside ``module``
    (``module`` itself included) with its state-dict ``prefix``, ``class``, ``config`` (``config.to_json_string``)
    and ``tied`` (``{name: name it is tied to}``, relative to the prefix). ``{}`` when there is none, or when
    ``transformers.modeling_utils`` was never imported (then there cannot be one).

    [Note: a save imports none of transformers]
    ``PreTrainedModel`` is defined in ``transformers.modeling_utils``, so a module holding one has imported it.
    ``transformers`` itself is no such sign: Lightning's own imports bring it in, and its ``PreTrainedModel``
    attribute is lazy, importing the modeling code (hundreds of modules, about half a second a process) on first
    access; read there, every rank of every run paid that at its first save, all ranks at once."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return {}
    base = modeling.PreTrainedModel
    found: List[Dict[str, Any]] = []
    inside: List[str] = []
    for name, sub in module.named_modules():
        if not isinstance(sub, base) or any(name.startswith(outer) for outer in inside):
            continue
        inside.append(name + "." if name else "")
        first: Dict[int, str] = {}
        tied: Dict[str, str] = {}
        for param_name, param in sub.named_parameters(remove_duplicate=False):
            if id(param) in first:
                tied[param_name] = first[id(param)]
            else:
                first[id(param)] = param_name
        cls = _hf_class(sub, base)
        try:
            config = json.loads(sub.config.to_json_string(use_diff=False))
        except (TypeError, ValueError, AttributeError):
            config = None  # never fail a save for the export's sake: export_hf then says it writes no config.json
        found.append({"prefix": name + "." if name else "", "class": cls.__name__, "config": config, "tied": tied})
    return {INFO_KEY: found} if found else {}


def _normalise_prefix(prefix: str) -> str:
    if not isinstance(prefix, str):
        raise TypeError(f"strip_prefix must be a string, got {prefix!r}")
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def _candidates(keys: List[str]) -> List[str]:
    """Prefixes a user may mean: every leading ``a.``, ``a.b.`` shared by more than one key."""
    counts: Dict[str, int] = {}
    for key in keys:
        parts = key.split(".")
        for depth in range(1, min(len(parts), 3)):
            prefix = ".".join(parts[:depth]) + "."
            counts[prefix] = counts.get(prefix, 0) + 1
    return sorted(prefix for prefix, count in counts.items() if count > 1)[:12]


def recorded_models(path: PathLike) -> List[Dict[str, Any]]:
    """The Hugging Face models recorded in the ``zero.json`` of the sharded checkpoint at ``path`` (``[]`` for any
    other checkpoint, or one saved without transformers)."""
    try:
        directory = resolve_checkpoint_dir(path)
    except FileNotFoundError:
        return []
    if not is_sharded_checkpoint(directory):
        return []
    models = read_checkpoint_info(directory).get(INFO_KEY, [])
    return models if isinstance(models, list) else []


def select_keys(
    where: str, entries: List[TensorEntry], prefix: Optional[str], models: List[Dict[str, Any]]
) -> Tuple[str, Optional[Dict[str, Any]], List[TensorEntry], List[str]]:
    """The prefix to strip, the recorded model it is (if any), the entries under it and the keys left out.

    ``prefix=None`` auto-detects: exactly one recorded model. Otherwise a :class:`ValueError` lists candidates.
    """
    keys = [entry.key for entry in entries]
    if prefix is None:
        if len(models) != 1:
            found = (
                "records no transformers.PreTrainedModel (saved by an older lightning-zero, or not a "
                "lightning-zero checkpoint, or the model is no PreTrainedModel)"
                if not models
                else f"records {len(models)} transformers models, at prefixes {[m['prefix'] for m in models]}"
            )
            raise ValueError(
                f"{where} {found}; say which keys to export with strip_prefix (--strip-prefix), e.g. "
                f"one of {_candidates(keys)}"
            )
        prefix = models[0]["prefix"]
    prefix = _normalise_prefix(prefix)
    model = next((m for m in models if m.get("prefix") == prefix), None)
    chosen = [entry for entry in entries if entry.key.startswith(prefix)]
    if not chosen:
        raise ValueError(f"{where}: no key starts with {prefix!r}; candidates: {_candidates(keys)}")
    left_out = [entry.key for entry in entries if not entry.key.startswith(prefix)]
    return prefix, model, chosen, left_out


def check_output_dir(output_dir: str, sharded: Optional[bool]) -> None:
    """Refuse an output that ``from_pretrained`` could read instead of the export. ``sharded=None`` (before the
    layout is known) checks only what no layout would replace."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"output {output_dir} is a file; --hf takes a directory")
    other = () if sharded is None else (WEIGHTS_NAME if sharded else INDEX_NAME,)  # the other layout's entry point
    stale = [
        name
        for name in (*other, "pytorch_model.bin", "pytorch_model.bin.index.json")
        if os.path.exists(os.path.join(output_dir, name))
    ]
    if stale:
        # from_pretrained might read those instead of (or mixed with) what we write; they are not ours to delete
        raise ValueError(
            f"{output_dir} already holds {stale}, which from_pretrained could load instead of the "
            "export; choose an empty directory"
        )


def shard_numbers(sizes: List[int], max_bytes: Optional[int]) -> List[int]:
    """The file (1..n) of each of consecutive tensors of ``sizes`` bytes: at most ``max_bytes`` a file, a larger
    tensor in a file of its own; ``None``: one file."""
    numbers: List[int] = []
    used = 0
    for size in sizes:
        if max_bytes is not None and numbers and used + size > max_bytes:
            numbers.append(numbers[-1] + 1)
            used = 0
        else:
            numbers.append(numbers[-1] if numbers else 1)
        used += size
    return numbers


def _plan_shards(entries: List[TensorEntry], max_bytes: Optional[int]) -> List[List[TensorEntry]]:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: List[List[TensorEntry]] = [[]]
    for entry, number in zip(entries, shard_numbers([entry.nbytes for entry in entries], max_bytes)):
        if number > len(shards):
            shards.append([])
        shards[-1].append(entry)
    return shards


def _write_json(path: str, value: Any) -> None:
    tmp = path + ".partial"
    with open(tmp, "w") as file:
        json.dump(value, file, indent=2, sort_keys=True)
    os.replace(tmp, path)


def _check_exportable(where: str, prefix: str, meta: dict, extras: dict) -> None:
    """Refuse an export that would silently miss part of the model: frozen weights the checkpoint left out, or
    non-tensor entries under the model's prefix (safetensors stores tensors only)."""
    excluded = [key for key in meta.get("frozen_parameters_excluded") or () if key.startswith(prefix)]
    if excluded:
        raise ValueError(
            f"{where} left out {len(excluded)} frozen weight(s) of the model "
            f"(exclude_frozen_parameters=True, e.g. {excluded[0]!r}); the export would miss them"
        )
    inside_extras = sorted(key for key in extras if key.startswith(prefix))
    if inside_extras:
        raise ValueError(f"{where}: {inside_extras} under {prefix!r} are not tensors; safetensors cannot store them")


def export_hf(
    checkpoint: PathLike,
    output_dir: PathLike,
    strip_prefix: Optional[str] = None,
    dtype: Union[None, str, torch.dtype] = None,
    max_shard_size: Union[None, int, str] = None,
) -> List[str]:
    """Write the Hugging Face model of ``checkpoint`` to ``output_dir`` as ``model.safetensors`` (+ ``config.json``
    when the checkpoint records the model's config), streaming tensor by tensor.

    ``checkpoint`` is anything :func:`lightning_zero.checkpoint.consolidate_checkpoint` reads. ``strip_prefix``
    (e.g. ``"model"``) picks the keys to export and removes the prefix; by default it is the recorded
    ``PreTrainedModel``'s (see the module docstring). Tied weights recorded at save time are written once. ``dtype``
    (``"fp32"``, ``"bf16"``, ``"fp16"``) converts floating-point tensors (default: as stored) and is written into
    ``config.json``. ``max_shard_size`` (bytes, or ``"2GB"``) splits the weights into
    ``model-0000i-of-0000n.safetensors`` files and ``model.safetensors.index.json``, as ``save_pretrained`` does, when
    they exceed it. Returns the checkpoint keys left out (those outside the prefix).
    """
    dtype = parse_dtype(dtype)
    max_bytes = None if max_shard_size is None else parse_size(max_shard_size, "max_shard_size")
    output_dir = os.fspath(output_dir)
    check_output_dir(output_dir, sharded=None)  # fail fast; the layout's own check follows once it is known
    where = os.fspath(checkpoint)
    models = recorded_models(checkpoint)
    source = open_source(checkpoint)
    try:
        extras = source.extras()
        prefix, model, chosen, left_out = select_keys(where, source.entries, strip_prefix, models)
        _check_exportable(where, prefix, source.meta(), extras)
        # a tied name is dropped only when the weight it is tied to is written
        names = {entry.key[len(prefix) :] for entry in chosen}
        tied = {name: to for name, to in (model or {}).get("tied", {}).items() if to in names}
        chosen = [entry for entry in chosen if entry.key[len(prefix) :] not in tied]
        originals = {entry.key: entry for entry in chosen}
        entries = [
            TensorEntry(entry.key[len(prefix) :], entry.dtype, entry.shape)
            for entry in (converted(e, dtype) for e in chosen)
        ]
        by_new = {new.key: originals[old.key] for new, old in zip(entries, chosen)}

        def load(entry: TensorEntry) -> torch.Tensor:
            return cast(source.load(by_new[entry.key]), dtype)

        shards = _plan_shards(entries, max_bytes)
        check_output_dir(output_dir, sharded=len(shards) > 1)
        os.makedirs(output_dir, exist_ok=True)
        if len(shards) == 1:
            write_safetensors(os.path.join(output_dir, WEIGHTS_NAME), entries, load, metadata={"format": "pt"})
        else:
            weight_map = {}
            for number, shard in enumerate(shards, 1):
                name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                write_safetensors(os.path.join(output_dir, name), shard, load, metadata={"format": "pt"})
                weight_map.update((entry.key, name) for entry in shard)
            index = {"metadata": {"total_size": sum(entry.nbytes for entry in entries)}, "weight_map": weight_map}
            _write_json(os.path.join(output_dir, INDEX_NAME), index)  # last: its presence means complete
    finally:
        source.close()
    if model is None or model.get("config") is None:
        warnings.warn(
            f"no {CONFIG_NAME} written: {where} records no transformers model config at prefix "
            f"{prefix!r}; copy the model's {CONFIG_NAME} into {output_dir} before from_pretrained",
            stacklevel=2,
        )
    else:
        config = dict(model["config"])
        config["architectures"] = [model["class"]]
        floating = {entry.dtype for entry in entries if entry.dtype.is_floating_point}
        if len(floating) == 1 and next(iter(floating)) in _DTYPE_NAMES:
            config["dtype"] = _DTYPE_NAMES[next(iter(floating))]  # what the weights now are, for dtype="auto"
        _write_json(os.path.join(output_dir, CONFIG_NAME), config)
    return left_out + sorted(key for key in extras if not key.startswith(prefix))


def strip_prefix_entries(
    where: str, entries: List[TensorEntry], prefix: str
) -> Tuple[List[TensorEntry], Dict[str, str], List[str]]:
    """For plain safetensors output with ``strip_prefix``: the renamed entries, ``{new key: old key}`` and the keys
    left out."""
    _, _, chosen, left_out = select_keys(where, entries, prefix, [])
    cut = len(_normalise_prefix(prefix))
    renamed = [TensorEntry(entry.key[cut:], entry.dtype, entry.shape) for entry in chosen]
    return renamed, {new.key: old.key for new, old in zip(renamed, chosen)}, left_out
