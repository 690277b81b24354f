"""Bounded-memory exact initialisation: record the model's construction per tensor, replay it unit by unit.

[Note: record and replay]
At stages 2-3 no rank should hold the full model, yet the model's own init code must run exactly as in a plain CPU
build (see :mod:`lightning_zero.distributed.exact_init`). :func:`deferred_build` runs construction under a
``TorchDispatchMode`` in which every CPU tensor *created* (factory ops: ``empty``, ``zeros``, ``arange``, ``randn``
...) is a *deferred* tensor: a wrapper subclass that reports ``device='cpu'`` (so init code that skips meta tensors,
as ``nn.init`` does, still runs) and holds only a meta tensor for its layout. Every aten op that writes deferred
memory (``normal_``, ``uniform_``, ``copy_``, ``erfinv_``, ``mul_`` ...) or makes new deferred memory from it
(``clone``, ``_to_copy``, QR ...) is appended to a log, with its real CPU inputs kept (copied when small; held with
their version counter when large, a later in-place change to them is refused). Deferred memory is identified by
its meta storage, so views, ``.data``, ``detach``, slicing and tied weights need no bookkeeping: a view is its
storage plus size, stride and offset, rebuilt on the replayed storage. Layout-only in-place ops (``t_``) update the
wrapper too. Deferred tensors keep recording after construction (their own ``__torch_dispatch__``), so a
``load_state_dict`` or a dtype conversion before sharding is replayed as well.

Random ops are exact because the CPU generator state (and that of an explicit ``generator=``) is saved before each
one and the op is run once on a real scratch tensor of the same layout, so the RNG stream advances exactly as in a
plain build; the scratch is dropped (peak: one tensor). Replay sets the saved state before each random op and
restores the caller's state afterwards.

Anything that needs a deferred value in Python (``.item()``, ``torch.equal``, ``bool()``, printing, ops whose output
shape depends on data, ops without a meta kernel) runs for real on inputs replayed at that moment. When such an op
writes deferred memory, the written bytes are kept in the log: exact, but not bounded; those bytes count against the
host-memory budget and exceeding it raises :class:`InitMemoryError` naming the module and the op.

:func:`materialize_module` replays the log restricted to what a set of tensors depends on (one reverse pass: an
entry is needed when it writes a needed storage, and then its inputs are needed), in the original order, freeing
intermediate storages after their last use. ``apply_zero`` calls it unit by unit right before ``fully_shard``, so
the peak is one unit, plus the temporaries its init made, plus the shards. Tensors that are plain attributes of a
module rather than parameters or buffers (torchmetrics states and their defaults) are made real when construction
ends.

Refused rather than guessed: ``set_``/``resize_`` on a deferred tensor, assigning a tensor from elsewhere to its
``.data``, its ``data_ptr()``, ops mixing tensors of two deferred builds, and an op that returns a view of a value
that only existed while it ran. Not detected: a write through ``.data`` of a large *real* tensor the init code read
(``.data`` has its own version counter) between construction and setup.

A build that skipped torch's layer init (``empty_init=True``) also follows which storages hold memory nothing wrote
(``track_undefined``, the rule of :mod:`.undefined_memory`); its ``empty`` factories replay as NaN, never garbage.

Why hand-written: torch has no maintained deferred init (torchdistx's ``deferred_init``, the same idea, is an
unmaintained C++ extension for old torch releases; FSDP2 documents meta-device init plus ``reset_parameters``,
which is not exact).

This module records; the log's entries and their replay are :mod:`.deferred_replay`. It is framework-free: it never
imports Lightning.
"""

from __future__ import annotations

import gc
import inspect
import logging
from contextlib import contextmanager
from typing import Any, Generator, Optional

import torch
from torch import nn

from lightning_zero.distributed.deferred_replay import (
    DeferredInitError,
    DeferredRef,
    HeldInput,
    LogReplay,
    RecordedOp,
    deferred_key,
)
from lightning_zero.distributed.undefined_memory import follow, op_name
from lightning_zero.torch_compat import TENSOR_DATA, TorchDispatchMode, disable_torch_dispatch, make_wrapper_subclass
from lightning_zero.torch_compat.tensors import (
    op_schema,
    storage_identity,
    tensor_version,
    tree_flatten,
    tree_unflatten,
)

