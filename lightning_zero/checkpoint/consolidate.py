"""Consolidate a sharded (or DeepSpeed ZeRO) checkpoint into one file, streaming tensor by tensor.

The same streaming writes the 16-bit weights file a save adds with DeepSpeed's
``stage3_gather_16bit_weights_on_model_save`` (:func:`write_16bit_weights`).

Lightning's ``consolidate_checkpoint`` and DeepSpeed's ``zero_to_fp32`` materialise the whole model in memory.
Here a *source* (:mod:`lightning_zero.checkpoint.tensor_sources`) enumerates ``TensorEntry`` (key, dtype, shape)
from metadata alone, and loads one full tensor at a time; the writers of :mod:`lightning_zero.checkpoint.streaming`
put it on disk and drop it. Peak memory is about three times the largest tensor (the assembled tensor, one chunk
being read, a dtype-converted copy).
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from lightning_zero.checkpoint.atomic import PathLike
from lightning_zero.checkpoint.hf_export import strip_prefix_entries
from lightning_zero.checkpoint.streaming import TensorEntry, tensor_slot, write_safetensors, write_torch_checkpoint
from lightning_zero.checkpoint.tensor_sources import (
    DCPTensorSource,
    TorchFileSource,
    cast,
    converted,
    open_source,
    parse_dtype,
)


def iter_consolidated(
    path: PathLike, dtype: Union[None, str, torch.dtype] = None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(key, full tensor)`` of the model state of the checkpoint at ``path`` one at a time."""
    dtype = parse_dtype(dtype)
    source = open_source(path)
    try:
        for entry in source.entries:
            yield entry.key, cast(source.load(entry), dtype)
    finally:
        source.close()


def _check_output(path: PathLike, output: PathLike) -> None:
    output = os.path.abspath(os.fspath(output))
    if os.path.isdir(output):
        raise ValueError(f"output {output} is an existing directory; give the path of the file to write")
    if output == os.path.abspath(os.fspath(path)).rstrip(os.sep):
        raise ValueError(f"output {output} is the checkpoint being consolidated; give another path")
    parent = os.path.dirname(output)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise ValueError(f"output {output} cannot be created: {parent} is a file, not a directory")


def _strip(path: PathLike, entries: List[TensorEntry], prefix: str, extras: Dict[str, Any]):
    """``strip_prefix`` for :func:`consolidate_checkpoint`: renamed entries, ``{new: old}``; warns what is left out."""
    entries, renamed, left_out = strip_prefix_entries(os.fspath(path), entries, prefix)
    cut = prefix if prefix.endswith(".") or not prefix else prefix + "."
    inside = sorted(key for key in extras if key.startswith(cut))
    if inside:
        raise ValueError(f"{path}: {inside} under {cut!r} are not tensors; safetensors cannot store them")
    left_out += sorted(extras)
    if left_out:
        warnings.warn(
            f"strip_prefix={prefix!r}: {len(left_out)} key(s) outside the prefix are left out: "
            f"{left_out[:8]}{' ...' if len(left_out) > 8 else ''}",
            stacklevel=3,
        )
    return entries, renamed, left_out


#: How :func:`options_problem` spells the options: as Python arguments (the function, the callback), or as the CLI's.
PYTHON_NAMES = {
    "output": "output",
    "with_optimizer": "with_optimizer=True",
    "dtype": "dtype",
    "strip_prefix": "strip_prefix",
    "other_export": "the returned dict (output=None)",
}
CLI_NAMES = {
    "output": "OUTPUT",
    "with_optimizer": "--with-optimizer",
    "dtype": "--dtype",
    "strip_prefix": "--strip-prefix",
    "other_export": "--hf",
}


def options_problem(
    output: Optional[PathLike],
    dtype: Any,
    with_optimizer: bool,
    strip_prefix: Optional[str] = None,
    names: Dict[str, str] = PYTHON_NAMES,
) -> Optional[str]:
    """The first rule the combination of consolidation options breaks, as a message, or ``None``: the one rule set
    of :func:`consolidate_checkpoint`, ``lightning-zero consolidate`` and ``ConsolidateCheckpoint`` (``names``:
    how the caller spells the options, :data:`PYTHON_NAMES` or :data:`CLI_NAMES`)."""
    safetensors = output is not None and os.fspath(output).endswith(".safetensors")
    if with_optimizer and (output is None or safetensors):
        return (
            f"{names['with_optimizer']} writes a Lightning checkpoint file: give an {names['output']} that does "
            "not end in .safetensors"
        )
    if with_optimizer and dtype is not None:
        return (
            f"{names['with_optimizer']} keeps the trained dtypes (a resumed run must continue from the exact "
            f"weights); leave {names['dtype']} unset"
        )
    if strip_prefix is not None and (with_optimizer or output is not None and not safetensors):
        return (
            f"{names['strip_prefix']} applies to a .safetensors {names['output']} or {names['other_export']}: "
            "a Lightning checkpoint keeps the LightningModule's keys"
        )
    return None


