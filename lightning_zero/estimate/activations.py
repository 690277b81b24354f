"""Activation memory of transformer-like models: the formula, and a measurement to check it against.

The formula counts the bytes autograd keeps alive between forward and backward (the tensors saved for backward),
per micro-batch and per rank, for a pre-LayerNorm decoder block as written in ``examples/gpt.py``: LayerNorm, a fused
QKV projection, ``scaled_dot_product_attention`` (a fused kernel that keeps no ``s x s`` score matrix), an output
projection, LayerNorm and a ``4h`` GELU MLP, no dropout. ``docs/memory.md`` derives it op by op and relates it to
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1: ``sbh(34 + 5as/h)``
bytes per layer in fp16 with dropout and unfused attention).

Notation: ``s`` sequence length, ``b`` micro-batch, ``h`` hidden size, ``a`` attention heads, ``L`` layers,
``V`` vocabulary. Per layer, in elements of the compute dtype: LN1 input ``sbh``, QKV input ``sbh``, QKV output
``3sbh`` (q, k, v are views of it), attention output ``sbh`` (the projection's input is the same storage),
LN2 input ``sbh``, MLP input ``sbh``, MLP hidden ``4sbh``, GELU output ``4sbh``: ``16 sbh``; plus the attention's
log-sum-exp ``abs`` fp32 values and the LayerNorm statistics ``4bs`` fp32 values.

Measuring the tensors autograd saves (``saved_activation_bytes``) rather than an allocator's peak is what makes the
check exact on CPU, where there is no caching allocator to ask; no library offers that count, hence the hook here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import Tensor

from lightning_zero.distributed.replicas import replica_dtype
from lightning_zero.estimate.precisions import PRECISIONS
from lightning_zero.torch_compat import view_base

_HALF_TRUE = ("16-true", "bf16-true")
# Lightning reads the bare "16" and "bf16" as "16-mixed" and "bf16-mixed" (its precision plugins' alias table).
_MIXED = ("16-mixed", "bf16-mixed", "16", "bf16")
CHECKPOINTING = ("none", "full", "full+cpu")


@dataclass(frozen=True)
class TransformerShape:
    """The sizes that decide activation memory. ``vocab`` 0 leaves out the logits (a model without an LM head);
    ``attention_scores`` adds the ``a s^2 b`` probabilities an unfused (eager) attention keeps."""

    hidden: int
    layers: int
    heads: int
    seq_len: int
    micro_batch: int
    vocab: int = 0
    mlp_ratio: int = 4
    layer_params: int = 0
    attention_scores: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "seq_len", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransformerShape.{name} must be an integer >= 1, got {value!r}")
        for name in ("vocab", "mlp_ratio", "layer_params"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TransformerShape.{name} must be an integer >= 0, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"TransformerShape.hidden ({self.hidden}) must be divisible by heads ({self.heads})")


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes per rank for one micro-batch: ``accelerator`` at the backward peak, ``cpu`` when the
    checkpointed block inputs are kept in CPU memory (``full+cpu``)."""

    accelerator: int
    cpu: int = 0


def _dtype_bytes(precision: str) -> tuple[int, int]:
    """``(residual, compute)`` bytes per element: the residual stream and the matmul/GELU outputs."""
    if precision in _HALF_TRUE:
        return 2, 2
    if precision in _MIXED:
        return 4, 2  # autocast: parameters and the residual stream stay fp32, matmuls run in half precision
    return 4, 4


def layer_activation_bytes(shape: TransformerShape, precision: str = "32-true") -> int:
    """Bytes one block keeps for backward (see the module docstring for the op-by-op count)."""
    s, b, h, a = shape.seq_len, shape.micro_batch, shape.hidden, shape.heads
    resid, comp = _dtype_bytes(precision)
    m = shape.mlp_ratio
    sbh = s * b * h
    # Both LayerNorm inputs are the residual stream; in compute precision: the QKV input (LN1's output, or under
    # autocast the half-precision cast the matmul saves), q/k/v, the attention output, the MLP input, its hidden
    # activation and the GELU output.
    per_layer = 2 * sbh * resid + sbh * comp * (1 + 3 + 1 + 1 + 2 * m)
    if precision in _MIXED:
        per_layer += 2 * shape.layer_params  # autocast's half-precision weight copies, alive until backward
    small = 4 * (a * b * s + 4 * b * s)  # attention log-sum-exp, LayerNorm mean and rstd (fp32)
    scores = a * s * s * b * comp if shape.attention_scores else 0
    return per_layer + small + scores


