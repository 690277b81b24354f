"""Both adapters' constructor arguments are declared once (``ZeroArguments`` and ``DeepSpeedArguments``) and their
signatures generated from them (:mod:`lightning_zero.adapters.arguments`): what ``inspect``, Python's call rules and
LightningCLI (jsonargparse) see must be what a written-out signature would give."""

import inspect
import typing
from dataclasses import fields

import pytest
import yaml

from lightning_zero import ZeroStrategy
from lightning_zero.adapters.settings import ZeroArguments
from lightning_zero.ds_config.strategy_arguments import DeepSpeedArguments
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from tests.lightning_models import RegressionModule

LIGHTNING = {"accelerator", "parallel_devices", "cluster_environment"}


@pytest.mark.parametrize(
    "strategy, precision",
    [(ZeroStrategy, "precision_plugin"), (FabricZeroStrategy, "precision")],
    ids=["trainer", "fabric"],
)
def test_the_signature_is_the_dataclasses_fields_with_their_types_and_defaults(strategy, precision):
    parameters = inspect.signature(strategy).parameters
    hints = {**typing.get_type_hints(DeepSpeedArguments), **typing.get_type_hints(ZeroArguments)}
    declared = [f for f in fields(ZeroArguments)] + [
        f for f in fields(DeepSpeedArguments) if f.name not in {g.name for g in fields(ZeroArguments)}
    ]
    assert set(parameters) == {f.name for f in declared} | LIGHTNING | {precision}
    for field in declared:
        parameter = parameters[field.name]
        assert parameter.annotation == hints[field.name], field.name
        if not (strategy is FabricZeroStrategy and field.name == "auto_resume"):
            assert parameter.default == field.default, field.name
    assert parameters["auto_resume"].default is (strategy is ZeroStrategy)  # Fabric refuses True
    assert list(parameters)[:2] == ["stage", "offload"]
    assert typing.get_type_hints(strategy.__init__)["stage"] == typing.Optional[typing.Literal[0, 1, 2, 3]]


@pytest.mark.parametrize("strategy", [ZeroStrategy, FabricZeroStrategy], ids=["trainer", "fabric"])
def test_calls_bind_as_with_a_written_signature(strategy):
    assert strategy(3, "cpu").zero_config.stage == 3  # positional, in the declared order
    assert strategy(stage=3, offload="cpu").zero_config.offload == "cpu"
    with pytest.raises(TypeError, match="ZeroStrategy\\(\\) got an unexpected keyword argument 'stagee'"):
        strategy(stagee=3)
    with pytest.raises(TypeError, match="multiple values for argument 'stage'"):
        strategy(3, stage=2)


def _cli(args):
    from lightning.pytorch.cli import LightningCLI

    return LightningCLI(RegressionModule, args=args, run=False)


def test_lightning_cli_prints_the_strategys_arguments_with_their_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli(["--trainer.strategy=lightning_zero.ZeroStrategy", "--trainer.strategy.stage=3", "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert printed["class_path"] == "lightning_zero.ZeroStrategy"
    init_args = printed["init_args"]
    assert (init_args["stage"], init_args["offload"], init_args["start_method"]) == (3, None, "popen")
    assert (init_args["auto_resume"], init_args["hang_timeout"], init_args["state_dict_type"]) == (
        True,
        600.0,
        "sharded",
    )
    assert "overlap_comm" in init_args and "precision_plugin" in init_args  # DeepSpeedStrategy's and Lightning's
    assert len(init_args) == len(inspect.signature(ZeroStrategy).parameters)


def _write_config(tmp_path, init_args: str):
    config = tmp_path / "config.yaml"
    config.write_text(f"""
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  strategy:
    class_path: lightning_zero.ZeroStrategy
    init_args: {init_args}
""")
    return str(config)


def test_lightning_cli_yaml_builds_the_strategy_and_refuses_an_invalid_stage_while_parsing(tmp_path, capsys):
    cli = _cli(["--config", _write_config(tmp_path, "{stage: 3, offload: cpu, overlap_comm: true}")])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    assert (strategy.stage, strategy.zero_config.offload) == (3, "cpu")
    with pytest.raises(SystemExit) as exit_info:
        _cli(["--config", _write_config(tmp_path, "{stage: 4}")])
    assert exit_info.value.code != 0
    error = capsys.readouterr().err  # the parser's refusal, before any strategy is built
    assert 'key "stage"' in error and "Expected a typing.Literal[0, 1, 2, 3]" in error and "Given value: 4" in error
