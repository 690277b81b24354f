"""Code written for other strategies, run under ``ZeroStrategy`` stages 0-3 and compared with Lightning's
``DDPStrategy`` (2 gloo ranks, same seed, same data): weights, logged metrics, gathered and predicted outputs.

The patterns are those of ordinary LightningModules (and of Lightning's ``tests_pytorch/models/test_hooks.py`` and
``test_restore.py``): tied weights, one module under two names, a frozen part, a non-persistent buffer, parameters
created in ``setup()``, dropout, a ``torch.compile``d submodule, a penalty on the parameters in ``training_step``,
the user's own ``clip_grad_norm_``, torchmetrics updated per step, ``self.all_gather``, gradient accumulation,
``ModelCheckpoint(monitor=...)`` with ``ckpt_path="best"``, ``predict(return_predictions=True)``, the order of the
hooks and the modules' train/eval modes, fitting the same module twice, gradient hooks on parameters, and an
optimizer that creates its states in its constructor (torch's Adagrad).
"""

import functools

import pytest
import torch
import torchmetrics
from lightning.pytorch import LightningModule, seed_everything
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.conformance.models import full_state, trainer, zero
from tests.ranks import run_distributed

TOLERANCE = 1e-5
STAGES = [pytest.param(stage, id=f"s{stage}") for stage in range(4)]


def _data(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen))


def _assert_close(got, expected, path="result"):
    """Equal structure, values within fp32 tolerance; DTensors are compared as full tensors."""
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), f"{path}: keys {sorted(set(got) ^ set(expected))}"
        for key in expected:
            _assert_close(got[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), f"{path}: {len(got)} items, DDP has {len(expected)}"
        for i, (a, b) in enumerate(zip(got, expected)):
            _assert_close(a, b, f"{path}[{i}]")
    elif isinstance(expected, torch.Tensor):
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert got.shape == expected.shape, f"{path}: shape {tuple(got.shape)}, DDP has {tuple(expected.shape)}"
        torch.testing.assert_close(got.float(), expected.float(), rtol=TOLERANCE, atol=TOLERANCE, msg=path)
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, rel=TOLERANCE, abs=TOLERANCE), path
    else:
        assert got == expected, path


