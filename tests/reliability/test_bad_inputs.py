"""Bad inputs, table-driven: none silent, none cryptic, none late.

Every row is one bad input. The test asserts the exception type, that the message names the offending input, and
that it surfaced before any process group existed: ``torch.distributed.is_initialized()`` is false afterwards and
``ZeroStrategy``'s ``_init_dist_connection`` is patched to fail the test if it is ever reached.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_zero import ZeroStrategy
from lightning_zero.adapters import launch_checks as validation
from lightning_zero.checkpoint import CheckpointError, CheckpointSaveError
from lightning_zero.ds_config import DeepSpeedConfigError
from tests.lightning_models import RegressionModule, dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def no_process_group(monkeypatch):
    """Fail on any attempt to start a process group; restore the environment Lightning's launcher writes into."""
    saved = dict(os.environ)

    def reached(*args, **kwargs):
        raise AssertionError("init_process_group was reached: the bad input was not refused before it")

    monkeypatch.setattr("lightning_zero.adapters.process_group._init_dist_connection", reached)
    for name in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE", "RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    yield
    assert not dist.is_initialized()
    os.environ.clear()
    os.environ.update(saved)


# ---------------------------------------------------------------------------------------------------- strategy args
STRATEGY_ARGS = [
    ("timeout-negative", dict(timeout=-1), ValueError, "timeout"),
    ("timeout-zero", dict(timeout=0), ValueError, "timeout"),
    ("timeout-inf", dict(timeout=math.inf), ValueError, "timeout"),
    ("timeout-negative-timedelta", dict(timeout=timedelta(seconds=-5)), ValueError, "timeout"),
    ("timeout-string", dict(timeout="30"), TypeError, "timeout"),
    ("timeout-bool", dict(timeout=True), TypeError, "timeout"),
    ("backend-unknown", dict(process_group_backend="foo"), ValueError, "'foo'"),
    ("backend-empty", dict(process_group_backend=""), TypeError, "process_group_backend"),
    ("backend-not-str", dict(process_group_backend=3), TypeError, "process_group_backend"),
    ("backend-per-device-unknown", dict(process_group_backend="cpu:gloo,cuda:foo"), ValueError, "'foo'"),
    ("stage-5", dict(stage=5), ValueError, "stage"),
    ("stage-str", dict(stage="2"), ValueError, "stage"),
    ("offload-disk", dict(offload="disk"), ValueError, "offload"),
    ("offload-stage-0", dict(stage=0, offload="cpu"), ValueError, "offload"),
    ("pin-memory-str", dict(pin_memory="yes"), TypeError, "pin_memory"),
    ("pin-memory-no-offload", dict(pin_memory=True), ValueError, "pin_memory"),
    ("sharded-classes-int", dict(sharded_module_classes=[3]), TypeError, "sharded_module_classes"),
    ("sharded-classes-stage-1", dict(stage=1, sharded_module_classes=["Block"]), ValueError, "sharded_module_classes"),
    ("reshard-stage-2", dict(stage=2, reshard_after_forward=True), ValueError, "reshard_after_forward"),
    ("reshard-zero", dict(stage=3, reshard_after_forward=0), ValueError, "reshard_after_forward"),
    ("start-method", dict(start_method="thread"), ValueError, "start_method"),
    ("async-save-str", dict(async_save="yes"), TypeError, "async_save"),
    ("load-full-weights-str", dict(load_full_weights="yes"), TypeError, "load_full_weights"),
    ("checkpoint-io", dict(checkpoint_io=object()), ValueError, "checkpoint_io"),
    ("comm-dtype", dict(communication_data_type="fp8"), ValueError, "fp8"),
    ("loss-scale-negative", dict(loss_scale=-1), ValueError, "loss_scale"),
    ("pipeline-size-zero", dict(pipeline_parallel_size=0), ValueError, "pipeline_parallel_size"),
    ("micro-batches-no-pipeline", dict(micro_batches=4), ValueError, "micro_batches"),
    ("pipeline-schedule", dict(pipeline_parallel_size=2, pipeline_schedule="zigzag"), ValueError, "zigzag"),
    ("strict-str", dict(config={}, strict="yes"), TypeError, "strict"),
    ("config-int", dict(config=3), TypeError, "DeepSpeed config"),
    ("config-empty-string", dict(config=""), DeepSpeedConfigError, "empty string"),
]
if not dist.is_nccl_available():
    STRATEGY_ARGS.append(("backend-nccl-unavailable", dict(process_group_backend="nccl"), ValueError, "nccl"))