def consolidate_checkpoint(
    path: PathLike,
    output: Optional[PathLike] = None,
    dtype: Union[None, str, torch.dtype] = None,
    with_optimizer: bool = False,
    strip_prefix: Optional[str] = None,
    layout: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
) -> Optional[Dict[str, Any]]:
    """Consolidate the checkpoint at ``path`` (lightning-zero sharded or DeepSpeed ZeRO directory; a regular
    Lightning checkpoint file is accepted too, e.g. to convert it to safetensors or another dtype).

    * ``output=None``: return the full model state dict (this holds the whole model in memory, by definition).
    * ``output`` ending in ``.safetensors``: write the model tensors as safetensors; returns ``None``.
    * any other ``output``: write a Lightning checkpoint ``{"state_dict": ..., **meta}`` readable by
      ``LightningModule.load_from_checkpoint`` and ``torch.load(output, weights_only=True)``; returns ``None``.

    Files are written tensor by tensor (peak memory ~3x the largest tensor), to ``output + ".partial"`` first and
    renamed when complete (removed on failure). A sharded source is verified first (every file's size and CRC-32,
    chunks covering each tensor exactly); damage is a :class:`CheckpointError` naming the file. An ``output`` that
    is an existing directory is refused before anything is read. ``dtype`` (``"fp32"``, ``"bf16"``, ``"fp16"``)
    converts floating-point tensors.

    ``with_optimizer=True`` (a lightning-zero sharded checkpoint, written to a Lightning checkpoint file) adds the
    optimizer states in ``torch.optim.Optimizer.state_dict()`` form and drops lightning-zero's own bookkeeping, so
    that ``Trainer(strategy="ddp").fit(model, ckpt_path=output)`` (or any other strategy) resumes the run: weights,
    optimizer states, LR schedulers, loops, callbacks, epoch and step. It keeps the trained dtypes (``dtype`` is
    refused with it); see :mod:`lightning_zero.checkpoint.resumable`.

    ``strip_prefix`` (returned dict or ``.safetensors`` output only) keeps the keys under that prefix (e.g.
    ``"model"`` for ``self.model = AutoModel...``) with the prefix removed, for loading into the bare inner model;
    the keys left out are reported with a warning. For a Hugging Face directory use
    :func:`lightning_zero.checkpoint.export_hf`.

    ``layout`` (a torch ``output``) rearranges the Lightning checkpoint dict before it is written (its tensors are
    placeholders, streamed as they are): Fabric's ``state_dict_type="full"`` writes Fabric's own layout with it.
    """
    dtype = parse_dtype(dtype)
    source = _checked_source(path, output, dtype, with_optimizer, strip_prefix)
    try:
        entries = [converted(entry, dtype) for entry in source.entries]
        originals = {entry.key: entry for entry in source.entries}
        extras = source.extras()
        if strip_prefix is not None:
            entries, renamed, left_out = _strip(path, entries, strip_prefix, extras)
            originals = {new: originals[old] for new, old in renamed.items()}
            extras = {}
        if output is None:
            state: Dict[str, Any] = OrderedDict((e.key, cast(source.load(originals[e.key]), dtype)) for e in entries)
            state.update(extras)
            return state
        output = os.fspath(output)
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)

        def load(entry: TensorEntry) -> torch.Tensor:
            return cast(source.load(originals[entry.key]), dtype)

        if output.endswith(".safetensors"):
            if extras:
                raise ValueError(
                    f"the checkpoint's state_dict holds non-tensor entries {sorted(extras)}, which safetensors "
                    "cannot store; write a .ckpt/.pt output instead"
                )
            write_safetensors(output, entries, load, metadata={"format": "pt"})
            return None
        _write_lightning_checkpoint(source, output, entries, extras, load, with_optimizer, layout or (lambda c: c))
        return None
    finally:
        source.close()


