import pytest
import torch
from torch import nn

from lightning_zero import estimate_model_states_memory, zero_formula
from lightning_zero.cli import main

P = 1_000_000


@pytest.mark.parametrize(
    "stage, params, grads, states",
    [(0, 4 * P, 4 * P, 8 * P), (1, 4 * P, 4 * P, 2 * P), (2, P, P, 2 * P), (3, P, P, 2 * P)],
)
def test_fp32_adam_formulas_at_four_ranks(stage, params, grads, states):
    got = zero_formula(P, stage, 4)
    assert (got.params, got.grads, got.optimizer_states) == (params, grads, states)


def test_mixed_precision_keeps_fp32_masters_as_the_parameters():
    """ZeroStrategy's 16 bytes per parameter under mixed precision are 4 + 4 + 8 (fp32 parameters are the masters),
    not DeepSpeed's 2 + 2 + 12: the same totals where all of it is partitioned alike, more at stage 1, which
    partitions only the optimizer states (measured: test_zero_parity's memory test)."""
    for precision in ("bf16-mixed", "16-mixed", "16-true"):
        assert zero_formula(P, 0, 8, precision=precision) == zero_formula(P, 0, 8)
        stage1 = zero_formula(P, 1, 8, precision=precision)
        assert (stage1.params, stage1.grads, stage1.optimizer_states) == (4 * P, 4 * P, 8 * P // 8)
        assert stage1.total == 8 * P + 8 * P // 8 > 4 * P + 12 * P // 8  # DeepSpeed's ZeRO-1: 4P + 12P/N
        assert zero_formula(P, 3, 8, precision=precision).total == 16 * P // 8
    # bf16-true at stages 0-1: bf16 replicas, fp32 masters beside m and v (distributed/replicas.py), DeepSpeed's split
    stage1 = zero_formula(P, 1, 8, precision="bf16-true")
    assert (stage1.params, stage1.grads, stage1.optimizer_states) == (2 * P, 2 * P, 12 * P // 8)
    assert zero_formula(P, 0, 8, precision="bf16-true").total == 16 * P
    assert zero_formula(P, 3, 8, precision="bf16-true") == zero_formula(P, 3, 8)
    # ... unless the masters are swapped to NVMe: then the run keeps fp32 parameters
    assert zero_formula(P, 1, 8, precision="bf16-true", swapped_masters=True) == zero_formula(P, 1, 8)
    nvme = estimate_model_states_memory(P, 1, 8, offload="nvme", precision="bf16-true")
    assert nvme.accelerator == estimate_model_states_memory(P, 1, 8, offload="nvme").accelerator
    # low precision halves only what compute reads: the parameters gathered at stage 2
    gathered = {
        precision: estimate_model_states_memory(P, 2, 8, precision=precision) for precision in ("32-true", "bf16-mixed")
    }
    assert gathered["32-true"].accelerator.total == gathered["bf16-mixed"].accelerator.total == 16 * P // 8
    assert gathered["32-true"].accelerator_peak - gathered["bf16-mixed"].accelerator_peak == 2 * P


def test_estimate_places_offloaded_states_on_cpu_and_peaks():
    est = estimate_model_states_memory(P, 2, 4, offload="cpu")  # ZeRO-Offload: the device keeps its shards
    assert est.accelerator.total == 2 * P and est.cpu.total == 4 * P  # (4 + 4) P / 4; (4 + 4 + 8) P / 4
    assert est.accelerator_peak == 6 * P  # the shards and the gathered fp32 parameters
    est1 = estimate_model_states_memory(P, 1, 4, offload="cpu")
    assert est1.accelerator.total == 8 * P and est1.cpu.optimizer_states == 12 * P // 4  # master + m + v
    est3 = estimate_model_states_memory(P, 3, 4, largest_unit_params=P // 10)
    assert est3.accelerator_peak == est3.accelerator.total + 2 * (P // 10) * 4


def test_estimate_from_module_uses_largest_unit():
    # The two consecutive Linear(100, 100) blocks share one FSDP2 unit (grouped up to the default unit_bytes, see
    # lightning_zero.distributed.units): that unit, not one block, sizes the stage-3 peak.
    model = nn.Sequential(nn.Linear(10, 10), nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100)))
    est = estimate_model_states_memory(model, 3, 2)
    total = sum(p.numel() for p in model.parameters())
    assert est.accelerator.total == zero_formula(total, 3, 2).total
    assert est.accelerator_peak - est.accelerator.total == min(2 * 2 * 10100, total) * 4
    # Blocks at least as large as the default unit (8 MiB: a Linear(2048, 2048) is 16.8 MB) stay one unit each:
    # the peak is two of them. Shapes only: counted on the meta device.
    with torch.device("meta"):
        big = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(3)))
    est = estimate_model_states_memory(big, 3, 2)
    assert est.accelerator_peak - est.accelerator.total == 2 * (2048 * 2048 + 2048) * 4
    # Smaller blocks are grouped up to the default: of three 4 MiB Linears two share a unit, the third (at least
    # half a target) is its own, and the peak, two units gathered, is all of them.
    three = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(3)))
    est = estimate_model_states_memory(three, 3, 2)
    assert est.accelerator_peak - est.accelerator.total == 3 * (1024 * 1024 + 1024) * 4


def test_estimate_validates_like_the_strategy():
    with pytest.raises(ValueError, match="needs a ZeRO stage"):
        estimate_model_states_memory(P, 0, 4, offload="cpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        estimate_model_states_memory(P, 2, 4, precision="fp8")


def test_estimate_cli_prints_every_stage(capsys):
    assert main(["estimate", "--params", "1e6", "--world-size", "4", "--precision", "32-true"]) == 0
    out = capsys.readouterr().out
    assert "stage" in out and out.count("GiB") == 12


def test_estimate_memory_takes_every_model_state_setting():
    """estimate_memory's model-state part is estimate_model_states_memory with the same settings (hybrid sharding,
    NVMe buffers), not its defaults."""
    from lightning_zero import estimate_memory, estimate_model_states_memory

    for kwargs in (dict(hybrid_shard_size=2), dict(sub_group_size=1000, buffer_count=2), dict(largest_unit_params=10)):
        offload = "nvme" if "buffer_count" in kwargs else None
        assert estimate_memory(10**6, 3, 4, offload, **kwargs).states == estimate_model_states_memory(
            10**6, 3, 4, offload, **kwargs
        ), kwargs


def test_stage_1_estimate_of_a_module_is_the_heaviest_ranks_whole_parameters():
    """Stage 1 steps whole parameters: with a 100-row embedding beside small layers, the rank holding the
    embedding carries more than the even share, and a module's estimate says so (a bare count cannot)."""
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    p = sum(q.numel() for q in model.parameters())
    by_module = estimate_model_states_memory(model, 1, 4)
    by_count = estimate_model_states_memory(p, 1, 4)
    assert by_count.accelerator.optimizer_states == 8 * p // 4
    assert by_module.accelerator.optimizer_states == 8 * 800  # the embedding's rank steps it alone
    assert by_module.accelerator.params == by_count.accelerator.params == 4 * p
