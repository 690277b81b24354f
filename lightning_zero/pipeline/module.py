"""``PipelineModule``: a sequential model described as a list of layers that can be split into pipeline stages.

[Note: one naming for every stage]
Layer ``i`` of the list is registered as ``layers.<i>`` whichever stage builds it, so the ``state_dict`` keys of a
stage are a subset of the unsplit model's keys and the union over stages is exactly the unsplit key set. A tied
module (:class:`TiedLayerSpec`) is registered once, under the index of the key's *first* occurrence, also on a stage
that only holds a later occurrence; tied keys therefore appear on several stages with equal values.

[Note: when layers are built]
Modules passed directly are already built. Specs are built at construction when no multi-process group is running
(the plain sequential model). When ``torch.distributed`` is initialised with more than one process, nothing is built
until :func:`~lightning_zero.pipeline.build_pipeline` assigns stages and calls :meth:`PipelineModule.materialize` with
the owned layers; :meth:`materialize` with no argument builds everything (pipeline size 1).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.pipeline.partition import partition_for_method
from lightning_zero.pipeline.specs import LayerSpec, TiedLayerSpec


def _run_layers(runners: Sequence[Callable[[Any], Any]], x: Any, interval: int) -> Any:
    """Apply ``runners`` in order; with ``interval > 0`` every ``interval`` consecutive layers form one checkpoint."""
    if interval <= 0 or not torch.is_grad_enabled():
        for run in runners:
            x = run(x)
        return x
    for start in range(0, len(runners), interval):
        chunk = runners[start : start + interval]

        def run_chunk(inp: Any, chunk: Sequence[Callable] = chunk) -> Any:
            for run in chunk:
                inp = run(inp)
            return inp

        x = checkpoint(run_chunk, x, use_reentrant=False)
    return x


def _call_through_module(module: nn.Module, forward_fn: Callable[[nn.Module, Any], Any], x: Any) -> Any:
    """Run ``forward_fn(module, x)`` as the module's own call, so its hooks run.

    [Note: tied forward_fn under FSDP2] ``forward_fn`` reads the tied weight directly (e.g. ``h @ emb.weight.t()``).
    With FSDP2 that weight is a sharded DTensor unless the module's pre-forward hook has unsharded it, and the
    gradient reduce-scatter is registered by the same hooks. Temporarily making ``forward_fn`` the instance's
    ``forward`` and calling the module routes the call through those hooks.
    """
    previous = module.__dict__.get("forward")
    module.forward = lambda inp: forward_fn(module, inp)
    try:
        return module(x)
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


class StageModule(nn.Module):
    """The layers ``start .. end - 1`` of a :class:`PipelineModule`, as one ``nn.Module`` for a pipeline stage.

    It shares (does not copy) the parent's layer modules and names them ``layers.<global index>`` like the parent, so
    FSDP2 units and parameter names agree. The parent keeps the canonical registration; a stage module is an
    execution view handed to ``torch.distributed.pipelining.PipelineStage``.
    """

    def __init__(self, parent: "PipelineModule", start: int, end: int) -> None:
        super().__init__()
        self.start, self.end = start, end
        self.interval = parent.activation_checkpoint_interval
        self.layers = nn.ModuleDict()
        for index in range(start, end):
            owner = parent.module_index(index)
            if owner is not None and str(owner) not in self.layers:
                self.layers[str(owner)] = parent.layers[str(owner)]
        self._runners = [parent.layer_runner(i) for i in range(start, end)]

    def forward(self, x: Any) -> Any:
        return _run_layers(self._runners, x, self.interval)


class PipelineModule(nn.Module):
    """A sequential model (DeepSpeed's ``PipelineModule`` interface) runnable as one model or as pipeline stages.

    Args:
        layers: modules, plain callables (e.g. ``torch.flatten``; they hold no parameters) or
            :class:`LayerSpec`/:class:`TiedLayerSpec`, applied in order.
        loss_fn: ``loss_fn(output, target)`` returning the *mean* loss of a batch. Needed for pipelined training and
            for ``forward(inputs, targets)``.
        num_stages: total number of pipeline stages (pipeline ranks × virtual stages). ``None`` lets
            :func:`build_pipeline` decide; if given, it must match what the pipeline is built with.
        partition_method: ``"parameters"`` (balance trainable parameters; if no layer has any, uniform),
            ``"uniform"`` (balance layer counts), ``"type:REGEX"`` (balance the layers whose class name matches,
            case-insensitive ``re.search``) or an explicit list of ``num_stages + 1`` boundaries. See
            :mod:`lightning_zero.pipeline.partition` for the exact boundaries each method produces.
        activation_checkpoint_interval: ``k > 0`` recomputes every ``k`` consecutive layers of a stage in backward
            (``torch.utils.checkpoint``, non-reentrant); ``0`` disables it.

    Outside a pipeline run, ``module(x)`` returns the output of all layers and ``module(x, y)`` the loss. Once
    :func:`build_pipeline` attached a runner, ``module(x, y)`` runs the whole schedule (forward and, in training mode
    with grad enabled, backward) and returns the mean loss on every pipeline rank.
    """

    def __init__(
        self,
        layers: Iterable[Any],
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        num_stages: Optional[int] = None,
        partition_method: Union[str, Sequence[int]] = "parameters",
        activation_checkpoint_interval: int = 0,
    ) -> None:
        super().__init__()
        self.specs = list(layers)
        if not self.specs:
            raise ValueError("PipelineModule needs at least one layer")
        for i, layer in enumerate(self.specs):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(f"layer {i} must be an nn.Module, a callable or a LayerSpec, got {layer!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {loss_fn!r}")
        if num_stages is not None and (
            isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= len(self.specs)
        ):
            raise ValueError(
                f"num_stages must be None or an int in [1, {len(self.specs)}] (one layer per stage at "
                f"least), got {num_stages!r}"
            )
        if (
            isinstance(activation_checkpoint_interval, bool)
            or not isinstance(activation_checkpoint_interval, int)
            or activation_checkpoint_interval < 0
        ):
            raise ValueError(
                f"activation_checkpoint_interval must be an int >= 0, got {activation_checkpoint_interval!r}"
            )
        self.loss_fn = loss_fn
        self.num_stages = num_stages
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.tied_first_index: dict = {}
        for i, layer in enumerate(self.specs):
            if isinstance(layer, TiedLayerSpec):
                first = self.tied_first_index.setdefault(layer.key, i)
                if self.specs[first].cls is not layer.cls:
                    raise TypeError(
                        f"tied key {layer.key!r} is used with {self.specs[first].class_name} and "
                        f"{layer.class_name}; all occurrences of a key must build the same class"
                    )
        if num_stages is not None:  # validate an explicit partition early, before any process group exists
            self.partition(num_stages)
        self.layers = nn.ModuleDict()
        self.built_indices: tuple = ()
        self.runner = None  # the PipelineRunner build_pipeline attaches (schedules.py)
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            self.materialize()

    # ----------------------------------------------------------------------------------------------- structure
    def __len__(self) -> int:
        return len(self.specs)

    def partition(self, num_stages: int) -> list:
        """Stage boundaries for ``num_stages`` stages (see the boundary convention in ``partition.py``)."""
        if self.num_stages is not None and num_stages != self.num_stages:
            raise ValueError(
                f"PipelineModule was created with num_stages={self.num_stages}, but the pipeline has "
                f"{num_stages} stages (pipeline ranks x virtual stages)"
            )
        return partition_for_method(self.specs, self.partition_method, num_stages)

    def module_index(self, index: int) -> Optional[int]:
        """Global index under which layer ``index``'s module is registered (``None`` for plain callables)."""
        layer = self.specs[index]
        if isinstance(layer, TiedLayerSpec):
            return self.tied_first_index[layer.key]
        return index if isinstance(layer, (LayerSpec, nn.Module)) else None

    def materialize(self, indices: Optional[Iterable[int]] = None) -> None:
        """Build the listed layers (all when ``None``), registering them as ``layers.<index>``; idempotent."""
        wanted = range(len(self.specs)) if indices is None else sorted(set(indices))
        for index in wanted:
            owner = self.module_index(index)
            if owner is None or str(owner) in self.layers:
                continue
            layer = self.specs[owner]
            self.layers[str(owner)] = layer.build() if isinstance(layer, LayerSpec) else layer
        self.built_indices = tuple(sorted(set(self.built_indices) | set(wanted)))

    def drop_layers_except(self, keep: Iterable[int]) -> None:
        """Forget the modules not needed by the layers in ``keep`` (used when the model was built before the stage
        assignment was known: the memory of other stages' layers is released)."""
        keep = set(keep)
        needed = {str(self.module_index(i)) for i in keep if self.module_index(i) is not None}
        for name in [n for n in self.layers.keys() if n not in needed]:
            del self.layers[name]
        self.built_indices = tuple(sorted(keep))

    def layer_runner(self, index: int) -> Callable[[Any], Any]:
        """A function applying layer ``index`` (which must be built)."""
        layer = self.specs[index]
        owner = self.module_index(index)
        if owner is None:
            return layer
        if str(owner) not in self.layers or index not in self.built_indices:
            raise RuntimeError(
                f"layer {index} is not built on this process (built: {list(self.built_indices)}); "
                "call materialize() or run it on the stage that owns it"
            )
        module = self.layers[str(owner)]
        if isinstance(layer, TiedLayerSpec) and layer.forward_fn is not None:
            return lambda x, fn=layer.forward_fn, m=module: _call_through_module(m, fn, x)
        return module

    def stage_module(self, start: int, end: int) -> StageModule:
        """An execution view of layers ``start .. end - 1`` for one pipeline stage."""
        return StageModule(self, start, end)

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, inputs: Any, targets: Any = None) -> Any:
        if self.runner is not None:
            if targets is None:
                raise ValueError(
                    "a pipelined PipelineModule needs targets: the last stage computes the loss, "
                    "call module(inputs, targets)"
                )
            if self.training and torch.is_grad_enabled():
                return self.runner.step(inputs, targets, sync_grads=self.runner.sync_grads)
            return self.runner.eval_step(inputs, targets)
        if len(self.built_indices) != len(self.specs):
            raise RuntimeError(
                "this PipelineModule holds only some layers (it was built for a pipeline stage); "
                "use the pipeline runner, or call materialize() to build the whole model"
            )
        runners = [self.layer_runner(i) for i in range(len(self.specs))]
        outputs = _run_layers(runners, inputs, self.activation_checkpoint_interval)
        if targets is None:
            return outputs
        if self.loss_fn is None:
            raise ValueError("module(inputs, targets) needs a loss_fn; pass loss_fn= to PipelineModule")
        return self.loss_fn(outputs, targets)
