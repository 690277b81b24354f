"""A DeepSpeedStrategy user changes the class name and nothing else.

Every constructor argument of Lightning's ``DeepSpeedStrategy`` (Trainer and Fabric) is a ZeroStrategy argument with
its name and type; each DeepSpeedStrategy-only one becomes the ds_config key it stands for, so it is honoured, warned
about or refused by name exactly as that key (:mod:`lightning_zero.ds_config.strategy_arguments`). The calls below
are those of Lightning's DeepSpeed docs and strategy tests (written here again, with the class name swapped); each
trains on 2 CPU ranks to the weights of the equivalent ``config=``, and that config is checked against the one
Lightning's own DeepSpeedStrategy builds from the same call.
"""

import inspect
import logging
import os
import re
import warnings

import pytest
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.ds_config import DeepSpeedConfigWarning
from lightning_zero.ds_config.strategy_arguments import DEEPSPEED_ARGUMENT_NAMES
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from tests.lightning_models import RegressionModule, full_state, quiet_trainer
from tests.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 2
NVME = "<nvme>"  # replaced by a per-test directory


def _lightning_signature(fabric: bool) -> inspect.Signature:
    if fabric:
        from lightning.fabric.strategies import DeepSpeedStrategy
    else:
        from lightning.pytorch.strategies import DeepSpeedStrategy
    return inspect.signature(DeepSpeedStrategy.__init__)


@pytest.mark.parametrize("fabric", [False, True], ids=["trainer", "fabric"])
def test_every_deepspeed_strategy_argument_is_a_zero_strategy_argument(fabric):
    ours = inspect.signature((FabricZeroStrategy if fabric else ZeroStrategy).__init__).parameters
    theirs = [name for name in _lightning_signature(fabric).parameters if name != "self"]
    assert len(theirs) == 46
    assert [name for name in theirs if name not in ours] == []


def test_the_docs_table_lists_all_46_arguments():
    with open(os.path.join(ROOT, "docs", "deepspeed_arguments.md")) as handle:
        text = handle.read()
    rows = set(re.findall(r"^\| `(\w+)`", text, flags=re.M))
    theirs = {name for name in _lightning_signature(False).parameters if name != "self"} | {"precision"}
    assert theirs <= rows, sorted(theirs - rows)


