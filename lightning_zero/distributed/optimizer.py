"""Stage-1 optimizer partitioning and CPU offload of optimizer states, applied to the user's optimizer in place.

Why in place rather than ``torch.distributed.optim.ZeroRedundancyOptimizer``: ZeroRedundancyOptimizer wraps the
user's optimizer in a new object, so an LR scheduler built on the original (as every ``configure_optimizers``
does) would keep stepping param groups nobody reads, and its local optimizer cannot keep fp32 masters in CPU
memory. Here the user's optimizer object, its ``param_groups`` dicts and its class stay; only each group's
``params`` list is narrowed to what this rank steps. The algorithm is ZeroRedundancyOptimizer's: a greedy
size-balanced partition of each group, a local step, then the updated parameters broadcast from their owners.

[Note: what the optimizer holds]
After :func:`shard_optimizer`, ``param_groups[i]["params"]`` holds exactly the tensors this rank steps:
  - stages 0, 2, 3 without offload: the module's parameters (plain tensors or FSDP2 DTensor shards);
  - stage 1: only the parameters this rank owns;
  - ``bf16-true`` at stages 0-1 (:mod:`.replicas`): fp32 *masters* of the owned parameters on the compute device,
    the module holding bf16 replicas;
  - with the optimizer offloaded and parameters not (``offload_optimizer="cpu"``/``"nvme"`` at stages 1-3,
    DeepSpeed's ZeRO-Offload): fp32 CPU *masters* of the owned parameters; at stages 2-3 a master is a DTensor
    with the same mesh, placements and global shape as the FSDP2 shard it mirrors, so its optimizer states are
    DTensors too and checkpoints have the same layout with and without offload.
The module's parameters of every group are kept in :attr:`OptimizerSharding.model_params` (clipping and
checkpoints need them). Gradient flow is: backward fills the module's ``.grad``; the step pre-hook copies owned
gradients into the masters; the optimizer steps; the post-hook copies masters back, broadcasts from owners, and
drops the module's gradients (torch's ``zero_grad`` only reaches the tensors the groups hold, so the optimizer's
class gets one that clears the module's others too: [Note: zero_grad reaches the module's gradients]).
Why hand-written: torch has no optimizer wrapper that keeps CPU copies of device parameters (FSDP2's
``CPUOffloadPolicy`` moves the parameters themselves, which is DeepSpeed's ``offload_param``); the copies are plain
``Tensor.copy_`` (``non_blocking`` into pinned buffers when computing on CUDA, then one stream synchronisation
before the CPU reads them). At stage 3 with ``offload_params="cpu"`` the sharded parameters themselves are the CPU
fp32 masters (``CPUOffloadPolicy``) and no copy is made. With ``offload_optimizer="nvme"`` the optimizer's
per-element states are swapped to disk by :mod:`lightning_zero.offload.optimizer_swapper`, and the fp32 masters
(stage 1: plain tensors; stages 2-3: DTensor copies of the FSDP2 shards) with them (the swapper then does the
gradient and parameter copies per sub-group, and the hooks below skip them). With ``offload_params`` the shards
themselves are the masters: parameter swapping (``offload_params="nvme"``) moves those.

[Note: what optimizer.step() runs]
:func:`shard_optimizer` leaves the user's ``optimizer.step()`` running these layers, outermost first; each is added
only when its setting asks for it, so a plain stage-2 Adam runs step 5 alone on CUDA (torch's optimizer over the
DTensor shards, as shipped) and step 4 around step 5 where it steps on the CPU (:mod:`.cpu_tuning`):

1. torch's step hooks, pre-hook :func:`_pre_step`: with the optimizer offloaded, copy this rank's gradients into
   the CPU masters' gradient buffers (stage 1 or ``offload_optimizer``);
2. ``offload_optimizer="nvme"``: the state swapper's step (:mod:`lightning_zero.offload.optimizer_swapper`), one
   sub-group at a time with its states (and masters) read from disk, calling the layers below per sub-group;
3. ``offload_params="nvme"``: the parameter swapper's step (:mod:`lightning_zero.offload.param_swapper`), one FSDP2
   unit at a time with its shards resident;
4. an optimizer stepping on the CPU, Adam, AdamW or SGD over DTensors: the local-shard step (:mod:`.local_step`),
   which hands torch's own step the local tensors;
5. the optimizer class's own ``step`` (torch's, with the user's ``foreach``/``fused`` choice; on the CPU an
   Adam/AdamW that left it to torch steps its fp32 groups with ``fused=True``, set for the step by pre/post-hooks
   after those of layers 1 and 6: :mod:`lightning_zero.ops.cpu_fused`);
6. torch's step hooks, post-hook :func:`_post_step`: copy the masters back into the module's parameters,
   broadcast each stage-1 parameter from the rank that stepped it, drop gradients the optimizer does not hold.

Layers 2-4 (and, where the groups hold less than the module's parameters, a class on top of them whose step is
the class's own and whose ``zero_grad`` clears the module's other gradients) replace the optimizer's class by a
generated subclass (:mod:`lightning_zero.ops.step_override`, which keeps its name, identity and LR schedulers'
wrappers) and are undone in reverse order by :meth:`OptimizerSharding.remove`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.diagnostics.timing import collective_timer
from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.distributed.cpu_tuning import tune_optimizer
from lightning_zero.distributed.local_step import restore_step, wrap_like
from lightning_zero.distributed.owner_broadcast import BroadcastPlan, broadcast_from_owners, plan_broadcast
from lightning_zero.offload.optimizer_swapper import OptimizerStateSwapper, attach_swapper, detach_swapper
from lightning_zero.offload.param_swapper import attach_param_step, detach_param_step, find_param_swapper
from lightning_zero.ops.step_override import override_step, restore_step_override
from lightning_zero.torch_compat import local_tensor

_ATTR = "_lightning_zero_sharding"


def partition_by_size(sizes: list[int], world_size: int) -> list[int]:
    """Assign items to ranks, largest first, each to the currently lightest rank. Returns the owner of each item.

    Deterministic, so every rank computes the same assignment without communicating.
    """
    loads = [0] * world_size
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


@dataclass
class OptimizerSharding:
    """What :func:`shard_optimizer` did to an optimizer; reachable as :func:`get_sharding` (optimizer)."""

    config: ZeroConfig
    model_params: list[list[Tensor]]  # per group, every module parameter, in the user's order
    owners: list[list[int]]  # per group, the rank that steps each parameter (-1: every rank)
    masters: dict[int, Tensor] = field(default_factory=dict)  # id(model param) -> CPU master (optimizer offload)
    master_grads: dict[int, Tensor] = field(default_factory=dict)  # id(model param) -> the master's grad buffer
    rank: int = 0
    group: Optional[object] = None
    hooks: list = field(default_factory=list)
    swapper: Optional[OptimizerStateSwapper] = None  # offload_optimizer="nvme": states swapped to disk
    param_step_of: Optional[torch.optim.Optimizer] = None  # offload_params="nvme": steps unit by unit
    local_step_of: Optional[torch.optim.Optimizer] = None  # steps DTensor local shards (.local_step)
    zero_grad_of: Optional[torch.optim.Optimizer] = None  # zero_grad reaches the module's gradients too
    broadcast_plan: Optional[BroadcastPlan] = None  # stage 1's buckets, made when the optimizer is sharded
    not_held: Optional[tuple] = None  # (groups' identity and sizes, module params the optimizer does not hold)
    beside_replicas: bool = False  # the masters are fp32 values of bf16 replicas on the compute device (.replicas)
    masters_elsewhere: set[int] = field(default_factory=set)  # id(model param) whose owner (another rank) has one
    released: bool = False  # remove() ran: the hooks are gone, the groups keep what sharding made of them

    def all_model_params(self) -> list[Tensor]:
        return [p for params in self.model_params for p in params]

    def owned_model_params(self) -> list[Tensor]:
        return [
            p
            for params, owners in zip(self.model_params, self.owners)
            for p, owner in zip(params, owners)
            if owner in (-1, self.rank)
        ]

    def sync_masters(self, params: Optional[list[Tensor]] = None, sources: Optional[dict[int, Tensor]] = None) -> None:
        """After the module's parameters were loaded, the masters take their values: the optimizer steps the
        masters, so stale ones would undo the load at the next step. ``params``: only these module parameters
        (those without a master here are skipped); default every owned one. ``sources``: ``{id(param): the value
        loaded into it}``, copied where it is a plain tensor of the master's shape and dtype.

        [Note: a master more precise than its parameter keeps what the parameter cannot hold]
        Under ``bf16-true`` a parameter is its master rounded. Without the loaded value itself, each element of the
        master is kept where its rounding equals the parameter (a checkpoint loaded its fp32 value into the master
        first: :func:`lightning_zero.checkpoint.states.module_state_dict`) and replaced by the parameter's value
        where they differ (the parameter was loaded from elsewhere)."""
        chosen = [p for p in (self.owned_model_params() if params is None else params) if id(p) in self.masters]
        if not chosen:
            return
        if self.swapper is not None:
            self.swapper.make_resident()  # swapped-out masters are empty: read them back, the next step writes them
        with torch.no_grad():
            for param in chosen:
                master, value = local_tensor(self.masters[id(param)]), local_tensor(param.detach())
                source = (sources or {}).get(id(param))
                if (
                    isinstance(source, Tensor)
                    and not hasattr(source, "to_local")
                    and source.shape == master.shape
                    and source.dtype == master.dtype
                ):
                    master.copy_(source.detach())
                    continue
                if master.dtype != value.dtype:
                    value = torch.where(master.to(value.dtype) == value, master, value.to(master.dtype))
                master.copy_(value)

    def follow_module_loads(self, module: torch.nn.Module) -> None:
        """Make the masters follow every ``load_state_dict`` into ``module`` or any of its submodules (a user's
        ``model.load_state_dict(base_weights)`` after setup, as LitGPT's fine-tuning does); without it the next
        step would put the old weights back. On each submodule that directly holds parameters with a master, a
        pre-hook notes which of them the state dict holds and a post-hook syncs just those: a partial load
        (``strict=False``) leaves the other masters alone, which matters where they are more precise than their
        parameters (``bf16-true``). Removed by :meth:`remove`. Also records this sharding as one holding masters of
        ``module``'s parameters (:func:`master_holders`)."""
        if self.masters or self.masters_elsewhere:
            _register_holder(module, self)
        if not self.masters:
            return
        for sub in module.modules():
            own = {name: p for name, p in sub.named_parameters(recurse=False) if id(p) in self.masters}
            if own:
                self.hooks.extend(self._follow_loads_of(sub, own))

    def _follow_loads_of(self, sub: torch.nn.Module, own: dict[str, Tensor]) -> list:
        loaded: list[Tensor] = []

        sources: dict[int, Tensor] = {}

        def note(_module, state_dict, prefix, *args) -> None:
            loaded[:] = [param for name, param in own.items() if prefix + name in state_dict]
            sources.update(
                {id(param): state_dict[prefix + name] for name, param in own.items() if prefix + name in state_dict}
            )

        def sync(_module, _incompatible_keys) -> None:
            self.sync_masters(loaded, sources)
            loaded.clear()
            sources.clear()

        return [sub.register_load_state_dict_pre_hook(note), sub.register_load_state_dict_post_hook(sync)]

    def swaps_masters(self) -> bool:
        """The masters live on NVMe and the swapper copies gradients and parameters per sub-group."""
        return self.swapper is not None and bool(self.swapper.companions)

    def remove(self) -> None:
        """Remove the step hooks and stop swapping (states back in memory, swap files removed); the optimizer
        steps through torch's DTensor path again."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        if self.zero_grad_of is not None:  # first: the override applied last
            restore_step_override(self.zero_grad_of, _ZERO_GRAD_MARK)
            self.zero_grad_of = None
        if self.swapper is not None:
            detach_swapper(self.swapper.optimizer)
            self.swapper = None
        if self.param_step_of is not None:  # after the state swapper, which steps through it
            detach_param_step(self.param_step_of)
            self.param_step_of = None
        if self.local_step_of is not None:  # last: the swappers' classes derive from the local-step class
            restore_step(self.local_step_of)
            self.local_step_of = None
        # The buckets live on in the parameters that are still their views; one moved since (Lightning's teardown
        # moves the module to the CPU) must not be kept on its old device by the plan.
        self.broadcast_plan = None
        self.released = True

    def narrowed_groups(self) -> bool:
        """Whether sharding changed what the optimizer's groups hold (stage 1: this rank's partition; offload or
        bf16 replicas: the masters in the parameters' place), so it steps correctly only with its hooks."""
        return self.config.stage == 1 or bool(self.masters) or bool(self.masters_elsewhere)


def get_sharding(optimizer: torch.optim.Optimizer) -> Optional[OptimizerSharding]:
    return getattr(optimizer, _ATTR, None)


# module -> the shardings holding masters of its parameters: a weak table, not a module attribute, so that pickling
# the module (torch.save(model), spawn) never carries optimizers along
_HOLDERS: "weakref.WeakKeyDictionary[torch.nn.Module, list[OptimizerSharding]]" = weakref.WeakKeyDictionary()


def _register_holder(module: torch.nn.Module, sharding: OptimizerSharding) -> None:
    """Record ``sharding`` for ``module``, forgetting those of earlier runs (removed: their hooks are gone) so that a
    new fit's masters are the only ones found; the current run's stay found after its teardown (a checkpoint saved
    after ``fit`` returns holds the masters)."""
    live = [s for s in _HOLDERS.get(module, []) if s.hooks and s is not sharding]
    _HOLDERS[module] = [*live, sharding]


def master_holders(module: torch.nn.Module) -> list[OptimizerSharding]:
    """The shardings holding fp32 masters of ``module``'s parameters (of it or any submodule), so that a checkpoint
    saved or loaded without its optimizers still reads and writes the masters (``fabric.load(path, {"model": m})``,
    an evaluation's ``ckpt_path``, ``fabric.load_raw``)."""
    found: list[OptimizerSharding] = []
    for sub in module.modules():
        found.extend(s for s in _HOLDERS.get(sub, ()) if all(s is not f for f in found))
    return found


def shard_optimizer(
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    *,
    group=None,
    device: Optional[torch.device] = None,
    fp32_values: Optional[dict[int, Tensor]] = None,
) -> OptimizerSharding:
    """Partition (stage 1) and/or offload (``config.offloads_optimizer_only``: CPU masters) ``optimizer`` in place;
    see the module note. ``fp32_values``: the fp32 values of bf16 replicas
    (:func:`~lightning_zero.distributed.replicas.keep_fp32_values`); those of the parameters this rank steps become
    its masters, and every entry of this optimizer's parameters is removed from the dict.

    Must be called on a fresh optimizer (no state yet), after the model was wrapped by
    :func:`~lightning_zero.distributed.apply_zero.apply_zero`. Calling it twice is an error.
    """
    if get_sharding(optimizer) is not None:
        raise RuntimeError("shard_optimizer was already applied to this optimizer")
    constructor_states = len(optimizer.state) > 0
    if constructor_states:
        if not only_constructor_states(optimizer):
            raise RuntimeError(
                "shard_optimizer needs a fresh optimizer: this one already has state. Create the "
                "optimizer after the model is wrapped, and load its state after sharding."
            )
        optimizer.state.clear()
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    model_params = [list(g["params"]) for g in optimizer.param_groups]
    if config.stage == 1:
        owners = [partition_by_size([p.numel() for p in params], world) for params in model_params]
    else:
        owners = [[-1] * len(params) for params in model_params]
    sharding = OptimizerSharding(config, model_params, owners, rank=rank, group=group)
    offload_here = config.offloads_optimizer_only
    replicas = fp32_values is not None
    sharding.beside_replicas = replicas and not offload_here
    # The masters (stage 1: plain tensors; stages 2-3: DTensors over the FSDP2 shards) are swapped with the states.
    swap_masters = offload_here and config.swaps_optimizer_states
    pin = bool(config.pin_memory if config.pin_memory is not None else (device is not None and device.type == "cuda"))
    if pin and not torch.cuda.is_available():
        raise ValueError("pin_memory=True needs CUDA; this run has no CUDA device")
    for group_dict, params, group_owners in zip(optimizer.param_groups, model_params, owners):
        kept = []
        for param, owner in zip(params, group_owners):
            value = _fp32_value(param, fp32_values, owner in (-1, rank)) if replicas else None
            if owner not in (-1, rank):
                if offload_here or value is not None:
                    sharding.masters_elsewhere.add(id(param))
                continue
            master = _make_master(param, value, offload_here, swap_masters, pin)
            if master is not None:
                sharding.masters[id(param)] = master
            kept.append(param if master is None else master)
        group_dict["params"] = kept
    if constructor_states and not config.swaps_optimizer_states:  # swapped: made per sub-group, by the step
        _make_constructor_states(optimizer)
    if config.stage == 1 or sharding.masters:
        sharding.hooks.append(optimizer.register_step_pre_hook(_pre_step))
        sharding.hooks.append(optimizer.register_step_post_hook(_post_step))
    # Only where it steps on the CPU (cpu_tuning.py): the fused kernel's hooks after _pre_step, so the CPU masters
    # have their gradients when it decides (the NVMe swappers narrow these same group dicts, so their resident
    # tensors step with its flag too). [Note: the local step under NVMe swapping] The local step first, the
    # innermost step: the swappers narrow ``param_groups`` to a sub-group (and a unit) with its states and masters
    # resident, then call the class step they derive from, which steps exactly those on their local shards.
    fused, local_step = tune_optimizer(optimizer, device)
    if fused is not None:
        sharding.hooks.append(fused)  # its remove() also puts the flags back
    if local_step:
        sharding.local_step_of = optimizer
    _attach_nvme_swapping(optimizer, sharding, config, rank=rank, pin=pin, swap_masters=swap_masters)
    setattr(optimizer, _ATTR, sharding)
    if sharding.narrowed_groups():  # last: see [Note: zero_grad reaches the module's gradients]
        override_step(optimizer, _same_step, marker=_ZERO_GRAD_MARK, extra={"zero_grad": _zero_grad_of(optimizer)})
        sharding.zero_grad_of = optimizer
    if config.stage == 1:
        plan_broadcast(sharding)  # before the gradients and states exist: see the note in broadcast_from_owners
    return sharding


def _attach_nvme_swapping(
    optimizer: torch.optim.Optimizer,
    sharding: OptimizerSharding,
    config: ZeroConfig,
    *,
    rank: int,
    pin: bool,
    swap_masters: bool,
) -> None:
    """NVMe swapping around ``optimizer``'s step: the parameter swapper's unit-by-unit step (``offload_params``),
    then the optimizer-state swapper (``offload_optimizer``), with the masters it swaps beside the states."""
    if config.swaps_parameters:
        # Before the state swapper: it steps each of its sub-groups through this unit-by-unit step.
        param_swapper = find_param_swapper(sharding.all_model_params())
        if param_swapper is None:
            raise RuntimeError(
                "offload_params='nvme' needs the module sharded by apply_zero (stage 3) before its "
                "optimizer is sharded: no parameter swapper holds this optimizer's parameters"
            )
        attach_param_step(optimizer, param_swapper)
        sharding.param_step_of = optimizer
    if config.swaps_optimizer_states:
        # After the hooks: the swapped step runs inside torch's hook wrapper, so they still run once per step.
        companions = {
            id(master): p
            for p in sharding.owned_model_params()
            if swap_masters and (master := sharding.masters.get(id(p))) is not None
        }
        sharding.swapper = attach_swapper(optimizer, config.nvme, rank=rank, pin_memory=pin, masters=companions)


def only_constructor_states(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every state is one an optimizer's constructor made before any step (each with a ``step`` of 0).

    torch's Adagrad creates its states in ``Adagrad.__init__`` (``torch/optim/adagrad.py``); kept, they would be keyed
    by parameters this rank does not step (stage 1), that offload replaces by CPU masters or that sharding replaced,
    so :func:`shard_optimizer` drops them and makes them again for what the groups hold
    (:func:`_make_constructor_states`). A state a step or a loaded state dict left is refused by the caller."""
    for state in optimizer.state.values():
        step = state.get("step")
        if step is None or float(step) != 0:
            return False
    return True


def _make_constructor_states(optimizer: torch.optim.Optimizer) -> None:
    """Make the states the optimizer's constructor made (:func:`only_constructor_states`) again, for the tensors its
    groups hold now, by building a throwaway optimizer of its class over them with its defaults. torch 2.11's
    Adagrad needs them: its ``_init_group`` (``torch/optim/adagrad.py``) reads ``state["sum"]`` without making it,
    where torch 2.13 and 2.14 (read there; 2.12 was not) make a missing one. A class whose constructor does not
    take its ``defaults`` back as keywords is left to make its states in its step, as before; so are states swapped
    to NVMe (the swapped masters are empty placeholders here, and the swapper holds one sub-group's states at a
    time)."""
    groups = [dict(group) for group in optimizer.param_groups]
    try:
        fresh = type(optimizer)(groups, **optimizer.defaults)
    except TypeError:
        return
    optimizer.state.update(fresh.state)


def _pre_step(optimizer, args, kwargs) -> None:
    sharding = get_sharding(optimizer)
    if not sharding.masters:
        return
    # torch passes the optimizer itself as args[0]; anything after it is a positional closure.
    if len(args) > 1 or kwargs.get("closure") is not None:
        raise RuntimeError(
            "With offload the optimizer steps CPU masters, so gradients must exist before step(): "
            "run the closure first and call step() without one."
        )
    if sharding.swaps_masters():
        return  # the swapper copies each sub-group's gradients into its masters
    if sharding.beside_replicas:
        _upcast_replica_grads(optimizer, sharding)
        return
    pinned = False
    with torch.no_grad():
        for param in sharding.owned_model_params():
            master = sharding.masters[id(param)]
            if param.grad is None:
                master.grad = None
                continue
            # One grad buffer per master for the whole run: zero_grad(set_to_none) drops .grad, not the buffer.
            buffer = sharding.master_grads.get(id(param))
            if buffer is None:
                buffer = sharding.master_grads[id(param)] = _cpu_like(master, local_tensor(master).is_pinned())
            pinned = pinned or local_tensor(buffer).is_pinned()
            local_tensor(buffer).copy_(local_tensor(param.grad), non_blocking=local_tensor(buffer).is_pinned())
            master.grad = buffer
    if pinned:  # device-to-host copies into pinned memory are asynchronous: finish them before the CPU step
        torch.cuda.current_stream().synchronize()


def _make_master(param: Tensor, value: Optional[Tensor], offload: bool, swap: bool, pin: bool) -> Optional[Tensor]:
    """The tensor the optimizer steps for ``param`` in its place, or ``None`` (it steps ``param`` itself): a CPU fp32
    copy with the optimizer offloaded (an empty placeholder when the swapper keeps the masters on disk: it writes
    them sub-group by sub-group, never all resident at once), else the fp32 ``value`` of a bf16 replica."""
    if offload:
        if swap:
            master = _empty_master(param)
        else:
            master = _cpu_like(param, pin)
            with torch.no_grad():
                local_tensor(master).copy_(local_tensor(param.detach() if value is None else value))
    elif value is not None:
        master = value  # on the compute device (.replicas)
    else:
        return None
    return master.requires_grad_(param.requires_grad)


def _fp32_value(param: Tensor, fp32_values: dict[int, Tensor], owned: bool) -> Optional[Tensor]:
    """The fp32 value of a bf16 replica (removed from ``fp32_values``: kept only where this rank steps it); one that
    step 3 did not record (an optimizer built after the others took theirs) starts from the replica's value, so
    that it is still stepped in fp32 (not owned: the replica, only telling that its owner keeps a master). ``None``
    for a parameter that is not a low-precision replica."""
    value = fp32_values.pop(id(param), None)
    if value is None and param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
        value = param.detach().float() if owned else param.detach()
    return value


def _upcast_replica_grads(optimizer, sharding: OptimizerSharding) -> None:
    """Step 3 of the replicas note: each owned bf16 gradient upcast into its master's gradient (a fresh fp32 tensor,
    freed after the step as DeepSpeed frees its fp32 gradient partition), then every bf16 gradient dropped, before
    the optimizer's states are touched (the step's peak)."""
    with torch.no_grad():
        for param in sharding.owned_model_params():
            master = sharding.masters.get(id(param))
            if master is not None:  # a parameter that was low precision already is stepped itself
                master.grad = None if param.grad is None else param.grad.float()
                param.grad = None
        for param in _not_held(optimizer, sharding):
            param.grad = None


def _post_step(optimizer, args, kwargs) -> None:
    sharding = get_sharding(optimizer)
    with torch.no_grad():
        if sharding.masters and not sharding.swaps_masters():  # swapped: copied back per sub-group
            for param in sharding.owned_model_params():
                master = sharding.masters.get(id(param))
                if master is None:
                    continue
                local_tensor(param).copy_(local_tensor(master), non_blocking=True)
                if sharding.beside_replicas:
                    master.grad = None
            if any(local_tensor(m).is_pinned() for m in sharding.masters.values()):
                torch.cuda.current_stream().synchronize()
        with collective_timer().record("zero1_parameter_broadcast"):
            broadcast_from_owners(sharding)
    # The optimizer's zero_grad only reaches what it holds; the module's other gradients are dead after the step.
    for param in _not_held(optimizer, sharding):
        param.grad = None


def _not_held(optimizer, sharding: OptimizerSharding) -> list[Tensor]:
    """The module parameters ``optimizer`` does not hold, remembered for as long as its groups keep their identity
    and lengths (a group added or a list replaced is seen, and the list recomputed), so a step does not rebuild a
    set of every parameter."""
    key = tuple((id(g), id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
    if sharding.not_held is None or sharding.not_held[0] != key:
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        sharding.not_held = (key, [p for p in sharding.all_model_params() if id(p) not in held])
    return sharding.not_held[1]


_ZERO_GRAD_MARK = "zero_grad of the module's gradients"


def _same_step(optimizer, base_step, closure):
    return base_step(optimizer) if closure is None else base_step(optimizer, closure)


def _zero_grad_of(optimizer) -> Callable:
    """[Note: zero_grad reaches the module's gradients]
    Where the groups hold less than the module's parameters (stage 1: this rank's partition; offload or bf16
    replicas: the masters), torch's ``zero_grad`` clears only what they hold. The step drops the rest (``_post_step``),
    but a backward not followed by this optimizer's step leaves its gradients on the other ranks' parameters (or on
    the module's, beside the masters): the generator's loss of a GAN flowing through the discriminator, a
    discriminator stepped every other batch. The next backward adds to them, and DDP's average hands the owner a
    gradient no DDP run has. So ``zero_grad`` clears those too, as it clears every parameter under DDP. It is a
    method of the optimizer's class (generated by :func:`~lightning_zero.ops.step_override.override_step`, whose
    step is the class's own), so the wrappers Lightning and Fabric build over the optimizer's class reach it
    (Lightning's ``Strategy.setup_precision_plugin`` builds its ``LightningOptimizer`` wrappers again after the
    optimizers were set up, Fabric wraps what ``setup_optimizer`` returns); ``self`` may be such a wrapper."""
    below = type(optimizer).zero_grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        below(self, set_to_none)
        sharding = get_sharding(self)
        if sharding is None or sharding.released:
            return
        for param in _not_held(self, sharding):
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
                continue
            grad = param.grad.detach_() if param.grad.grad_fn is not None else param.grad.requires_grad_(False)
            grad.zero_()

    return zero_grad


def _cpu_like(tensor: Tensor, pin: bool) -> Tensor:
    """An uninitialised CPU tensor for ``tensor``'s local part, at least fp32 (the master precision), wrapped as a
    DTensor with the same mesh, placements and global shape when ``tensor`` is one (FSDP2's uneven last shard
    included)."""
    local = local_tensor(tensor)
    return wrap_like(
        torch.empty(local.shape, dtype=torch.promote_types(local.dtype, torch.float32), device="cpu", pin_memory=pin),
        tensor,
    )


def _empty_master(param: Tensor) -> Tensor:
    """A placeholder fp32 master for ``param`` that holds no memory (an empty local tensor; a DTensor with
    ``param``'s mesh, placements and global shape when ``param`` is one): the NVMe swapper fills it."""
    return wrap_like(torch.empty(0, dtype=torch.float32, device="cpu"), param)
