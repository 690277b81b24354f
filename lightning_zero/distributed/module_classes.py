"""Selecting submodules by class: one rule for ``sharded_module_classes`` (the FSDP units, :mod:`.apply_zero`) and
for activation checkpointing (:mod:`.activation_checkpointing`), and the blocks both select by default
(:func:`find_repeated_blocks`).

[Note: which modules a class selects]
A class the user gives selects its instances, *subclasses included* (``isinstance``), as torch's
``ModuleWrapPolicy`` and Lightning's FSDP policies do: naming a base class ``Block`` also selects the
``GPTBlock(Block)`` instances; exact types would silently select none of them. A class *name* is looked up among the
classes of the model's modules (it must be the class of at least one) and then selects as that class does.

The classes :func:`find_repeated_blocks` *detects* select exactly (``type(module) is cls``): they were counted by
exact type, and a subclass of a detected class is another kind of layer. Example: with detected ``nn.Linear``
blocks, ``isinstance`` would also pick ``nn.MultiheadAttention``'s ``out_proj`` (a ``Linear`` subclass that the
attention uses without calling it), making it an FSDP unit whose parameters are never gathered.

A given class or name that selects no module of the model is refused, naming the classes present, unless the caller
allows it (a pipeline stage holds only some of the model's layers): an input that does nothing is an error, not a
silent no-op.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator

from torch import nn


@dataclass(frozen=True)
class ClassSelector:
    """A set of module classes and how it selects (see the module note). ``type(m) in selector``, iteration and
    ``len`` work as on the set; calling it on a module says whether it is selected."""

    classes: frozenset
    exact: bool = False

    def __contains__(self, cls: object) -> bool:
        if self.exact:
            return cls in self.classes
        return isinstance(cls, type) and bool(self.classes) and issubclass(cls, tuple(self.classes))

    def __call__(self, module: nn.Module) -> bool:
        return type(module) in self

    def __iter__(self) -> Iterator[type]:
        return iter(self.classes)

    def __len__(self) -> int:
        return len(self.classes)


def detected(classes: Iterable[type]) -> ClassSelector:
    """The blocks :func:`find_repeated_blocks` found: exact types."""
    return ClassSelector(frozenset(classes), exact=True)


def given(module: nn.Module, spec: Iterable, what: str, require_match: bool = True) -> ClassSelector:
    """The user's classes and class names ``spec`` (already validated as such) for ``module``; ``what`` names the
    argument in errors. A name or class that selects no module of ``module`` is a ``ValueError`` unless
    ``require_match=False`` (then it is dropped)."""
    modules = list(module.modules())
    present = {type(m).__name__: type(m) for m in modules}
    classes, unmatched = set(), []
    for item in spec:
        cls = present.get(item) if isinstance(item, str) else item
        if cls is None or not any(isinstance(m, cls) for m in modules):
            unmatched.append(item if isinstance(item, str) else item.__name__)
        else:
            classes.add(cls)
    if unmatched and require_match:
        raise ValueError(
            f"{what} names {sorted(unmatched)}, but the model has no module of that class. "
            f"Classes present: {sorted(present)}"
        )
    return ClassSelector(frozenset(classes))


# Containers whose repeated children are the natural FSDP units ("the blocks").
_CONTAINERS = (nn.ModuleList, nn.Sequential)


def find_repeated_blocks(module: nn.Module) -> set[type]:
    """Module classes that occur at least twice as children of a ``ModuleList``/``Sequential`` and own parameters.

    These are the transformer blocks, residual stages and so on that FSDP wants as units. Only the outermost
    such classes are returned: a class nested inside another detected block is left to that block's unit.
    """
    counts: Counter[type] = Counter()
    for container in module.modules():
        if isinstance(container, _CONTAINERS):
            for child in container.children():
                if any(True for _ in child.parameters()):
                    counts[type(child)] += 1
    candidates = {cls for cls, count in counts.items() if count >= 2}
    # A class with any instance nested inside another candidate is a layer of the blocks, not a block: drop it
    # entirely. Keeping it because one instance also sits outside the blocks (an ``nn.Linear`` head next to blocks
    # whose MLPs are ``Sequential(Linear, GELU, Linear)``) would make every such layer inside the blocks its own unit
    # too: a collective per layer, and FSDP2 warns about each unit whose output is a view (``Linear`` on 3-D input).
    nested: set[type] = set()
    for name, sub in module.named_modules():
        if type(sub) in candidates and _has_ancestor_of(module, name, candidates):
            nested.add(type(sub))
    return candidates - nested


def _has_ancestor_of(root: nn.Module, name: str, classes: set[type]) -> bool:
    """Whether a module above ``name`` (a dotted name under ``root``, ``root`` itself excluded) is of ``classes``."""
    parts = name.split(".")
    current = root
    for part in parts[:-1]:
        current = getattr(current, part)
        if type(current) in classes:
            return True
    return False