def head_activation_bytes(shape: TransformerShape, precision: str = "32-true") -> int:
    """Bytes kept outside the blocks: token ids and targets, the final LayerNorm's input, the LM head's input and
    the log-softmax of the cross-entropy (in fp32 under autocast, which computes the loss in fp32)."""
    s, b, h, v = shape.seq_len, shape.micro_batch, shape.hidden, shape.vocab
    resid, comp = _dtype_bytes(precision)
    logits = s * b * v * (4 if precision in _MIXED else comp)
    return 2 * 8 * s * b + s * b * h * (resid + comp) + 4 * 2 * b * s + logits


def precision_at_stage(precision: str, stage: int, swapped_masters: bool = False) -> str:
    """The precision the activations of a ZeroStrategy run at ``stage`` follow: at stages 0-1 a ``*-true`` flag that
    keeps no low-precision replicas (``16-true``: :func:`~lightning_zero.distributed.replicas.replica_dtype`) runs as
    autocast over the fp32 parameters, so its activations are those of ``*-mixed``; every other flag and stage, the
    flag's own."""
    if stage <= 1 and precision in _HALF_TRUE and replica_dtype(precision, stage, swapped_masters) is None:
        return precision.replace("-true", "-mixed")
    return precision


def activation_bytes(
    shape: TransformerShape, precision: str = "32-true", checkpointing: str = "none"
) -> ActivationBytes:
    """Per-rank activation bytes of one micro-batch.

    Args:
        shape: the model's sizes and the micro-batch.
        precision: a Trainer precision string (``32-true``, ``bf16-mixed``, ``bf16-true``, ...).
        checkpointing: ``"none"`` (every block keeps its activations), ``"full"`` (each block keeps only its input,
            and one block's activations are rebuilt at a time during backward) or ``"full+cpu"`` (as ``"full"``,
            with the block inputs in CPU memory).
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    layer = layer_activation_bytes(shape, precision)
    head = head_activation_bytes(shape, precision)
    if checkpointing == "none":
        return ActivationBytes(shape.layers * layer + head)
    inputs = shape.layers * shape.seq_len * shape.micro_batch * shape.hidden * _dtype_bytes(precision)[0]
    if checkpointing == "full":
        return ActivationBytes(inputs + layer + head)
    return ActivationBytes(layer + head, inputs)


def storage_key(tensor: Tensor) -> tuple[str, int]:
    """What identifies ``tensor``'s storage: its device and data pointer (views share it)."""
    return str(tensor.device), tensor.untyped_storage().data_ptr()


class SavedBytes:
    """Result of ``saved_activation_bytes``: ``total`` bytes, and ``by_device`` (``"cpu"``, ``"cuda"``, ...)."""

    def __init__(self) -> None:
        self.by_device: dict[str, int] = {}
        self._seen: set[tuple[str, int]] = set()

    def add(self, tensor: Tensor, device: str) -> None:
        """Count the bytes of ``tensor``'s storage on ``device``, once per storage."""
        key = storage_key(tensor)
        if key not in self._seen:
            self._seen.add(key)
            self.by_device[device] = self.by_device.get(device, 0) + tensor.untyped_storage().nbytes()

    @property
    def total(self) -> int:
        return sum(self.by_device.values())


@contextlib.contextmanager
def saved_activation_bytes(exclude: Iterable[Tensor] = ()) -> Iterator[SavedBytes]:
    """Count the bytes of the tensors autograd saves for backward inside the block, each storage once.

    Parameters and views of parameters are left out (a linear layer saves ``weight.t()``: a model state, which
    ``model_state_memory`` counts); ``exclude`` names further storages to leave out. Tensors saved inside a
    non-reentrant ``torch.utils.checkpoint`` region go to its own hooks and are not seen; a reentrant one saves its
    inputs here.
    """
    excluded = {storage_key(t) for t in exclude if not t.is_meta}
    result = SavedBytes()

    def pack(tensor: Tensor) -> Tensor:
        # Parameters and their views (a linear layer saves ``weight.t()``) are model states, including the
        # parameters FSDP2 gathers for a unit, which are parameters of their own.
        is_param = isinstance(tensor, torch.nn.Parameter) or isinstance(view_base(tensor), torch.nn.Parameter)
        if not tensor.is_meta and not is_param and storage_key(tensor) not in excluded:
            result.add(tensor, tensor.device.type)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result