log = logging.getLogger(__name__)

# The host-memory budget of a build in bytes (0: no guard), read by exact_init's InitConfig.from_env. It bounds both
# builds, exact_init's on real memory and the real values this log keeps, so the name and its error live here, in the
# module exact_init imports.
BUDGET_ENV = "LIGHTNING_ZERO_INIT_MEMORY_BUDGET"


class InitMemoryError(MemoryError):
    """Building the model on this rank would exceed its share of the host memory."""


class _Deferred(torch.Tensor):
    """A CPU tensor whose value is defined by its recorder's log: reports ``device='cpu'`` (init code that skips
    meta tensors, as ``nn.init`` does, must still run) and holds a meta tensor with the layout."""

    _meta: torch.Tensor
    _recorder: "_Recorder"

    @staticmethod
    def __new__(cls, meta: torch.Tensor, recorder: "_Recorder"):
        wrapper = make_wrapper_subclass(cls, meta, device="cpu", requires_grad=meta.requires_grad)
        wrapper._meta = meta
        wrapper._recorder = recorder
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Outside a recording (after construction): keep recording, so a later in-place write (load_state_dict
        # after Trainer.init_module) is replayed too and any value read is exact.
        flat, _ = tree_flatten((args, kwargs or {}))
        recorder = next(a._recorder for a in flat if isinstance(a, _Deferred))
        return recorder.dispatch(func, args, kwargs or {})

    @property
    def data(self):
        return TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value):  # module.to(dtype) swaps .data: the new layout and value come with it
        if not isinstance(value, _Deferred) or value._recorder is not self._recorder:
            raise DeferredInitError(
                "Assigning a tensor that was not built in the same deferred construction to the .data of a deferred "
                "tensor cannot be replayed; copy_ into it instead, or build without deferral "
                "(LIGHTNING_ZERO_DEFERRED_INIT=0)."
            )
        TENSOR_DATA.__set__(self, value)
        self._meta = value._meta

    def data_ptr(self):  # every deferred tensor would report 0, and "same address" means "shared memory"
        raise DeferredInitError(
            "data_ptr() of a deferred tensor: it has no memory until apply_zero replays it (see "
            "lightning_zero.distributed.deferred_init); build without deferral (LIGHTNING_ZERO_DEFERRED_INIT=0) "
            "if this code must run during construction."
        )

    def __deepcopy__(self, memo):  # a recorded clone, owned by the same log (never a copy of the log)
        if id(self) not in memo:
            with torch.no_grad():
                memo[id(self)] = self.clone().requires_grad_(self.requires_grad)
        return memo[id(self)]

    def __repr__(self, *, tensor_contents=None):  # printing reads values: show the replayed ones
        return f"deferred({self._recorder.value(self)!r})"


_COPY_BELOW = 1 << 20  # bytes: real inputs up to this size are copied into the log, larger ones held


def _innermost_module() -> str:
    """The class of the innermost ``nn.Module.__init__`` on the stack: where an error happened."""
    for frame_info in inspect.stack(context=0):
        owner = frame_info.frame.f_locals.get("self")
        if frame_info.function == "__init__" and isinstance(owner, nn.Module):
            return type(owner).__name__
    return "<outside any module __init__>"


