"""Manual optimization under ZeroStrategy trains exactly like the unsharded single-process reference.

The GAN pattern (two optimizers, ``toggle_optimizer``, ``manual_backward``, a ``training_step`` that calls
submodules or ``self.forward`` rather than ``self(...)``) on a model FSDP2 gives no sub-unit, so every parameter
sits in the root unit whose forward is still running when ``manual_backward`` is called (see
``lightning_zero/distributed/manual_backward.py``); also one optimizer with manual gradient accumulation, and
save/resume of both optimizers' states.
"""

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_zero import ZeroStrategy
from tests.lightning_models import dataset, full_state
from tests.ranks import run_distributed

BATCH = 4
WORLD = 2


class TwoLayer(nn.Module):
    """No ModuleList/Sequential: FSDP2 finds no repeated block, so the root unit owns every parameter."""

    def __init__(self, width_in, hidden, width_out):
        super().__init__()
        self.a = nn.Linear(width_in, hidden)
        self.b = nn.Linear(hidden, width_out)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def gan_step(module, x, y, opt_g, opt_d, backward, toggle, untoggle):
    """One GAN step, shared by the LightningModule and the single-process reference."""
    toggle(opt_g)
    fake = module.forward(x) if module.via_forward else module.generator(x)
    g_loss = nn.functional.mse_loss(fake, y) + module.discriminator(fake).mean()
    opt_g.zero_grad()
    backward(g_loss)
    opt_g.step()
    untoggle(opt_g)
    toggle(opt_d)
    # after opt_g.step(): the generator runs again with its new weights (must not reuse a stale gathered copy)
    fresh = module.generator(x).detach()
    d_loss = module.discriminator(fresh).pow(2).mean() - module.discriminator(y).mean()
    backward(d_loss)
    with torch.no_grad():  # a forward between the last backward and the step (logging): its gathered copy goes stale
        module.score = module.discriminator(y).mean()
    opt_d.step()
    opt_d.zero_grad()  # zeroing after the step: gradients of the g step must not have leaked into D
    untoggle(opt_d)


class GAN(LightningModule):
    def __init__(self, via_forward=False):
        super().__init__()
        self.automatic_optimization = False
        self.via_forward = via_forward
        self.generator = TwoLayer(6, 16, 3)
        self.discriminator = TwoLayer(3, 8, 1)

    def forward(self, x):
        return self.generator(x)

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        gan_step(self, *batch, opt_g, opt_d, self.manual_backward, self.toggle_optimizer, self.untoggle_optimizer)

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.generator.parameters(), lr=0.1, momentum=0.9),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.1, momentum=0.9),
        )

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=BATCH)


class Accumulating(LightningModule):
    """One optimizer, gradients accumulated by hand over two batches, a submodule called directly."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.model = TwoLayer(6, 16, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.model(x), y) / 2)
        if batch_idx % 2 == 1:
            opt = self.optimizers()
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=BATCH)


def global_batches(count):
    """The batches the ranks see together (DistributedSampler, seed 0, epoch 0), as one global batch each."""
    x_all, y_all = dataset().tensors
    order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
    for b in range(count):
        index = torch.cat([order[rank::WORLD][b * BATCH : (b + 1) * BATCH] for rank in range(WORLD)])
        yield x_all[index], y_all[index]


def reference_gan(batches, via_forward=False):
    torch.manual_seed(0)
    module = GAN(via_forward)
    opt_g, opt_d = module.configure_optimizers()
    owners = {opt_g: list(module.generator.parameters()), opt_d: list(module.discriminator.parameters())}

    def toggle(optimizer):
        for opt, params in owners.items():
            for param in params:
                param.requires_grad_(opt is optimizer)

    def untoggle(_optimizer):
        for param in module.parameters():
            param.requires_grad_(True)

    for x, y in global_batches(batches):
        gan_step(module, x, y, opt_g, opt_d, lambda loss: loss.backward(), toggle, untoggle)
    return full_state(module)


def reference_accumulating(batches):
    torch.manual_seed(0)
    module = Accumulating()
    opt = module.configure_optimizers()
    for i, (x, y) in enumerate(global_batches(batches)):
        (nn.functional.mse_loss(module.model(x), y) / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    return full_state(module)


def make_trainer(stage, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=WORLD,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return Trainer(strategy=ZeroStrategy(stage=stage), **{**defaults, **kwargs})


def assert_same(got, expected, label):
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-6, f"{label}: max abs diff {worst:.2e} from the single-process reference"


def _gan_worker(rank, world_size):
    for stage, via_forward in ((0, False), (1, True), (2, False), (3, True)):
        torch.manual_seed(0)
        module = GAN(via_forward)
        start = full_state(module)
        make_trainer(stage, max_steps=2 * 3).fit(module)  # 3 batches, two optimizer steps each
        got = full_state(module)
        assert all(not torch.equal(got[k], start[k]) for k in start), f"stage {stage}: a weight never changed"
        assert_same(got, reference_gan(3, via_forward), f"GAN stage={stage} via_forward={via_forward}")


def test_gan_two_optimizers_toggle_and_submodule_calls_match_reference():
    run_distributed(_gan_worker, WORLD)


def _accumulation_worker(rank, world_size):
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        module = Accumulating()
        make_trainer(stage, max_steps=2, limit_train_batches=4).fit(module)
        assert_same(full_state(module), reference_accumulating(4), f"manual accumulation stage={stage}")


def test_manual_gradient_accumulation_matches_reference():
    run_distributed(_accumulation_worker, WORLD)


def _resume_worker(rank, world_size, root):
    from torch.distributed.tensor import DTensor

    for stage in (1, 3):
        torch.manual_seed(0)
        straight = GAN()
        make_trainer(stage, max_epochs=2, limit_train_batches=2).fit(straight)

        torch.manual_seed(0)
        first = GAN()
        trainer = make_trainer(stage, max_epochs=1, limit_train_batches=2)
        trainer.fit(first)
        path = f"{root}/stage{stage}.ckpt"
        trainer.save_checkpoint(path)

        torch.manual_seed(1)  # different initial weights: everything must come from the checkpoint
        resumed = GAN()
        trainer = make_trainer(stage, max_epochs=2, limit_train_batches=2)
        trainer.fit(resumed, ckpt_path=path)
        assert_same(full_state(resumed), full_state(straight), f"resume stage={stage}")
        if stage == 3:
            assert all(isinstance(p, DTensor) for p in resumed.parameters())


def test_save_mid_run_and_resume_both_optimizers_equals_uninterrupted(tmp_path):
    run_distributed(_resume_worker, WORLD, str(tmp_path))
