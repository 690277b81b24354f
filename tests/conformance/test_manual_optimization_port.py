"""The patterns of Lightning's manual-optimization guide at stages 2-3, equal to Lightning's ``DDPStrategy``.

Source read: ``docs/source-pytorch/model/manual_optimization.rst`` (Lightning-AI/pytorch-lightning): the minimal
loop, gradient accumulation by hand, ``self.clip_gradients``, the two-optimizer GAN, learning-rate schedulers
stepped by hand, optimizers stepped at different frequencies, and ``opt.step(closure=...)``; plus
``toggle_optimizer``/``untoggle_optimizer`` and ``toggled_optimizer`` (``LightningModule``), and the GAN whose
generator runs through ``self(z)`` (the LightningModule's own ``forward``) rather than the submodule.

Each pattern trains 3 batches on 2 gloo ranks under ``DDPStrategy`` and under ``ZeroStrategy`` at stages 2 and 3,
from the same weights on the same data; every weight must move, and the sharded runs must end where DDP ends. The
generator's layers sit in a ``ModuleList`` of repeated blocks (FSDP2 units of their own), the rest in the root unit,
so both kinds of unit are crossed by every backward.
"""

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.conformance.models import full_state, max_abs_diff, trainer, zero
from tests.ranks import run_distributed

WORLD, BATCHES, NOISE = 2, 3, 4


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Generator(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.inp = nn.Linear(NOISE, 8)
        self.blocks = nn.ModuleList(Block(8) for _ in range(2)) if blocks else nn.ModuleList()

    def forward(self, z):
        x = self.inp(z)
        for block in self.blocks:
            x = block(x)
        return x


class ManualBase(LightningModule):
    """Generator (blocks: FSDP2 sub-units) and discriminator (root unit), data of 8 features per sample."""

    def __init__(self, blocks=True):
        super().__init__()
        self.automatic_optimization = False
        self.generator = Generator(blocks)
        self.discriminator = nn.Linear(8, 1)

    def forward(self, z):
        return self.generator(z)

    def noise(self, n, batch_idx):
        """The same noise for a rank and batch under every strategy (no draw from the global generator)."""
        gen = torch.Generator().manual_seed(1000 * self.global_rank + batch_idx)
        return torch.randn(n, NOISE, generator=gen)

    def regression_loss(self, batch):
        (x,) = batch
        return (self.discriminator(self(x[:, :NOISE])) - x[:, NOISE:].sum(1, keepdim=True)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(7))), batch_size=4)


class TwoOptimizers(ManualBase):
    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.generator.parameters(), lr=0.05, momentum=0.9),
            torch.optim.Adam(self.discriminator.parameters(), lr=0.01),
        )


class GanThroughSelf(TwoOptimizers):
    """The generator runs through ``self(z)``, then the discriminator is called directly after the first step."""

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        z = self.noise(4, batch_idx)
        g = self.discriminator(self(z)).mean()
        self.manual_backward(g)
        opt_g.step()
        opt_g.zero_grad()
        d = self.discriminator(batch[0]).mean()
        self.manual_backward(d)
        opt_d.step()
        opt_d.zero_grad()


class GuideGan(TwoOptimizers):
    """The guide's ``SimpleGAN``: discriminator on real and detached fake samples, then the generator through it."""

    def training_step(self, batch, batch_idx):
        g_opt, d_opt = self.optimizers()
        (x,) = batch
        criterion = nn.functional.binary_cross_entropy_with_logits
        real, fake = torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1)
        g_x = self(self.noise(x.shape[0], batch_idx))
        err_d = criterion(self.discriminator(x), real) + criterion(self.discriminator(g_x.detach()), fake)
        d_opt.zero_grad()
        self.manual_backward(err_d)
        d_opt.step()
        err_g = criterion(self.discriminator(g_x), real)
        g_opt.zero_grad()
        self.manual_backward(err_g)
        g_opt.step()
        self.log_dict({"g_loss": err_g, "d_loss": err_d}, sync_dist=True)


class ToggledGan(TwoOptimizers):
    """``toggle_optimizer``/``untoggle_optimizer`` around the generator step, ``toggled_optimizer`` around the
    discriminator's: the frozen side must collect no gradient."""

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        (x,) = batch
        self.toggle_optimizer(opt_g)
        g_loss = -self.discriminator(self(self.noise(x.shape[0], batch_idx))).mean()
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        with self.toggled_optimizer(opt_d):
            fake = self(self.noise(x.shape[0], batch_idx + 100))
            d_loss = self.discriminator(fake).pow(2).mean() - self.discriminator(x).mean()
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()


class DifferentFrequencies(TwoOptimizers):
    """The guide's alternating schedule: the discriminator steps every other batch, the generator every batch."""

    def training_step(self, batch, batch_idx):
        g_opt, d_opt = self.optimizers()
        (x,) = batch
        g_x = self(self.noise(x.shape[0], batch_idx))
        err_d = self.discriminator(g_x.detach()).pow(2).mean() - self.discriminator(x).mean()
        d_opt.zero_grad()
        self.manual_backward(err_d)
        if (batch_idx + 1) % 2 == 0:
            d_opt.step()
        err_g = -self.discriminator(g_x).mean()
        g_opt.zero_grad()
        self.manual_backward(err_g)
        g_opt.step()


class Minimal(ManualBase):
    """The guide's first example, with a per-step scheduler stepped by hand."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.regression_loss(batch))
        opt.step()
        self.lr_schedulers().step()

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


class Accumulation(ManualBase):
    """Gradients of two batches accumulated by hand, then one step."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.regression_loss(batch) / 2)
        if (batch_idx + 1) % 2 == 0:
            opt.step()
            opt.zero_grad()