# ---------------------------------------------------------------------------------------------- many patterns
class Patterns(LightningModule):
    """One module holding the patterns that must train exactly as under DDP."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 16)
        self.head = nn.Linear(16, 12, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter under two names
        self.inp = nn.Linear(6, 16)
        self.block = nn.Linear(16, 16)
        self.again = self.block  # one module under two names, applied twice
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.compiled = torch.compile(nn.Linear(16, 16), backend="aot_eager")
        self.drop = nn.Dropout(0.2)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16), persistent=False)
        self.late = None
        self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=3, dist_sync_on_step=True)
        self.gathered, self.clip_norms = [], []

    def setup(self, stage):
        if self.late is None:  # a parameter created in the setup hook, before the strategy wraps the model
            self.late = nn.Linear(16, 3)

    def forward(self, x):
        ids = (x.abs() * 2).long().clamp(max=11)
        h = torch.tanh(self.inp(self.drop(x))) * self.scale + self.emb(ids).mean(1)
        h = h + torch.tanh(self.block(h)) + torch.tanh(self.again(h)) + torch.tanh(self.frozen(h))
        h = h + torch.tanh(self.compiled(h))
        return self.late(h) + self.head(h)[:, :3]

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        penalty = sum(p.pow(2).sum() for p in self.parameters() if p.requires_grad)
        self.acc(out, y)
        self.log("train_acc", self.acc, on_step=True, on_epoch=True)
        return nn.functional.cross_entropy(out, y) + 1e-3 * penalty

    def on_before_optimizer_step(self, optimizer):
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.parameters() if p.requires_grad], 0.5)
        self.clip_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.gathered.append(self.all_gather(out).detach().clone())
        self.log("val_loss", nn.functional.cross_entropy(out, y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.05)

    def train_dataloader(self):
        return DataLoader(_data(32, 7), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(16, 8), batch_size=4)

    test_dataloader = predict_dataloader = val_dataloader


def _run_patterns(strategy, root):
    seed_everything(0)
    module = Patterns()
    best = ModelCheckpoint(dirpath=root, monitor="val_loss", save_top_k=1)
    t = trainer(
        strategy,
        max_steps=-1,
        max_epochs=3,
        limit_train_batches=4,
        limit_val_batches=2,
        accumulate_grad_batches=2,
        callbacks=[best],
        enable_checkpointing=True,
    )
    t.fit(module)
    result = {
        "state": full_state(module),
        "metrics": {k: float(v) for k, v in t.callback_metrics.items()},
        "gathered": list(module.gathered),
        "clip_norms": module.clip_norms,
        "best_score": float(best.best_model_score),
        "best": best.best_model_path.rsplit("/", 1)[-1],
        "scale": module.scale.clone(),
        "keys": sorted(module.state_dict()),
    }
    result["test"] = t.test(module, ckpt_path="best", verbose=False)
    result["predictions"] = torch.cat(t.predict(module, return_predictions=True))
    assert module.head.weight is module.emb.weight and module.again is module.block
    return result


def _patterns_worker(rank, world_size, stage, root):
    expected = _run_patterns(DDPStrategy(), f"{root}/ddp")
    assert "scale" not in expected["keys"], "a non-persistent buffer is not part of the state dict"
    _assert_close(_run_patterns(zero(stage), f"{root}/zero"), expected)


@pytest.mark.parametrize("stage", STAGES)
def test_user_patterns_train_like_ddp(tmp_path, stage):
    run_distributed(_patterns_worker, 2, stage, str(tmp_path))


# ---------------------------------------------------------------------------------------------- hooks and modes
HOOKS = (
    "setup",
    "configure_model",
    "configure_optimizers",
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "optimizer_zero_grad",
    "optimizer_step",
    "lr_scheduler_step",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_model_eval",
    "on_validation_start",
    "on_validation_batch_start",
    "validation_step",
    "on_validation_batch_end",
    "on_validation_end",
    "on_validation_model_train",
    "on_train_end",
    "on_fit_end",
    "on_test_model_eval",
    "on_test_start",
    "test_step",
    "on_test_end",
    "on_predict_model_eval",
    "on_predict_start",
    "predict_step",
    "on_predict_end",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
    "teardown",
)


class Hooked(Patterns):
    """Records every hook with the module's mode, a user-frozen dropout's mode and grad mode at the call (the
    dropout is put in ``eval()`` by the user in ``on_fit_start``: Lightning restores it after validation)."""

    def __init__(self):
        super().__init__()
        self.calls = []
        for name in HOOKS:
            object.__setattr__(self, name, self._recording(name, getattr(self, name)))

    def _recording(self, name, hook):
        @functools.wraps(hook)
        def record(*args, **kwargs):
            self.calls.append((name, self.training, self.drop.training, torch.is_grad_enabled()))
            return hook(*args, **kwargs)

        return record

    def on_fit_start(self):
        self.drop.eval()

    def configure_optimizers(self):
        opt = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


def _run_hooks(strategy):
    seed_everything(0)
    module = Hooked()
    t = trainer(strategy, max_steps=-1, max_epochs=2, limit_train_batches=2, limit_val_batches=1)
    t.fit(module)
    t.validate(module, verbose=False)
    t.test(module, verbose=False)
    t.predict(module, return_predictions=False)
    return module.calls, full_state(module)


def _hooks_worker(rank, world_size, stage):
    expected_calls, expected_state = _run_hooks(DDPStrategy())
    calls, state = _run_hooks(zero(stage))
    assert calls == expected_calls
    _assert_close(state, expected_state)


@pytest.mark.parametrize("stage", [pytest.param(0, id="s0"), pytest.param(3, id="s3")])
def test_hook_order_and_module_modes_as_under_ddp(stage):
    run_distributed(_hooks_worker, 2, stage)


# ---------------------------------------------------------------------------------------------- fit twice, early stop
def _fit_twice(strategy_factory):
    seed_everything(0)
    module = Patterns()
    t = trainer(strategy_factory(), max_steps=-1, max_epochs=1, limit_train_batches=2)
    t.fit(module)
    t.fit_loop.max_epochs = 2  # Lightning's test_restore.py::test_fit_twice: the same trainer goes on
    t.fit(module)
    after_same_trainer = full_state(module)
    stopper = EarlyStopping(monitor="val_loss", patience=1)
    t = trainer(
        strategy_factory(), max_steps=-1, max_epochs=20, limit_train_batches=2, limit_val_batches=2, callbacks=[stopper]
    )
    t.fit(module)  # a new trainer on the module the first one trained
    return {
        "first": after_same_trainer,
        "second": full_state(module),
        "stopped": t.current_epoch,
        "val_loss": float(t.callback_metrics["val_loss"]),
    }


def _fit_twice_worker(rank, world_size, stage):
    expected = _fit_twice(DDPStrategy)
    assert expected["stopped"] < 20, "early stopping never stopped the reference: the comparison proves little"
    _assert_close(_fit_twice(lambda: zero(stage)), expected)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_fitting_the_same_module_again_and_early_stopping(stage):
    run_distributed(_fit_twice_worker, 2, stage)


# ---------------------------------------------------------------------------------------------- gradient hooks
class GradientHook(LightningModule):
    """Half of a weight kept fixed by a hook on its gradient (gradient masking), registered in ``__init__`` or, with
    ``late``, in ``on_fit_start`` (after the strategy set the model up)."""

    def __init__(self, late=False):
        super().__init__()
        self.late = late
        self.inp, self.block, self.out = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        if not late:
            self._mask_gradient()

    def _mask_gradient(self):
        mask = torch.ones(16, 16)
        mask[:8] = 0
        self.block.weight.register_hook(lambda grad: grad * mask)

    def on_fit_start(self):
        if self.late:
            self._mask_gradient()

    def forward(self, x):
        return self.out(torch.tanh(self.block(torch.tanh(self.inp(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(_data(32, 7), batch_size=4)


def _gradient_hook_worker(rank, world_size):
    seed_everything(0)
    initial = GradientHook().block.weight.detach().clone()
    for late in (False, True):
        for strategy in (DDPStrategy(), zero(0), zero(1)):
            seed_everything(0)
            module = GradientHook(late)
            trainer(strategy, max_steps=3).fit(module)
            weight = full_state(module)["block.weight"]
            assert torch.equal(weight[:8], initial[:8]), f"{type(strategy).__name__} late={late}: the hook did not run"
            assert not torch.equal(weight[8:], initial[8:])
        for stage in (2, 3):  # the hook would be lost silently: refused, naming the parameter
            seed_everything(0)
            module = GradientHook(late)
            with pytest.raises(ValueError, match=r"'block\.weight' have gradient hooks"):
                trainer(zero(stage), max_steps=3).fit(module)
            assert torch.equal(full_state(module)["block.weight"], initial), "refused before any step"


def test_gradient_hooks_on_parameters_run_or_are_refused():
    run_distributed(_gradient_hook_worker, 2)


# ---------------------------------------------------------------------------------------------- Adagrad
class AdagradModule(GradientHook):
    """torch's Adagrad creates its states in its constructor, before any step."""

    def __init__(self):
        super().__init__(late=True)  # no hook: on_fit_start below does not add one

    def on_fit_start(self):
        pass

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.1, initial_accumulator_value=0.1)


