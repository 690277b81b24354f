"""FSDP2 units sized by bytes, small units left to the root, and explicit prefetch.

FSDP2 communicates once per unit: one all-gather of the unit's parameters (twice per step at stage 3: forward and
backward, except the root and the last unit, see ``apply_zero._kept_from_forward_to_backward``) and one reduce-scatter
of its gradients. Units that follow the model's repeated blocks make the number of collectives a property of the module
tree: a flat ``nn.Sequential`` of 24 small ``Linear`` layers pays 24 fixed collective costs where DeepSpeed, which
buckets by bytes, pays a few. :func:`plan_units` groups *consecutive* blocks
(siblings of one parent, in registration order, which is the execution order of a ``Sequential`` and of the usual
``for block in self.blocks`` loop) into one unit each until their parameters reach ``unit_bytes``; FSDP2 shards a
group with one ``fully_shard([block_a, block_b, ...])`` call (torch >= 2.6), one all-gather and one reduce-scatter
for all of them. Grouping changes no module, parameter name or placement (every parameter stays a ``Shard(0)``
DTensor over the same mesh), so state-dict keys and checkpoints do not depend on it.

``param_persistence_threshold`` (DeepSpeed's ``stage3_param_persistence_threshold``) leaves a unit whose parameters
number fewer elements than the threshold to the root unit: FSDP2 gathers the root's parameters once per step, in
its forward, and keeps them through backward (the root is never resharded after forward), so these parameters cost
no collective of their own and are never re-gathered in backward; their gradients are reduce-scattered (averaged)
with the root's and they are saved and loaded like every other parameter. Unlike DeepSpeed they stay sharded
between steps, which only saves memory.

``prefetch_bytes`` (DeepSpeed's ``stage3_prefetch_bucket_size``) makes each unit issue the all-gathers of the units
that run after it (forward) or before it (backward) until their bytes reach the budget, through FSDP2's
``set_modules_to_forward_prefetch``/``set_modules_to_backward_prefetch``. Without it FSDP2's own schedule applies
(it prefetches one unit ahead in backward). On CPU with gloo, FSDP2 issues all-gathers synchronously, so a prefetch
moves the collective earlier but overlaps nothing; the knob is for CUDA.

[Note: the default unit size]
``DEFAULT_UNIT_BYTES`` weighs step time against peak memory. Time: a unit costs a fixed amount per step beyond its
bytes (hooks, copy-in/out, its collectives), so fewer, larger units are faster, until messages grow past the size
where gloo's cost per byte rises again. Memory: at the peak of a step a unit's gathered parameters, unsharded
gradients and communication buffers are alive several times over, so the peak grows with the unit, and units too
large let ZeroStrategy train fewer blocks than DeepSpeed under the same memory cap. The default is the size that
keeps a good share of what grouping saves in step time while stage 2's capacity stays above DeepSpeed's. Blocks
larger than the target (a transformer block of a billion-parameter model) stay one unit each, exactly as without
grouping. The measurements behind the choice, the commands that repeat them, and the earlier defaults:
``docs/units.md``.

[Note: one unit for a model smaller than a unit]
At stage 2 a model whose parameters all fit in one unit (``unit_bytes``, ``DEFAULT_UNIT_BYTES`` by default) is one FSDP2
unit, the root, instead of its grouped blocks plus the root (``apply_zero.whole_model_is_one_unit``). Stage 2 keeps
every unit gathered from forward to backward, so a second unit saves no memory; it only adds its fixed cost per step
(hooks, one all-gather and one reduce-scatter), which on such a model is a share of the step a user sees (the bench
GPT's step times with one unit and with two: ``docs/units.md``). DeepSpeed's ZeRO-2 reduces such a model in one bucket
as well. Stage 3 keeps its units (each unit there is resharded after forward, which is what stage 3 is for), as do
``unit_bytes=0`` (one unit per block, asked for) and ``sharded_module_classes`` (the units the user named).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

log = logging.getLogger(__name__)

DEFAULT_UNIT_BYTES = 8 * 2**20  # see [Note: the default unit size]
DEFAULT_PARAM_PERSISTENCE_THRESHOLD = 0  # grouping already merges small blocks; see docs/units.md
# DeepSpeed counts its bucket sizes in elements; parameters at rest are fp32 (masters) unless the run is bf16-true.
DS_BUCKET_ELEMENT_BYTES = 4


def check_unit_knobs(stage: int, unit_bytes, param_persistence_threshold, prefetch_bytes) -> None:
    """Refuse a unit knob that is not a non-negative int, or one given at a stage without FSDP2 units (0-1)."""
    for name, value in (
        ("unit_bytes", unit_bytes),
        ("param_persistence_threshold", param_persistence_threshold),
        ("prefetch_bytes", prefetch_bytes),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if stage < 2:
            raise ValueError(
                f"{name}={value} sizes FSDP2 units, which only stages 2 and 3 have; stage {stage} runs "
                "DDP (its gradient bucket is bucket_cap_mb). Drop it or use stage=2/3."
            )


@dataclass
class UnitPlan:
    """What :func:`plan_units` decided: each group becomes one ``fully_shard`` call; ``persistent`` blocks are
    left to the root unit."""

    groups: list[list[nn.Module]] = field(default_factory=list)
    persistent: list[nn.Module] = field(default_factory=list)


def _param_stats(modules: list[nn.Module]) -> tuple[int, int]:
    """(bytes, elements) of the distinct parameters below ``modules`` (a shared parameter counts once)."""
    seen: set[int] = set()
    nbytes = numel = 0
    for module in modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                nbytes += param.numel() * param.element_size()
                numel += param.numel()
    return nbytes, numel


def param_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s distinct parameters (meta tensors included: a deferred build counts as built)."""
    return _param_stats([module])[0]