# --------------------------------------------------------------------------------- argument by argument
# (arguments, what happens, check): "honoured" checks the setting it changes; "warned"/"refused" check the message
# names the argument. Every DeepSpeedStrategy-only argument appears at least once.
NVME_BOTH = dict(
    stage=3,
    offload_optimizer=True,
    offload_parameters=True,
    offload_optimizer_device="nvme",
    offload_params_device="nvme",
    nvme_path=NVME,
)
ARGUMENT_CASES = [
    ("zero_optimization", dict(zero_optimization=False), "honoured", lambda s: s.zero_config.stage == 0),
    ("zero_optimization", dict(zero_optimization=False, stage=3), "refused", None),
    ("remote_device", dict(stage=3, remote_device="cpu"), "refused", None),
    ("remote_device", dict(stage=2, remote_device="cpu"), "warned", None),
    (
        "remote_device",
        dict(NVME_BOTH, remote_device="nvme"),
        "honoured",
        lambda s: s.zero_config.offload_params == "nvme",
    ),
    ("offload_optimizer", dict(offload_optimizer=True), "honoured", lambda s: s.zero_config.offload_optimizer == "cpu"),
    (
        "offload_parameters",
        dict(stage=3, offload_optimizer=True, offload_parameters=True),
        "honoured",
        lambda s: s.zero_config.offload_params == "cpu",
    ),
    ("offload_params_device", NVME_BOTH, "honoured", lambda s: s.zero_config.offload_params == "nvme"),
    ("offload_params_device", dict(stage=3, offload_params_device="nvme"), "warned", None),
    (
        "offload_optimizer_device",
        dict(offload_optimizer=True, offload_optimizer_device="nvme", nvme_path=NVME),
        "honoured",
        lambda s: s.zero_config.offload_optimizer == "nvme",
    ),
    ("offload_optimizer_device", dict(offload_optimizer=True, offload_optimizer_device="nvme"), "refused", None),
    (
        "params_buffer_size",
        dict(NVME_BOTH, params_buffer_size=12345),
        "honoured",
        lambda s: s.zero_config.nvme.buffer_size == 12345,
    ),
    ("params_buffer_count", dict(NVME_BOTH, params_buffer_count=7), "warned", None),  # one buffer_count: optimizer's
    (
        "optimizer_buffer_count",
        dict(NVME_BOTH, optimizer_buffer_count=6),
        "honoured",
        lambda s: s.zero_config.nvme.buffer_count == 6,
    ),
    ("block_size", dict(NVME_BOTH, block_size=4096), "honoured", lambda s: s.zero_config.nvme.aio.block_size == 4096),
    ("block_size", dict(block_size=4096), "warned", None),  # no NVMe: no file I/O
    ("queue_depth", dict(NVME_BOTH, queue_depth=4), "honoured", lambda s: s.zero_config.nvme.aio.queue_depth == 4),
    (
        "single_submit",
        dict(NVME_BOTH, single_submit=True),
        "honoured",
        lambda s: s.zero_config.nvme.aio.single_submit is True,
    ),
    (
        "overlap_events",
        dict(NVME_BOTH, overlap_events=False),
        "honoured",
        lambda s: s.zero_config.nvme.aio.overlap_events is False,
    ),
    ("thread_count", dict(NVME_BOTH, thread_count=2), "honoured", lambda s: s.zero_config.nvme.aio.thread_count == 2),
    ("contiguous_gradients", dict(contiguous_gradients=False), "warned", None),
    ("overlap_comm", dict(overlap_comm=False), "warned", None),
    ("allgather_partitions", dict(allgather_partitions=False), "warned", None),
    ("reduce_scatter", dict(reduce_scatter=False), "warned", None),
    (
        "allgather_bucket_size",
        dict(stage=2, allgather_bucket_size=5e8),
        "honoured",
        lambda s: s.zero_config.unit_bytes == 4 * 500_000_000,
    ),
    (
        "reduce_bucket_size",
        dict(stage=2, reduce_bucket_size=1e6),
        "honoured",
        lambda s: s.zero_config.unit_bytes == 4 * 1_000_000,
    ),
    (
        "reduce_bucket_size",
        dict(stage=1, reduce_bucket_size=2**20),
        "honoured",
        lambda s: s.ds_config.raw["zero_optimization"]["reduce_bucket_size"] == 2**20,
    ),  # the DDP bucket, at setup
    ("overlap_comm", dict(overlap_comm=True, zero_optimization=False), "warned", None),
    (
        "zero_allow_untested_optimizer",
        dict(zero_allow_untested_optimizer=True),
        "honoured",
        lambda s: s.ds_config.raw["zero_allow_untested_optimizer"] is True,
    ),
    (
        "logging_batch_size_per_gpu",
        dict(logging_batch_size_per_gpu=4),
        "honoured",
        lambda s: s.ds_config.raw["train_micro_batch_size_per_gpu"] == 4,
    ),
    (
        "logging_level",
        dict(logging_level=logging.INFO),
        "honoured",
        lambda s: logging.getLogger("lightning_zero").level == logging.INFO,
    ),
    ("partition_activations", dict(partition_activations=True), "warned", None),
    ("contiguous_memory_optimization", dict(contiguous_memory_optimization=True), "warned", None),
    ("synchronize_checkpoint_boundary", dict(synchronize_checkpoint_boundary=True), "warned", None),
]


def _with_nvme(arguments: dict, path) -> dict:
    return {k: (str(path) if v == NVME else v) for k, v in arguments.items()}


def test_the_cases_cover_every_deepspeed_strategy_only_argument():
    assert set(DEEPSPEED_ARGUMENT_NAMES) - {"cpu_checkpointing"} <= {name for name, *_ in ARGUMENT_CASES}


