"""Tensor sources: a checkpoint's model state read one full tensor at a time, for streaming consolidation and export.

A *source* enumerates ``TensorEntry`` (key, dtype, shape) from metadata alone, and loads one full tensor at a time;
:mod:`lightning_zero.checkpoint.consolidate` and :mod:`lightning_zero.checkpoint.hf_export` hand it to the writers
of :mod:`lightning_zero.checkpoint.streaming`, which put it on disk and drop it. :func:`open_source` picks the
source for a lightning-zero sharded checkpoint (:class:`DCPTensorSource`), a DeepSpeed ZeRO directory
(:class:`lightning_zero.checkpoint.deepspeed_reader.DeepSpeedTensorSource`) or a single-file Lightning checkpoint
(:class:`TorchFileSource`); :func:`parse_dtype`, :func:`converted` and :func:`cast` are the dtype conversion both
writers apply.

The DCP chunk reader is hand-written: DCP's own loader needs a pre-allocated target ``state_dict`` per call and
re-reads the metadata each time; reading the storage records directly is simpler and keeps every read
``weights_only``.
"""

from __future__ import annotations

import io
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from lightning_zero.checkpoint.atomic import PathLike
from lightning_zero.checkpoint.deepspeed_reader import DeepSpeedTensorSource, is_deepspeed_checkpoint
from lightning_zero.checkpoint.directory import checkpoint_directory, verify_and_read
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.safe_load import load_meta, read_dcp_metadata, safe_torch_load
from lightning_zero.checkpoint.streaming import TensorEntry
from lightning_zero.checkpoint.verify import check_metadata

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "16": torch.float16,
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

    def __init__(self, path: PathLike, top_key: str = "state_dict", *, being_saved: bool = False) -> None:
        """``being_saved``: ``path`` is the partial directory of a save still in progress (its shards and ``.metadata``
        written, ``zero.json`` not yet), read by that save itself; there are no file records to check yet, so only
        the metadata's structure is (chunks covering each tensor exactly, records inside the files)."""
        if being_saved:
            self.path = os.fspath(path)
            metadata = read_dcp_metadata(self.path)
            problems = check_metadata(self.path, metadata)
            read: Dict[str, Any] = {"metadata": metadata, "meta": None}
        else:
            self.path = checkpoint_directory(path)
            # Every file's size and checksum, and chunks that cover each tensor exactly: `load` below then never
            # hands out the uninitialised memory of `torch.empty` nor a corrupt byte. The files read are kept.
            problems, read = verify_and_read(self.path, checksums=True)
        if problems:
            more = (
                f" (and {len(problems) - 1} more problems; `lightning-zero verify` lists them)"
                if len(problems) > 1
                else ""
            )
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
                key = fqn[len(top_key) + 1 :]
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
                raise CheckpointError(
                    f"{self.path}: the DCP metadata has no key path for {fqn!r}; cannot split it into nested keys",
                    self.path,
                )
            if len(path) < 2 or path[0] != top_key:
                continue
            item = self._metadata.state_dict_metadata.get(fqn)
            if item is None:
                continue
            if isinstance(item, TensorStorageMetadata):
                yield path[1:], TensorEntry(fqn, item.properties.dtype, tuple(item.size))
            else:
                yield (
                    path[1:],
                    safe_torch_load(io.BytesIO(self._read_record(MetadataIndex(fqn))), what=f"{self.path} {fqn!r}"),
                )

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
        return {
            key: safe_torch_load(io.BytesIO(self._read_record(MetadataIndex(fqn))), what=f"{self.path} {fqn!r}")
            for key, fqn in self._bytes_fqns.items()
        }

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
    if is_deepspeed_checkpoint(path):
        return DeepSpeedTensorSource(path)
    if os.path.isfile(path):
        return TorchFileSource(path)
    return DCPTensorSource(path)


def converted(entry: TensorEntry, dtype: Optional[torch.dtype]) -> TensorEntry:
    """``entry`` as it will be after :func:`cast` to ``dtype`` (non-floating entries keep theirs)."""
    if dtype is None or not entry.dtype.is_floating_point:
        return entry
    return TensorEntry(entry.key, dtype, entry.shape)


def cast(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``tensor`` in ``dtype`` when it is floating-point and a dtype is given; otherwise as it is."""
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
