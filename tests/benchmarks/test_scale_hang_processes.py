"""benchmarks/scale/hang_processes.py and save_verdicts.py at a few ranks: the figures docs/scale.md quotes."""

from benchmarks.scale import hang_processes, save_verdicts


def test_a_hang_across_processes_is_named_by_every_rank_after_one_diagnosis():
    row = hang_processes.run(8, 2, timeout=2.0, poll=0.2, steady=1.0, step_s=0.25)
    assert row["ranks_named_the_hung_rank"] == 8, row
    assert row["ranks_that_diagnosed"] == 1, row
    assert row["hang_to_every_rank_named_s"] < 2.0 + 30, row


def test_verdict_bytes_grow_with_the_ranks_as_all_gather_object_sends_them():
    small, large = save_verdicts.payload_bytes(8), save_verdicts.payload_bytes(1024)
    assert large["verdicts_bytes_per_rank"] == 128 * small["verdicts_bytes_per_rank"]  # (8 + an empty list) a rank
    assert small["reports_bytes_per_rank"] < large["reports_bytes_per_rank"] / 128 * 1.1  # the probe names lengthen