def _adagrad_worker(rank, world_size):
    def fit(strategy):
        seed_everything(0)
        module = AdagradModule()
        t = trainer(strategy, max_steps=3)
        t.fit(module)
        return full_state(module), t.optimizers[0]

    expected, _ = fit(DDPStrategy())
    for stage, offload in ((0, None), (1, None), (1, "cpu"), (2, None), (3, None)):
        state, optimizer = fit(zero(stage, offload))
        _assert_close(state, expected, f"stage {stage} offload={offload}")
        assert all(float(s["step"]) == 3 for s in optimizer.state.values())


def test_optimizer_states_made_by_the_constructor():
    run_distributed(_adagrad_worker, 2)


# ---------------------------------------------------------------------------------------------- gradient hooks: Fabric
def _fabric_gradient_hook_worker(rank, world_size, stage):
    from tests.conformance.fabric_models import IN, OUT, full_weights, make_fabric, train_step

    mask = torch.ones(OUT, IN)
    mask[0] = 0  # the first output row keeps its weights
    fabric = make_fabric(stage=stage)
    for late in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(IN, OUT)
        initial = model.weight.detach().clone()
        if not late:
            model.weight.register_hook(lambda grad: grad * mask)
        if stage >= 2 and not late:
            with pytest.raises(ValueError, match=r"'weight' have gradient hooks"):
                fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            continue
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        if late:  # on the parameter the set-up model holds (at stages 2-3 a shard)
            model.weight.register_hook(lambda grad: grad * mask)
        if stage >= 2:
            with pytest.raises(ValueError, match=r"'weight' have gradient hooks"):
                train_step(fabric, model, optimizer)
            continue
        train_step(fabric, model, optimizer)
        weight = full_weights(model)["weight"]
        assert torch.equal(weight[0], initial[0]), f"late={late}: the hook did not run"
        assert not torch.equal(weight[1], initial[1])


