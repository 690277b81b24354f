import itertools
import json
import os
import random
import types

import pytest
import torch

from lightning_zero.ops.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError, StaticLossScaler, has_overflow
from tests.ranks import run_distributed


def reference_trajectory(overflows, power, window, hysteresis, consecutive, min_scale):
    """The documented rules, written as a plain loop over a list: (scale after each update) or 'raise' at the end.

    The scale doubles on a clean step when the number of clean steps since the last overflow (or since the start,
    counting as if an overflow happened at step -1) minus one is a positive multiple of the window.
    """
    scale, budget, last_overflow = 2.0**power, hysteresis, -1
    out = []
    for step, overflow in enumerate(overflows):
        if overflow:
            if budget == 1:
                if scale == min_scale:
                    out.append("raise")
                    return out
                scale = max(scale / 2, min_scale)
            else:
                budget -= 1
            last_overflow = step
        else:
            if consecutive:
                budget = hysteresis
            clean_run = step - last_overflow - 1
            if clean_run > 0 and clean_run % window == 0:
                budget = hysteresis
                scale *= 2
        out.append(scale)
    return out


def run_ours(overflows, power, window, hysteresis, consecutive, min_scale):
    scaler = DynamicLossScaler(power, window, hysteresis, consecutive, min_scale)
    out = []
    for overflow in overflows:
        try:
            scaler.update(overflow)
        except LossScaleAtMinimumError:
            out.append("raise")
            return out, scaler
        out.append(scaler.scale)
    return out, scaler


def random_sequences(seed, count=40, length=120):
    rng = random.Random(seed)
    for _ in range(count):
        p = rng.choice([0.02, 0.1, 0.3, 0.6])
        # bursts of overflows so hysteresis and the floor are reached, runs of clean steps so the scale grows
        yield [rng.random() < p for _ in range(length)]


CONFIGS = list(itertools.product([3, 16], [1, 3, 7], [1, 2, 4], [False, True], [1, 0.5]))


def test_trajectories_match_reference_on_every_parameter_combination():
    raised = grown = 0
    for index, (power, window, hyst, consecutive, min_scale) in enumerate(CONFIGS):
        for overflows in random_sequences(index):
            ref = reference_trajectory(overflows, power, window, hyst, consecutive, min_scale)
            ours, scaler = run_ours(overflows, power, window, hyst, consecutive, min_scale)
            assert ours == ref, (power, window, hyst, consecutive, min_scale, overflows)
            raised += ref[-1] == "raise"
            grown += any(s != "raise" and s > 2.0**power for s in ref)
            if ref[-1] != "raise":
                assert scaler.skipped_steps == sum(overflows)
    # the sequences really exercise the floor error and the growth rule
    assert raised > 20 and grown > 20


def test_known_trajectory_by_hand():
    # window 2, hysteresis 2: the first overflow only spends hysteresis, the second halves; growth after 2 clean
    # steps counted from the step after the last overflow; the growth refills the hysteresis, so the last overflow
    # keeps the scale.
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    scales = []
    for overflow in [False, False, False, True, True, False, False, False, True]:
        s.update(overflow)
        scales.append(s.scale)
    assert scales == [16, 16, 32, 32, 16, 16, 16, 32, 32]
    assert s.skipped_steps == 3 and s.cur_iter == 9


def deepspeed_scaler_module():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.runtime.fp16 import loss_scaler
    except Exception as error:  # deepspeed is an optional peer, never a dependency
        pytest.skip(f"deepspeed is not importable here ({type(error).__name__}: {error}); comparison skipped")
    return loss_scaler


