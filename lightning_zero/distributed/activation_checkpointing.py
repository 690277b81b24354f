"""Activation checkpointing (and CPU activation offload) of a model's blocks, on ``torch.utils.checkpoint``.

A checkpointed block keeps only its inputs from forward to backward; backward runs the block's forward again to
rebuild the tensors its gradient needs. Each selected block's ``forward`` is replaced, on that instance, by
``torch.utils.checkpoint.checkpoint(forward, ..., use_reentrant=False)``; with ``cpu_checkpointing`` the inputs it
keeps are held by ``torch.autograd.graph.save_on_cpu`` (DeepSpeed's ``cpu_checkpointing``).

Why not ``checkpoint_wrapper``/``apply_activation_checkpointing`` (what Lightning's FSDP strategies use): they
insert a ``CheckpointWrapper`` module, which renames every parameter below it (``_checkpoint_wrapped_module.``),
changes ``model.blocks[0]``'s type for user code, and changes the classes
:func:`~lightning_zero.distributed.module_classes.find_repeated_blocks` sees.
Replacing ``forward`` on the instance keeps the module tree, the parameter names, the state-dict keys and the
optimizer's parameters exactly as without checkpointing, so checkpoints move freely between runs with and without
it; :meth:`ActivationCheckpointHandle.remove` restores the original ``forward``.

[Note: composition with DDP and FSDP2]
The replaced ``forward`` runs inside ``nn.Module.__call__``, so hooks on the block stay *outside* the checkpointed
region: an FSDP2 unit's pre-forward all-gather and post-forward reshard run once, and in backward FSDP2's
pre-backward hook (on the block's outputs) gathers the parameters before the recomputation, which is triggered
later, when autograd first unpacks a tensor the block saved. DDP's hooks are on the parameters' gradients, which are
produced once, by the original graph: the recomputation only rebuilds saved values. Non-reentrant checkpointing
restores the CPU and device RNG states and the autocast state for the recomputation, so dropout and every precision
recompute the same values.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_zero.distributed import module_classes
from lightning_zero.torch_compat import wrap_policy_module_classes

log = logging.getLogger(__name__)

PolicySpec = Union[bool, type, str, frozenset, set, list, tuple, Callable[[nn.Module], bool]]


@dataclass(frozen=True)
class ActivationCheckpointConfig:
    """Which blocks recompute their activations in backward, and where their kept inputs live.

    Args:
        policy: ``True``: the repeated blocks the strategy detects
            (:func:`~lightning_zero.distributed.module_classes.find_repeated_blocks`; under :func:`apply_zero`, the
            ``sharded_module_classes`` when given); a set of module classes or class names;
            or a callable ``policy(module) -> bool``. Only the outermost selected modules are checkpointed, never
            the root module.
        cpu_checkpointing: keep each checkpointed block's inputs in CPU memory until backward (pinned when they are
            on CUDA), as DeepSpeed's ``cpu_checkpointing``.
        every_k: checkpoint every ``k``-th selected block (blocks ``0, k, 2k, ...``); the others keep their
            activations (selective checkpointing: less recomputation, more memory).
        number_checkpoints: checkpoint this many of the selected blocks, spread evenly; ``None``: all (or every
            ``k``-th). Not together with ``every_k``. (A ds_config's key of that name sizes a DeepSpeed buffer and
            does not set this.)
    """

    policy: Any = True
    cpu_checkpointing: bool = False
    every_k: int = 1
    number_checkpoints: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", _normalise_policy(self.policy))
        if not isinstance(self.cpu_checkpointing, bool):
            raise TypeError(f"cpu_checkpointing must be True or False, got {self.cpu_checkpointing!r}")
        if isinstance(self.every_k, bool) or not isinstance(self.every_k, int) or self.every_k < 1:
            raise ValueError(f"every_k must be an int >= 1, got {self.every_k!r}")
        n = self.number_checkpoints
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"number_checkpoints must be None or an int >= 1, got {n!r}")
        if n is not None and self.every_k != 1:
            raise ValueError(
                "give either every_k or number_checkpoints, not both: each selects which blocks are "
                f"checkpointed (got every_k={self.every_k}, number_checkpoints={n})"
            )


def _normalise_policy(policy: Any) -> Any:
    if policy is True:
        return True
    if policy is False or policy is None:
        raise ValueError(
            "an ActivationCheckpointConfig is only built when checkpointing is on; use "
            "activation_checkpointing=False (no config) to turn it off"
        )
    if isinstance(policy, (str, type)):
        policy = (policy,)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if isinstance(policy, ModuleWrapPolicy):  # what Lightning's activation_checkpointing_policy also accepts
        policy = wrap_policy_module_classes(policy)
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = frozenset(policy)
        if not classes:
            raise ValueError(
                "activation_checkpointing got an empty set of module classes: nothing would be "
                "checkpointed. Pass True (the detected blocks), classes, or False"
            )
        for item in classes:
            if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
                raise TypeError(
                    f"activation_checkpointing entries must be nn.Module subclasses or class names, got {item!r}"
                )
        return classes
    if callable(policy):
        return policy
    raise TypeError(
        "activation_checkpointing must be False, True, a set of module classes (or class names) or a "
        f"callable(module) -> bool, got {policy!r}"
    )


def activation_checkpoint_config(
    activation_checkpointing: Any = None,
    cpu_checkpointing: Optional[bool] = None,
    activation_checkpointing_policy: Any = None,
    ds_section: Optional[dict] = None,
) -> Optional[ActivationCheckpointConfig]:
    """The config from a strategy's arguments, over a ds_config ``activation_checkpointing`` section (or ``None``:
    off). Shared by the Trainer and Fabric strategies.

    Args:
        activation_checkpointing: ``None`` (the ds_config decides; off without one), ``False``, ``True``, a set of
            module classes/names, a callable ``(module) -> bool``, or an :class:`ActivationCheckpointConfig`
            (selective checkpointing: ``every_k``/``number_checkpoints``).
        cpu_checkpointing: ``None`` (the ds_config's, else ``False``) or a bool; needs checkpointing on.
        activation_checkpointing_policy: Lightning's ``FSDPStrategy``/``ModelParallelStrategy`` name for the same
            argument; giving both is an error.
        ds_section: the ds_config's ``activation_checkpointing`` section with DeepSpeed's defaults filled in. Its
            presence turns checkpointing on for the detected blocks (DeepSpeed applies it where the model calls
            its checkpoint API; a Lightning model does not, so the repeated blocks take that role);
            ``cpu_checkpointing`` applies, the rest has no effect (reported). ``number_checkpoints`` too: in DeepSpeed
            it sizes a buffer and never limits which blocks are checkpointed.
    """
    if activation_checkpointing_policy is not None:
        if activation_checkpointing is not None:
            raise ValueError(
                "give activation_checkpointing or its Lightning alias activation_checkpointing_policy, not both"
            )
        activation_checkpointing = activation_checkpointing_policy
    if cpu_checkpointing is not None and not isinstance(cpu_checkpointing, bool):
        raise TypeError(f"cpu_checkpointing must be True, False or None, got {cpu_checkpointing!r}")
    if isinstance(activation_checkpointing, ActivationCheckpointConfig):
        if cpu_checkpointing is not None and cpu_checkpointing != activation_checkpointing.cpu_checkpointing:
            raise ValueError(
                "cpu_checkpointing disagrees with the ActivationCheckpointConfig given as "
                "activation_checkpointing; set it in the config only"
            )
        return activation_checkpointing
    section = dict(ds_section) if ds_section else None
    if activation_checkpointing is None:
        activation_checkpointing = section is not None
    if activation_checkpointing is False:
        if cpu_checkpointing:
            raise ValueError(
                "cpu_checkpointing=True keeps the inputs of checkpointed blocks in CPU memory, so it "
                "needs activation_checkpointing (True, classes or a callable)"
            )
        return None
    if cpu_checkpointing is None:
        cpu_checkpointing = bool(section.get("cpu_checkpointing", False)) if section else False
    number = section.get("number_checkpoints") if section else None  # DeepSpeed's type, though it selects nothing
    if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 1):
        raise ValueError(f"activation_checkpointing.number_checkpoints must be null or an int >= 1, got {number!r}")
    return ActivationCheckpointConfig(policy=activation_checkpointing, cpu_checkpointing=cpu_checkpointing)


def select_blocks(
    module: nn.Module, config: ActivationCheckpointConfig, *, require_match: bool = True
) -> list[nn.Module]:
    """The modules ``config`` checkpoints, in registration (usually execution) order. Errors when none match (a
    policy that selects nothing would silently save no memory), unless ``require_match=False`` (a pipeline stage
    holding only some of the model's layers)."""
    policy = config.policy
    if policy is True:
        classes = module_classes.find_repeated_blocks(module)
        if not classes:
            raise ValueError(
                "activation_checkpointing=True checkpoints the repeated blocks (classes occurring at "
                "least twice in a ModuleList/Sequential), but this model has none: pass the classes to "
                "checkpoint or a callable(module) -> bool"
            )
        chosen = module_classes.detected(classes)  # [Note: which modules a class selects]
    elif isinstance(policy, frozenset):
        chosen = module_classes.given(module, policy, "activation_checkpointing", require_match)
    else:
        chosen = policy
    selected: list[nn.Module] = []
    inside: set[int] = set()  # ids of modules below an already-selected block: only the outermost is checkpointed
    for sub in module.modules():
        if sub is module or id(sub) in inside or not chosen(sub):
            continue
        selected.append(sub)
        inside.update(id(m) for m in sub.modules())
    if not selected and require_match:
        raise ValueError(
            f"the activation_checkpointing policy {policy!r} selects no submodule of "
            f"{type(module).__name__}: nothing would be checkpointed"
        )
    if config.number_checkpoints is not None and config.number_checkpoints < len(selected):
        count = len(selected)
        return [selected[i * count // config.number_checkpoints] for i in range(config.number_checkpoints)]
    return selected[:: config.every_k]


class _CheckpointedForward:
    """The replacement ``forward``: the original one under non-reentrant ``checkpoint`` (see the module note)."""

    def __init__(self, forward: Callable, had_instance_forward: bool, cpu_checkpointing: bool) -> None:
        self.forward = forward
        self.had_instance_forward = had_instance_forward  # the user's own per-instance forward: restore it, not delete
        self.cpu_checkpointing = cpu_checkpointing

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        if not torch.is_grad_enabled():  # evaluation: nothing is saved, so there is nothing to recompute
            return self.forward(*args, **kwargs)
        offload = nullcontext()
        if self.cpu_checkpointing:
            # The inputs checkpoint keeps are saved through the saved-tensor hooks active around it (the block's own
            # saved tensors go through checkpoint's inner hooks and are dropped), so save_on_cpu moves exactly them.
            # Keyword-argument tensors are captured by reference instead, and stay where they are.
            on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values()))
            offload = torch.autograd.graph.save_on_cpu(pin_memory=on_cuda)
        with offload:
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


class ActivationCheckpointHandle:
    """What :func:`apply_activation_checkpointing` did; :meth:`remove` undoes it."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.blocks = blocks

    def remove(self) -> None:
        for block in self.blocks:
            wrapper = block.__dict__.get("forward")
            if isinstance(wrapper, _CheckpointedForward):
                if wrapper.had_instance_forward:
                    block.forward = wrapper.forward
                else:
                    del block.forward
        self.blocks = []


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` replaced this module's ``forward``."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def apply_activation_checkpointing(
    module: nn.Module, config: ActivationCheckpointConfig, *, require_match: bool = True
) -> ActivationCheckpointHandle:
    """Checkpoint the blocks of ``module`` that ``config`` selects, in place; call before DDP/``fully_shard``.

    Idempotent: blocks already checkpointed are left as they are (evaluation after fit reuses the module). Returns a
    handle whose ``remove()`` restores every original ``forward``.
    """
    blocks = select_blocks(module, config, require_match=require_match)
    done = []
    for block in blocks:
        if is_checkpointed(block):
            continue
        had_instance_forward = "forward" in block.__dict__
        block.forward = _CheckpointedForward(block.forward, had_instance_forward, config.cpu_checkpointing)
        done.append(block)
    log.info(
        "activation checkpointing: %d blocks (%s)%s",
        len(blocks),
        sorted({type(b).__name__ for b in blocks}),
        ", inputs kept on CPU" if config.cpu_checkpointing else "",
    )
    return ActivationCheckpointHandle(done)
