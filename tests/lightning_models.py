"""Small LightningModules shared by the Trainer-level tests (module level, so forked/spawned ranks can use them)."""

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH = 16


def quiet_trainer(strategy, world_size, *, max_steps, **kwargs):
    """A CPU Trainer for parity tests: no logger, checkpoints, progress bar, summary or validation (``kwargs`` win)."""
    defaults = dict(
        accelerator="cpu",
        devices=world_size,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    defaults.update(kwargs)
    return Trainer(strategy=strategy, **defaults)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def dataset(n=64, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen))


def make_optimizer_and_scheduler(params_with_names, lr=1e-2):
    params = list(params_with_names)
    decay = [p for n, p in params if p.ndim == 2]
    no_decay = [p for n, p in params if p.ndim != 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2}], lr=lr
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return opt, sched


class RegressionModule(LightningModule):
    """Automatic optimization, two param groups, a per-step LR scheduler."""

    def __init__(self, batch_size: int = 4, build_in_configure_model: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.net = None if build_in_configure_model else Net()

    def configure_model(self):
        if self.net is None:
            self.net = Net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        opt, sched = make_optimizer_and_scheduler(self.named_parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=self.hparams.batch_size)

    def val_dataloader(self):
        return DataLoader(dataset(16, seed=8), batch_size=self.hparams.batch_size)

    test_dataloader = val_dataloader

    def predict_dataloader(self):
        return DataLoader(dataset(16, seed=8), batch_size=self.hparams.batch_size)


class ManualModule(RegressionModule):
    """Manual optimization: the user calls backward, clipping and step."""

    def __init__(self, batch_size: int = 4):
        super().__init__(batch_size)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        return loss


def reference_weights(steps, global_batch, accumulate=1, clip=None, seed=0):
    """Train Net on one process with the same global batches, as Lightning + ZeroStrategy should."""
    torch.manual_seed(seed)
    module = RegressionModule()
    opt, sched = make_optimizer_and_scheduler(module.named_parameters())
    x_all, y_all = dataset().tensors
    # Lightning always shuffles training data with DistributedSampler(seed=0); its epoch-0 permutation, cut into
    # consecutive blocks of one global micro-batch, is what the ranks see together (within one epoch).
    order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
    x_all, y_all = x_all[order], y_all[order]
    micro = global_batch // accumulate
    for step in range(steps):
        for i in range(accumulate):
            start = (step * accumulate + i) * micro
            x, y = x_all[start : start + micro], y_all[start : start + micro]
            (nn.functional.mse_loss(module(x), y) / accumulate).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def trained_weights(trainer):
    """The whole weights a checkpoint of this run holds, on every rank: the strategy's module state dict (the fp32
    masters where the module holds bf16 replicas, each rank those it steps at stage 1), gathered and unsharded."""
    import torch.distributed as dist

    mine = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
        for k, v in trainer.strategy.lightning_module_state_dict().items()
    }
    if not dist.is_initialized():
        return mine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def full_state(module):
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }
