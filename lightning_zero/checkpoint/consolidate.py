"""Consolidate a sharded (or DeepSpeed ZeRO) checkpoint into one file, streaming tensor by tensor.

Lightning's ``consolidate_checkpoint`` and DeepSpeed's ``zero_to_fp32`` materialise the whole model in memory.
Here a *source* enumerates ``TensorEntry`` (key, dtype, shape) from metadata alone, and loads one full tensor at a
time; the writers of :mod:`lightning_zero.checkpoint.streaming` put it on disk and drop it. Peak memory is about
three times the largest tensor (the assembled tensor, one chunk being read, a dtype-converted copy).

The DCP chunk reader is hand-written: DCP's own loader needs a pre-allocated target ``state_dict`` per call and
re-reads the metadata each time; reading the storage records directly is simpler and keeps every read
``weights_only``.
"""

from __future__ import annotations

import io
import os
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from lightning_zero.checkpoint.directory import checkpoint_directory, verify_and_read
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.safe_load import load_meta, safe_torch_load
from lightning_zero.checkpoint.streaming import TensorEntry, tensor_slot, write_safetensors, write_torch_checkpoint

PathLike = Union[str, os.PathLike]

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "16": torch.float16,
}


def parse_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    """``None`` keeps stored dtypes; otherwise one of ``fp32``/``bf16``/``fp16`` (or the torch dtype)."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be None, 'fp32', 'bf16' or 'fp16' (or the torch dtype), got {dtype!r}")


class DCPTensorSource:
    """Reads full tensors of one top-level entry (default ``state_dict``) of a DCP checkpoint, one at a time."""

    def __init__(self, path: PathLike, top_key: str = "state_dict") -> None:
        self.path = checkpoint_directory(path)
        # Every file's size and checksum, and chunks that cover each tensor exactly: `load` below then never hands
        # out the uninitialised memory of `torch.empty` nor a corrupt byte. The files verification read are kept.
        problems, read = verify_and_read(self.path, checksums=True)
        if problems:
            more = f" (and {len(problems) - 1} more problems; `lightning-zero verify` lists them)" \
                if len(problems) > 1 else ""
            raise CheckpointError(f"{problems[0]}{more}", problems[0].path) from problems[0]
        metadata = read["metadata"]
        self._meta: Optional[Dict[str, Any]] = read["meta"]  # handed out once by meta(), then read again
        self._storage = metadata.storage_data
        mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        self.entries: List[TensorEntry] = []
        self._fqns: Dict[str, str] = {}
        self._bytes_fqns: Dict[str, str] = {}
        self._metadata = metadata
        # planner_data keeps the order of the saved dict (the module's state_dict order); fall back to metadata.
        order = list(mappings) + [fqn for fqn in metadata.state_dict_metadata if fqn not in mappings]
        self._paths: Dict[str, Optional[Tuple[str, ...]]] = {}
        for fqn in order:
            item = metadata.state_dict_metadata.get(fqn)
            path_parts = mappings.get(fqn)
            self._paths[fqn] = tuple(str(part) for part in path_parts) if path_parts is not None else None
            if path_parts is not None:
                if len(path_parts) < 2 or path_parts[0] != top_key:
                    continue
                key = ".".join(str(part) for part in path_parts[1:])
            elif fqn.startswith(top_key + "."):
                key = fqn[len(top_key) + 1:]
            else:
                continue
            if isinstance(item, TensorStorageMetadata):
                self.entries.append(TensorEntry(key, item.properties.dtype, tuple(item.size)))
                self._fqns[key] = fqn
            elif isinstance(item, BytesStorageMetadata):
                self._bytes_fqns[key] = fqn
        self._files: Dict[str, Any] = {}

    def _read_record(self, index: MetadataIndex) -> bytes:
        info = self._storage[index]
        if getattr(info, "transform_descriptors", None):
            raise NotImplementedError(
                f"{self.path}: storage transforms {info.transform_descriptors} (DCP extensions such as compression) "
                "are not supported by the streaming reader"
            )
        file = self._files.get(info.relative_path)
        if file is None:
            file = self._files[info.relative_path] = open(os.path.join(self.path, info.relative_path), "rb")
        file.seek(info.offset)
        return file.read(info.length)

    def items_under(self, top_key: str) -> Iterator[Tuple[Tuple[str, ...], Any]]:
        """``(path below top_key, value)`` of every entry saved under ``top_key`` (e.g. ``optimizer_states``), in
        saved order: a :class:`TensorEntry` (keyed by its DCP name, for :meth:`load_fqn`) for a tensor, the value
        itself (read with ``weights_only``) for anything else. Needs DCP's planner data (the nested key paths),
        which every checkpoint written by ``save_sharded_checkpoint`` has."""
        for fqn, path in self._paths.items():
            if path is None:
                raise CheckpointError(f"{self.path}: the DCP metadata has no key path for {fqn!r}; cannot split it "
                                      "into nested keys", self.path)
            if len(path) < 2 or path[0] != top_key:
                continue
            item = self._metadata.state_dict_metadata.get(fqn)
            if item is None:
                continue
            if isinstance(item, TensorStorageMetadata):
                yield path[1:], TensorEntry(fqn, item.properties.dtype, tuple(item.size))
            else:
                yield path[1:], safe_torch_load(io.BytesIO(self._read_record(MetadataIndex(fqn))),
                                                what=f"{self.path} {fqn!r}")

    def load(self, entry: TensorEntry) -> torch.Tensor:
        """The full tensor for ``entry`` (one of :attr:`entries`), assembled from its chunks."""
        return self.load_fqn(self._fqns[entry.key])

    def load_fqn(self, fqn: str) -> torch.Tensor:
        """The full tensor saved under the DCP name ``fqn``, assembled from its chunks."""
        md = self._metadata.state_dict_metadata[fqn]
        what = f"{self.path} tensor {fqn!r}"
        if len(md.chunks) == 1 and tuple(md.chunks[0].sizes) == tuple(md.size):
            return safe_torch_load(io.BytesIO(self._read_record(MetadataIndex(fqn, md.chunks[0].offsets))), what=what)
        full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for chunk in md.chunks:
            part = safe_torch_load(io.BytesIO(self._read_record(MetadataIndex(fqn, chunk.offsets))), what=what)
            target = full
            for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                target = target.narrow(dim, start, length)
            target.copy_(part.reshape(target.shape))
            del part
        return full

    def extras(self) -> Dict[str, Any]:
        """Non-tensor entries under the top key (e.g. a module's ``_extra_state``), read with ``weights_only``."""
        return {key: safe_torch_load(io.BytesIO(self._read_record(MetadataIndex(fqn))), what=f"{self.path} {fqn!r}")
                for key, fqn in self._bytes_fqns.items()}

    def meta(self) -> Dict[str, Any]:
        meta, self._meta = self._meta, None  # the copy verification read, once (a caller may change it)
        return meta if meta is not None else load_meta(self.path)

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()


class TorchFileSource:
    """A regular (single-file) Lightning checkpoint, memory-mapped and read with ``weights_only=True``."""

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        self._checkpoint = safe_torch_load(self.path, what=self.path, mmap=True)
        state = self._checkpoint.get("state_dict") if isinstance(self._checkpoint, dict) else None
        if not isinstance(state, dict):
            raise ValueError(f"{self.path} is not a Lightning checkpoint (no 'state_dict' dict)")
        self._state = state
        self.entries = [TensorEntry(k, v.dtype, tuple(v.shape)) for k, v in state.items() if torch.is_tensor(v)]

    def load(self, entry: TensorEntry) -> torch.Tensor:
        return self._state[entry.key].detach().clone()

    def extras(self) -> Dict[str, Any]:
        return {k: v for k, v in self._state.items() if not torch.is_tensor(v)}

    def meta(self) -> Dict[str, Any]:
        return {k: v for k, v in self._checkpoint.items() if k not in ("state_dict", "optimizer_states")}

    def optimizer_states(self) -> list:
        states = self._checkpoint.get("optimizer_states")
        if not states:
            raise ValueError(f"{self.path} holds no optimizer states (saved with save_weights_only=True?)")
        return states

    def close(self) -> None:
        self._checkpoint = self._state = None


def open_source(path: PathLike):
    """A tensor source for a lightning-zero sharded checkpoint, a DeepSpeed ZeRO checkpoint directory, or a
    regular single-file Lightning checkpoint."""
    from lightning_zero.checkpoint.deepspeed_reader import DeepSpeedTensorSource, is_deepspeed_checkpoint

    if is_deepspeed_checkpoint(path):
        return DeepSpeedTensorSource(path)
    if os.path.isfile(path):
        return TorchFileSource(path)
    return DCPTensorSource(path)


def _converted(entry: TensorEntry, dtype: Optional[torch.dtype]) -> TensorEntry:
    if dtype is None or not entry.dtype.is_floating_point:
        return entry
    return TensorEntry(entry.key, dtype, entry.shape)


def iter_consolidated(path: PathLike, dtype: Union[None, str, torch.dtype] = None
                      ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(key, full tensor)`` of the model state of the checkpoint at ``path`` one at a time."""
    dtype = parse_dtype(dtype)
    source = open_source(path)
    try:
        for entry in source.entries:
            yield entry.key, _cast(source.load(entry), dtype)
    finally:
        source.close()


def _cast(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


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
    import warnings

    from lightning_zero.checkpoint.hf_export import strip_prefix_entries

    entries, renamed, left_out = strip_prefix_entries(os.fspath(path), entries, prefix)
    cut = prefix if prefix.endswith(".") or not prefix else prefix + "."
    inside = sorted(key for key in extras if key.startswith(cut))
    if inside:
        raise ValueError(f"{path}: {inside} under {cut!r} are not tensors; safetensors cannot store them")
    left_out += sorted(extras)
    if left_out:
        warnings.warn(f"strip_prefix={prefix!r}: {len(left_out)} key(s) outside the prefix are left out: "
                      f"{left_out[:8]}{' ...' if len(left_out) > 8 else ''}", stacklevel=3)
    return entries, renamed, left_out


#: How :func:`options_problem` spells the options: as Python arguments (the function, the callback), or as the CLI's.
PYTHON_NAMES = {"output": "output", "with_optimizer": "with_optimizer=True", "dtype": "dtype",
                "strip_prefix": "strip_prefix", "other_export": "the returned dict (output=None)"}
CLI_NAMES = {"output": "OUTPUT", "with_optimizer": "--with-optimizer", "dtype": "--dtype",
             "strip_prefix": "--strip-prefix", "other_export": "--hf"}


def options_problem(output: Optional[PathLike], dtype: Any, with_optimizer: bool, strip_prefix: Optional[str] = None,
                    names: Dict[str, str] = PYTHON_NAMES) -> Optional[str]:
    """The first rule the combination of consolidation options breaks, as a message, or ``None``: the one rule set
    of :func:`consolidate_checkpoint`, ``lightning-zero consolidate`` and ``ConsolidateCheckpoint`` (``names``:
    how the caller spells the options, :data:`PYTHON_NAMES` or :data:`CLI_NAMES`)."""
    safetensors = output is not None and os.fspath(output).endswith(".safetensors")
    if with_optimizer and (output is None or safetensors):
        return (f"{names['with_optimizer']} writes a Lightning checkpoint file: give an {names['output']} that does "
                "not end in .safetensors")
    if with_optimizer and dtype is not None:
        return (f"{names['with_optimizer']} keeps the trained dtypes (a resumed run must continue from the exact "
                f"weights); leave {names['dtype']} unset")
    if strip_prefix is not None and (with_optimizer or output is not None and not safetensors):
        return (f"{names['strip_prefix']} applies to a .safetensors {names['output']} or {names['other_export']}: "
                "a Lightning checkpoint keeps the LightningModule's keys")
    return None


def consolidate_checkpoint(
    path: PathLike, output: Optional[PathLike] = None, dtype: Union[None, str, torch.dtype] = None,
    with_optimizer: bool = False, strip_prefix: Optional[str] = None,
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
    """
    dtype = parse_dtype(dtype)
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
        raise ValueError(f"{path}: with_optimizer=True reads lightning-zero sharded checkpoints and Lightning "
                         "checkpoint files, not DeepSpeed checkpoints")
    try:
        entries = [_converted(entry, dtype) for entry in source.entries]
        originals = {entry.key: entry for entry in source.entries}
        extras = source.extras()
        if strip_prefix is not None:
            entries, renamed, left_out = _strip(path, entries, strip_prefix, extras)
            originals = {new: originals[old] for new, old in renamed.items()}
            extras = {}
        if output is None:
            state: Dict[str, Any] = OrderedDict((e.key, _cast(source.load(originals[e.key]), dtype)) for e in entries)
            state.update(extras)
            return state
        output = os.fspath(output)
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)

        def load(entry: TensorEntry) -> torch.Tensor:
            return _cast(source.load(originals[entry.key]), dtype)

        if output.endswith(".safetensors"):
            if extras:
                raise ValueError(
                    f"the checkpoint's state_dict holds non-tensor entries {sorted(extras)}, which safetensors "
                    "cannot store; write a .ckpt/.pt output instead"
                )
            write_safetensors(output, entries, load, metadata={"format": "pt"})
            return None
        state_dict: Dict[str, Any] = OrderedDict((entry.key, tensor_slot(entry)) for entry in entries)
        state_dict.update(extras)
        if with_optimizer and isinstance(source, TorchFileSource):
            checkpoint = {**source.meta(), "state_dict": state_dict, "optimizer_states": source.optimizer_states()}
            write_torch_checkpoint(output, checkpoint, load)  # its (memory-mapped) states are written as they are
            return None
        if with_optimizer:
            from lightning_zero.checkpoint.resumable import resumable_checkpoint

            checkpoint, load_any = resumable_checkpoint(source, state_dict, load)
            write_torch_checkpoint(output, checkpoint, load_any)
            return None
        checkpoint = dict(source.meta())
        checkpoint.pop("state_dict", None)
        checkpoint["state_dict"] = state_dict
        write_torch_checkpoint(output, checkpoint, load)
        return None
    finally:
        source.close()