@pytest.mark.parametrize(
    "kwargs,error,message", [row[1:] for row in STRATEGY_ARGS], ids=[row[0] for row in STRATEGY_ARGS]
)
def test_bad_strategy_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        ZeroStrategy(**kwargs)


# ---------------------------------------------------------------------------------------------------- ds_config files
CONFIG_FILES = [
    ("empty-json", "ds.json", b"", "is empty"),
    ("whitespace-json", "ds.json", b"  \n\t\n", "is empty"),
    ("empty-yaml", "ds.yaml", b"", "is empty"),
    ("yaml-syntax", "ds.yaml", b"zero_optimization:\n  stage: 2\n   bad: 1\n", r"not valid YAML at line 3, column \d"),
    ("yaml-flow-syntax", "ds.yml", b"a: [1, 2\nb: 3\n", r"not valid YAML at line 2"),
    ("json-syntax", "ds.json", b'{\n  "zero_optimization": {"stage": 2\n  "x": [1,\n}', r"line \d+ column \d+"),
    ("binary-nul", "ds.json", bytes(range(256)), "binary file"),
    ("latin-1", "ds.json", '{"comment": "café"}'.encode("latin-1"), "not UTF-8 text"),
    ("utf-16", "ds.json", '{"a": 1}'.encode("utf-16"), "is UTF-16 text"),
    ("top-level-list", "ds.json", b"[1, 2]", "JSON object"),
    ("top-level-scalar-yaml", "ds.yaml", b"just a string\n", "JSON object"),
    ("nan-value", "ds.json", b'{"gradient_clipping": NaN}', "NaN"),
    ("infinity-value", "ds.json", b'{"gradient_clipping": Infinity}', "Infinity"),
    ("duplicate-keys", "ds.json", b'{"steps_per_print": 1, "steps_per_print": 2}', "duplicate key 'steps_per_print'"),
]


@pytest.mark.parametrize("name,content,message", [row[1:] for row in CONFIG_FILES], ids=[r[0] for r in CONFIG_FILES])
def test_bad_config_file(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DeepSpeedConfigError, match=message) as info:
        ZeroStrategy(config=str(path))
    if not any(word in message for word in ("NaN", "Infinity", "duplicate", "JSON object")):
        assert str(path) in str(info.value)  # the message names the file


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(DeepSpeedConfigError, match="does not exist"):
        ZeroStrategy(config=str(tmp_path / "nope.json"))
    with pytest.raises(DeepSpeedConfigError, match="is a directory"):
        ZeroStrategy(config=str(tmp_path))