def _checked_source(
    path: PathLike,
    output: Optional[PathLike],
    dtype: Optional[torch.dtype],
    with_optimizer: bool,
    strip_prefix: Optional[str],
):
    """The source :func:`consolidate_checkpoint` reads, opened once its options pass their checks (before the
    expensive work: an unusable ``output`` is refused before anything is read)."""
    if not isinstance(with_optimizer, bool):
        raise TypeError(f"with_optimizer must be a bool, got {with_optimizer!r}")
    problem = options_problem(output, dtype, with_optimizer, strip_prefix)
    if problem:
        raise ValueError(problem)
    if output is not None:
        _check_output(path, output)  # before the expensive work
    source = open_source(path)
    if with_optimizer and not isinstance(source, (DCPTensorSource, TorchFileSource)):
        source.close()
        raise ValueError(
            f"{path}: with_optimizer=True reads lightning-zero sharded checkpoints and Lightning "
            "checkpoint files, not DeepSpeed checkpoints"
        )
    return source


def _write_lightning_checkpoint(
    source,
    output: str,
    entries: List[TensorEntry],
    extras: Dict[str, Any],
    load: Callable[[TensorEntry], torch.Tensor],
    with_optimizer: bool,
    layout: Callable[[Dict[str, Any]], Dict[str, Any]],
) -> None:
    """Write ``output`` as a Lightning checkpoint file for :func:`consolidate_checkpoint`: the model's ``entries``
    (streamed through ``load``) and non-tensor ``extras`` as its ``state_dict``, next to the source's other keys;
    ``with_optimizer`` adds the optimizer states so that another strategy resumes from it; ``layout`` rearranges
    the dict."""
    state_dict: Dict[str, Any] = OrderedDict((entry.key, tensor_slot(entry)) for entry in entries)
    state_dict.update(extras)
    if with_optimizer and isinstance(source, TorchFileSource):
        checkpoint = {**source.meta(), "state_dict": state_dict, "optimizer_states": source.optimizer_states()}
        write_torch_checkpoint(output, layout(checkpoint), load)  # its (memory-mapped) states are written as they are
        return
    if with_optimizer:
        from lightning_zero.checkpoint.resumable import resumable_checkpoint

        checkpoint, load_any = resumable_checkpoint(source, state_dict, load)
        write_torch_checkpoint(output, layout(checkpoint), load_any)
        return
    checkpoint = dict(source.meta())
    checkpoint.pop("state_dict", None)
    checkpoint["state_dict"] = state_dict
    write_torch_checkpoint(output, layout(checkpoint), load)


#: The file :func:`write_16bit_weights` adds to a checkpoint: DeepSpeed's ``save_16bit_model`` default file name, so
#: scripts written for DeepSpeed find it under the name they know.
WEIGHTS_16BIT_FILE = "pytorch_model.bin"
_DTYPE_OF_PRECISION = {
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
}


def weights_16bit_dtype(precision: str) -> torch.dtype:
    """The dtype DeepSpeed's ``save_16bit_model`` writes for a run in ``precision``: the dtype its engine keeps the
    module in, fp16 or bf16 under fp16/bf16 training, and fp32 (despite the name) for an fp32 run."""
    return _DTYPE_OF_PRECISION.get(precision, torch.float32)


def write_16bit_weights(directory: str, dtype: torch.dtype) -> str:
    """Write ``directory/pytorch_model.bin``: the full model weights of the sharded checkpoint being saved in
    ``directory`` (its partial directory, shards and ``.metadata`` written), floating-point tensors cast to
    ``dtype``; returns the file's path. Rank 0 calls it before ``zero.json`` is written, so the file is recorded,
    verified and swapped into place with the rest of the checkpoint, and deleted with it.

    The file is what ``torch.save(module.state_dict())`` of the unsharded model in ``dtype`` would be (the
    LightningModule's keys; parameters and buffers, not non-tensor extra state, as DeepSpeed's
    ``_zero3_consolidated_16bit_state_dict``), so ``module.load_state_dict(torch.load(path, weights_only=True))``
    reads it. Streamed: each full tensor is assembled from the saved shards, written and dropped before the next
    is read, so this rank holds one tensor at a time (about three times the largest), never the model.
    """
    source = DCPTensorSource(directory, being_saved=True)
    try:
        originals = {entry.key: entry for entry in source.entries}
        state = OrderedDict((entry.key, tensor_slot(converted(entry, dtype))) for entry in source.entries)
        output = os.path.join(directory, WEIGHTS_16BIT_FILE)
        write_torch_checkpoint(output, state, lambda entry: cast(source.load(originals[entry.key]), dtype))
    finally:
        source.close()
    return output