def _written(func, args, kwargs) -> list:
    """The tensors ``func`` writes, by its schema: an in-place ``self``, ``out=``, ``Tensor(a!)[]`` lists."""
    written = []
    for index, arg in enumerate(op_schema(func).arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[index] if index < len(args) else kwargs.get(arg.name)
            written.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return written


def _recordable(func, written: list) -> bool:
    """Whether ``func``'s outputs are all tensors (none at all is fine for an op that writes its inputs)."""
    returns = op_schema(func).returns
    return all(str(ret.type) in ("Tensor", "Tensor[]", "Optional[Tensor]") for ret in returns) and (
        len(returns) > 0 or bool(written)
    )


class _Recorder(LogReplay, TorchDispatchMode):
    def __init__(self, budget: Optional[int], track_undefined: bool = False) -> None:
        super().__init__()
        self.budget = budget
        self.track_undefined = track_undefined
        self.undefined: set[int] = set()  # keys of storages holding memory nothing wrote (track_undefined)
        self.sealed_at: Optional[int] = None  # the log's length when construction ended
        self.written_after: tuple[int, frozenset] = (-1, frozenset())  # undefined_state's cache
        self.pinned = 0
        self.bases: dict[int, torch.Tensor] = {}  # key -> a meta tensor keeping the storage (and its key) alive
        self.entries: list[RecordedOp] = []
        self.peak_bytes = 0  # most real bytes a replay or an RNG scratch held at once (tests bound it)

    # ------------------------------------------------------------------ recording
    def deferred(self, value: Any) -> bool:
        return isinstance(value, _Deferred) and value._recorder is self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if not any(isinstance(a, _Deferred) for a in flat):
            if self._is_cpu_factory(func, flat, kwargs):
                return self._record(func, args, kwargs, factory=True)
            return func(*args, **kwargs)
        return self.dispatch(func, args, kwargs)

    def dispatch(self, func, args, kwargs):
        """Record ``func`` on deferred inputs, or run it for real where it needs their values."""
        flat, spec = tree_flatten((args, kwargs))
        mutated_args = _written(func, args, kwargs)
        foreign = [a for a in flat if isinstance(a, _Deferred) and not self.deferred(a)]
        if foreign:  # tensors of another deferred build (Trainer.init_module, then configure_model)
            owners = {id(a._recorder): a._recorder for a in mutated_args if isinstance(a, _Deferred)}
            if not any(self.deferred(a) for a in flat):
                owners = owners or {id(foreign[0]._recorder): foreign[0]._recorder}
            if len(owners) > 1:
                raise DeferredInitError(
                    f"{func} in {_innermost_module()} writes tensors of two deferred constructions at once: build "
                    "them in one place, or without deferral (LIGHTNING_ZERO_DEFERRED_INIT=0)."
                )
            owners.pop(id(self), None)
            if owners:  # the build that owns what is written records it; it reads this build's tensors' values
                return next(iter(owners.values())).dispatch(func, args, kwargs)
            # Only read here: their values now, as real inputs of this build's op.
            flat = [a._recorder.value(a) if isinstance(a, _Deferred) and not self.deferred(a) else a for a in flat]
            args, kwargs = tree_unflatten(flat, spec)
        if not _recordable(func, mutated_args) or any(not self.deferred(a) for a in mutated_args):
            return self._eager(func, args, kwargs)  # a Python value, or real memory written from deferred values
        return self._record(func, args, kwargs, factory=False)

    @staticmethod
    def _is_cpu_factory(func, flat, kwargs) -> bool:
        if any(isinstance(a, torch.Tensor) for a in flat) or not _recordable(func, []):
            return False
        device = kwargs.get("device")
        return device is None or torch.device(device).type == "cpu"

    def _rng_states(self, func, flat) -> list:
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return []
        gens = [torch.default_generator] + [a for a in flat if isinstance(a, torch.Generator)]
        return [(g, g.get_state()) for g in gens]

    def _record(self, func, args, kwargs, factory: bool):
        flat, spec = tree_flatten((args, kwargs))
        meta_flat = [
            a._meta if self.deferred(a) else self._meta_like(a) if isinstance(a, torch.Tensor) else a for a in flat
        ]
        meta_args, meta_kwargs = tree_unflatten(meta_flat, spec)
        refs = [DeferredRef.of(a) if self.deferred(a) else None for a in flat]  # layouts before the op
        written_args = _written(func, args, kwargs)  # in-place, out= and list-writing ops (checked deferred)
        if op_name(func) in ("set_", "resize_", "resize_as_"):
            raise DeferredInitError(
                f"Deferred initialisation cannot follow {func} in {_innermost_module()}: it changes which memory a "
                "tensor uses. Build without deferral (LIGHTNING_ZERO_DEFERRED_INIT=0) if the model fits on one rank."
            )
        if factory:
            meta_kwargs = {**meta_kwargs, "device": torch.device("meta")}
        try:
            out = func(*meta_args, **meta_kwargs)
        except Exception as error:  # no meta kernel, or an output shape that depends on values
            log.debug("deferred init: %s has no meta run (%s); running it for real", func, error)
            return self._eager(func, args, kwargs)
        out_flat, out_spec = tree_flatten(out)
        if factory and all(o.numel() == 0 for o in out_flat if isinstance(o, torch.Tensor)):
            return func(*args, **kwargs)  # costs nothing real; torch.empty(0).set_(storage) handles stay usable
        if not all(o.is_meta for o in out_flat if isinstance(o, torch.Tensor)):
            return self._eager(func, args, kwargs)
        if torch.Tag.inplace_view in func.tags:  # t_, unsqueeze_ ...: only the layout changes, also the wrapper's
            for a in flat:
                if self.deferred(a):
                    with disable_torch_dispatch():
                        torch.ops.aten.as_strided_.default(a, a._meta.shape, a._meta.stride(), a._meta.storage_offset())
            return tree_unflatten(
                [given_arg for given_arg in flat if self.deferred(given_arg)][: len(out_flat)], out_spec
            )
        rng = self._rng_states(func, flat)
        if rng:
            self._advance_rng(func, flat, spec, refs, written_args)
        reads = frozenset(deferred_key(a) for a in flat if self.deferred(a))
        new = set()
        for o in out_flat:
            if isinstance(o, torch.Tensor) and storage_identity(o) not in self.bases:
                self.bases[storage_identity(o)] = o
                new.add(storage_identity(o))
        written = {ref.key for ref, a in zip(refs, flat) if ref is not None and any(a is w for w in written_args)}
        # An in-place op returns the very tensor it was given; a new output gets a new wrapper.
        given = {id(a._meta): a for a in flat if self.deferred(a)}
        wrapped = [
            (given[id(o)] if id(o) in given else _Deferred(o, self)) if isinstance(o, torch.Tensor) else o
            for o in out_flat
        ]
        writes = frozenset(new | written)
        if self.track_undefined:
            self._track(func, reads - written, new, [ref for ref in refs if ref is not None and ref.key in written])
        if writes:  # otherwise a view: its storage, size, stride and offset say all there is to replay
            self.entries.append(
                RecordedOp(
                    func,
                    spec,
                    [ref if ref is not None else self._snapshot(a) for ref, a in zip(refs, flat)],
                    [DeferredRef.of(w) if isinstance(w, _Deferred) else None for w in wrapped],
                    reads,
                    writes,
                    frozenset(new),
                    rng,
                )
            )
        return tree_unflatten(wrapped, out_spec)

    def _track(self, func, reads: set, new: set, written: list) -> None:  # see undefined_memory
        follow(
            self.undefined,
            op_name(func),
            reads,
            new,
            [(r.key, r.size, r.dtype, self.bases[r.key].untyped_storage().nbytes()) for r in written],
        )

    @staticmethod
    def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")

    def _snapshot(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        # A real input may be changed later by the code that owns it; the log keeps the value it had here: a copy
        # when small, else the tensor itself and its version, checked at replay (a state dict loaded in
        # configure_model is not copied a second time).
        nbytes = value.untyped_storage().nbytes()
        self._count(nbytes, "a real tensor read by the init code")
        if nbytes <= _COPY_BELOW:
            return value.detach().clone()
        return HeldInput(value, tensor_version(value))  # the object itself: a detach() here would get its own version

    def _count(self, nbytes: int, what: str) -> None:
        self.pinned += nbytes
        if self.budget is not None and self.pinned > self.budget:
            raise InitMemoryError(
                f"Deferred initialisation keeps {self.pinned / 1024**3:.2f} GiB of real values in its log, over "
                f"the budget of {self.budget / 1024**3:.2f} GiB, at {_innermost_module()} ({what}). Raise the "
                f"budget (${BUDGET_ENV}, bytes; 0: no guard) or see lightning_zero.distributed.deferred_init."
            )

    def _advance_rng(self, func, flat, spec, refs, written_args) -> None:
        """Run a random op once on real scratch memory: the generators move exactly as in a plain build."""
        keys = {ref.key for ref in refs if ref is not None}
        # Written deferred tensors only need their layout; others (a bernoulli_ p tensor) need their values.
        scratch = {deferred_key(a) for a in written_args}
        storages = self.replay(keys - scratch) if keys - scratch else {}
        real = []
        for ref, a in zip(refs, flat):
            if ref is None:
                real.append(a)
            elif ref.key in scratch:
                real.append(torch.empty_strided(ref.size, ref.stride, dtype=ref.dtype))
                self.peak_bytes = max(self.peak_bytes, real[-1].untyped_storage().nbytes())
            else:
                real.append(ref.on(storages[ref.key]))
        args, kwargs = tree_unflatten(real, spec)
        with torch.no_grad():
            func(*args, **kwargs)

    def value(self, tensor: "_Deferred") -> torch.Tensor:
        """The exact current value of a deferred tensor, on real memory."""
        return DeferredRef.of(tensor).on(self.replay({deferred_key(tensor)})[deferred_key(tensor)])

    def _eager(self, func, args, kwargs):
        """Run ``func`` for real on replayed inputs; pin any deferred memory it writes."""
        flat, spec = tree_flatten((args, kwargs))
        keys = {deferred_key(a) for a in flat if self.deferred(a)}
        storages = self.replay(keys)
        real = [DeferredRef.of(a).on(storages[deferred_key(a)]) if self.deferred(a) else a for a in flat]
        real_args, real_kwargs = tree_unflatten(real, spec)
        rng = self._rng_states(func, flat)
        out = func(*real_args, **real_kwargs)
        out_flat, out_spec = tree_flatten(out)
        # What the op wrote, by its schema (an op may return nothing, or something else than what it wrote).
        written = {deferred_key(a) for a in _written(func, args, kwargs) if self.deferred(a)}
        if self.track_undefined:
            self._track(
                func,
                keys - written,
                set(),
                [DeferredRef.of(a) for a in _written(func, args, kwargs) if self.deferred(a)],
            )
        replayed = {s.data_ptr(): key for key, s in storages.items()}
        for o in out_flat:
            if isinstance(o, torch.Tensor) and replayed.get(o.untyped_storage().data_ptr()) not in (None, *written):
                raise DeferredInitError(
                    f"Deferred initialisation cannot follow {func} in {_innermost_module()}: it returns a view "
                    "of a tensor whose value only exists during this call. Build without deferral "
                    "(LIGHTNING_ZERO_DEFERRED_INIT=0)."
                )
        for key in written:  # keep the written bytes: exact, counted against the budget
            storage = storages[key]
            data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)).clone()
            self._count(data.nbytes, f"{func} wrote a deferred tensor and has no meta kernel")
            log.warning(
                "deferred init: %s in %s runs on real memory; its %d bytes are kept until sharding",
                func,
                _innermost_module(),
                data.nbytes,
            )
            target = DeferredRef(key, torch.uint8, (storage.nbytes(),), (1,), 0)
            self.entries.append(
                RecordedOp(
                    torch.ops.aten.copy_.default,
                    tree_flatten(((None, None), {}))[1],
                    [target, data],
                    [target],
                    frozenset(),
                    frozenset({key}),
                    frozenset(),
                    rng,
                )
            )
        if not written:
            return out
        # An in-place op returns the tensor it wrote: hand back the deferred tensor, not the replayed copy.
        by_key = {deferred_key(a): a for a in flat if self.deferred(a)}
        return tree_unflatten(
            [
                by_key[replayed[o.untyped_storage().data_ptr()]]
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in replayed
                else o
                for o in out_flat
            ],
            out_spec,
        )

    # ------------------------------------------------------------------ sessions
    def seal(self) -> None:
        """End of construction: tensors that are plain module attributes (torchmetrics states and defaults) get
        real values now; only parameters and buffers stay deferred until ``apply_zero`` shards them.

        Every live module is scanned (the garbage collector's list): a module built without parameters (a metric
        on its own) registers nothing that a hook would see.
        """
        self.sealed_at = len(self.entries)
        for module in [obj for obj in gc.get_objects() if issubclass(type(obj), nn.Module)]:
            for name, value in list(vars(module).items()):
                if name not in ("_parameters", "_buffers", "_modules"):
                    replaced = self._materialize_loose(value)
                    if replaced is not value:
                        vars(module)[name] = replaced

    def _materialize_loose(self, value: Any) -> Any:
        if self.deferred(value):
            return self.value(value).requires_grad_(value.requires_grad)
        if isinstance(value, dict) and any(self.deferred(v) for v in value.values()):
            for k, v in list(value.items()):
                value[k] = self._materialize_loose(v)
        elif isinstance(value, list) and any(self.deferred(v) for v in value):
            value[:] = [self._materialize_loose(v) for v in value]
        return value


