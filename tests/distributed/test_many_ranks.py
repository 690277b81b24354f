"""Real runs at 16, 8 and 3 gloo ranks on CPU: every ZeRO stage (and CPU offload) equals one unsharded process, with
parameters whose sizes divide no world size (empty shards at 8 and 16 ranks), and a stage-3 checkpoint saved by 16
ranks resumes at 8 and at 3 ranks, at stage 3 and at other stages (``docs/scale.md``, "Real runs at 8 and 16 ranks").

Each world starts once and runs all its cases in turn (``tests/distributed/many_ranks_worker.py``): a gloo world of 16
processes on two cores costs seconds to start, its steps milliseconds.
"""

from __future__ import annotations

import pytest

from lightning_zero.checkpoint import read_checkpoint_info
from tests.distributed import many_ranks_worker as worker
from tests.ranks import run_distributed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def expected():
    return worker.references()


@pytest.fixture(scope="module")
def saved_at_16(tmp_path_factory, expected):
    """The 16-rank world: parity of every case, then the stage-3 run saved."""
    directory = str(tmp_path_factory.mktemp("many_ranks"))
    run_distributed(worker.saving_world, 16, expected, directory)
    return directory


def test_sixteen_ranks_match_one_process_and_save_a_sharded_checkpoint(saved_at_16):
    info = read_checkpoint_info(f"{saved_at_16}/ckpt")
    assert info["stage"] == 3 and info["world_size"] == 16, info


def test_eight_ranks_match_one_process_and_resume_the_16_rank_checkpoint(saved_at_16, expected):
    # accumulation and clipping over empty shards ran at 16 ranks; here the plain runs keep the world cheap
    run_distributed(worker.resuming_world, 8, expected, saved_at_16, ("plain",), ((3, None), (2, "cpu")))


def test_three_ranks_resume_the_16_rank_checkpoint(saved_at_16, expected):
    run_distributed(worker.resuming_world, 3, expected, saved_at_16, (), ((3, None), (1, None), (0, None)))