@pytest.mark.parametrize("fabric", [False, True], ids=["trainer", "fabric"])
@pytest.mark.parametrize(
    "name,arguments,outcome,check", ARGUMENT_CASES, ids=[f"{case[0]}-{i}" for i, case in enumerate(ARGUMENT_CASES)]
)
def test_each_argument_is_honoured_or_named(tmp_path, fabric, name, arguments, outcome, check):
    logger = logging.getLogger("lightning_zero")
    level = logger.level
    arguments = _with_nvme(arguments, tmp_path)
    cls = FabricZeroStrategy if fabric else ZeroStrategy
    if fabric and name == "logging_batch_size_per_gpu":
        outcome = "warned"  # Fabric's loop sizes the batches; DeepSpeed only logged samples/s with it
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if outcome == "refused":
                with pytest.raises((ValueError, TypeError), match=name):
                    cls(**arguments)
                return
            strategy = cls(**arguments)
        named = [str(w.message) for w in caught if name in str(w.message)]
        if outcome == "warned":
            assert named, f"no warning names {name}: {[str(w.message) for w in caught]}"
        else:
            assert named == [], named
            assert check(strategy)
    finally:
        logger.setLevel(level)


def test_bad_values_are_refused_by_name():
    for arguments, name in [
        (dict(overlap_comm="yes"), "overlap_comm"),
        (dict(reduce_bucket_size=0), "reduce_bucket_size"),
        (dict(reduce_bucket_size=1.5), "reduce_bucket_size"),
        (dict(remote_device="gpu"), "remote_device"),
        (dict(logging_batch_size_per_gpu=0), "logging_batch_size_per_gpu"),
        (dict(offload_optimizer="yes"), "offload_optimizer"),
        (dict(zero_optimization=False, offload_optimizer=True), "zero_optimization"),
    ]:
        with pytest.raises((ValueError, TypeError), match=name):
            ZeroStrategy(**arguments)


def test_a_false_switch_is_deepspeed_strategys_default():
    # offload_optimizer=False / offload_parameters=False ask for nothing, as in DeepSpeedStrategy; a config's
    # offload then still applies (DeepSpeedStrategy would read the config alone)
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert ZeroStrategy(config=config, offload_optimizer=False).zero_config.offload_optimizer == "cpu"
    assert ZeroStrategy(offload_optimizer=False, offload_parameters=False).zero_config.offload == "none"
    # the knobs of a section a config opened apply to it
    strategy = ZeroStrategy(config=config, offload_optimizer_device="cpu", stage=3)
    assert (strategy.zero_config.stage, strategy.zero_config.offload_optimizer) == (3, "cpu")


def test_a_mismatched_logging_batch_size_is_refused_naming_the_argument():
    from torch.utils.data import DataLoader

    from lightning_zero.ds_config import DeepSpeedConfigError
    from tests.lightning_models import dataset

    # a DataLoader given to fit exists before the process group, so the check runs there (in this process)
    trainer = quiet_trainer(ZeroStrategy(logging_batch_size_per_gpu=3), 1, max_steps=1)
    with pytest.raises(DeepSpeedConfigError, match="from the argument logging_batch_size_per_gpu=3"):
        trainer.fit(RegressionModule(), train_dataloaders=DataLoader(dataset(), batch_size=4))


def test_logging_batch_size_under_fabric_is_warned_about_by_name():
    with pytest.warns(DeepSpeedConfigWarning, match="logging_batch_size_per_gpu=1 has no effect with Fabric"):
        FabricZeroStrategy(stage=3, logging_batch_size_per_gpu=1)


