"""The log of a deferred construction and its replay (see [Note: record and replay] in
:mod:`lightning_zero.distributed.deferred_init`, which records it).

A log is a list of :class:`RecordedOp`: each names the deferred storages it reads and writes by their keys, and
holds its other inputs as values (:class:`HeldInput` for large real ones). :class:`LogReplay` replays the part of a
log that a set of storages depends on, on real memory.

This module is framework-free: it never imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_zero.distributed.undefined_memory import EMPTY_FACTORIES, fill_nan, op_name
from lightning_zero.torch_compat.tensors import storage_identity, tensor_version, tree_flatten, tree_unflatten


class DeferredInitError(RuntimeError):
    """The recorder met a pattern it cannot reproduce exactly; the message names the module and the op."""


def deferred_key(tensor: torch.Tensor) -> int:
    """The key of a deferred tensor's memory in the log: its meta storage (views and tied weights share it)."""
    return storage_identity(tensor._meta)


@dataclass(frozen=True)
class DeferredRef:
    """A deferred tensor in the log: its storage and its layout on it."""

    key: int
    dtype: torch.dtype
    size: tuple
    stride: tuple
    offset: int

    @staticmethod
    def of(tensor: torch.Tensor) -> "DeferredRef":
        meta = tensor._meta
        if (meta.dtype, meta.shape, meta.stride(), meta.storage_offset()) != (
            tensor.dtype,
            tensor.shape,
            tensor.stride(),
            tensor.storage_offset(),
        ):
            raise DeferredInitError(
                "a deferred tensor's layout changed outside its log (a metadata change this recorder does not "
                "follow); build without deferral (LIGHTNING_ZERO_DEFERRED_INIT=0)"
            )
        return DeferredRef(
            deferred_key(tensor), meta.dtype, tuple(meta.shape), tuple(meta.stride()), meta.storage_offset()
        )

    def on(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


@dataclass(frozen=True)
class HeldInput:
    """A large real input of a logged op, with its version counter when it was read."""

    tensor: torch.Tensor
    version: int


@dataclass
class RecordedOp:
    func: Any
    spec: Any
    flat: list  # DeferredRef, real snapshots, or plain values
    out_refs: list  # DeferredRef of each tensor output (None for others)
    reads: frozenset
    writes: frozenset
    new: frozenset
    rng: list = field(default_factory=list)  # (generator, state) to restore before the op


class LogReplay:
    """The replay half of a recorder: its log (``entries``), the meta tensor of each deferred storage (``bases``),
    whether ``empty`` factories replay as NaN (``track_undefined``) and the most real bytes a replay held."""

    entries: list[RecordedOp]
    bases: dict[int, torch.Tensor]
    track_undefined: bool
    peak_bytes: int

    def replay(self, targets: set[int]) -> dict[int, torch.UntypedStorage]:
        """Real storages holding the final recorded values of the deferred storages ``targets``."""
        needed = set(targets)
        subset = []
        for index in range(len(self.entries) - 1, -1, -1):
            entry = self.entries[index]
            if entry.writes & needed:
                subset.append(entry)
                needed |= entry.reads
        subset.reverse()
        last_use: dict[int, int] = {}
        for position, entry in enumerate(subset):
            for key in entry.reads | entry.writes:
                last_use[key] = position
        gens = {id(g): g for entry in subset for g, _ in entry.rng}
        saved = [(g, g.get_state()) for g in gens.values()]
        env: dict[int, torch.UntypedStorage] = {}
        try:
            with torch.no_grad():
                for position, entry in enumerate(subset):
                    self._replay_entry(entry, env)
                    self.peak_bytes = max(self.peak_bytes, sum(storage.nbytes() for storage in env.values()))
                    for key in entry.reads | entry.writes:
                        if last_use[key] == position and key not in targets:
                            env.pop(key, None)
        finally:
            for generator, state in saved:
                generator.set_state(state)
        missing = targets - env.keys()
        if missing:  # a deferred storage nothing ever wrote: it was created by a view of nothing recorded
            raise DeferredInitError(f"deferred init: {len(missing)} storages have no recorded origin")
        return {key: env[key] for key in targets}

    def _replay_entry(self, entry: RecordedOp, env: dict) -> None:
        real = []
        for value in entry.flat:
            if isinstance(value, DeferredRef):
                real.append(value.on(env[value.key]))
            elif isinstance(value, HeldInput):
                if tensor_version(value.tensor) != value.version:
                    raise DeferredInitError(
                        f"A real tensor of shape {tuple(value.tensor.shape)} that the model's init code read (via "
                        f"{entry.func}) was modified in place afterwards, so its value then is lost. Keep it "
                        "unchanged until setup, or build without deferral (LIGHTNING_ZERO_DEFERRED_INIT=0)."
                    )
                real.append(value.tensor)
            else:
                real.append(value)
        args, kwargs = tree_unflatten(real, entry.spec)
        for generator, state in entry.rng:
            generator.set_state(state)
        out = entry.func(*args, **kwargs)
        if self.track_undefined and op_name(entry.func) in EMPTY_FACTORIES:
            fill_nan(tree_flatten(out)[0])
        for o, ref in zip(tree_flatten(out)[0], entry.out_refs):
            if ref is None or ref.key not in entry.new:
                continue
            nbytes = self.bases[ref.key].untyped_storage().nbytes()
            if (
                o.untyped_storage().nbytes() == nbytes
                and tuple(o.stride()) == ref.stride
                and o.storage_offset() == ref.offset
                and o.dtype == ref.dtype
            ):
                env[ref.key] = o.untyped_storage()
            else:  # the CPU kernel chose another layout than the meta one: copy into the recorded layout
                storage = torch.UntypedStorage(nbytes)
                ref.on(storage).copy_(o)
                env[ref.key] = storage

    def mark(self) -> int:
        """A position in the log, for :meth:`written_since`."""
        return len(self.entries)

    def written_since(self, mark: int, tensor: torch.Tensor) -> bool:
        """Whether an op logged after ``mark`` wrote the memory of ``tensor`` (its storage, any part of it)."""
        key = deferred_key(tensor)
        return any(key in entry.writes for entry in self.entries[mark:])