def test_matches_deepspeed_step_for_step(monkeypatch):
    module = deepspeed_scaler_module()
    # DeepSpeed's update_scale asks deepspeed.comm for the rank only to decide whether to log.
    monkeypatch.setattr(module, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    compared = 0
    for index, (power, window, hyst, consecutive, min_scale) in enumerate(CONFIGS):
        for overflows in random_sequences(1000 + index, count=15):
            ds = module.DynamicLossScaler(
                init_scale=2**power,
                scale_window=window,
                min_scale=min_scale,
                delayed_shift=hyst,
                consecutive_hysteresis=consecutive,
            )
            ours = DynamicLossScaler(power, window, hyst, consecutive, min_scale)
            for overflow in overflows:
                try:
                    ds.update_scale(overflow)
                except Exception as error:
                    assert "minimum" in str(error)
                    with pytest.raises(LossScaleAtMinimumError):
                        ours.update(overflow)
                    break
                ours.update(overflow)
                assert float(ds.cur_scale) == ours.scale
                assert (ds.cur_iter, ds.last_overflow_iter, ds.cur_hysteresis) == (
                    ours.cur_iter,
                    ours.last_overflow_iter,
                    ours.cur_hysteresis,
                )
                compared += 1
    assert compared > 10_000


def test_error_at_min_scale_is_clear_and_leaves_state_unchanged():
    s = DynamicLossScaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    s.update(True)
    assert s.scale == 1
    before = s.state_dict()
    with pytest.raises(LossScaleAtMinimumError, match="min_loss_scale=1"):
        s.update(True)
    assert s.state_dict() == before
    quiet = DynamicLossScaler(initial_scale_power=0, hysteresis=1, raise_error_at_min_scale=False)
    quiet.update(True)
    quiet.update(True)
    assert quiet.scale == 1 and quiet.skipped_steps == 2


def test_state_dict_round_trip_through_json_continues_identically():
    rng = random.Random(5)
    overflows = [rng.random() < 0.15 for _ in range(200)]
    a = DynamicLossScaler(16, 5, 3, False, 1)
    for o in overflows[:100]:
        a.update(o)
    b = DynamicLossScaler(16, 5, 3, False, 1)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for o in overflows[100:]:
        a.update(o)
        b.update(o)
        assert a.state_dict() == b.state_dict()
    assert a.skipped_steps == sum(overflows) and a.skipped_steps > 0
    with pytest.raises(ValueError, match="StaticLossScaler"):
        StaticLossScaler(8.0).load_state_dict(a.state_dict())


def test_static_scaler_counts_skips_and_never_changes():
    s = StaticLossScaler(128.0)
    for o in [True, False, True]:
        s.update(o)
    assert s.scale == s.loss_scale == 128.0 and s.skipped_steps == 2
    t = StaticLossScaler(128.0)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.skipped_steps == 2 and t.cur_iter == 3
    with pytest.raises(ValueError, match="same loss_scale"):
        StaticLossScaler(64.0).load_state_dict(s.state_dict())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(loss_scale_window=0), "loss_scale_window"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(min_loss_scale=0), "min_loss_scale"),
        (dict(initial_scale_power=-1), "initial_scale_power"),
        (dict(initial_scale_power=0, min_loss_scale=4), "below min_loss_scale"),
        (dict(consecutive_hysteresis="yes"), "consecutive_hysteresis"),
    ],
)
def test_invalid_configuration_is_rejected(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        DynamicLossScaler(**kwargs)


def test_has_overflow_single_process():
    finite = [torch.ones(3), None, torch.zeros(0), torch.ones(2, dtype=torch.float16)]
    assert not has_overflow(finite)
    assert has_overflow(finite + [torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)])
    assert has_overflow([torch.tensor([float("-inf")], dtype=torch.float16)])
    assert not has_overflow([torch.full((4,), 3e38)])  # huge but finite: a sum-based check would overflow here
    assert not has_overflow([])


def _overflow_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    clean = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    assert not has_overflow([clean, torch.ones(2)])
    # only rank 1's shard holds an inf: every rank must see the overflow
    full = torch.ones(4, 3)
    full[3, 1] = float("inf")
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.isfinite(sharded.to_local()).all() == (rank == 0)
    assert has_overflow([sharded])
    # a plain local tensor that is bad on rank 0 only
    local = torch.tensor([float("nan")]) if rank == 0 else torch.ones(1)
    assert has_overflow([local])
    # a rank with nothing to check still joins the collective
    assert has_overflow([] if rank == 0 else [torch.tensor([float("inf")])])
    assert not has_overflow([] if rank == 0 else [torch.ones(1)])


def test_has_overflow_two_ranks_one_bad_shard():
    run_distributed(_overflow_worker, 2)
