"""The memory ladder of ``lightning-zero advise``: the configurations to try, fastest first, and what each needs.

The order follows the usual DeepSpeed advice (``docs/memory.md``): start from plain data parallelism, enable
activation checkpointing, move to ZeRO-2, offload the optimizer, ZeRO-3, offload its optimizer, then its parameters
too, keep the checkpointed activations in CPU memory, shrink the micro-batch, and finally NVMe. Each step saves
memory and, as a rule, costs speed, so the first rung that fits is the predicted winner. The rest of the grid (stage
0-3 x offload x
checkpointing) follows the ladder.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass, field, replace
from typing import Optional

from lightning_zero.estimate.activations import CHECKPOINTING, TransformerShape
from lightning_zero.estimate.model_states import FullEstimate, estimate_memory
from lightning_zero.estimate.precisions import PRECISIONS

# Predicted (parameters and optimizer states on disk, docs/offload.md) but never picked or measured: it needs a
# directory on a fast local disk, which advise does not know.
NVME_REASON = (
    "not picked, it needs nvme_path: ZeroStrategy(stage=3, offload='nvme', nvme_path=<a directory on "
    "a local NVMe disk>) swaps parameters and optimizer states there"
)
PARAM_ONLY_REASON = (
    "not available separately: offload_params needs offload_optimizer (the sharded fp32 parameters "
    "are the optimizer's masters), so the next rungs offload the optimizer, then both"
)


@dataclass(frozen=True)
class Rung:
    """One configuration. ``reason`` set means the rung cannot run (it is shown, not predicted to fit).

    ``offload`` is the strategy's shorthand (at stage 3 it moves the parameters too); ``optimizer_only`` keeps the
    parameters on the device at stage 3 and offloads the optimizer alone (``offload_optimizer``)."""

    step: str
    stage: int = 0
    offload: Optional[str] = None
    checkpointing: str = "none"
    micro_batch: int = 1
    reason: str = ""
    optimizer_only: bool = False

    def __post_init__(self) -> None:
        if self.optimizer_only and not self.offload:
            raise ValueError("Rung.optimizer_only needs an offload device")

    @property
    def offload_kwargs(self) -> dict:
        """Where the optimizer and the parameters go, as ``ZeroStrategy``/the estimator take them."""
        if not self.offload:
            return {}
        if self.optimizer_only:
            return {"offload_optimizer": self.offload}
        return {"offload": self.offload}

    @property
    def label(self) -> str:
        parts = [f"ZeRO-{self.stage}"]
        if self.offload:
            what = "optimizer offload" if self.optimizer_only else "offload"
            parts.append(what if self.offload == "cpu" else f"{what} to {self.offload}")
        if self.checkpointing != "none":
            parts.append("ckpt" + (" in cpu" if self.checkpointing == "full+cpu" else ""))
        return " + ".join(parts) + f", mb {self.micro_batch}"

    def strategy_kwargs(self) -> dict:
        """The ``ZeroStrategy`` arguments of this rung."""
        kwargs: dict = {"stage": self.stage, **self.offload_kwargs}
        if self.checkpointing != "none":
            kwargs["activation_checkpointing"] = True
        if self.checkpointing == "full+cpu":
            kwargs["cpu_checkpointing"] = True
        return kwargs


@dataclass(frozen=True)
class Machine:
    """The target: ``devices`` ranks per node, ``device_memory`` bytes each, ``cpu_memory`` bytes for the node.
    On a CPU-only machine (``accelerator="cpu"``) the ranks' device and CPU memory are one and the same."""

    devices: int
    device_memory: int
    cpu_memory: int
    accelerator: str = "cpu"
    num_nodes: int = 1
    headroom: float = 0.1

    def __post_init__(self) -> None:
        for name in ("devices", "device_memory", "cpu_memory", "num_nodes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Machine.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.accelerator not in ("cpu", "cuda"):
            raise ValueError(f"Machine.accelerator must be 'cpu' or 'cuda', got {self.accelerator!r}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"Machine.headroom must be in [0, 1), got {self.headroom!r}")

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


def this_machine(devices: Optional[int] = None) -> Machine:
    """What this machine has: its CUDA devices (the smallest one's memory) or, without CUDA, its CPU memory."""
    import torch

    cpu = available_cpu_memory()
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
        return Machine(devices or count, memory, cpu, "cuda")
    devices = devices or 1
    return Machine(devices, cpu // devices, cpu, "cpu")


def available_cpu_memory() -> int:
    """Host memory this process can still use (``distributed.init.available_host_memory``: ``MemAvailable``, capped
    by what the cgroup limit leaves after its usage); the total memory where neither can be read."""
    from lightning_zero.distributed.exact_init import available_host_memory

    available = available_host_memory()
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def strategy_supports(*names: str) -> bool:
    """Whether the installed ``ZeroStrategy`` accepts these constructor arguments."""
    from lightning_zero.strategies.trainer_strategy import ZeroStrategy

    params = inspect.signature(ZeroStrategy.__init__).parameters
    return all(name in params for name in names)


def _availability(rung: Rung) -> Rung:
    if rung.reason:
        return rung
    if rung.checkpointing != "none" and not strategy_supports("activation_checkpointing"):
        return replace(rung, reason="needs activation checkpointing support")
    if rung.checkpointing == "full+cpu" and not strategy_supports("cpu_checkpointing"):
        return replace(rung, reason="needs cpu_checkpointing support")
    return rung


def ladder(micro_batch: int) -> list[Rung]:
    """The rungs in ladder order for the desired ``micro_batch`` (then halvings down to 1), NVMe, then the rest of
    the stage x offload x checkpointing grid at ``micro_batch``."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    mb = micro_batch
    rungs = [
        Rung("data parallel", 0, None, "none", mb),
        Rung("+ activation checkpointing", 0, None, "full", mb),
        Rung("ZeRO-2", 2, None, "full", mb),
        Rung("ZeRO-2 + optimizer offload", 2, "cpu", "full", mb),
        Rung("ZeRO-3", 3, None, "full", mb),
        Rung("+ parameter offload", 3, None, "full", mb, reason=PARAM_ONLY_REASON),
        Rung("+ optimizer offload", 3, "cpu", "full", mb, optimizer_only=True),
        Rung("+ parameter and optimizer offload", 3, "cpu", "full", mb),
        Rung("+ checkpoints in CPU memory", 3, "cpu", "full+cpu", mb),
    ]
    smaller = mb // 2
    while smaller >= 1:
        rungs.append(Rung("smaller micro-batch", 3, "cpu", "full+cpu", smaller))
        smaller //= 2
    rungs.append(Rung("NVMe offload", 3, "nvme", "full+cpu", 1, reason=NVME_REASON))
    # The rest of the grid, cheapest first by the same rule (offload costs most, then checkpointing, then stage):
    # where checkpointing is not available these are the runnable alternatives to the ladder's later rungs.
    named = {
        (r.stage, r.offload, r.checkpointing, r.micro_batch) for r in rungs if not r.reason and not r.optimizer_only
    }
    grid = [
        (stage, offload, ckpt)
        for stage in (0, 1, 2, 3)
        for offload in ((None,) if stage == 0 else (None, "cpu"))
        for ckpt in CHECKPOINTING
    ]
    grid.sort(key=lambda c: (c[1] is not None, CHECKPOINTING.index(c[2]), c[0]))
    rungs += [
        Rung("grid", stage, offload, ckpt, mb)
        for stage, offload, ckpt in grid
        if (stage, offload, ckpt, mb) not in named
    ]
    return [_availability(r) for r in rungs]


@dataclass
class Prediction:
    """A rung with its prediction, the fit verdict and (after ``--measure``) the measurement."""

    rung: Rung
    estimate: Optional[FullEstimate] = None
    fits: bool = False
    measured_peak: Optional[int] = None
    step_time: Optional[float] = None
    measured: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def throughput(self) -> Optional[float]:
        """Samples per second per rank (micro-batch over step time)."""
        if not self.step_time:
            return None
        return self.rung.micro_batch / self.step_time


def predict(
    rungs: list[Rung],
    model_or_num_params,
    shape: TransformerShape,
    machine: Machine,
    precision: str,
    largest_unit_params: Optional[int] = None,
) -> list[Prediction]:
    """Predict every rung's per-rank peaks and whether it fits ``machine`` (with its headroom)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    out = []
    usable = 1 - machine.headroom
    for rung in rungs:
        if rung.reason.startswith("not available"):
            out.append(Prediction(rung))
            continue
        est = estimate_memory(
            model_or_num_params,
            rung.stage,
            machine.world_size,
            precision=precision,
            shape=replace(shape, micro_batch=rung.micro_batch),
            checkpointing=rung.checkpointing,
            largest_unit_params=largest_unit_params,
            **rung.offload_kwargs,
        )
        if machine.accelerator == "cpu":  # device memory is CPU memory: every rank's whole footprint shares it
            fits = (est.accelerator_peak + est.cpu_peak) * machine.devices <= usable * machine.cpu_memory
        else:
            fits = (
                est.accelerator_peak <= usable * machine.device_memory
                and est.cpu_peak * machine.devices <= usable * machine.cpu_memory
            )
        out.append(Prediction(rung, est, fits))
    return out


def predicted_winner(predictions: list[Prediction]) -> Optional[Prediction]:
    """The first runnable rung (ladder order: fastest first) predicted to fit."""
    return next((p for p in predictions if p.fits and not p.rung.reason), None)


def lightning_yaml(rung: Rung, precision: str, machine: Machine, batch_key: Optional[str] = None) -> str:
    """The winning configuration as a LightningCLI snippet (``trainer.strategy`` class_path/init_args)."""
    lines = [
        "# lightning-zero advise: the winning configuration",
        "trainer:",
        f"  accelerator: {'gpu' if machine.accelerator == 'cuda' else 'cpu'}",
        f"  devices: {machine.devices}",
    ]
    if machine.num_nodes > 1:
        lines.append(f"  num_nodes: {machine.num_nodes}")
    lines += [
        f"  precision: {precision}",
        "  strategy:",
        "    class_path: lightning_zero.ZeroStrategy",
        "    init_args:",
    ]
    lines += [f"      {key}: {json.dumps(value)}" for key, value in rung.strategy_kwargs().items()]
    if batch_key:
        section, _, key = batch_key.partition(".")
        lines += [f"{section}:", f"  {key}: {rung.micro_batch}"]
    else:
        lines.append(f"# micro-batch per device: {rung.micro_batch} (your DataLoader's batch_size)")
    return "\n".join(lines) + "\n"


def ds_config(rung: Rung, precision: str) -> dict:
    """The winning configuration as a DeepSpeed ``ds_config`` dict (loadable by ``ZeroStrategy(config=...)``)."""
    zero: dict = {"stage": rung.stage}
    if rung.offload:
        zero["offload_optimizer"] = {"device": rung.offload}
        if rung.stage == 3 and not rung.optimizer_only:
            zero["offload_param"] = {"device": rung.offload}
    config: dict = {
        "train_micro_batch_size_per_gpu": rung.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
    }
    if precision in ("bf16-mixed", "16-mixed"):
        config["bf16" if precision.startswith("bf16") else "fp16"] = {"enabled": True}
    elif precision not in ("32-true", "32"):
        # DeepSpeed's bf16/fp16 sections keep fp32 masters: writing one would silently change the precision.
        raise ValueError(
            f"precision {precision!r} has no ds_config equivalent (DeepSpeed's bf16/fp16 modes keep "
            "fp32 master weights, i.e. bf16-mixed/16-mixed)"
        )
    if rung.checkpointing != "none":
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": rung.checkpointing == "full+cpu",
        }
    return config
