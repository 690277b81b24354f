"""``DistributedDataParallel``: its keywords across versions and its C++ reducer.

DDP's ``reducer`` (a ``torch._C._distributed_c10d.Reducer``) has no public Python API; the package calls two of its
methods at points DDP's own forward would, outside a forward.
"""

from __future__ import annotations

from typing import Optional


def ddp_buffer_sync_kwargs(enabled: bool) -> dict:
    """``DistributedDataParallel``'s keyword for broadcasting rank 0's buffers before each forward.

    torch 2.13 deprecated ``broadcast_buffers`` (a ``FutureWarning``) for ``forward_sync_buffers``, which leaves the
    broadcast at construction on whatever it is set to (``broadcast_buffers=False`` skipped that one too); torch
    2.11-2.12 have only ``broadcast_buffers``. Both start every rank from rank 0's buffers where the package calls
    DDP, because the package broadcasts the module's states itself first when ``enabled`` is False
    (:func:`lightning_zero.distributed.apply_zero.apply_zero`).
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}


def rebuild_ddp_buckets(ddp) -> Optional[bool]:
    """Rebuild ``ddp``'s gradient buckets in the order its last synchronised backward learnt, as DDP's forward does
    (``reducer._rebuild_buckets()``, a collective of the DDP group): ``True`` if it rebuilt, ``False`` if it had
    nothing to rebuild, ``None`` where this torch's reducer has no such method (the caller then stops trying).
    A rebuild is also recorded where DDP records its own (``_has_rebuilt_buckets``, read by its logging)."""
    rebuild = getattr(ddp.reducer, "_rebuild_buckets", None)
    if rebuild is None:
        return None
    rebuilt = bool(rebuild())
    if rebuilt:
        ddp._has_rebuilt_buckets = True
    return rebuilt


def prepare_ddp_backward(ddp, output) -> None:
    """Tell ``ddp``'s reducer which tensors the coming backward starts from (every tensor in ``output``), as DDP's
    forward does for its own output (``_find_tensors`` + ``reducer.prepare_for_backward``; Lightning's
    ``prepare_for_backward`` in ``lightning/pytorch/overrides/distributed.py`` calls the same pair)."""
    from torch.nn.parallel.distributed import _find_tensors

    ddp.reducer.prepare_for_backward(list(_find_tensors(output)))
