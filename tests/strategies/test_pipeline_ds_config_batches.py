"""DeepSpeed's batch arithmetic under a pipeline counts data-parallel replicas, not ranks."""

from lightning_zero import ZeroStrategy
from tests.ranks import run_distributed
from tests.strategies.test_strategy_pipeline import BATCH, PipelinedLM, _trainer


def _pipeline_batch_worker(rank, world_size):
    # 2 ranks = 2 pipeline stages x 1 data-parallel replica: train_batch_size 8 = micro 4 x accumulation 2 x 1.
    # Counting ranks instead (8 = 4 x 1 x 2) would silently train with half the global batch.
    strategy = ZeroStrategy(stage=1, pipeline_parallel_size=2, config={"train_batch_size": 2 * BATCH})
    trainer = _trainer(strategy, world_size, max_steps=1)
    trainer.fit(PipelinedLM())
    effective = strategy.ds_config.translation.effective
    assert (
        effective["train_batch_size"],
        effective["train_micro_batch_size_per_gpu"],
        effective["gradient_accumulation_steps"],
    ) == (2 * BATCH, BATCH, 2)
    assert trainer.accumulate_grad_batches == 2


def test_train_batch_size_counts_data_parallel_replicas_under_a_pipeline():
    run_distributed(_pipeline_batch_worker, 2)