class Clipping(ManualBase):
    """``self.clip_gradients(opt, 0.5, "norm")`` between backward and step (a bound the gradients exceed)."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = 10 * self.regression_loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()


class Closure(ManualBase):
    """``opt.step(closure=closure)``, the closure doing forward, ``zero_grad`` and backward."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()

        def closure():
            loss = self.regression_loss(batch)
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure)


PATTERNS = {
    cls.__name__: cls
    for cls in (GanThroughSelf, GuideGan, ToggledGan, DifferentFrequencies, Minimal, Accumulation, Clipping, Closure)
}


def _fit(pattern, strategy, blocks):
    torch.manual_seed(0)
    module = PATTERNS[pattern](blocks)
    start = full_state(module)
    trainer(strategy, max_steps=-1, max_epochs=1, limit_train_batches=BATCHES).fit(module)
    got = full_state(module)
    unchanged = [k for k in start if torch.equal(start[k], got[k])]
    assert not unchanged, f"{pattern} under {type(strategy).__name__}: weights never changed: {unchanged}"
    return got


def _parity_worker(rank, world_size, pattern, stages, blocks):
    expected = _fit(pattern, DDPStrategy(find_unused_parameters=True), blocks)
    for stage in stages:
        stage, offload = stage if isinstance(stage, tuple) else (stage, None)
        worst = max_abs_diff(_fit(pattern, zero(stage, offload), blocks), expected)
        assert worst <= 1e-6, f"{pattern} stage {stage} offload {offload}: max abs diff {worst:.2e} from DDP"


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_manual_optimization_pattern_equals_ddp(pattern):
    run_distributed(_parity_worker, WORLD, pattern, (2, 3), True)


def test_gan_through_self_with_only_root_parameters_equals_ddp():
    """The smallest failing case: two bare ``nn.Linear`` (no sub-unit), ``self(z)`` then ``self.discriminator``."""
    run_distributed(_parity_worker, WORLD, "GanThroughSelf", (2, 3), False)


@pytest.mark.parametrize("pattern", ["GuideGan", "DifferentFrequencies"])
def test_zero_grad_clears_gradients_the_optimizer_does_not_hold(pattern):
    """A backward the optimizer does not step (the generator's loss through the discriminator; a discriminator
    stepped every other batch) leaves gradients on the parameters a partitioned (stage 1) or offloaded optimizer
    does not hold; its ``zero_grad`` must clear them, as DDP's clears every parameter."""
    run_distributed(_parity_worker, WORLD, pattern, ((1, None), (2, "cpu")), True)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_manual_optimization_pattern_equals_ddp_without_blocks(pattern):
    run_distributed(_parity_worker, WORLD, pattern, (0, 1, (1, "cpu"), 2, (2, "cpu"), 3, (3, "cpu")), False)


class LbfgsClosure(Closure):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def _lbfgs_worker(rank, world_size):
    with pytest.raises(TypeError, match="LBFGS"):
        trainer(zero(2), max_steps=1).fit(LbfgsClosure())


def test_lbfgs_closure_is_refused_by_name():
    """The guide's closure example names ``LBFGS``, which re-evaluates the closure; the guide warns it is not
    supported with DeepSpeed, and ZeroStrategy refuses it naming the optimizer rather than stepping wrongly."""
    run_distributed(_lbfgs_worker, WORLD)


class GanNet(nn.Module):
    """The alternating GAN step as Fabric scripts write it: every loss through the wrapped module's forward."""

    def __init__(self):
        super().__init__()
        self.generator = Generator(blocks=True)
        self.discriminator = nn.Linear(8, 1)

    def forward(self, z, x, part):
        fake = self.generator(z)
        if part == "d":
            return self.discriminator(fake.detach()).pow(2).mean() - self.discriminator(x).mean()
        return -self.discriminator(fake).mean()


def _fabric_gan(strategy, rank):
    from tests.fabric.test_fabric_parity import make_fabric

    fabric = make_fabric(strategy)
    torch.manual_seed(0)
    module = GanNet()
    model, opt_g, opt_d = fabric.setup(
        module,
        torch.optim.SGD(module.generator.parameters(), lr=0.05, momentum=0.9),
        torch.optim.SGD(module.discriminator.parameters(), lr=0.05),  # not Adam: its first step hides a wrong size
    )
    data = torch.randn(3, WORLD, 4, 8, generator=torch.Generator().manual_seed(7))
    for i in range(3):
        x = data[i, rank]
        z = torch.randn(4, NOISE, generator=torch.Generator().manual_seed(1000 * rank + i))
        opt_d.zero_grad()  # the wrapper Fabric built over the optimizer
        fabric.backward(model(z, x, "d"))
        if i % 2 == 1:
            opt_d.step()
        opt_g.zero_grad()
        fabric.backward(model(z, x, "g"))
        opt_g.step()
    inner = model._forward_module
    return full_state(getattr(inner, "module", inner))


def _fabric_zero_grad_worker(rank, world_size):
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy

    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy

    expected = _fabric_gan(FabricDDPStrategy(find_unused_parameters=True), rank)
    for stage, offload in ((1, None), (2, "cpu")):
        ddp = {"find_unused_parameters": True} if stage <= 1 else {}  # a DDP option: refused at stages 2-3
        strategy = FabricZeroStrategy(stage=stage, offload=offload, **ddp)
        worst = max_abs_diff(_fabric_gan(strategy, rank), expected)
        assert worst <= 1e-6, f"Fabric stage {stage} offload {offload}: max abs diff {worst:.2e} from DDP"


def test_fabric_optimizer_zero_grad_clears_gradients_the_optimizer_does_not_hold():
    """The same under Fabric: ``zero_grad`` on the optimizer Fabric wraps reaches the partitioned optimizer's."""
    run_distributed(_fabric_zero_grad_worker, WORLD)
