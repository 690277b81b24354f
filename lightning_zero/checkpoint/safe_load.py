"""Loading checkpoint files without executing pickled code.

Two kinds of pickles appear in a lightning-zero checkpoint directory:

* ``meta.pt`` (Lightning's loop state, hyper-parameters, ...) is read with ``torch.load(weights_only=True)``. When it
  holds a type that torch does not allow-list, :func:`load_meta` raises an error naming the type and the exact
  ``torch.serialization.add_safe_globals`` call that allows it.
* ``.metadata`` of ``torch.distributed.checkpoint`` (DCP). In torch 2.13 ``FileSystemReader.read_metadata`` uses a
  plain ``pickle.load``, which would run any code a tampered file carries. :class:`SafeFileSystemReader` reads it
  with :class:`DCPMetadataUnpickler`, which only resolves DCP's own metadata dataclasses and a few torch value types.

Hand-written because neither torch nor another maintained library offers a restricted reader for DCP metadata.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_zero.checkpoint.atomic import PathLike
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.torch_compat import set_element

# The only classes a DCP `.metadata` pickle written by torch's FileSystemWriter references (checked on torch 2.13).
_DCP_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "slice"},
}
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint file references a Python global that we refuse to load."""


class DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP ``.metadata`` files that refuses every global outside an explicit allow-list."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, _TORCH_VALUE_TYPES):
                return value
        elif name in _DCP_ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"refusing to load DCP metadata: it references {module}.{name}, which is not one of the metadata types "
            "torch.distributed.checkpoint writes. The checkpoint is corrupt or was tampered with."
        )


def _read_metadata_file(path: str) -> Metadata:
    """Unpickle the DCP metadata file ``path`` with the allow-list; any damage is a :class:`CheckpointError`."""
    try:
        with open(path, "rb") as file:
            metadata = DCPMetadataUnpickler(file).load()
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(f"{path}: {err}", path) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file missing", path) from None
    except Exception as err:  # truncated or garbage bytes fail in many ways inside pickle
        raise CheckpointError(
            f"{path}: not a readable DCP metadata file (truncated or corrupt: {type(err).__name__}: {err})", path
        ) from err
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{path}: does not hold DCP Metadata (got {type(metadata).__name__})", path)
    return metadata


def read_dcp_metadata(path: PathLike) -> Metadata:
    """Read the ``.metadata`` file of the DCP checkpoint directory ``path`` without running pickled code."""
    return _read_metadata_file(os.path.join(os.fspath(path), ".metadata"))


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata read cannot execute code.

    Tensor payloads are already read by torch with ``torch.load(weights_only=True)``; non-tensor ("bytes") items go
    through :class:`SafeLoadPlanner`. ``metadata``: the directory's ``.metadata`` as the caller read (and checked) it
    with :func:`read_dcp_metadata`, returned instead of reading the file again.
    """

    def __init__(self, path: PathLike, *args: Any, metadata: Optional[Metadata] = None, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        if rank is None and self._metadata is not None:
            metadata = self._metadata
        else:
            metadata = _read_metadata_file(os.path.join(os.fspath(self.path), name))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items with ``weights_only=True`` (torch's uses ``False``)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = safe_torch_load(value, what=f"checkpoint item {read_item.dest_index.fqn!r}")
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")


def safe_torch_load(source: Any, *, what: str, **kwargs: Any) -> Any:
    """``torch.load(source, weights_only=True)`` with an actionable error when a type is not allow-listed, and a
    :class:`CheckpointError` naming ``what`` when the bytes are not a readable torch file."""
    path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    try:
        return torch.load(source, weights_only=True, map_location="cpu", **kwargs)
    except pickle.UnpicklingError as err:
        found = _GLOBAL_IN_MESSAGE.search(str(err))
        if not found:
            raise CheckpointError(f"{what}: not a readable torch file (corrupt: {_first_line(err)})", path) from err
        type_name = found.group(1)
        short = type_name.rsplit(".", 1)[-1]
        raise UnsafeCheckpointError(
            f"{what} contains the type {type_name}, which torch.load(weights_only=True) does not allow. Loading "
            f"never executes pickled code. If you trust this type, allow-list it before loading: "
            f"`torch.serialization.add_safe_globals([{short}])` (after importing {short} from its module)."
        ) from err
    except FileNotFoundError:
        raise CheckpointError(f"{what}: file missing", path) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, TypeError) as err:
        # torch reports a damaged zip or storage with assorted internal errors; none names the file
        raise CheckpointError(
            f"{what}: not a readable torch file (truncated, corrupt or another file type: {_first_line(err)})", path
        ) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def load_meta(path: PathLike) -> dict:
    """Load the ``meta.pt`` of a sharded checkpoint directory with ``weights_only=True``."""
    where = os.path.join(os.fspath(path), "meta.pt")
    meta = safe_torch_load(where, what=where)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: must hold a dict, got {type(meta).__name__}", where)
    return meta
