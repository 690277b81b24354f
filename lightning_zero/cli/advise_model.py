"""What ``lightning-zero advise`` needs from the user's model: its class and init args, a parameter count, the size
of its largest block and its transformer shape, all without allocating its weights (built on the meta device)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

_NAMES = {
    "layers": ("n_layer", "num_hidden_layers", "n_layers", "num_layers"),
    "heads": ("n_head", "num_attention_heads", "n_heads", "num_heads"),
    "seq_len": ("block_size", "seq_len", "max_seq_len", "seq_length", "max_position_embeddings", "n_positions"),
    "vocab": ("vocab_size", "n_vocab"),
}
_FLAGS = {"hidden": "--hidden", "layers": "--layers", "heads": "--heads", "seq_len": "--seq-len"}


class AdviseError(Exception):
    """A problem with the user's input, reported as ``lightning-zero advise: error: ...``."""


def load_object(spec: str) -> Any:
    """``package.module:Name`` or ``path/to/file.py:Name``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise AdviseError(f"{spec!r} must look like 'package.module:Class' or 'path/to/file.py:Class'")
    if target.endswith(".py"):
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise AdviseError(f"{target!r} does not exist")
        directory = os.path.dirname(path)
        if directory not in sys.path:
            sys.path.insert(0, directory)  # its sibling imports (examples/train_gpt.py imports gpt) must resolve
        module_name = os.path.splitext(os.path.basename(path))[0]
        module = sys.modules.get(module_name)
        if module is None or os.path.abspath(getattr(module, "__file__", "") or "") != path:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise AdviseError(f"cannot import {target!r} (from {spec!r}): {err}") from err
    try:
        return getattr(module, name)
    except AttributeError:
        raise AdviseError(f"{target!r} has no attribute {name!r}") from None


@dataclass
class ModelSpec:
    """The model to advise on: ``model_class`` spec, its ``init_args``, and settings read from a LightningCLI
    config (``config_batch_key`` is where the config keeps the micro-batch, e.g. ``data.batch_size``)."""

    model_class: str
    init_args: dict = field(default_factory=dict)
    data_class: Optional[str] = None
    data_args: dict = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)
    config_batch_key: Optional[str] = None
    hf_config: Optional[str] = None  # a transformers config.json: the model is built from it (AutoModelForCausalLM)


#: Top-level keys only a DeepSpeed ds_config has (a LightningCLI config has model/data/trainer sections instead).
_DS_CONFIG_KEYS = (
    "zero_optimization",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "fp16",
    "bf16",
    "optimizer",
    "scheduler",
)


def _config_kind(raw: dict) -> str:
    """``"lightning"`` (a LightningCLI config), ``"hf"`` (a transformers ``config.json``) or ``"ds_config"``."""
    if any(key in raw for key in ("model", "data", "trainer")):
        return "lightning"
    if "model_type" in raw or "architectures" in raw:
        return "hf"
    if any(key in raw for key in _DS_CONFIG_KEYS):
        return "ds_config"
    return "lightning"


def read_config(path: str, model: Optional[str], data: Optional[str]) -> ModelSpec:
    """A LightningCLI YAML: ``model`` (``class_path``/``init_args`` or plain init args), ``data`` likewise and
    ``trainer``. ``model``/``data`` name the classes when the config does not (a CLI with fixed classes)."""
    import yaml

    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):  # a Hugging Face model directory
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except OSError as err:
        raise AdviseError(f"cannot read --config {path!r}: {err}") from err
    if not isinstance(raw, dict):
        raise AdviseError(f"--config {path!r} is not a mapping")
    kind = _config_kind(raw)
    if kind == "ds_config":
        raise AdviseError(
            f"--config {path!r} is a DeepSpeed ds_config, which holds no model: --config takes a "
            "LightningCLI YAML (model/data/trainer sections) or a Hugging Face config.json; give the "
            "model with --model module:Class (and --init-args), and advise writes the ds_config "
            "(advise_ds_config.json)"
        )
    if kind == "hf":
        if model is not None or data is not None:
            raise AdviseError(
                f"--config {path!r} is a Hugging Face config.json, which is the model: drop --model/--data"
            )
        return ModelSpec(f"transformers config {path}", hf_config=path)

    def section(name: str, given: Optional[str]) -> tuple[Optional[str], dict]:
        value = raw.get(name) or {}
        if "class_path" in value:
            return given or value["class_path"], dict(value.get("init_args") or {})
        return given, dict(value)

    model_class, init_args = section("model", model)
    data_class, data_args = section("data", data)
    if model_class is None:
        raise AdviseError(f"--config {path!r} names no model class_path: pass --model module:Class")
    batch_key = "data.batch_size" if "batch_size" in data_args else None
    return ModelSpec(model_class, init_args, data_class, data_args, dict(raw.get("trainer") or {}), batch_key)


def instantiate(spec: ModelSpec, device: Optional[str] = "meta") -> Any:
    """The model, its weights on the meta device (``device=None``: the real module, ``configure_model`` left to the
    strategy). Required init args missing from the model's own args are taken
    from the data module's attributes of the same name (what LightningCLI's ``link_arguments`` usually does)."""
    import inspect

    import torch

    if spec.hf_config is not None:
        return _instantiate_hf(spec.hf_config, spec.init_args, device)
    cls = load_object(spec.model_class)
    init_args = dict(spec.init_args)
    if spec.data_class:
        data = load_object(spec.data_class)(**spec.data_args)
        for name in inspect.signature(cls).parameters:
            if name not in init_args and hasattr(data, name):
                init_args[name] = getattr(data, name)
    for name, value in spec.data_args.items():  # e.g. block_size linked from data to model
        params = inspect.signature(cls).parameters
        if name in params and name not in init_args:
            init_args[name] = value
    try:
        if device is None:
            module = cls(**init_args)
        else:
            with torch.device(device):
                module = cls(**init_args)
                configure = getattr(module, "configure_model", None)
                if callable(configure):
                    configure()
    except TypeError as err:
        raise AdviseError(
            f"cannot build {spec.model_class} with {sorted(init_args)}: {err} "
            "(pass the missing init args with --init-args key=value)"
        ) from err
    spec.init_args = init_args
    return module


def _instantiate_hf(path: str, overrides: dict, device: Optional[str]) -> Any:
    """The causal-LM model of a local transformers ``config.json`` (a file or its directory; read offline), with
    ``--init-args`` overriding config fields, its weights on ``device``."""
    import torch

    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError as err:
        raise AdviseError(
            f"--config {path!r} is a Hugging Face config.json: reading it needs transformers ({err})"
        ) from err
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, **overrides)
    except (OSError, ValueError, KeyError) as err:
        raise AdviseError(f"cannot read the Hugging Face config {path!r}: {err}") from err
    with torch.device(device or "cpu"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM (an encoder, say): its bare model
            return AutoModel.from_config(config)


def _lookup(module: Any, names: tuple, extra: dict) -> Optional[int]:
    objects = [module, getattr(module, "config", None), dict(getattr(module, "hparams", {}) or {}), extra]
    for child in getattr(module, "children", lambda: [])():
        objects += [child, getattr(child, "config", None)]
    for obj in objects:
        for name in names:
            value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def infer_shape(module: Any, spec: ModelSpec, overrides: dict) -> tuple[dict, int, int]:
    """``(shape kwargs without micro_batch, parameter count, largest FSDP2 unit's parameters)``. ``overrides`` (from
    the command line) win; a size that cannot be found is refused, naming its flag."""
    from lightning_zero.distributed.module_classes import find_repeated_blocks
    from lightning_zero.ds_config.auto import infer_hidden_size

    num_params = sum(p.numel() for p in module.parameters())
    if num_params == 0:
        raise AdviseError(f"{spec.model_class} has no parameters after configure_model()")
    blocks = find_repeated_blocks(module)
    block_modules = [m for m in module.modules() if type(m) in blocks]
    layer_params = max((sum(p.numel() for p in m.parameters()) for m in block_modules), default=0)
    hints = {**dict(getattr(module, "hparams", {}) or {}), **spec.data_args, **spec.init_args}
    found = {
        "hidden": infer_hidden_size(module, hints),
        "layers": len(block_modules) or _lookup(module, _NAMES["layers"], hints),
        "heads": _lookup(module, _NAMES["heads"], hints),
        "seq_len": _lookup(module, _NAMES["seq_len"], hints),
        "vocab": _lookup(module, _NAMES["vocab"], hints) or 0,
    }
    found.update({k: v for k, v in overrides.items() if v is not None})
    missing = [k for k in _FLAGS if not found.get(k)]
    if missing:
        raise AdviseError(
            "cannot tell the model's " + ", ".join(missing) + " from its attributes, hyperparameters or "
            "init args: pass " + ", ".join(_FLAGS[k] for k in missing)
        )
    found["layer_params"] = layer_params
    from lightning_zero.distributed.apply_zero import unit_groups
    from lightning_zero.distributed.config import ZeroConfig

    # stage 3 gathers whole FSDP2 units: consecutive blocks grouped up to the default unit_bytes, not one block
    groups, _ = unit_groups(module, ZeroConfig(stage=3))
    unit = max((sum(p.numel() for m in group for p in m.parameters()) for group in groups), default=0)
    return found, num_params, unit or num_params