# ------------------------------------------------------------------------------------------------ ds_config contents
CONFIG_CONTENTS = [
    ("optimizer-unknown", {"optimizer": {"type": "Adamm", "params": {"lr": 1e-3}}}, "'Adamm'"),
    ("optimizer-negative-lr", {"optimizer": {"type": "AdamW", "params": {"lr": -1, "torch_adam": True}}}, "lr"),
    ("optimizer-unknown-param", {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentom": 0.9}}}, "momentom"),
    ("optimizer-max-grad-norm", {"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "max_grad_norm"),
    ("optimizer-unsupported", {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "OneBitAdam"),
    ("optimizer-not-object", {"optimizer": "AdamW"}, "optimizer"),
    ("scheduler-unknown", {"scheduler": {"type": "WarmupLinear", "params": {}}}, "'WarmupLinear'"),
    (
        "scheduler-zero-warmup",
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
        "warmup_num_steps",
    ),
    ("scheduler-unknown-param", {"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}}, "warmup_steps"),
    ("scheduler-bad-type", {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}}, "warmup_type"),
    ("stage-7", {"zero_optimization": {"stage": 7}}, "zero_optimization.stage"),
    ("stage-auto", {"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage"),
    ("fp16-and-bf16", {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled"),
    ("train-batch-negative", {"train_batch_size": -8}, "train_batch_size"),
    ("micro-batch-float", {"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu"),
    ("top-level-typo", {"zero_optimizatoin": {"stage": 2}}, "zero_optimization"),
    ("offload-stage-0", {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "stage is 0"),
    ("offload-device", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}, "device"),
    ("clipping-string", {"gradient_clipping": "x"}, "gradient_clipping"),
    (
        "gather-16bit-string",
        {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "yes"}},
        "stage3_gather_16bit_weights_on_model_save",
    ),
    ("comm-dtype", {"communication_data_type": "int8"}, "communication_data_type"),
    ("steps-per-print-zero", {"steps_per_print": 0}, "steps_per_print"),
    ("hpz-stage-2", {"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}, "zero_hpz_partition_size"),
    ("unsupported-section", {"sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
    ("fp16-window-zero", {"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window"),
    ("nvme-offload", {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "nvme"),
]


@pytest.mark.parametrize("config,message", [row[1:] for row in CONFIG_CONTENTS], ids=[r[0] for r in CONFIG_CONTENTS])
def test_bad_config_content(config, message):
    with pytest.raises((DeepSpeedConfigError, NotImplementedError), match=message):
        ZeroStrategy(config=config)


def test_good_inputs_next_to_the_bad_ones_are_honoured(tmp_path):
    """No false alarms: seconds become a timedelta, a UTF-8 BOM and hjson-style files load, per-group scheduler
    lists and "auto" optimizer values pass the constructor's dry build."""
    assert ZeroStrategy(timeout=30).settings.timeout == timedelta(seconds=30)
    assert ZeroStrategy(timeout=timedelta(minutes=5)).settings.timeout == timedelta(minutes=5)
    assert ZeroStrategy(process_group_backend="gloo").process_group_backend == "gloo"
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"zero_optimization": {"stage": 3}}')
    assert ZeroStrategy(config=str(bom)).stage == 3
    relaxed = tmp_path / "relaxed.json"
    relaxed.write_text('{\n  // DeepSpeed reads hjson\n  "zero_optimization": {"stage": 1,},\n}')
    assert ZeroStrategy(config=str(relaxed)).stage == 1
    ZeroStrategy(
        config={"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": [0, 0], "warmup_max_lr": [0.1, 0.05]}}}
    )
    ZeroStrategy(
        config={
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto"}},
            "scheduler": {
                "type": "OneCycle",
                "params": {"cycle_min_lr": 0.01, "cycle_max_lr": "auto", "cycle_first_step_size": 10},
            },
        }
    )


# ---------------------------------------------------------------------------------------------------- Trainer level
class ConfigOptimizedModule(RegressionModule):
    configure_optimizers = LightningModule.configure_optimizers  # not overridden: the config's optimizer is used


def _fit(strategy, loader=None, module_class=RegressionModule, **trainer_kwargs):
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(trainer_kwargs)
    Trainer(strategy=strategy, **kwargs).fit(module_class(batch_size=4), train_dataloaders=loader)


def _loader(batch_size):
    return DataLoader(dataset(), batch_size=batch_size)


TRAINER_LEVEL = [
    (
        "precision-mismatch",
        lambda: ZeroStrategy(config={"fp16": {"enabled": True}}),
        dict(precision="bf16-mixed"),
        DeepSpeedConfigError,
        "precision='bf16-mixed'",
    ),
    (
        "clipping-mismatch",
        lambda: ZeroStrategy(config={"gradient_clipping": 0.5}),
        dict(gradient_clip_val=1.0),
        DeepSpeedConfigError,
        "gradient_clip_val=1.0",
    ),
    (
        "accumulation-mismatch",
        lambda: ZeroStrategy(config={"gradient_accumulation_steps": 4}),
        dict(accumulate_grad_batches=2),
        DeepSpeedConfigError,
        "accumulate_grad_batches",
    ),
    (
        "steps-per-print-mismatch",
        lambda: ZeroStrategy(config={"steps_per_print": 7}),
        dict(log_every_n_steps=3),
        DeepSpeedConfigError,
        "log_every_n_steps=3",
    ),
    (
        "batch-arithmetic",
        lambda: ZeroStrategy(config={"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}),
        {},
        DeepSpeedConfigError,
        r"train_batch_size \(10\)",
    ),
    (
        "batch-vs-accumulation",
        lambda: ZeroStrategy(config={"train_batch_size": 6, "gradient_accumulation_steps": 4}),
        {},
        DeepSpeedConfigError,
        r"train_batch_size \(6\)",
    ),
    (
        "micro-batch-vs-direct-loader",
        lambda: ZeroStrategy(config={"train_micro_batch_size_per_gpu": 8}),
        dict(loader=_loader(4)),
        DeepSpeedConfigError,
        r"train_micro_batch_size_per_gpu=8 .* batch_size \(4\)",
    ),
    (
        "train-batch-vs-direct-loader",
        lambda: ZeroStrategy(config={"train_batch_size": 10}),
        dict(loader=_loader(4)),
        DeepSpeedConfigError,
        r"train_batch_size \(10\)",
    ),
    (
        "optimizer-auto-without-hparam",
        lambda: ZeroStrategy(config={"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}),
        dict(module_class=ConfigOptimizedModule),
        DeepSpeedConfigError,
        r"optimizer\.params\.lr.*'learning_rate'",
    ),
    (
        "pin-memory-on-cpu",
        lambda: ZeroStrategy(stage=2, offload="cpu", pin_memory=True),
        {},
        ValueError,
        "pin_memory=True",
    ),
    (
        "pipeline-does-not-divide",
        lambda: ZeroStrategy(stage=1, pipeline_parallel_size=2),
        {},
        ValueError,
        "pipeline_parallel_size=2 must divide the world size 1",
    ),
]


@pytest.mark.parametrize(
    "make,trainer_kwargs,error,message", [row[1:] for row in TRAINER_LEVEL], ids=[r[0] for r in TRAINER_LEVEL]
)
def test_bad_trainer_combination_fails_before_the_process_group(make, trainer_kwargs, error, message):
    with pytest.raises(error, match=message):
        _fit(make(), **trainer_kwargs)


def test_nccl_on_a_cpu_run_fails_before_the_process_group(monkeypatch):
    # as on a CUDA build of torch, where the nccl backend exists but this run computes on CPU
    monkeypatch.setitem(validation._BACKEND_AVAILABLE, "nccl", lambda: True)
    with pytest.raises(ValueError, match=r"process_group_backend='nccl' needs a CUDA device.*'cpu'"):
        _fit(ZeroStrategy(process_group_backend="nccl"))


# ---------------------------------------------------------------------------------------------------- launchers (17.3)
_TORCHRUN = dict(
    RANK="0", GROUP_RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="test"
)
_SLURM = dict(
    SLURM_JOB_NAME="train",
    SLURM_NODEID="0",
    SLURM_PROCID="0",
    SLURM_LOCALID="0",
    SLURM_JOB_ID="1",
    SLURM_NODELIST="localhost",
)
LAUNCHERS = [
    (
        "torchrun-devices",
        {**_TORCHRUN, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        dict(devices=2),
        r"devices=2 x num_nodes=1 = 2 processes, but torchrun \(TorchElastic\) started a world of 1",
    ),
    (
        "torchrun-num-nodes",
        {**_TORCHRUN, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
        dict(devices=2, num_nodes=2),
        r"= 4 processes, but torchrun \(TorchElastic\) started a world of 2",
    ),
    (
        "torchrun-local-size",
        {**_TORCHRUN, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
        dict(devices=1, num_nodes=2),
        r"devices=1 processes per node, but torchrun \(TorchElastic\) started 2",
    ),
    (
        "slurm-devices",
        {**_SLURM, "SLURM_NTASKS": "1", "SLURM_NNODES": "1"},
        dict(devices=2),
        r"SLURM \(srun\) started a world of 1",
    ),
    # SLURM_NNODES not exported: Lightning's DDP would not notice; the world size itself still disagrees
    (
        "slurm-num-nodes-no-nnodes",
        {**_SLURM, "SLURM_NTASKS": "1"},
        dict(devices=1, num_nodes=2),
        r"num_nodes=2 = 2 processes, but SLURM \(srun\) started a world of 1",
    ),
    (
        "slurm-per-node",
        {**_SLURM, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"},
        dict(devices=1, num_nodes=2),
        r"devices=1 processes per node, but SLURM \(srun\) started 2",
    ),
    (
        "fabric-run-or-deepspeed",
        {"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "1"},
        dict(devices=2),
        r"external launcher .* started a world of 1",
    ),
]


@pytest.mark.parametrize("env,trainer_kwargs,message", [row[1:] for row in LAUNCHERS], ids=[r[0] for r in LAUNCHERS])
def test_launcher_world_size_mismatch_is_refused_at_trainer_construction(monkeypatch, env, trainer_kwargs, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        Trainer(strategy=ZeroStrategy(), accelerator="cpu", logger=False, **trainer_kwargs)


def test_matching_launcher_world_size_is_accepted(monkeypatch):
    for key, value in {**_TORCHRUN, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    trainer = Trainer(strategy=ZeroStrategy(), accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.cluster_environment.world_size() == 2


def test_real_torchrun_with_a_mismatched_trainer_refuses(tmp_path):
    """One real ``torchrun --nproc-per-node 1`` launch of ``Trainer(devices=2)``: refused with the message."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        from lightning.pytorch import Trainer
        from lightning_zero import ZeroStrategy
        Trainer(strategy=ZeroStrategy(), accelerator="cpu", devices=2, logger=False)
        print("NOT REFUSED")
    """)
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "0", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "NOT REFUSED" not in output
    assert "torchrun (TorchElastic) started a world of 1" in output, output


# ---------------------------------------------------------------------------------------------------- CLI
CLI = [
    ("params-negative", ["--params", "-5", "--world-size", "2"], "--params"),
    ("params-zero", ["--params", "0", "--world-size", "2"], "--params"),
    ("params-nan", ["--params", "nan", "--world-size", "2"], "--params"),
    ("params-inf", ["--params", "inf", "--world-size", "2"], "--params"),
    ("params-text", ["--params", "seven", "--world-size", "2"], "--params"),
    ("world-size-zero", ["--params", "1e6", "--world-size", "0"], "--world-size"),
    ("world-size-negative", ["--params", "1e6", "--world-size", "-2"], "--world-size"),
    ("precision-unknown", ["--params", "1e6", "--world-size", "2", "--precision", "fp8"], "--precision"),
    ("unit-negative", ["--params", "1e6", "--world-size", "2", "--largest-unit-params", "-1"], "--largest-unit-params"),
    (
        "unit-too-large",
        ["--params", "1e6", "--world-size", "2", "--largest-unit-params", "1e7"],
        "--largest-unit-params",
    ),
    ("offload-stage-0", ["--params", "1e6", "--world-size", "2", "--stage", "0", "--offload", "cpu"], "--offload"),
    ("stage-5", ["--params", "1e6", "--world-size", "2", "--stage", "5"], "--stage"),
]


@pytest.mark.parametrize("argv,message", [row[1:] for row in CLI], ids=[r[0] for r in CLI])
def test_bad_cli_argument(capsys, argv, message):
    from lightning_zero.cli import main

    with pytest.raises(SystemExit) as info:
        main(["estimate", *argv])
    assert info.value.code != 0
    text = capsys.readouterr().err + str(info.value.code)
    assert message in text and "error" in text, text
    assert "GiB" not in capsys.readouterr().out


def test_the_table_has_at_least_sixty_rows():
    rows = (
        len(STRATEGY_ARGS)
        + len(CONFIG_FILES)
        + 2
        + len(CONFIG_CONTENTS)
        + len(TRAINER_LEVEL)
        + 1
        + len(LAUNCHERS)
        + 1
        + len(CLI)
    )
    assert rows >= 60, rows


# -------------------------------------------------------------------------------------------------------- ckpt_path
def _bad_ckpt_path(root, kind):
    """A ``ckpt_path`` ZeroStrategy cannot load, made under ``root``."""
    sharded = os.path.join(root, "sharded.ckpt")
    os.makedirs(sharded)
    for name in ("zero.json", ".metadata", "__0_0.distcp"):  # enough for is_sharded_checkpoint to say yes
        open(os.path.join(sharded, name), "w").close()
    if kind == "not-a-checkpoint-file":
        path = os.path.join(root, "notes.ckpt")
        with open(path, "w") as file:
            file.write("not a checkpoint")
        return path
    if kind == "inside-sharded":
        return os.path.join(sharded, "__0_0.distcp")
    if kind == "zero-json":
        return os.path.join(sharded, "zero.json")
    if kind == "incomplete-directory":
        os.makedirs(os.path.join(root, "half.ckpt"))
        return os.path.join(root, "half.ckpt")
    return "s3://bucket/run/last.ckpt"


CKPT_PATHS = [
    (
        "not-a-checkpoint-file",
        CheckpointError,
        "notes.ckpt: not a checkpoint file .neither a torch.save file nor safetensors",
    ),
    ("inside-sharded", ValueError, r"__0_0.distcp' is a file inside the sharded checkpoint .*sharded.ckpt: pass the"),
    ("zero-json", ValueError, r"zero.json' is a file inside the sharded checkpoint .*sharded.ckpt"),
    ("incomplete-directory", CheckpointError, "half.ckpt is a directory but not a complete lightning-zero checkpoint"),
    ("remote-url", CheckpointSaveError, "s3://bucket/run/last.ckpt"),
]


@pytest.mark.parametrize("kind,error,message", CKPT_PATHS, ids=[row[0] for row in CKPT_PATHS])
@pytest.mark.parametrize("external", [False, True], ids=["lightning-launched", "torchrun"])
@pytest.mark.parametrize("method", ["fit", "validate"])
def test_unloadable_ckpt_path_is_refused_before_any_process_group(
    tmp_path, monkeypatch, kind, error, message, external, method
):
    if external:  # processes started by torchrun: Lightning itself has no launcher there
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        for name, value in dict(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT="29999",
        ).items():
            monkeypatch.setenv(name, value)
    path = _bad_ckpt_path(str(tmp_path), kind)
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        max_steps=1,
    )
    with pytest.raises(error, match=message):
        getattr(trainer, method)(RegressionModule(batch_size=4), ckpt_path=path)
