"""Tensor and dispatcher internals: storage identity, version counters, wrapper subclasses, dispatch modes and
pytrees.

The deferred-initialisation recorder (``distributed/deferred_init.py``) is a ``__torch_dispatch__`` subclass plus a
dispatch mode: torch documents that mechanism but keeps its helpers private (``torch.utils._python_dispatch``,
``torch.utils._pytree``, ``Tensor._make_wrapper_subclass``, ``torch._C._DisableTorchDispatch``; torch 2.11-2.13 have
no public ``torch.utils.pytree``). A rename breaks ``empty_init``/deferred init at import or at the first op.
"""

from __future__ import annotations

import torch
from torch.utils import _python_dispatch, _pytree

#: The base class of every torch dispatch mode (``torch.utils._python_dispatch.TorchDispatchMode``).
TorchDispatchMode = _python_dispatch.TorchDispatchMode
#: What dispatch handlers flatten and rebuild their nested arguments with (``torch.utils._pytree``).
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten

#: The C-level ``Tensor.data`` descriptor: a subclass that overrides ``data`` calls it to get torch's own behaviour.
TENSOR_DATA = torch._C.TensorBase.data


def storage_identity(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage shared by all its views, also for meta tensors (whose ``data_ptr()`` is
    0 for every storage): the address of the C++ storage object (``UntypedStorage._cdata``)."""
    return tensor.untyped_storage()._cdata


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many references hold ``tensor``'s storage (``torch._C._storage_Use_Count``), counting the temporary
    Python storage object this call creates; a pool reuses a buffer only when nothing but itself holds it."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter (``Tensor._version``), bumped by every in-place write; what autograd checks
    saved tensors with, and what the recorder checks a held input with."""
    return tensor._version


def view_base(tensor: torch.Tensor):
    """The tensor ``tensor`` is a view of, or ``None`` (``Tensor._base``)."""
    return tensor._base


def tensor_has_gradient_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has hooks of ``register_hook`` (``Tensor._backward_hooks``, set in ``torch/_tensor.py``)
    or ``register_post_accumulate_grad_hook`` (``_post_accumulate_grad_hooks``): neither has a public reader."""
    return bool(tensor._backward_hooks or getattr(tensor, "_post_accumulate_grad_hooks", None))


def make_wrapper_subclass(cls, meta: torch.Tensor, *, device, requires_grad: bool):
    """A ``cls`` instance with ``meta``'s shape, strides, offset and dtype on ``device``, and no storage of its own
    (``Tensor._make_wrapper_subclass``, how every ``__torch_dispatch__`` wrapper subclass is built)."""
    return torch.Tensor._make_wrapper_subclass(
        cls,
        meta.shape,
        strides=meta.stride(),
        storage_offset=meta.storage_offset(),
        dtype=meta.dtype,
        device=device,
        requires_grad=requires_grad,
    )


def disable_torch_dispatch():
    """A context in which ops on wrapper subclasses go straight to their C++ kernels, skipping
    ``__torch_dispatch__`` (``torch._C._DisableTorchDispatch``): used to change a wrapper's own layout."""
    return torch._C._DisableTorchDispatch()


def op_schema(func):
    """The ``FunctionSchema`` of the ``OpOverload`` ``func`` (``OpOverload._schema``): its arguments' alias
    information (which ones it writes) and its return types."""
    return func._schema


def privateuse1_backend_name() -> str:
    """The device type the ``privateuse1`` backend is registered under (``torch._C._get_privateuse1_backend_name``,
    one of the device types ``SyncBatchNorm.forward`` in ``torch/nn/modules/batchnorm.py`` accepts)."""
    return torch._C._get_privateuse1_backend_name()
