"""Work per optimizer step, counted with the torch profiler (load-independent): collectives and casts that a change
removed must stay removed. See ``docs/performance_notes_lowprec.md`` for what each count bought."""

from collections import Counter

import pytest
import torch
from lightning.pytorch import Callback

from lightning_zero import ZeroStrategy
from tests.lightning_models import RegressionModule, full_state, quiet_trainer, reference_weights
from tests.ranks import run_distributed

BATCH = 2  # 3 optimizer steps x 2 ranks x 4 micro-batches x 2 = 48 samples: one epoch of the 64
ACCUMULATE = 4
WARM_STEPS = 1
COUNTED_STEPS = 2


class CountOps(Callback):
    """Profiles the optimizer steps after the first (lazy initialisation done) and counts the ops by name."""

    def __init__(self, accumulate):
        self.accumulate, self.prof, self.counts = accumulate, None, Counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == WARM_STEPS * self.accumulate:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()

    def on_train_end(self, trainer, pl_module):
        self.prof.__exit__(None, None, None)
        self.counts = Counter(event.name for event in self.prof.events())


class DirectModule(RegressionModule):
    """Calls the network, not ``self(x)``: no nested call of the FSDP2 root (see test_nested_root_call_...)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


def _fit_counting(stage, precision, world_size, accumulate=ACCUMULATE, module_class=DirectModule, **knobs):
    torch.manual_seed(0)
    module = module_class(batch_size=BATCH)
    counter = CountOps(accumulate)
    # unit_bytes=0: one FSDP unit per block, so the counts below are per block (distributed/units.py)
    trainer = quiet_trainer(
        ZeroStrategy(stage=stage, unit_bytes=0, **knobs),
        world_size,
        max_steps=WARM_STEPS + COUNTED_STEPS,
        accumulate_grad_batches=accumulate,
        precision=precision,
        callbacks=[counter],
    )
    trainer.fit(module)
    return module, counter.counts["c10d::_allgather_base_"] / COUNTED_STEPS


def _max_diff_from_reference(module, world_size, accumulate):
    expected = reference_weights(WARM_STEPS + COUNTED_STEPS, BATCH * world_size * accumulate, accumulate)
    got = full_state(module)
    return max((got[k] - expected[k]).abs().max().item() for k in expected)


# RegressionModule's Net: two Block units and the root (inp, out) -> three FSDP units.
UNITS = 3


def _accumulation_worker(rank, world_size):
    for precision in ("32-true", "bf16-mixed"):
        module, gathers = _fit_counting(2, precision, world_size)
        # Stage 2 keeps the gathered parameters from the first micro-step's forward to the last one's backward:
        # one all-gather per unit per optimizer step, not one per micro-batch (4x as many before).
        assert gathers == UNITS, f"stage 2 {precision}: {gathers} all-gathers per optimizer step, expected {UNITS}"
        if precision == "32-true":  # keeping them changes nothing in the result
            worst = _max_diff_from_reference(module, world_size, ACCUMULATE)
            assert worst <= 1e-5, f"stage 2 accumulation: max abs diff {worst:.2e} from the reference"
    # Stage 3: the first block gathers in forward and again in backward on every micro-step; the root and the
    # last block stay gathered from forward to backward (zero.py's note on the two units stage 3 keeps), so like
    # stage 2's units they are gathered once per optimizer step.
    module, gathers = _fit_counting(3, "32-true", world_size)
    assert gathers == 2 * ACCUMULATE + 2, f"stage 3: {gathers} all-gathers per optimizer step"
    worst = _max_diff_from_reference(module, world_size, ACCUMULATE)
    assert worst <= 1e-5, f"stage 3 accumulation: max abs diff {worst:.2e} from the reference"
    # reshard_after_forward=True: every unit, the root too, gathers in forward and in backward on every micro-step.
    _, gathers = _fit_counting(3, "32-true", world_size, reshard_after_forward=True)
    assert gathers == UNITS * 2 * ACCUMULATE, f"stage 3, reshard all: {gathers} all-gathers per optimizer step"


def test_stage_2_accumulation_gathers_each_unit_once_per_optimizer_step():
    run_distributed(_accumulation_worker, 2)


def _nested_root_worker(rank, world_size):
    # training_step calls self(x): the root is called inside its own forward (root_reentry's note).
    module, gathers = _fit_counting(2, "bf16-true", world_size, accumulate=1, module_class=RegressionModule)
    assert gathers == UNITS, f"stage 2: {gathers} all-gathers per step, expected one per unit ({UNITS})"
    module, gathers = _fit_counting(3, "32-true", world_size, accumulate=1, module_class=RegressionModule)
    # forward and backward for the first block; once for the root and the last block (kept into backward)
    assert gathers == 2 + 2, f"stage 3: {gathers} all-gathers per step, expected 4"
    worst = _max_diff_from_reference(module, world_size, 1)
    assert worst <= 1e-5, f"stage 3 with a nested root call: max abs diff {worst:.2e} from the reference"


def test_nested_root_call_in_training_step_does_not_regather_the_root():
    run_distributed(_nested_root_worker, 2)


def _fabric_accumulation_worker(rank, world_size):
    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
    from tests.fabric.test_fabric_parity import fabric_train, make_fabric

    gathers = {}
    for accumulate in (1, ACCUMULATE):
        fabric = make_fabric(FabricZeroStrategy(stage=2, unit_bytes=0), precision="bf16-mixed")
        model, optimizer = fabric_train(fabric, rank, world_size, accumulate=accumulate, steps=range(1))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fabric_train(
                fabric, rank, world_size, accumulate=accumulate, steps=range(1, 3), model=model, optimizer=optimizer
            )
        gathers[accumulate] = sum(event.name == "c10d::_allgather_base_" for event in prof.events()) / 2
    # Fabric's no_backward_sync goes through the same set_gradient_sync: the micro-steps add no all-gather.
    assert gathers[ACCUMULATE] == gathers[1] > 0, f"all-gathers per optimizer step by accumulation: {gathers}"


@pytest.mark.slow  # two Fabric set-ups: ~30-60 s on 2 loaded cores; the Trainer test covers the shared function
def test_fabric_stage_2_accumulation_gathers_once_per_optimizer_step():
    run_distributed(_fabric_accumulation_worker, 2)