@contextmanager
def deferred_build(budget: Optional[int] = None, track_undefined: bool = False) -> Generator["_Recorder", None, None]:
    """Record construction instead of running it on real memory (see the module Note).

    Every CPU tensor created inside is deferred (its value is defined by the log, no memory is allocated);
    :func:`materialize_module` (called by ``apply_zero``) gives a module real, exact values. ``budget`` bounds the
    bytes the log may keep as real values (``None``: no bound). ``track_undefined``: follow the memory nothing wrote
    (:func:`undefined_state`). Yields the recorder (its log).
    """
    recorder = _Recorder(budget, track_undefined)
    with recorder:
        yield recorder
    recorder.seal()


def is_deferred(tensor: Any) -> bool:
    """Whether ``tensor`` is a deferred tensor (its value still lives in a construction log)."""
    return isinstance(tensor, _Deferred)


def undefined_state(tensor: Any) -> tuple[bool, bool]:
    """For a deferred tensor of a build that tracks it: (whether it holds memory nothing wrote, whether anything wrote
    it after its construction ended); ``(False, False)`` for any other tensor."""
    if not isinstance(tensor, _Deferred) or not tensor._recorder.track_undefined:
        return False, False
    recorder, key = tensor._recorder, deferred_key(tensor)
    if recorder.sealed_at is None:
        return key in recorder.undefined, False
    if recorder.written_after[0] != len(recorder.entries):  # what the log wrote after construction, once per change
        written = frozenset().union(*(entry.writes for entry in recorder.entries[recorder.sealed_at :]))
        recorder.written_after = (len(recorder.entries), written)
    return key in recorder.undefined, key in recorder.written_after[1]


