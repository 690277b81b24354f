"""Both adapters' constructor signatures, generated from the dataclasses that declare the arguments once.

A ZeroStrategy takes its own arguments (:class:`~lightning_zero.adapters.settings.ZeroArguments`), those of
Lightning's ``DeepSpeedStrategy`` (:class:`~lightning_zero.ds_config.strategy_arguments.DeepSpeedArguments`) and the
few every Lightning strategy takes (accelerator, devices, cluster environment, precision plugin), whose names and
types differ between the Trainer and Fabric. :class:`StrategyArguments` puts them together into one
``inspect.Signature`` with annotations and defaults and sets it on the adapter's ``__init__``, so ``inspect``,
LightningCLI (jsonargparse's ``_parameter_resolvers.get_signature_parameters_and_indexes`` reads
``inspect.signature``, whose annotations then need no evaluating) and the documentation see each argument
with its type, while the adapter's ``__init__(*args, **kwargs)`` binds what it was given against that signature: an
unknown argument is a ``TypeError`` naming it, exactly as with a written-out signature.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import fields
from typing import Any, Callable, Optional

import torch

from lightning_zero.adapters.settings import ZeroArguments
from lightning_zero.ds_config.strategy_arguments import DeepSpeedArguments

_KEYWORD = inspect.Parameter.POSITIONAL_OR_KEYWORD


def lightning_parameter(name: str, annotation: Any, default: Any = None) -> inspect.Parameter:
    """One of the arguments every Lightning strategy takes (``accelerator``, ``precision_plugin``, ...)."""
    return inspect.Parameter(name, _KEYWORD, default=default, annotation=annotation)


def _declared(dataclass: type, skip: frozenset = frozenset()) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(dataclass)
    return [
        inspect.Parameter(f.name, _KEYWORD, default=f.default, annotation=hints[f.name])
        for f in fields(dataclass)
        if f.name not in skip
    ]


class StrategyArguments:
    """An adapter's constructor signature: ``ZeroArguments``' fields, with Lightning's ``accelerator``,
    ``parallel_devices`` and ``cluster_environment`` before ``checkpoint_io`` and the framework's ``precision``
    parameter after it, as Lightning's strategies order them, then ``DeepSpeedArguments``' (those ``ZeroArguments``
    already has are one argument). ``defaults`` overrides a declared default for this adapter."""

    def __init__(self, precision: inspect.Parameter, defaults: Optional[dict[str, Any]] = None) -> None:
        environment = [
            lightning_parameter("accelerator", Optional[Any]),
            lightning_parameter("parallel_devices", Optional[list[torch.device]]),
            lightning_parameter("cluster_environment", Optional[Any]),
        ]
        own = _declared(ZeroArguments)
        at = [p.name for p in own].index("checkpoint_io")
        own = [*own[:at], *environment, own[at], precision, *own[at + 1 :]]
        deepspeed = _declared(DeepSpeedArguments, skip=frozenset(p.name for p in own))
        defaults = dict(defaults or {})
        parameters = [p.replace(default=defaults.pop(p.name)) if p.name in defaults else p for p in own + deepspeed]
        if defaults:
            raise TypeError(f"no such argument to give a default: {sorted(defaults)}")
        self.lightning_names = tuple(p.name for p in (*environment, precision))
        self.signature = inspect.Signature([inspect.Parameter("self", _KEYWORD), *parameters], return_annotation=None)
        self.owner = "ZeroStrategy"

    def bind(self, args: tuple, kwargs: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(lightning, settings)``: the values of Lightning's own arguments (for the base class) and of the
        rest (for :func:`~lightning_zero.adapters.settings.resolve_settings`), defaults filled in. An unknown
        argument, a missing or a repeated one is a ``TypeError`` naming it, as with a written signature."""
        try:
            bound = self.signature.bind(None, *args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{self.owner}() {error}") from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        del values["self"]
        return {name: values.pop(name) for name in self.lightning_names}, values

    def declare(self, init: Callable) -> Callable:
        """Give ``init`` (an adapter's ``__init__(self, *args, **kwargs)``) this signature, its annotations and the
        per-argument documentation of ``ZeroArguments`` (LightningCLI's help reads it)."""
        init.__signature__ = self.signature
        init.__annotations__ = {name: p.annotation for name, p in self.signature.parameters.items() if name != "self"}
        init.__annotations__["return"] = None
        init.__doc__ = ZeroArguments.__doc__
        self.owner = init.__qualname__.rpartition(".")[0] or self.owner
        return init
