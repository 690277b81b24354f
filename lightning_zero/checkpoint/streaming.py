"""Single-file writers that take tensors one at a time, so peak memory is one tensor, not the model.

* :func:`write_safetensors` writes the safetensors header (known up front from shapes and dtypes), then each
  tensor's bytes in order. The ``safetensors`` package only saves a dict that is entirely in memory, so this is
  hand-written against the published format (8-byte little-endian header size, JSON header, raw data).
* :func:`write_torch_checkpoint` writes the zip format of ``torch.save`` (what ``torch.load(weights_only=True)``
  reads): the pickle ``data.pkl`` only refers to storages by key, so we pickle the whole object first with
  placeholders for the tensors, then stream each storage record. torch has no public incremental writer; this
  uses the writer torch.save itself uses (:func:`lightning_zero.torch_compat.open_zipfile_writer`) and mirrors the
  records torch.save emits.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch

from lightning_zero.torch_compat import REBUILD_TENSOR, open_zipfile_writer, storage_alignment, storage_type_names

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class TensorEntry:
    """Key, dtype and shape of one tensor of a checkpoint, known before its data is read."""

    key: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _replace(tmp: str, output: str) -> None:
    os.replace(tmp, output)


def _discard(tmp: str) -> None:
    """Remove our own half-written temporary file after a failure (never the output itself)."""
    try:
        os.remove(tmp)
    except OSError:
        pass


def write_safetensors(
    output: str,
    entries: List[TensorEntry],
    load: Callable[[TensorEntry], torch.Tensor],
    metadata: Dict[str, str] | None = None,
) -> None:
    """Write ``entries`` to ``output`` in safetensors format, calling ``load(entry)`` for one tensor at a time."""
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for entry in entries:
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{entry.key}: dtype {entry.dtype} cannot be stored in safetensors")
        header[entry.key] = {
            "dtype": SAFETENSORS_DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to an 8-byte boundary with spaces
    tmp = output + ".partial"
    try:
        with open(tmp, "wb") as file:
            file.write(len(encoded).to_bytes(8, "little"))
            file.write(encoded)
            for entry in entries:
                tensor = load(entry)
                if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                    raise RuntimeError(
                        f"{entry.key}: expected {entry.dtype}{list(entry.shape)}, "
                        f"read {tensor.dtype}{list(tensor.shape)}"
                    )
                file.write(_raw_bytes(tensor))
                del tensor
    except BaseException:
        _discard(tmp)
        raise
    _replace(tmp, output)


class _TensorSlot:
    """Stands in for a tensor in the pickle; its data is written later under storage key ``key``."""

    __slots__ = ("entry", "key", "tensor")

    def __init__(self, entry: TensorEntry, key: str, tensor: torch.Tensor | None = None) -> None:
        self.entry, self.key, self.tensor = entry, key, tensor


class _StorageRef:
    __slots__ = ("slot",)

    def __init__(self, slot: _TensorSlot) -> None:
        self.slot = slot


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class _StreamingPickler(pickle.Pickler):
    """Pickles ``_TensorSlot`` exactly as torch.save pickles a contiguous CPU tensor, without its data."""

    def __init__(self, file: io.BytesIO, slots: List[_TensorSlot]) -> None:
        super().__init__(file, protocol=2)
        self.slots = slots
        self.storage_types = storage_type_names()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):  # a real tensor inside the metadata (e.g. a callback's best score)
            if obj.layout != torch.strided or type(obj) not in (torch.Tensor, torch.nn.Parameter):
                raise TypeError(f"cannot stream a {type(obj).__name__} with layout {obj.layout}")
            tensor = obj.detach().cpu().contiguous()
            obj = _TensorSlot(TensorEntry("", tensor.dtype, tuple(tensor.shape)), "", tensor)
        if isinstance(obj, _TensorSlot):
            obj.key = str(len(self.slots))
            self.slots.append(obj)
            shape = obj.entry.shape
            return (
                REBUILD_TENSOR,
                (_StorageRef(obj), 0, torch.Size(shape), _contiguous_stride(shape), False, OrderedDict()),
            )
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            entry = obj.slot.entry
            name = self.storage_types.get(entry.dtype)
            if name is None:
                raise TypeError(f"{entry.key}: dtype {entry.dtype} has no legacy storage type for torch.save")
            return ("storage", getattr(torch, name), obj.slot.key, "cpu", math.prod(entry.shape))
        return None


def write_torch_checkpoint(
    output: str,
    obj: Any,
    load: Callable[[TensorEntry], torch.Tensor],
) -> None:
    """``torch.save(obj, output)`` where ``obj`` may hold :func:`tensor_slot` placeholders loaded one at a time."""
    slots: List[_TensorSlot] = []
    buffer = io.BytesIO()
    _StreamingPickler(buffer, slots).dump(obj)
    data = buffer.getvalue()
    tmp = output + ".partial"
    try:
        with open_zipfile_writer(tmp) as writer:
            writer.write_record("data.pkl", data, len(data))
            writer.write_record(".format_version", "1", 1)
            alignment = str(storage_alignment())
            writer.write_record(".storage_alignment", alignment, len(alignment))
            writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
            for slot in slots:
                tensor = slot.tensor if slot.tensor is not None else load(slot.entry)
                slot.tensor = None
                if tensor.dtype != slot.entry.dtype or tuple(tensor.shape) != slot.entry.shape:
                    raise RuntimeError(
                        f"{slot.entry.key}: expected {slot.entry.dtype}{list(slot.entry.shape)}, "
                        f"read {tensor.dtype}{list(tensor.shape)}"
                    )
                tensor = tensor.detach().cpu().contiguous()
                storage = tensor.untyped_storage()
                if storage.nbytes() != tensor.numel() * tensor.element_size() or tensor.storage_offset():
                    tensor = tensor.clone()  # a view of a larger buffer: write only its own bytes
                    storage = tensor.untyped_storage()
                writer.write_record(f"data/{slot.key}", storage, storage.nbytes())
                del tensor, storage
    except BaseException:
        _discard(tmp)
        raise
    _replace(tmp, output)


def tensor_slot(entry: TensorEntry) -> _TensorSlot:
    """A placeholder for ``entry`` inside an object given to :func:`write_torch_checkpoint`."""
    return _TensorSlot(entry, "")
