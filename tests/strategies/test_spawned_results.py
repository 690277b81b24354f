"""``ZeroStrategy(start_method="fork"|"spawn")``: after ``fit`` the launching process's module holds the trained
weights, whole, at every stage (lightning_zero/strategies/spawned_results.py)."""

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_zero import ZeroStrategy
from tests.lightning_models import RegressionModule
from tests.ranks import free_port


def _fit_in_started_ranks(monkeypatch, stage, start_method="fork"):
    # A fresh rendezvous port per fit: Lightning's launcher reuses MASTER_PORT from the environment, and in one CI run
    # the ranks of a later fit read gloo addresses that were no longer listening (connectFullMesh refused).
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    seed_everything(0)
    model = RegressionModule()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=stage, start_method=start_method),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model)
    return before, model.state_dict()


@pytest.mark.slow  # four 2-rank fits, one of them in spawned interpreters
def test_launching_process_gets_the_full_trained_weights_at_every_stage(monkeypatch):
    before, reference = _fit_in_started_ranks(monkeypatch, 0)  # DDP: Lightning's own transfer of full tensors
    assert any(not torch.equal(before[k], v) for k, v in reference.items()), "the DDP fit did not train"
    # spawn pickles the launcher into each rank: ZeroStrategy(start_method="spawn") failed there before any rank ran
    for stage, start_method in ((2, "fork"), (3, "fork"), (2, "spawn")):
        _, got = _fit_in_started_ranks(monkeypatch, stage, start_method)
        assert got.keys() == reference.keys(), stage
        for key, value in reference.items():
            assert type(got[key]) is torch.Tensor and got[key].shape == value.shape, (stage, start_method, key)
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=f"stage {stage} {start_method}: {key}")