# --------------------------------------------------------------------------------- Lightning's own calls
# Each call of Lightning's DeepSpeed docs and strategy tests (src: docs/source-pytorch/advanced/model_parallel/
# deepspeed.rst, tests/tests_pytorch/strategies/test_deepspeed.py, tests/tests_fabric/strategies/), the config it
# stands for, and the Trainer settings it runs with here (CPU: precision 32 unless the call is about fp16).
LIGHTNING_CALLS = [
    ("DeepSpeedStrategy()", {}, {"zero_optimization": {"stage": 2}}, {}),
    ("stage=2", dict(stage=2), {"zero_optimization": {"stage": 2}}, {}),
    ("stage=3", dict(stage=3), {"zero_optimization": {"stage": 3}}, {}),
    (
        "stage=3, load_full_weights",
        dict(stage=3, load_full_weights=True),
        {"zero_optimization": {"stage": 3}},
        {"load_full_weights": True},
    ),
    (
        "activation knobs",
        dict(
            partition_activations=True,
            cpu_checkpointing=True,
            contiguous_memory_optimization=True,
            synchronize_checkpoint_boundary=True,
        ),
        {
            "zero_optimization": {"stage": 2},
            "activation_checkpointing": {
                "partition_activations": True,
                "cpu_checkpointing": True,
                "contiguous_memory_optimization": True,
                "synchronize_checkpoint_boundary": True,
            },
        },
        {},
    ),
    (
        "stage=3, logging_batch_size_per_gpu=1",
        dict(stage=3, logging_batch_size_per_gpu=1),
        {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1},
        {"batch_size": 1},
    ),
    (
        "stage=2, offload_optimizer=True",
        dict(stage=2, offload_optimizer=True),
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        {},
    ),
    (
        "offload_optimizer=True, buckets 5e8",
        dict(offload_optimizer=True, allgather_bucket_size=5e8, reduce_bucket_size=5e8),
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "allgather_bucket_size": 5e8,
                "reduce_bucket_size": 5e8,
            }
        },
        {},
    ),
    (
        "zero_optimization=False",
        dict(logging_batch_size_per_gpu=1, zero_optimization=False),
        {"train_micro_batch_size_per_gpu": 1},
        {"batch_size": 1},
    ),
    (
        "exclude_frozen_parameters",
        dict(exclude_frozen_parameters=True),
        {"zero_optimization": {"stage": 2}},
        {"exclude_frozen_parameters": True},
    ),
    (
        "stage 3 offload",
        dict(stage=3, offload_optimizer=True, offload_parameters=True),
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}},
        {},
    ),
    (
        "stage 3 offload, cpu_checkpointing",
        dict(stage=3, offload_optimizer=True, cpu_checkpointing=True),
        {
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "activation_checkpointing": {"cpu_checkpointing": True},
        },
        {},
    ),
    (
        "ZeRO-Infinity",
        dict(
            stage=3,
            offload_optimizer=True,
            offload_parameters=True,
            remote_device="nvme",
            offload_params_device="nvme",
            offload_optimizer_device="nvme",
            nvme_path=NVME,
        ),
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": NVME},
                "offload_param": {"device": "nvme", "nvme_path": NVME},
            }
        },
        {},
    ),
]
QUICK = ("stage=3", "stage 3 offload")  # the rest train in the slow sweep


def _leaves(config: dict, prefix: str = ""):
    for key, value in config.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _lookup(config: dict, path: str):
    for key in path.split("."):
        config = config[key]
    return config


@pytest.mark.parametrize("label,call,config,extra", LIGHTNING_CALLS, ids=[c[0] for c in LIGHTNING_CALLS])
def test_the_equivalent_config_is_the_one_lightning_builds(tmp_path, label, call, config, extra):
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    call, config = _with_nvme(call, tmp_path), _nvme_config(config, tmp_path)
    built = DeepSpeedStrategy(**call).config
    for path, value in _leaves(config):
        assert _lookup(built, path) == value, f"{label}: {path}"
    assert ("zero_optimization" in built) == ("zero_optimization" in config)


