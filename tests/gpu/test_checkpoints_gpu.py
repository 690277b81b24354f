"""Checkpoints saved and loaded on one CUDA device: the Trainer's sharded (sync and ``async_save``) and
``state_dict_type="full"`` checkpoints at stage 3 with the optimizer and the parameters offloaded to the CPU, and
Fabric's ``fabric.save``/``fabric.load`` at stages 2 and 3. A reload holds exactly the weights that were saved, and
training on from it ends where the single-process CPU reference does (tests/strategies/test_strategy_checkpoint.py's,
and tests/distributed/test_zero_parity.py's for Fabric).

Runs as `python -m pytest tests/gpu -q` on a machine with a GPU; skipped cleanly elsewhere.
"""

import os

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback, Trainer
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import wait_for_pending_saves
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from tests.distributed.test_zero_parity import LOCAL_BATCH, STEPS, TinyNet, data, make_optimizer, train_reference
from tests.gpu.single_device import (
    DEVICE,
    TRAINER_ACCELERATOR,
    assert_device_backend,
    end_process_group,
    full_weights,
    needs_device,
    start_one_rank,
    worst_difference,
)
from tests.lightning_models import RegressionModule
from tests.strategies.test_strategy_checkpoint import _reference as trainer_reference

pytestmark = needs_device

BATCH = 4
STEPS_PER_EPOCH = 2  # as tests/strategies/test_strategy_checkpoint.py, whose reference counts epochs of this many steps


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    start_one_rank(monkeypatch)
    yield
    end_process_group()


def _trainer(strategy, epochs, root, callbacks=()):
    return Trainer(
        accelerator=TRAINER_ACCELERATOR,
        devices=1,
        strategy=strategy,
        max_epochs=epochs,
        limit_train_batches=STEPS_PER_EPOCH,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        callbacks=list(callbacks),
    )


class WeightsAtTrainStart(Callback):
    """The module's weights once the checkpoint is restored, before the first resumed step."""

    def on_train_start(self, trainer, pl_module):
        self.weights = full_weights(pl_module)


@pytest.mark.parametrize("kind", ["sharded", "sharded-async", "full"])
def test_trainer_checkpoint_with_offloaded_optimizer_and_parameters(kind, tmp_path):
    settings = dict(
        stage=3,
        offload="cpu",
        async_save=kind == "sharded-async",
        state_dict_type="full" if kind == "full" else "sharded",
    )
    path = str(tmp_path / "offloaded.ckpt")
    torch.manual_seed(0)
    module = RegressionModule(batch_size=BATCH)
    _trainer(ZeroStrategy(**settings), 1, tmp_path).fit(module)
    assert_device_backend()
    assert all(p.device.type == "cpu" for p in module.parameters()), "offload='cpu' at stage 3 keeps shards on CPU"
    saved = full_weights(module)
    module.trainer.save_checkpoint(path)
    if kind == "sharded-async":
        with torch.no_grad():  # the save returned before the files landed: what changes now must not reach them
            for param in module.parameters():
                param.mul_(-3.0)
        wait_for_pending_saves()
    if kind == "full":
        assert os.path.isfile(path)
        in_file = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        assert all(torch.equal(in_file[k], v) for k, v in saved.items())
    else:
        assert os.path.isdir(path)

    torch.manual_seed(123)  # another initialisation: every weight must come from the checkpoint
    resumed, restored = RegressionModule(batch_size=BATCH), WeightsAtTrainStart()
    trainer = _trainer(ZeroStrategy(**settings), 2, tmp_path, callbacks=[restored])
    trainer.fit(resumed, ckpt_path=path)
    assert all(torch.equal(restored.weights[k], v) for k, v in saved.items()), "the reload is not what was saved"
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    worst = worst_difference(full_weights(resumed), trainer_reference(2, BATCH))
    assert worst <= 1e-4, worst  # the optimizer states came back too: the resumed run ends as the reference
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** (2 * STEPS_PER_EPOCH))


def _fabric(stage):
    fabric = Fabric(accelerator=DEVICE, devices=1, strategy=FabricZeroStrategy(stage=stage))
    fabric.launch()
    return fabric


def _fabric_steps(fabric, model, optimizer, steps):
    x, y = data(1, 1)
    for step in steps:
        rows = slice(step * LOCAL_BATCH, (step + 1) * LOCAL_BATCH)
        fabric.backward(nn.functional.mse_loss(model(fabric.to_device(x[rows])), fabric.to_device(y[rows])))
        optimizer.step()
        optimizer.zero_grad()


def _fabric_setup(fabric, seed):
    torch.manual_seed(seed)
    with fabric.init_module():
        module = TinyNet()
    return module, *fabric.setup(module, make_optimizer(module))


@pytest.mark.parametrize("stage", [2, 3])
def test_fabric_trains_saves_and_loads(stage, tmp_path):
    path = str(tmp_path / "fabric.ckpt")
    fabric = _fabric(stage)
    assert_device_backend()
    module, model, optimizer = _fabric_setup(fabric, seed=0)
    _fabric_steps(fabric, model, optimizer, range(1))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    at_save = full_weights(module)
    _fabric_steps(fabric, model, optimizer, range(1, STEPS))
    uninterrupted = full_weights(module)
    assert worst_difference(uninterrupted, train_reference(1)) <= 1e-4

    fabric = _fabric(stage)
    module, model, optimizer = _fabric_setup(fabric, seed=123)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(path, state) == {} and state["step"] == 1
    loaded = full_weights(module)
    assert all(torch.equal(loaded[k], v) for k, v in at_save.items()), "the reload is not what was saved"
    _fabric_steps(fabric, model, optimizer, range(1, STEPS))
    assert worst_difference(full_weights(module), uninterrupted) <= 1e-6  # the optimizer states came back too


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_hugging_face_export_from_the_training_device(offload, tmp_path):
    """``HuggingFaceExport`` after a stage-3 fit on the device: DCP's ``HuggingFaceStorageWriter`` writes what
    ``from_pretrained`` reads back equal to the trained weights (tied embeddings written once). Skipped where the
    GPU image lacks transformers or safetensors."""
    pytest.importorskip("safetensors")
    AutoModelForCausalLM = pytest.importorskip("transformers").AutoModelForCausalLM

    from lightning_zero import HuggingFaceExport
    from tests.checkpoint.test_hf_export import HFModule

    torch.manual_seed(0)
    module = HFModule("llama", tied=True)
    out = tmp_path / "hf"
    trainer = _trainer(ZeroStrategy(stage=3, offload=offload), 1, tmp_path, [HuggingFaceExport(out)])
    trainer.fit(module)
    assert_device_backend()
    trained = full_weights(module)
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert loaded.keys() == {key[len("model.") :] for key in trained if key.startswith("model.")}
    assert all(torch.equal(value, trained["model." + key]) for key, value in loaded.items())
