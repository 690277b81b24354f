"""Lazy layer descriptions for :class:`~lightning_zero.pipeline.PipelineModule`.

A spec records a class and its constructor arguments so that a layer is only built on the pipeline stage that owns
it (a 100-layer model split over 8 stages never materialises the other stages' layers). The semantics follow
DeepSpeed's ``LayerSpec``/``TiedLayerSpec``; torch's pipelining package has no equivalent, so these are hand-written.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn


class LayerSpec:
    """A layer described by its class and constructor arguments, built with :meth:`build`.

    Example: ``LayerSpec(nn.Linear, 16, 32, bias=False)`` builds ``nn.Linear(16, 32, bias=False)``.
    """

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {cls!r}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    @property
    def class_name(self) -> str:
        return self.cls.__name__

    def build(self) -> nn.Module:
        """Construct the layer (on the current default device)."""
        return self.cls(*self.args, **self.kwargs)

    def count_parameters(self) -> int:
        """Trainable parameter count, computed by building on the meta device (no memory, no RNG use)."""
        with torch.device("meta"):
            module = self.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.class_name}, args={self.args!r}, kwargs={self.kwargs!r})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights are shared by every spec with the same ``key`` (e.g. input embedding and output head).

    On one stage, all occurrences of a key run the same module instance. Across stages, each stage that holds the key
    builds its own copy; :func:`~lightning_zero.pipeline.build_pipeline` broadcasts the first occurrence's values at
    setup and all-reduces the gradients of the ``tied_weight_attr`` parameters among the holders after each step, so
    the copies stay equal. As in DeepSpeed, only the parameters named by ``tied_weight_attr`` are synchronised.

    Args:
        key: name of the tie; all specs with this key share one set of weights.
        cls, args, kwargs: how to build the module (only the first occurrence's arguments are used; later
            occurrences must describe the same class).
        forward_fn: ``forward_fn(module, x)`` used instead of ``module(x)`` for this occurrence, e.g.
            ``lambda emb, h: h @ emb.weight.t()`` for an output head tied to an embedding.
        tied_weight_attr: parameter name(s) on the module that are tied (dotted paths allowed).
    """

    def __init__(
        self,
        key: str,
        cls: type,
        *args: Any,
        forward_fn: Optional[Callable[[nn.Module, Any], Any]] = None,
        tied_weight_attr: Union[str, Sequence[str]] = "weight",
        **kwargs: Any,
    ) -> None:
        super().__init__(cls, *args, **kwargs)
        if not isinstance(key, str) or not key:
            raise TypeError(f"TiedLayerSpec key must be a non-empty string, got {key!r}")
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"forward_fn must be callable or None, got {forward_fn!r}")
        attrs = (tied_weight_attr,) if isinstance(tied_weight_attr, str) else tuple(tied_weight_attr)
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise TypeError(f"tied_weight_attr must be a parameter name or a list of names, got {tied_weight_attr!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attrs = attrs

    def __repr__(self) -> str:
        return f"TiedLayerSpec(key={self.key!r}, {self.class_name}, tied_weight_attr={self.tied_weight_attrs!r})"


def get_parameter(module: nn.Module, dotted_name: str) -> nn.Parameter:
    """The parameter at ``dotted_name`` (e.g. ``"weight"`` or ``"proj.weight"``) with a clear error if missing."""
    try:
        return module.get_parameter(dotted_name)
    except AttributeError as err:
        names = [n for n, _ in module.named_parameters()]
        raise AttributeError(
            f"tied_weight_attr {dotted_name!r} is not a parameter of {type(module).__name__}; "
            f"its parameters are {names}"
        ) from err