@pytest.mark.parametrize("fabric", [False, True], ids=["trainer", "fabric"])
def test_each_call_has_the_settings_of_its_config(tmp_path, fabric):
    cls = FabricZeroStrategy if fabric else ZeroStrategy
    for label, call, config, extra in LIGHTNING_CALLS:
        if fabric and ("train_micro_batch_size_per_gpu" in config or extra.get("load_full_weights")):
            continue  # Fabric refuses a config's batch keys (its loop sizes batches; the argument is warned about)
            # and load_full_weights (the state given to fabric.load says what is loaded)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeepSpeedConfigWarning)
            by_call = cls(**_with_nvme(call, tmp_path))
            by_config = cls(
                config=_nvme_config(config, tmp_path), **{k: v for k, v in extra.items() if k != "batch_size"}
            )
        for field in (
            "zero_config",
            "activation_checkpoint_config",
            "exclude_frozen_parameters",
            "load_full_weights",
            "loss_scale_config",
        ):
            assert getattr(by_call.settings, field) == getattr(by_config.settings, field), f"{label}: {field}"


def _nvme_config(config: dict, path) -> dict:
    if isinstance(config, dict):
        return {k: _nvme_config(v, path) for k, v in config.items()}
    return str(path) if config == NVME else config


def _calls_worker(rank, world_size, labels, nvme_root):
    for label, call, config, extra in LIGHTNING_CALLS:
        if label not in labels:
            continue
        batch_size = extra.get("batch_size", 4)
        ours = {k: v for k, v in extra.items() if k != "batch_size"}
        results = []
        for arguments in (_with_nvme(call, nvme_root), dict(config=_nvme_config(config, nvme_root), **ours)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeepSpeedConfigWarning)
                strategy = ZeroStrategy(**arguments)
            torch.manual_seed(0)
            model = RegressionModule(batch_size=batch_size)
            before = full_state(model)
            quiet_trainer(strategy, world_size, max_steps=3).fit(model)
            results.append(full_state(model))
        for key, value in results[0].items():
            assert not torch.equal(value, before[key]), f"{label}: {key} did not train"
            torch.testing.assert_close(
                value, results[1][key], atol=0, rtol=0, msg=lambda m: f"{label}: {key}: call vs config: {m}"
            )


def test_lightning_calls_train_as_their_configs_quick(tmp_path):
    run_distributed(_calls_worker, WORLD, QUICK, str(tmp_path))


@pytest.mark.slow
def test_lightning_calls_train_as_their_configs(tmp_path):
    run_distributed(_calls_worker, WORLD, tuple(c[0] for c in LIGHTNING_CALLS if c[0] not in QUICK), str(tmp_path))


def test_loss_scale_arguments_are_the_fp16_section():
    # Lightning's test_deepspeed_fp16_loss_scale... call: the knobs become the fp16 section's (fp16 precision only)
    knobs = dict(loss_scale=10, initial_scale_power=11, loss_scale_window=12, hysteresis=13, min_loss_scale=14)
    by_call = ZeroStrategy(**knobs).settings.loss_scale_config
    by_config = ZeroStrategy(config={"fp16": {"enabled": True, **knobs}}).settings.fp16_loss_scale_config
    assert by_call == by_config


def test_an_explicit_stage_over_a_config_says_so(tmp_path, monkeypatch, capsys):
    # strategy="zero_stage_2" with PL_DEEPSPEED_CONFIG_PATH at stage 3 trained at stage 2 while the startup table
    # printed stage 3, without a word (DeepSpeedStrategy would have used the config's stage)
    config = {"zero_optimization": {"stage": 3}}
    with pytest.warns(DeepSpeedConfigWarning, match=r"stage=2 over the config's 3"):
        strategy = ZeroStrategy(config=config, stage=2)
    assert strategy.zero_config.stage == 2
    strategy.ds_config.print_table()
    assert "explicit arguments win: stage=2 (config: 3)" in " ".join(capsys.readouterr().out.split())
    with pytest.warns(DeepSpeedConfigWarning, match=r"stage=2 over the config's 3"):
        ZeroStrategy(config=config, stage=2, overlap_comm=True)  # also when DeepSpeedStrategy arguments come along
