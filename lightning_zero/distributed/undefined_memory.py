"""Which memory of a recorded build nothing wrote: the rule :mod:`.deferred_init` follows under ``empty_init=True``.

A storage is *undefined* when an ``empty`` factory made it, or an op computed it from undefined memory; an op that
ignores the old value of what it writes (``copy_``, ``fill_``, ``zero_``, the random fills) defines a storage when
the view it writes covers all of it and it reads nothing undefined. A partial write (the padding row an
``nn.Embedding`` zeroes) leaves the rest undefined, so the storage stays so. Framework-free.
"""

from __future__ import annotations

import math

import torch

EMPTY_FACTORIES = frozenset(
    {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted"}
)
_OVERWRITES = frozenset(
    {
        "copy_",
        "fill_",
        "zero_",
        "normal_",
        "uniform_",
        "bernoulli_",
        "random_",
        "exponential_",
        "cauchy_",
        "log_normal_",
        "geometric_",
    }
)


def op_name(func) -> str:
    """An aten op's name without namespace and overload (``aten::copy_.default`` -> ``copy_``)."""
    return func.name().split("::")[-1].split(".")[0]


def follow(undefined: set, name: str, reads: set, new: set, written: list) -> None:
    """Update ``undefined`` (storage keys) for one op named ``name``: ``reads`` the keys it reads (not those it
    writes), ``new`` the storages it makes, ``written`` ``(key, size, dtype, storage_bytes)`` of each view it writes
    in place."""
    tainted = bool(reads & undefined)
    if tainted or name in EMPTY_FACTORIES:
        undefined |= new
    for key, size, dtype, storage_bytes in written:
        if tainted:
            undefined.add(key)
        elif name in _OVERWRITES and math.prod(size) * dtype.itemsize == storage_bytes:
            undefined.discard(key)


def fill_nan(outputs: list) -> None:
    """Replay of an ``empty`` factory in a build that follows undefined memory: NaN instead of garbage."""
    for out in outputs:
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            out.fill_(float("nan"))
