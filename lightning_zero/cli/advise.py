"""``lightning-zero advise``: which ZeRO configuration fits, and which runs fastest, for a model on some devices.

    lightning-zero advise --config examples/configs/zero3.yaml --model examples/gpt.py:GPTModule \\
        --data examples/train_gpt.py:CharDataModule
    lightning-zero advise --config path/to/llama/config.json --devices 8 --device-memory 80 --seq-len 4096
    lightning-zero advise --model mypkg.models:LitGPT --init-args n_layer=24 n_embd=2048 --seq-len 2048 \\
        --devices 8 --device-memory 80 --micro-batch 8 --precision bf16-mixed
    ... --measure            # also run a few steps of the best candidates here and rank them by throughput

Predictions (``lightning_zero.estimate_memory``) for every rung of the ladder (``lightning_zero/cli/ladder.py``,
``docs/memory.md``); the winner is written as a LightningCLI YAML snippet and a DeepSpeed ds_config JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from lightning_zero.cli.estimate import positive_int as _positive_int

GIB = 1024**3


def _gib(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of GiB")
    return int(value * GIB)


def _key_value(text: str) -> tuple:
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} must look like key=value")
    return key, yaml.safe_load(value)


def add_parser(subparsers) -> None:
    from lightning_zero.estimate.precisions import PRECISIONS

    p = subparsers.add_parser("advise", help="predict (and optionally measure) which ZeRO configuration fits best")
    p.add_argument(
        "--config",
        help="a LightningCLI YAML (model, data and trainer sections), or a Hugging Face "
        "model's config.json (a local file or its directory; read offline)",
    )
    p.add_argument("--model", help="the LightningModule: package.module:Class or path/to/file.py:Class")
    p.add_argument("--data", help="the LightningDataModule (its attributes fill the model's missing init args)")
    p.add_argument(
        "--init-args",
        nargs="*",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="model init args (override the config's)",
    )
    p.add_argument("--devices", type=_positive_int, help="ranks per node (default: the config's, else this machine's)")
    p.add_argument("--num-nodes", type=_positive_int, default=1)
    p.add_argument("--device-memory", type=_gib, help="GiB per device (default: this machine's)")
    p.add_argument("--cpu-memory", type=_gib, help="GiB of CPU memory per node (default: available memory)")
    p.add_argument("--accelerator", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--headroom", type=float, default=0.1, help="fraction of memory kept free (default 0.1)")
    p.add_argument("--micro-batch", type=_positive_int, help="desired micro-batch (default: the config's, else 1)")
    p.add_argument("--precision", choices=list(PRECISIONS), help="default: the config's trainer.precision or 32-true")
    for name in ("hidden", "layers", "heads", "seq-len", "vocab"):
        p.add_argument(f"--{name}", type=_positive_int, help=f"model {name} (default: read from the model)")
    p.add_argument("--measure", action="store_true", help="run a few steps of the best candidates on this machine")
    p.add_argument("--max-candidates", type=_positive_int, default=3, help="rungs to measure (default 3)")
    p.add_argument("--steps", type=_positive_int, default=3, help="measured steps per candidate (after 1 warm-up)")
    p.add_argument("--output-dir", default=".", help="where advise.yaml and advise_ds_config.json are written")
    p.add_argument("--overwrite", action="store_true", help="replace those files when they exist")
    p.set_defaults(func=run)


def _fail(message: str) -> SystemExit:
    return SystemExit(f"lightning-zero advise: error: {message}")


def _resolve(args):
    """The model spec, the instantiated (meta) module, the shape kwargs, the machine, precision and micro-batch."""
    import torch

    from lightning_zero.cli.advise_model import ModelSpec, infer_shape, instantiate, read_config
    from lightning_zero.cli.ladder import Machine, available_cpu_memory, this_machine

    if args.config:
        spec = read_config(args.config, args.model, args.data)
    elif args.model:
        spec = ModelSpec(args.model, {}, args.data)
    else:
        raise _fail("pass --config FILE.yaml or --model module:Class")
    spec.init_args.update(dict(args.init_args))
    module = instantiate(spec)
    overrides = {
        "hidden": args.hidden,
        "layers": args.layers,
        "heads": args.heads,
        "seq_len": args.seq_len,
        "vocab": args.vocab,
    }
    shape_kwargs, num_params, unit = infer_shape(module, spec, overrides)
    precision = args.precision or str(spec.trainer.get("precision", "32-true"))
    from lightning_zero.estimate.precisions import PRECISIONS

    if precision not in PRECISIONS:
        raise _fail(f"the config's trainer.precision {precision!r} is not one of {PRECISIONS}")
    config_devices = spec.trainer.get("devices")
    devices = args.devices or (config_devices if isinstance(config_devices, int) and config_devices > 0 else None)
    accelerator = args.accelerator or ("cuda" if torch.cuda.is_available() else "cpu")
    here = this_machine(devices)
    devices = devices or here.devices
    cpu_memory = args.cpu_memory or available_cpu_memory()
    if args.device_memory:
        device_memory = args.device_memory
    elif accelerator == "cuda" and here.accelerator == "cuda":
        device_memory = here.device_memory
    elif accelerator == "cpu":
        device_memory = cpu_memory // devices
    else:
        raise _fail("no CUDA device here to read its memory from: pass --device-memory GiB")
    try:
        machine = Machine(devices, device_memory, cpu_memory, accelerator, args.num_nodes, args.headroom)
    except ValueError as err:
        raise _fail(str(err)) from None
    micro_batch = args.micro_batch or (spec.data_args.get("batch_size") if spec.config_batch_key else None) or 1
    return spec, module, shape_kwargs, num_params, unit, machine, precision, int(micro_batch)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lightning_zero.cli.advise_model import AdviseError
    from lightning_zero.cli.ladder import ladder, predict, predicted_winner
    from lightning_zero.estimate.activations import TransformerShape

    start = time.perf_counter()
    try:
        spec, module, shape_kwargs, num_params, unit, machine, precision, micro_batch = _resolve(args)
        shape = TransformerShape(micro_batch=micro_batch, **shape_kwargs)
    except (AdviseError, ValueError) as err:
        raise _fail(str(err)) from None
    terminal = Console()
    # The table is wide: written to a file or a pipe it would otherwise be wrapped at 80 columns.
    console = terminal if terminal.is_terminal else Console(width=220)
    predictions = predict(ladder(micro_batch), num_params, shape, machine, precision, unit)
    winner = predicted_winner(predictions)
    if args.measure:
        winner = _measure(predictions, spec, shape, machine, precision, args, console)
    console.print(_table(predictions, shape, num_params, machine, precision, args.measure))
    elapsed = time.perf_counter() - start
    if winner is None:
        console.print("[bold red]No runnable rung fits[/]: more devices, more memory or a smaller model is needed.")
        return 1
    _write_outputs(winner, precision, machine, spec, args.output_dir, args.overwrite, console)
    how = "fastest measured" if args.measure else "first rung predicted to fit"
    console.print(f"winner ({how}): [bold]{winner.rung.label}[/] ({winner.rung.step}); took {elapsed:.1f} s")
    return 0


def _measure(predictions, spec, shape, machine, precision, args, console):
    """Run the first ``--max-candidates`` runnable rungs predicted to fit; the winner is the best throughput."""
    from lightning_zero.cli.advise_measure import measure_rung

    if machine.num_nodes > 1:
        raise _fail("--measure runs on this machine only: drop --num-nodes")
    if spec.hf_config is not None:
        raise _fail(
            "--measure trains a LightningModule: give one with --model module:Class (a Hugging Face "
            "config.json is predicted only)"
        )
    if not shape.vocab:
        raise _fail("--measure feeds random token ids and needs the vocabulary size: pass --vocab")
    candidates = [p for p in predictions if p.fits and not p.rung.reason][: args.max_candidates]
    for pred in predictions:
        if pred.rung.reason:
            pred.measured = "not run"
        elif pred not in candidates:
            pred.measured = "not measured" if pred.fits else "predicted not to fit"
    for pred in candidates:
        console.print(f"measuring {pred.rung.label} ...")
        result = measure_rung(
            {
                "model_class": spec.model_class,
                "init_args": spec.init_args,
                "data_class": None,
                "data_args": {},
                "strategy": pred.rung.strategy_kwargs(),
                "precision": precision,
                "accelerator": machine.accelerator,
                "devices": machine.devices,
                "micro_batch": pred.rung.micro_batch,
                "seq_len": shape.seq_len,
                "vocab": shape.vocab,
                "steps": args.steps,
                "warmup": 1,
            }
        )
        if result["status"] == "ok":
            pred.measured, pred.measured_peak, pred.step_time = "fits", result["peak"], result["time"]
        elif result["status"] == "oom":
            pred.measured = f"does not fit ({result['message']})"
        else:
            pred.measured = f"error: {result['message']}"
    ran = [p for p in candidates if p.step_time]
    return max(ran, key=lambda p: p.throughput, default=None)


def _table(predictions, shape, num_params, machine, precision, measured):
    from rich.table import Table

    title = (
        f"{num_params / 1e6:.1f}M parameters, {machine.world_size} x {machine.accelerator} "
        f"({machine.device_memory / GIB:.1f} GiB each, {machine.cpu_memory / GIB:.1f} GiB CPU), {precision}, "
        f"seq {shape.seq_len}, hidden {shape.hidden}, {shape.layers} layers"
    )
    table = Table(title=title)
    columns = ["#", "rung", "configuration", "device peak", "cpu", "fits", "note"]
    if measured:
        columns += ["measured peak", "step time", "samples/s/rank", "measured"]
    for column in columns:
        table.add_column(column)
    for i, p in enumerate(predictions, 1):
        if p.estimate is None:
            row = [str(i), p.rung.step, p.rung.label, "-", "-", "-", p.rung.reason]
        else:
            row = [
                str(i),
                p.rung.step,
                p.rung.label,
                f"{p.estimate.accelerator_peak / GIB:.3f} GiB",
                f"{p.estimate.cpu_peak / GIB:.3f} GiB",
                "yes" if p.fits else "no",
                p.rung.reason,
            ]
        if measured:
            row += [
                f"{p.measured_peak / GIB:.3f} GiB" if p.measured_peak is not None else "-",
                f"{p.step_time:.3f} s" if p.step_time else "-",
                f"{p.throughput:.1f}" if p.throughput else "-",
                p.measured or "-",
            ]
        table.add_row(*row)
    return table


def _write_outputs(winner, precision, machine, spec, output_dir, overwrite, console) -> None:
    from lightning_zero.cli.ladder import ds_config, lightning_yaml

    yaml_path = os.path.join(output_dir, "advise.yaml")
    json_path = os.path.join(output_dir, "advise_ds_config.json")
    existing = [p for p in (yaml_path, json_path) if os.path.exists(p)]
    if existing and not overwrite:
        raise _fail(f"{', '.join(existing)} already exist: pass --overwrite or another --output-dir")
    os.makedirs(output_dir, exist_ok=True)
    with open(yaml_path, "w") as f:
        f.write(lightning_yaml(winner.rung, precision, machine, spec.config_batch_key))
    console.print(f"LightningCLI snippet: {yaml_path}")
    try:
        config = ds_config(winner.rung, precision)
    except ValueError as err:
        console.print(f"ds_config not written: {err}")
        return
    with open(json_path, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    console.print(f"DeepSpeed ds_config: {json_path}")