@pytest.mark.parametrize("stage", [pytest.param(1, id="s1"), pytest.param(3, id="s3")])
def test_fabric_gradient_hooks_on_parameters_run_or_are_refused(stage):
    run_distributed(_fabric_gradient_hook_worker, 2, stage)


# ---------------------------------------------------------------------------------------------- unfreezing
class Unfreezing(GradientHook):
    """``block`` frozen before setup, unfrozen by the user at the second epoch (as ``BackboneFinetuning`` does)."""

    def __init__(self):
        super().__init__(late=True)
        self.block.requires_grad_(False)

    def on_fit_start(self):
        pass

    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            self.block.requires_grad_(True)


def _unfreezing_worker(rank, world_size):
    def fit(stage):
        seed_everything(0)
        module = Unfreezing()
        trainer(zero(stage), max_steps=-1, max_epochs=2, limit_train_batches=3).fit(module)
        return full_state(module)

    # FSDP2 (stage 3) reduces every gradient it gets; DDP (stages 0-1) only those of parameters trainable at setup
    expected = fit(3)
    seed_everything(0)
    assert not torch.equal(expected["block.weight"], Unfreezing().block.weight), "the unfrozen block did not train"
    for stage in (0, 1):
        state = fit(stage)
        _assert_close(state, expected, f"stage {stage}")
        gathered = [None] * world_size
        torch.distributed.all_gather_object(gathered, state["block.weight"])
        assert torch.equal(gathered[0], gathered[1]), f"stage {stage}: the ranks drifted apart"


def test_a_part_unfrozen_after_setup_trains_on_the_global_gradient():
    run_distributed(_unfreezing_worker, 2)


def _fabric_unfreezing_worker(rank, world_size):
    from lightning.fabric import Fabric

    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy

    def fit(stage):
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=FabricZeroStrategy(stage=stage))
        fabric.launch()
        fabric.seed_everything(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        model[0].requires_grad_(False)  # frozen at setup, unfrozen below (as BackboneFinetuning does)
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for p in model.parameters():
            p.requires_grad_(True)
        gen = torch.Generator().manual_seed(rank)  # each rank its own batches
        for step in range(4):
            x, y = torch.randn(4, 4, generator=gen), torch.randn(4, 1, generator=gen)
            with fabric.no_backward_sync(model, enabled=step % 2 == 0):  # accumulation over two batches
                fabric.backward(nn.functional.mse_loss(model(x), y))
            if step % 2 == 1:
                fabric.clip_gradients(model, optimizer, max_norm=0.05)  # sees the averaged gradients
                optimizer.step()
                optimizer.zero_grad()
        state = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()
        }
        return state

    expected = fit(3)  # FSDP2 reduces every gradient it gets
    for stage in (0, 1):
        state = fit(stage)
        _assert_close(state, expected, f"fabric stage {stage}")


def test_fabric_a_part_unfrozen_after_setup_trains_on_the_global_gradient():
    run_distributed(_fabric_unfreezing_worker, 2)
