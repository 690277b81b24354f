"""What ``ZeroStrategy`` does around training that is not ZeRO itself: Lightning's layer sync (``sync_batchnorm``),
callbacks it refuses, a teardown that leaves sharded modules where they are, and one-call hooks into the Trainer."""

from __future__ import annotations

from typing import Any, Callable

from lightning_zero.torch_compat import privateuse1_backend_name


def holds_sharded_parameters(module) -> bool:
    """Whether ``module`` is sharded by FSDP2 (stages 2-3, or a sharded pipeline stage).

    Asked of the modules as well as of the parameters: a unit that keeps its parameters gathered after a forward
    (every unit at stage 2, the root and the last unit at stage 3, for instance after an evaluation loop) exposes
    plain tensors until it reshards, so a model whose units are all gathered has no DTensor parameter.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return module is not None and (
        any(isinstance(sub, FSDPModule) for sub in module.modules())
        or any(isinstance(param, DTensor) for param in module.parameters())
    )


def stays_in_place(module) -> bool:
    """Whether teardown must leave ``module`` where it is (:func:`teardown_in_place`): it is sharded, or it holds
    tensors on the meta device (refused at setup: ``.cpu()`` would raise over that refusal, burying it)."""
    if module is None:
        return False
    return holds_sharded_parameters(module) or any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def teardown_in_place(cluster_environment, precision_plugin, accelerator, checkpoint_io) -> None:
    """Lightning's ``ParallelStrategy.teardown`` minus moving the module and optimizer states to CPU.

    Lightning's base teardown calls ``lightning_module.cpu()``. On sharded (DTensor) parameters that swaps every
    parameter: inside ``torch.inference_mode()`` (Lightning's evaluation loops) it raises ("Cannot set
    version_counter for inference tensor"), and on CUDA it would move the shards off the device so a later
    ``fit``/``validate``/``test`` with the same module, which keeps the sharded module as it is, would compute on
    CPU. Lightning's own FSDP2 strategy (``ModelParallelStrategy``) leaves the module in place the same way.
    """
    assert cluster_environment is not None and accelerator is not None
    cluster_environment.teardown()
    precision_plugin.teardown()
    accelerator.teardown()
    checkpoint_io.teardown()


_NEXT_CALL = "_lightning_zero_next_call"  # marks a replacement installed by wrap_next_call


def wrap_next_call(owner: Any, name: str, wrapper_of: Callable[[Callable], Callable]) -> None:
    """Run ``wrapper_of(original)`` instead of ``owner.<name>`` for its next call only, then the method is the class's
    again (also if the call raises). Lightning has no public hook at some moments the strategy must act (choosing
    the checkpoint to resume, registering signal handlers), so the strategy replaces one call on the instance.

    A replacement an earlier run installed and Lightning never called (a run that stopped before that moment, such
    as ``Tuner.lr_find``'s) is dropped first: stacked, the outer one would restore the class's method and the inner
    one then fail to (``AttributeError``).
    """
    if getattr(owner.__dict__.get(name), _NEXT_CALL, False):
        del owner.__dict__[name]
    replacement = wrapper_of(getattr(owner, name))

    def next_call(*args: Any, **kwargs: Any) -> Any:
        owner.__dict__.pop(name, None)
        return replacement(*args, **kwargs)

    setattr(next_call, _NEXT_CALL, True)
    setattr(owner, name, next_call)


_SYNC_BATCHNORM_DEVICES = ("cuda", "xpu", "hpu")


def check_trainer_before_process_group(trainer, device, stage: int, layer_sync) -> None:
    """Refuse, before any process group starts, what this strategy would otherwise run wrongly or crash on.

    - ``Trainer(sync_batchnorm=True)`` off GPU: torch's ``SyncBatchNorm`` raises inside its forward on CPU input
      once a process group exists, so the first training batch would fail deep inside torch.
    - ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging``) at stages 2-3: they deep-copy
      the module and average its parameters into the copy, mixing plain tensors with FSDP2's sharded DTensors
      ("mixed torch.Tensor and DTensor").
    - ``ModelPruning`` at stages 2-3: torch's pruning flattens each parameter, which an unevenly sharded DTensor
      refuses, and a per-shard top-k would not be the global one.
    """
    from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging

    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # Lightning < 2.5 has no WeightAveraging base
        WeightAveraging = StochasticWeightAveraging
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
    from lightning.pytorch.trainer.states import TrainerFn

    if trainer is None or trainer.state.fn != TrainerFn.FITTING:  # both only act while fitting
        return
    if isinstance(layer_sync, TorchSyncBatchNorm) and device.type not in (
        *_SYNC_BATCHNORM_DEVICES,
        privateuse1_backend_name(),
    ):
        raise ValueError(
            f"Trainer(sync_batchnorm=True) turns BatchNorm layers into torch.nn.SyncBatchNorm, which torch runs only "
            f"on {'/'.join(_SYNC_BATCHNORM_DEVICES)} devices, but this run computes on {device.type!r}. Train on a "
            "GPU, or remove sync_batchnorm=True (each rank then normalises with its own batch statistics)."
        )
    if stage >= 2:
        for callback in trainer.callbacks:
            if isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
                what = "it averages copies of the parameters"
            elif isinstance(callback, ModelPruning):
                what = "it prunes whole parameters (masks and top-k over the full tensor)"
            else:
                continue
            raise ValueError(
                f"The {type(callback).__name__} callback is not supported with ZeroStrategy(stage={stage}): "
                f"{what}, which stages 2-3 shard across ranks. Remove the callback, or use stage 0 or 1."
            )


def apply_layer_sync(layer_sync, model, fitting: bool):
    """Apply Lightning's layer sync (``Trainer(sync_batchnorm=True)``) to ``model`` before it is wrapped, as DDP
    does; returns the model to use.

    Only when fitting; a module that is already sharded (evaluation after ``fit``) keeps the layers it trained with.
    """
    from torch.distributed.fsdp import FSDPModule

    if fitting and layer_sync is not None and not isinstance(model, FSDPModule):
        return layer_sync.apply(model)
    return model


def revert_layer_sync(layer_sync, model, fitting: bool):
    """Undo :func:`apply_layer_sync` at teardown, at stages 0-1 only; returns the model to use.

    At stages 2-3 the synchronised layers' parameters are FSDP2 shards bound to those very layer objects; swapping
    the layers back would detach the shards from FSDP2, so the module keeps them (in ``eval()`` a ``SyncBatchNorm``
    normalises exactly like a ``BatchNorm``, with its running statistics).
    """
    if fitting and layer_sync is not None and not holds_sharded_parameters(model):
        return layer_sync.revert(model)
    return model
