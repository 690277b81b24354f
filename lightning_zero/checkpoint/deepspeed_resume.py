"""A DeepSpeed ZeRO checkpoint directory (stages 1-3) read as a full checkpoint, so that ``fit(ckpt_path=DIR)``
carries on a run that ``DeepSpeedStrategy`` (or ``DeepSpeedEngine.save_checkpoint``) saved, at any stage and world
size: :class:`DeepSpeedCheckpoint` has :class:`~lightning_zero.checkpoint.full_file.FullCheckpoint`'s interface, and
:mod:`lightning_zero.checkpoint.load_full` loads it as it loads one file, each rank reading only its slices.

What comes from where (the layout: :mod:`lightning_zero.checkpoint.deepspeed_reader`):

* weights: the fp32 masters of the trainable parameters (the exact values DeepSpeed steps; the module's 16-bit copy
  is a rounding of them), buffers and frozen parameters from the model file;
* optimizer states: DeepSpeed wraps the torch optimizer and steps one flat tensor per flat group, so each
  parameter's ``exp_avg``/``exp_avg_sq``/... is its range of the ranks' flat states, read as a
  :class:`~lightning_zero.checkpoint.full_file.RangeTensor` (the padding of the saving world size never read), and
  its ``step`` is the flat tensor's. Param-group hyper-parameters (``lr``, ``betas``, ...) are restored as
  ``Optimizer.load_state_dict`` restores them;
* Lightning's loops, epoch, global step, callbacks, LR schedulers and hyper-parameters: the client state Lightning
  passed to ``save_checkpoint`` (:meth:`DeepSpeedCheckpoint.rest`);
* the fp16 loss scaler's state, when DeepSpeed trained in fp16 (:meth:`DeepSpeedCheckpoint.loss_scaler_state`).

[Note: refused by name]
The optimizer being resumed must be DeepSpeed's in structure: one optimizer, as many param groups, each with the
same trainable parameters (by name; their order within a group is free, as DeepSpeed may reorder them), the same
state keys (another optimizer type's are refused by :func:`~lightning_zero.checkpoint.full_file.
check_full_optimizer_states`) and, for torch's Adam family, the same ``decoupled_weight_decay`` (Adam vs AdamW).
A hyper-parameter of the checkpoint the optimizer does not have is warned about by name, not dropped silently.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from lightning_zero.checkpoint.deepspeed_reader import DeepSpeedTensorSource, Slot, public_name
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.full_file import OptimizerTarget, RangeTensor

LOSS_SCALER_KEY = "deepspeed_loss_scaler"  # in :meth:`DeepSpeedCheckpoint.rest`: the fp16 scaler's state, if any
_SCHEDULER_KEYS = {"initial_lr"}  # added to a group by torch's LR schedulers; restored like the others


class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint as a full checkpoint: ``state_keys``, :meth:`shape`, :meth:`read`,
    :meth:`extras`, :attr:`optimizer_states` (after :meth:`align_to`), :meth:`rest`, :meth:`close`."""

    def __init__(self, path: str) -> None:
        self._source = DeepSpeedTensorSource(path)
        self.files = self._source.files
        self.path = self.files.path
        self._entries = {entry.key: entry for entry in self._source.entries}
        self.state_keys = list(self._entries)
        self._flat_states = [_flat_group_states(self.files, rank) for rank in range(self.files.world_size)]
        self._engine_name = {public_name(name): name for name in self.files.slots}  # trainable parameters
        self._groups = _param_groups(self.files)
        self.optimizer_states: Optional[List[dict]] = [
            self._optimizer_state(
                [names for _, names in self._groups], [dict(hyper or {}) for hyper, _ in self._groups]
            )
        ]

    def shape(self, key: str) -> Tuple[int, ...]:
        return self._entries[key].shape

    def read(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        entry = self._entries[key]
        return RangeTensor(
            entry.shape, entry.dtype, lambda start, length: self._source.read_range(key, start, length)
        ).rect(offsets, sizes)

    def extras(self) -> Dict[str, Any]:
        return self._source.extras()

    def rest(self) -> Dict[str, Any]:
        """The client state (for Lightning: loops, epoch, global_step, callbacks, lr_schedulers, ...), and the fp16
        loss scaler's state under :data:`LOSS_SCALER_KEY` when there is one."""
        rest = dict(self.files.client_state())
        scaler = self.loss_scaler_state()
        if scaler is not None:
            rest[LOSS_SCALER_KEY] = scaler
        return rest

    def loss_scaler_state(self) -> Optional[dict]:
        """The fp16 loss scaler's state as :mod:`lightning_zero.ops.loss_scaler` keeps it, or ``None`` when
        DeepSpeed did not train in fp16 (its bf16/fp32 runs keep an inert scaler of scale 1)."""
        model = self.files.model_states[0]
        if not ((model.get("ds_config") or {}).get("fp16") or {}).get("enabled"):
            return None
        scaler = self.files.optimizer[0].get("loss_scaler")
        state = getattr(scaler, "state", None) or {}
        skipped = int(model.get("skipped_steps") or 0)
        if type(scaler).__name__ == "DynamicLossScaler":
            return {
                "kind": "dynamic",
                "cur_scale": float(state["cur_scale"]),
                "cur_iter": int(state["cur_iter"]),
                "last_overflow_iter": int(state["last_overflow_iter"]),
                "cur_hysteresis": int(state["cur_hysteresis"]),
                "skipped_steps": skipped,
            }
        return {
            "kind": "static",
            "cur_scale": float(state.get("cur_scale", 1.0)),
            "cur_iter": int(model.get("global_steps") or 0),
            "skipped_steps": skipped,
        }

    def align_to(self, targets: List[OptimizerTarget]) -> None:
        """Check the optimizers being resumed against DeepSpeed's (see the refusal note) and list the states in
        their groups' order, so that :func:`~lightning_zero.checkpoint.full_file.check_full_optimizer_states` and
        :func:`~lightning_zero.checkpoint.full_file.apply_full_optimizer_states` load them."""
        if len(targets) != 1:
            raise CheckpointError(
                f"{self.path}: a DeepSpeed checkpoint holds the states of one optimizer, the model "
                f"being resumed has {len(targets)}",
                self.path,
            )
        target = targets[0]
        if len(target.names) != len(self._groups):
            raise CheckpointError(
                f"{self.path}: DeepSpeed's optimizer has {len(self._groups)} param group(s), the "
                f"optimizer being resumed has {len(target.names)}: configure_optimizers must build "
                "the same groups",
                self.path,
            )
        hypers = []
        for number, ((hyper, names), ours, params, group) in enumerate(
            zip(self._groups, target.names, target.params, target.optimizer.param_groups)
        ):
            self._check_group(number, names, ours, params)
            hypers.append(self._hyperparameters(number, hyper, group, target.optimizer))
        self.optimizer_states = [self._optimizer_state(target.names, hypers)]

    def _check_group(self, number: int, names: List[str], ours: List[str], params: List[torch.Tensor]) -> None:
        theirs, mine = set(names), set(ours)
        # DeepSpeed leaves frozen parameters out of its groups; a group may still list them
        trainable = {name for name, param in zip(ours, params) if param.requires_grad}
        missing, extra = [n for n in names if n not in mine], sorted(trainable - theirs)
        if missing or extra:
            parts = ([f"only in the checkpoint: {missing}"] if missing else []) + (
                [f"only in the optimizer being resumed: {extra}"] if extra else []
            )
            raise CheckpointError(
                f"{self.path}: param group {number} differs from DeepSpeed's: {'; '.join(parts)}. "
                "configure_optimizers must put the same parameters in each group",
                self.path,
            )

    def _hyperparameters(self, number: int, hyper: Optional[dict], group: dict, optimizer: Any) -> dict:
        """The group's saved hyper-parameters this optimizer has (the others warned about by name)."""
        kind = type(optimizer).__name__
        if hyper is None:
            warnings.warn(
                f"{self.path} is an elastic DeepSpeed checkpoint (elastic_checkpoint=true), which holds no "
                f"param-group hyper-parameters: group {number} keeps those configure_optimizers gave it "
                "(lr, betas, ...), as under DeepSpeed's own load; the LR schedulers' states are restored"
            )
            return {}
        saved, own = hyper.get("decoupled_weight_decay"), group.get("decoupled_weight_decay")
        if saved is not None and own is not None and bool(saved) != bool(own):
            raise CheckpointError(
                f"{self.path}: param group {number} was stepped with decoupled_weight_decay={saved} (torch's "
                f"{'AdamW' if saved else 'Adam'}), the optimizer being resumed ({kind}) uses {own}: "
                "configure_optimizers must build the same optimizer type",
                self.path,
            )
        unknown = sorted(set(hyper) - set(group) - _SCHEDULER_KEYS)
        if unknown:
            warnings.warn(
                f"{self.path}: param group {number} of DeepSpeed's optimizer has the hyper-parameters "
                f"{unknown}, which {kind} does not have: not restored"
            )
        return {key: value for key, value in hyper.items() if key in group or key in _SCHEDULER_KEYS}

    def _optimizer_state(self, groups: List[List[str]], hypers: List[dict]) -> dict:
        state = {}
        for names in groups:
            for name in names:
                if name in self._engine_name and (values := self._parameter_state(name)) is not None:
                    state[name] = values
        return {
            "state": state,
            "param_groups": [{**hyper, "params": list(names)} for hyper, names in zip(hypers, groups)],
        }

    def _parameter_state(self, name: str) -> Optional[dict]:
        """``name``'s optimizer state: its range of every flat state, the flat group's scalars (``step``)."""
        slot = self.files.slots[self._engine_name[name]]
        per_rank = [states[slot.group] for states in self._flat_states]
        if per_rank[0] is None:
            return None  # the flat group was never stepped
        shape = self.files.shapes[self._engine_name[name]]
        values: Dict[str, Any] = {}
        for key, value in per_rank[0].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                pieces = [states[key].reshape(-1) for states in per_rank]
                values[key] = RangeTensor(shape, value.dtype, _range_reader(slot, pieces))
            elif key == "step":  # torch keeps a float32 tensor; DeepSpeed's own Adams a number
                values[key] = torch.tensor(float(value), dtype=torch.float32)
            else:
                values[key] = value
        return values

    def close(self) -> None:
        self._source.close()
        self._flat_states, self.optimizer_states = [], None


def _range_reader(slot: Slot, pieces: List[torch.Tensor]):
    return lambda start, length: slot.read(pieces, start, length)


def _base_optimizer(files: Any, rank: int) -> Tuple[List[Optional[dict]], List[Optional[dict]], List[int]]:
    """Rank ``rank``'s inner torch optimizer: its state per flat group (``None``: never stepped), the
    hyper-parameters of each param group (``None`` when not saved) and the param group of each flat group."""
    saved = files.optimizer[rank]
    if files.stage == 3:
        inner = saved["optimizer_state_dict"]
        flat_ids, owner = [], []
        for number, group in enumerate(inner["param_groups"]):
            flat_ids += list(group["params"])
            owner += [number] * len(group["params"])
        hypers = [{k: v for k, v in group.items() if k != "params"} for group in inner["param_groups"]]
        return [inner["state"].get(i) for i in flat_ids], hypers, owner
    base = saved["base_optimizer_state"]
    if isinstance(base, list):  # an elastic checkpoint: per group states without padding, the step beside them
        step = saved.get("base_optimizer_state_step")
        states = [dict(group, **({"step": step} if step is not None and "step" not in group else {})) for group in base]
        return states, [None] * len(states), list(range(len(states)))
    states = [base["state"].get(group["params"][0]) for group in base["param_groups"]]
    hypers = [{k: v for k, v in group.items() if k != "params"} for group in base["param_groups"]]
    return states, hypers, list(range(len(states)))


def _flat_group_states(files: Any, rank: int) -> List[Optional[dict]]:
    """Rank ``rank``'s optimizer state per flat group, each flat state checked to cover the rank's masters (plus
    the group's end padding, which rigid stage 1-2 checkpoints keep)."""
    states, hypers, owner = _base_optimizer(files, rank)
    if len(states) != len(files.fp32[rank]):
        raise CheckpointError(
            f"{files.path}: rank {rank} holds optimizer states for {len(states)} flat group(s) and "
            f"fp32 masters for {len(files.fp32[rank])}",
            files.path,
        )
    paddings = files.optimizer[rank].get("group_paddings") or [0] * len(states)
    checked = []
    for group, state in enumerate(states):
        if state is not None:
            state, hyper = dict(state), hypers[owner[group]] or {}
            if "step" not in state and "step" in hyper:
                state["step"] = hyper["step"]  # DeepSpeed's FusedAdam counted steps in its param groups
            masters = files.fp32[rank][group].numel()
            allowed = {masters, masters + (paddings[group] if files.stage != 3 else 0)}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() not in allowed:
                    raise CheckpointError(
                        f"{files.path}: rank {rank}'s optimizer state {key!r} of flat group "
                        f"{group} has {value.numel()} elements, its fp32 masters {masters}",
                        files.path,
                    )
        checked.append(state)
    return checked


def _param_groups(files: Any) -> List[Tuple[Optional[dict], List[str]]]:
    """DeepSpeed's param groups: each one's hyper-parameters (rank 0's; ``step`` moved into the states) and its
    trainable parameters' public names, in DeepSpeed's order."""
    _, hypers, owner = _base_optimizer(files, 0)
    names: List[List[str]] = [[] for _ in hypers]
    for name, slot in files.slots.items():
        names[owner[slot.group]].append(public_name(name))
    return [
        (None if hyper is None else {k: v for k, v in hyper.items() if k != "step"}, group_names)
        for hyper, group_names in zip(hypers, names)
    ]