def plan_units(
    root: nn.Module, blocks: list[nn.Module], unit_bytes: int, param_persistence_threshold: int = 0
) -> UnitPlan:
    """Group ``blocks`` (the modules that would each be an FSDP unit) into units of about ``unit_bytes``.

    Only blocks that are consecutive children of the same parent are grouped: consecutive in that parent's
    registration order, with nothing between them but parameter-free modules (activations, dropout). A block that
    contains another block is never grouped (its nested blocks are units of their own, sharded first). A run's last
    group is merged into the one before it when it is under half the target, so runs do not end in a tiny unit.
    ``unit_bytes=0`` keeps one unit per block. Groups (single blocks included) with fewer than
    ``param_persistence_threshold`` parameter elements are left to the root (see the module docstring).
    """
    block_ids = {id(b) for b in blocks}
    nests = {id(b) for b in blocks if any(id(m) in block_ids for m in b.modules() if m is not b)}
    groups: list[list[nn.Module]] = [[b] for b in blocks if id(b) in nests]
    if unit_bytes <= 0:
        groups = [[b] for b in blocks]
    else:
        placed: set[int] = set()
        for parent in root.modules():
            run: list[nn.Module] = []
            for child in parent.children():
                if id(child) in block_ids and id(child) not in nests and id(child) not in placed:
                    placed.add(id(child))  # a block registered under two parents is grouped once
                    run.append(child)
                elif any(True for _ in child.parameters()) or id(child) in block_ids:
                    groups.extend(_split_run(run, unit_bytes))
                    run = []
            groups.extend(_split_run(run, unit_bytes))
    plan = UnitPlan()
    for group in groups:
        if param_persistence_threshold and _param_stats(group)[1] < param_persistence_threshold:
            plan.persistent.extend(group)
        else:
            plan.groups.append(group)
    planned = sum(len(g) for g in groups)
    if planned != len(blocks):  # every block is in exactly one group: a miss would leave it to the root silently
        raise RuntimeError(f"plan_units grouped {planned} of {len(blocks)} blocks; this is a bug")
    return plan


def _split_run(run: list[nn.Module], unit_bytes: int) -> list[list[nn.Module]]:
    groups: list[list[nn.Module]] = []
    current: list[nn.Module] = []
    size = 0
    for block in run:
        current.append(block)
        size += _param_stats([block])[0]
        if size >= unit_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        if groups and size < unit_bytes / 2:
            groups[-1].extend(current)
        else:
            groups.append(current)
    return groups


def set_prefetch(groups: list[list[nn.Module]], prefetch_bytes: int) -> None:
    """Make each FSDP2 unit (``groups`` as sharded by ``fully_shard``, in forward order) prefetch the units after it
    in forward and before it in backward until their parameter bytes reach ``prefetch_bytes`` (at least one unit).
    """
    units = [group[0] for group in groups]  # the modules of one group share one FSDP2 state
    # DTensor shards: numel() and element_size() are the full (unsharded) parameter's
    sizes = [_param_stats(group)[0] for group in groups]

    def ahead(order: list[int]) -> dict[int, list[nn.Module]]:
        chosen: dict[int, list[nn.Module]] = {}
        for pos, index in enumerate(order):
            picked, total = [], 0
            for nxt in order[pos + 1 :]:
                if picked and total >= prefetch_bytes:
                    break
                picked.append(units[nxt])
                total += sizes[nxt]
            chosen[index] = picked
        return chosen

    forward = ahead(list(range(len(units))))
    backward = ahead(list(reversed(range(len(units)))))
    for index, unit in enumerate(units):
        if forward[index]:
            unit.set_modules_to_forward_prefetch(forward[index])
        if backward[index]:
            unit.set_modules_to_backward_prefetch(backward[index])
