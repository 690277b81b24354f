"""Real models under ZeroStrategy: a tiny Hugging Face Llama and torchmetrics, on 2 gloo ranks.

The Llama is trained at every stage and compared with the same model trained by Lightning's plain ``DDPStrategy``
(same seed, same global batch): once built in ``__init__`` (parity of training itself) and once built in
``configure_model`` (parity of initialisation too, which an early defect broke at stages 2-3).
"""

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.strategies import DDPStrategy

from tests.conformance.models import (
    ALL_STAGES,
    STAGE_IDS,
    LlamaModule,
    MetricsModule,
    class_dataset,
    full_state,
    max_abs_diff,
    trainer,
    zero,
)
from tests.ranks import run_distributed

STEPS = 3


def _fit_llama(strategy, tie, in_configure_model):
    seed_everything(0)  # setup_environment re-seeds from it, so configure_model builds the same weights everywhere
    module = LlamaModule(tie, in_configure_model)
    trainer(strategy, max_steps=STEPS).fit(module)
    return module, full_state(module)


def _llama_worker(rank, world_size, stage, offload, in_configure_model):
    for tie in (True, False):
        _, expected = _fit_llama(DDPStrategy(), tie, in_configure_model)
        module, got = _fit_llama(zero(stage, offload), tie, in_configure_model)
        assert module.model.config.tie_word_embeddings is tie
        if tie:
            assert module.model.lm_head.weight is module.model.model.embed_tokens.weight, "tying was lost"
        diff = max_abs_diff(got, expected)
        assert diff <= 1e-4, f"stage {stage} offload={offload} tie={tie}: {diff:.2e} from DDP"
        seed_everything(0)
        initial = full_state(LlamaModule(tie, build_in_configure_model=False))
        assert max_abs_diff(expected, initial) > 1e-3, "the reference did not train: the comparison proves nothing"


def _cases(in_configure_model):
    return [pytest.param(stage, offload, id=name) for (stage, offload), name in zip(ALL_STAGES, STAGE_IDS)]


@pytest.mark.slow
@pytest.mark.parametrize("stage,offload", _cases(in_configure_model=False))
def test_hf_llama_built_in_init_trains_like_ddp(stage, offload):
    run_distributed(_llama_worker, 2, stage, offload, False)


@pytest.mark.slow
@pytest.mark.parametrize("stage,offload", _cases(in_configure_model=True))
def test_hf_llama_built_in_configure_model_trains_like_ddp(stage, offload):
    run_distributed(_llama_worker, 2, stage, offload, True)


def _metrics_worker(rank, world_size, stage, offload):
    seed_everything(0)
    module = MetricsModule()
    result = trainer(zero(stage, offload), limit_val_batches=1.0).validate(module, verbose=False)[0]
    # single process, global data, the same weights
    weights = full_state(module)
    plain = torch.nn.Linear(6, 3)
    plain.load_state_dict({k.removeprefix("net."): v for k, v in weights.items() if k.startswith("net.")})
    x, y = class_dataset().tensors
    probs = plain(x).softmax(-1).detach()
    mse = torch.nn.functional.mse_loss(probs, torch.nn.functional.one_hot(y, 3).float()).item()
    acc = (probs.argmax(-1) == y).float().mean().item()
    assert result["val_mse"] == pytest.approx(mse, rel=1e-5)
    assert result["val_acc"] == pytest.approx(acc, rel=1e-5)


@pytest.mark.parametrize(
    "stage,offload",
    [
        pytest.param(0, None, id="s0"),
        pytest.param(1, None, id="s1"),
        pytest.param(2, None, id="s2"),
        pytest.param(3, "cpu", id="s3-offload"),
    ],
)
def test_torchmetrics_built_in_configure_model_sync_over_ranks(stage, offload):
    run_distributed(_metrics_worker, 2, stage, offload)