@contextmanager
def recording_into(tensor: torch.Tensor) -> Generator[None, None, None]:
    """Run code (a module's ``reset_parameters()`` at setup) recorded into the log of the deferred ``tensor``, CPU
    tensors it creates included, as during its construction."""
    with torch.device("cpu"), tensor._recorder:
        yield


def has_deferred(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is still deferred."""
    return any(isinstance(t, _Deferred) for t in _tensors(module))


def _tensors(module: nn.Module):
    yield from module.parameters()
    yield from module.buffers()


def materialize_module(module: nn.Module) -> None:
    """Give every deferred parameter and buffer of ``module`` (and its submodules) its exact real value, in place.

    Tied parameters stay one ``Parameter``. Only the storages these tensors depend on are replayed, freeing
    intermediates after their last use. A log lives as long as a deferred tensor refers to it.
    """
    slots = []
    for sub in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(sub, kind).items():
                if isinstance(tensor, _Deferred):
                    slots.append((sub, kind, name, tensor))
    recorders = {id(t._recorder): t._recorder for *_, t in slots}
    made: dict[int, torch.Tensor] = {}
    for recorder in recorders.values():
        mine = [t for *_, t in slots if t._recorder is recorder]
        storages = recorder.replay({deferred_key(t) for t in mine})
        for tensor in mine:
            if id(tensor) not in made:
                made[id(tensor)] = DeferredRef.of(tensor).on(storages[deferred_key(tensor)])
    for sub, kind, name, tensor in slots:
        real = made[id(tensor)]
        if kind == "_parameters" and not isinstance(real, nn.Parameter):
            real = made[id(tensor)] = nn.Parameter(real, requires_grad=tensor.requires_grad)
        getattr(sub, kind)[name] = real
