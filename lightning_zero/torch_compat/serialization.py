"""The pieces of ``torch.save``'s zip format a streaming writer needs.

torch has no public incremental writer: ``checkpoint/streaming.py`` pickles the object with placeholders and writes
each storage as its own record, so it names the writer, the legacy storage types and the rebuild function the
pickle refers to exactly as ``torch.save`` does (``_save`` in ``torch/serialization.py``). A rename breaks streaming
saves; the files already written stay readable (their pickle names ``torch._utils._rebuild_tensor_v2``, which
``torch.load(weights_only=True)`` allows).
"""

from __future__ import annotations

import torch

#: What a pickled tensor is rebuilt by (``torch._utils._rebuild_tensor_v2``): the pickle must name this very function.
REBUILD_TENSOR = torch._utils._rebuild_tensor_v2


def open_zipfile_writer(path: str):
    """The zip writer ``torch.save`` itself writes through (``torch.serialization._open_zipfile_writer``), as a
    context manager whose ``write_record(name, data, size)`` appends one record."""
    return torch.serialization._open_zipfile_writer(path)


def storage_alignment() -> int:
    """The byte alignment ``torch.save`` gives storage records, from its public config
    (``torch.utils.serialization.config.save.storage_alignment``, what ``_get_storage_alignment`` reads)."""
    from torch.utils.serialization import config

    return config.save.storage_alignment


def storage_type_names() -> dict:
    """``{dtype: legacy storage type name}`` (``torch.storage._dtype_to_storage_type_map``): the name a pickle's
    storage record gives, e.g. ``"FloatStorage"`` for ``torch.float32``."""
    return torch.storage._dtype_to_storage_type_map()
