"""Pipeline parallelism through the Trainer: ZeroStrategy(pipeline_parallel_size=2) with every schedule, ZeRO stages on
the data-parallel dimension, clipping, accumulation, tied weights and checkpoints, against the unsplit model."""

import os

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from tests.lightning_models import quiet_trainer
from tests.pipeline.test_pipeline_parity import VOCAB, full_state, make_model
from tests.ranks import run_distributed

BATCH, STEPS, SEQ = 4, 3, 5


def data(n=64):
    gen = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randint(0, VOCAB, (n, SEQ), generator=gen), torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    )


def token_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class PipelinedLM(LightningModule):
    """``training_step`` returns ``self.model(inputs, targets)``: under the strategy that runs the whole schedule."""

    def __init__(self, batch_size=BATCH):
        super().__init__()
        self.save_hyperparameters()
        self.model = make_model()
        self.model.loss_fn = token_loss

    def training_step(self, batch, batch_idx):
        loss = self.model(*batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(*batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return DataLoader(data(), batch_size=self.hparams.batch_size)

    def val_dataloader(self):
        return DataLoader(data(16), batch_size=self.hparams.batch_size)


def reference(steps, global_batch, accumulate=1, clip=None):
    """The unsplit PipelineModule (plain sequential) on one process, same global batches, same optimizer."""
    module = PipelinedLM()
    module.model.materialize()  # inside a process group specs wait for a pipeline split: build them all here
    optimizer = module.configure_optimizers()
    x_all, y_all = data().tensors
    order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
    x_all, y_all = x_all[order], y_all[order]
    micro = global_batch // accumulate
    for step in range(steps):
        for i in range(accumulate):
            start = (step * accumulate + i) * micro
            (module.model(x_all[start : start + micro], y_all[start : start + micro]) / accumulate).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return full_state(module)


def _trainer(strategy, world_size, **kwargs):
    return quiet_trainer(strategy, world_size, **{"max_steps": STEPS, **kwargs})


def _gather_full_state(module, pp_group):
    """Every rank's layers, merged (each rank holds its stages' keys; tied keys appear on both ends)."""
    import torch.distributed as dist

    local = full_state(module)
    gathered = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, local, group=pp_group)
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged


def _parity_worker(rank, world_size, cases):
    for schedule, stage, accumulate, clip in cases:
        torch.manual_seed(0)
        module = PipelinedLM()
        strategy = ZeroStrategy(stage=stage, pipeline_parallel_size=2, micro_batches=2, pipeline_schedule=schedule)
        trainer = _trainer(strategy, world_size, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
        trainer.fit(module)
        label = f"{schedule} stage {stage} world {world_size} acc {accumulate} clip {clip}"
        dp = world_size // 2
        assert strategy.distributed_sampler_kwargs["num_replicas"] == dp, label
        got = _gather_full_state(module, strategy.meshes.pipeline.get_group())
        expected = reference(STEPS, BATCH * dp * accumulate, accumulate, clip)
        assert set(got) == set(expected), label
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-5, f"{label}: max abs diff {worst:.2e} from the unsplit reference"
        # the tied embedding and head stayed equal: one key, the same values on both end stages
        runner = module.model.runner
        for _key, owner, _attrs, group, _src in runner.tied_groups:
            weight = full_state(owner)["weight"]
            copies = [torch.zeros_like(weight) for _ in range(2)]
            torch.distributed.all_gather(copies, weight.contiguous(), group=group)
            assert torch.equal(copies[0], copies[1]), f"{label}: tied copies diverged"


CASES_PP2_DP1 = [
    ("gpipe", 0, 1, None),
    ("1f1b", 0, 2, 0.05),
    ("interleaved_1f1b", 1, 1, None),
    ("zero_bubble", 0, 1, 0.05),
    ("zbv", 0, 1, None),
]
CASES_PP2_DP2 = [("gpipe", 0, 1, 0.05), ("1f1b", 1, 1, None), ("1f1b", 2, 2, None), ("gpipe", 3, 1, 0.05)]


def test_pipeline_2_x_data_1_every_schedule_matches_the_unsplit_model():
    run_distributed(_parity_worker, 2, CASES_PP2_DP1)


def test_pipeline_2_x_data_2_with_zero_stages_matches_the_unsplit_model():
    run_distributed(_parity_worker, 4, CASES_PP2_DP2)


def _checkpoint_worker(rank, world_size, path):
    torch.manual_seed(0)
    module = PipelinedLM()
    trainer = _trainer(
        ZeroStrategy(stage=0, pipeline_parallel_size=2, micro_batches=2), world_size, limit_val_batches=1.0
    )
    trainer.fit(module)
    trainer.save_checkpoint(path)
    # forward-only validation through the schedule; the loss equals the unsplit model's on the same data
    validated = trainer.validate(module, verbose=False)[0]["val_loss"]
    plain = PipelinedLM()
    plain.model.materialize()
    plain.load_state_dict(reference(STEPS, BATCH))
    x, y = data(16).tensors
    with torch.no_grad():
        expected = torch.stack([plain.model(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, 16, BATCH)]).mean()
    assert validated == pytest.approx(expected.item(), rel=1e-5)


def test_pipelined_checkpoint_consolidates_into_the_unsplit_module(tmp_path):
    from lightning_zero.cli import main as cli_main

    path = str(tmp_path / "pp.ckpt")
    run_distributed(_checkpoint_worker, 2, path)
    out = str(tmp_path / "model.ckpt")
    assert cli_main(["consolidate", path, out]) == 0
    loaded = PipelinedLM.load_from_checkpoint(out)  # no launcher: the plain sequential model
    expected = reference(STEPS, BATCH)
    assert set(loaded.state_dict()) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(loaded.state_dict()[key], value, atol=1e-5, rtol=0)
    x, y = data(8).tensors
    assert torch.isfinite(loaded.model(x, y))  # plain inference and loss without any process group


def _offload_worker(rank, world_size, path):
    from lightning.pytorch import Callback

    from lightning_zero.offload.optimizer_swapper import get_swapper

    class SwapFiles(Callback):
        def on_train_batch_end(self, trainer, *args):
            self.seen = getattr(self, "seen", []) + [
                get_swapper(trainer.optimizers[0]) is not None and any(files for _, _, files in os.walk(path))
            ]

    torch.manual_seed(0)
    module, files = PipelinedLM(), SwapFiles()
    strategy = ZeroStrategy(
        stage=1, pipeline_parallel_size=2, micro_batches=2, offload_optimizer="nvme", nvme_path=path
    )
    _trainer(strategy, world_size, callbacks=[files]).fit(module)
    assert files.seen == [True] * STEPS  # the states were swapped to files at every step
    got, expected = _gather_full_state(module, strategy.meshes.pipeline.get_group()), reference(STEPS, BATCH)
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5
    assert not any(files for _, _, files in os.walk(path))  # removed at teardown


def test_pipeline_with_stage_1_nvme_optimizer_offload_swaps_and_matches_the_unsplit_model(tmp_path):
    """What the refusal of offload at stages 2-3 recommends instead is honoured: stage 1 swaps the optimizer
    states of each pipeline stage to NVMe and trains like the unsplit model."""
    run_distributed(_offload_worker, 2, str(tmp_path))


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(pipeline_parallel_size=0), ValueError, "pipeline_parallel_size"),
        (dict(micro_batches=4), ValueError, "only apply with pipeline_parallel_size > 1"),
        (dict(pipeline_parallel_size=2, pipeline_schedule="wavy"), ValueError, "pipeline_schedule must be one of"),
        (
            dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", virtual_stages=1),
            ValueError,
            "virtual_stages >= 2",
        ),
        (
            dict(pipeline_parallel_size=2, stage=3, offload="cpu"),
            NotImplementedError,
            "offload_optimizer='cpu', offload_params='cpu' at stage 3",
        ),
        # the refusal names what was set (the precise form), not the shorthand
        (
            dict(pipeline_parallel_size=2, stage=2, offload_optimizer="nvme", nvme_path="/tmp"),
            NotImplementedError,
            r"with offload_optimizer='nvme' at stage 2 is not supported",
        ),
    ],
)
def test_invalid_pipeline_arguments_fail_in_the_constructor(kwargs, error, message):
    with pytest.raises(error, match=message):
        ZeroStrategy(**kwargs)
