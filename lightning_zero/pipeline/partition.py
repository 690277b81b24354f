"""Splitting a list of layers into contiguous pipeline stages.

[Note: boundary convention]
A partition of ``n`` layers into ``k`` stages is a list ``b`` of ``k + 1`` ints with ``b[0] == 0``, ``b[k] == n`` and
``b[i] < b[i + 1]``: stage ``i`` owns layers ``b[i] .. b[i + 1] - 1``. Every stage owns at least one layer.

[Note: which balanced partition]
:func:`partition_layers` returns the partition that (1) minimises the weight of the heaviest stage and, among those,
(2) gives each stage, from the first to the last, as many layers as it can take without exceeding that optimum while
leaving at least one layer for every later stage. Rule (2) makes the answer unique, so tests can check exact
boundaries: e.g. uniform weights ``[1] * 5`` on 2 stages give ``[0, 3, 5]``, and zero-weight layers (unmatched by a
``type:`` regex) after a stage's last weighted layer stay on that stage.

DeepSpeed uses a similar greedy balance; torch's pipelining package only splits at user-marked points, so this is
hand-written.
"""

from __future__ import annotations

import re
from typing import Any, Sequence, Union

from torch import nn

from lightning_zero.pipeline.specs import LayerSpec

PARTITION_METHODS = ("parameters", "uniform", "type:REGEX", "an explicit list of boundaries")


def _validate_weights(weights: Sequence[float], num_stages: int) -> list:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    values = list(weights)
    if any(isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 for w in values):
        raise ValueError(f"layer weights must be non-negative numbers, got {values!r}")
    if len(values) < num_stages:
        raise ValueError(f"cannot split {len(values)} layers into {num_stages} stages: every stage needs a layer")
    return values


def _stages_needed(weights: list, cap: float) -> int:
    """Stages a left-to-right greedy fill needs when no stage may exceed ``cap``."""
    stages, current = 1, 0.0
    for w in weights:
        if current + w > cap:
            stages, current = stages + 1, 0.0
        current += w
    return stages


def partition_layers(weights: Sequence[float], num_stages: int) -> list:
    """Contiguous balanced partition of layers with the given weights; see the notes at the top of this module."""
    values = _validate_weights(weights, num_stages)
    n = len(values)
    # The optimal bottleneck is one of the contiguous-range sums; binary search the sorted candidates.
    candidates = sorted({sum(values[i:j]) for i in range(n) for j in range(i + 1, n + 1)} | {max(values)})
    candidates = [c for c in candidates if c >= max(values)]
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _stages_needed(values, candidates[mid]) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    cap = candidates[lo]
    boundaries, start = [0], 0
    for stage in range(num_stages - 1):
        later_stages = num_stages - stage - 1
        end, load = start + 1, values[start]
        while end < n - later_stages and load + values[end] <= cap:
            load += values[end]
            end += 1
        boundaries.append(end)
        start = end
    boundaries.append(n)
    if sum(values[start:]) > cap:  # cannot happen by the greedy-optimality argument; guard the invariant anyway
        raise AssertionError(f"internal error: last stage exceeds the optimal load {cap}")
    return boundaries


def validate_boundaries(boundaries: Sequence[int], num_layers: int, num_stages: int) -> list:
    """Check an explicit partition against the boundary convention and return it as a list."""
    b = list(boundaries)
    if (
        len(b) != num_stages + 1
        or any(isinstance(x, bool) or not isinstance(x, int) for x in b)
        or b[0] != 0
        or b[-1] != num_layers
        or any(b[i] >= b[i + 1] for i in range(num_stages))
    ):
        raise ValueError(
            f"an explicit partition must be {num_stages + 1} strictly increasing ints from 0 to {num_layers} "
            f"(stage i owns layers b[i]..b[i+1]-1), got {b!r}"
        )
    return b


def layer_class_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.class_name
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def layer_parameter_count(layer: Any) -> int:
    """Trainable parameters of a module or spec (specs are counted on the meta device, without building them)."""
    if isinstance(layer, LayerSpec):
        return layer.count_parameters()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0  # plain callables hold no parameters


def layer_weights(layers: Sequence[Any], method: str) -> list:
    """Per-layer weights for a named partition method (``"parameters"``, ``"uniform"`` or ``"type:REGEX"``)."""
    if not isinstance(method, str):
        raise TypeError(f"partition_method must be one of {PARTITION_METHODS}, got {method!r}")
    lowered = method.lower()
    if lowered == "uniform":
        return [1] * len(layers)
    if lowered == "parameters":
        return [layer_parameter_count(layer) for layer in layers]
    if lowered.startswith("type:"):
        pattern = re.compile(method[len("type:") :], re.IGNORECASE)
        weights = [1 if pattern.search(layer_class_name(layer)) else 0 for layer in layers]
        if not any(weights):
            names = sorted({layer_class_name(layer) for layer in layers})
            raise ValueError(f"partition_method {method!r} matches no layer class; the classes are {names}")
        return weights
    raise ValueError(f"partition_method must be one of {PARTITION_METHODS}, got {method!r}")


def partition_for_method(layers: Sequence[Any], method: Union[str, Sequence[int]], num_stages: int) -> list:
    """Boundaries for ``layers`` split into ``num_stages`` stages with a partition method or explicit boundaries."""
    if not isinstance(method, str):
        return validate_boundaries(method, len(layers), num_stages)
    weights = layer_weights(layers, method)
    if method.lower() == "parameters" and not any(weights):
        weights = [1] * len(layers)  # no trainable parameter anywhere: parameter balance degenerates to uniform
    return partition_layers(weights, num_stages)
