"""``lightning-zero estimate``: per-rank model-state memory for each ZeRO stage, before launching anything."""

from __future__ import annotations

import argparse
import math


def _positive_count(text: str) -> float:
    """A parameter count: a positive finite number such as ``7e9`` (argparse turns the error into a usage error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 1")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (also used by ``advise``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def add_parser(subparsers) -> None:
    from lightning_zero.estimate.precisions import PRECISIONS

    parser = subparsers.add_parser("estimate", help="estimate per-rank model-state memory for ZeRO stages 0-3")
    parser.add_argument("--params", type=_positive_count, required=True, help="number of parameters, e.g. 7e9")
    parser.add_argument("--world-size", type=positive_int, required=True)
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None, help="default: every stage")
    parser.add_argument(
        "--offload",
        choices=["cpu", "nvme"],
        default=None,
        help="shorthand: the optimizer (stages 1-2), the optimizer and parameters (stage 3); nvme: "
        "optimizer states swapped to disk (with the optimizer alone offloaded, the fp32 masters "
        "too); at stage 3 the fp32 parameter shards too (ZeRO-Infinity)",
    )
    parser.add_argument(
        "--offload-optimizer",
        choices=["cpu", "nvme"],
        default=None,
        help="precise form: optimizer states and fp32 masters only (parameters stay on the device)",
    )
    parser.add_argument(
        "--offload-params",
        choices=["cpu", "nvme"],
        default=None,
        help="precise form, stage 3: parameters and gradients too (needs --offload-optimizer); nvme: "
        "the fp32 parameter shards swapped to disk",
    )
    parser.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="32-true",
        help="the Trainer's precision (default: %(default)s, the Trainer's, estimate_memory's and advise's default)",
    )
    parser.add_argument(
        "--largest-unit-params",
        type=_positive_count,
        default=None,
        help="parameters of the largest block (stage-3 peak); default: all parameters",
    )
    parser.add_argument(
        "--hybrid-shard-size",
        type=positive_int,
        default=None,
        help="HSDP: states sharded within groups of this many ranks (e.g. GPUs per node)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.largest_unit_params is not None and args.largest_unit_params > args.params:
        raise SystemExit(
            f"lightning-zero estimate: error: --largest-unit-params ({args.largest_unit_params:.3g}) "
            f"cannot exceed --params ({args.params:.3g})"
        )
    precise = {"offload_optimizer": args.offload_optimizer, "offload_params": args.offload_params}
    offload = args.offload or args.offload_optimizer
    if args.offload and any(precise.values()):
        raise SystemExit(
            "lightning-zero estimate: error: give --offload (shorthand) or --offload-optimizer/"
            "--offload-params, not both"
        )
    if (offload or args.offload_params) and args.stage == 0:
        raise SystemExit(
            f"lightning-zero estimate: error: --offload {offload} needs --stage 1, 2 or 3 (stage 0 "
            "keeps every state on the device)"
        )
    if args.offload_params and args.stage != 3:
        raise SystemExit(
            "lightning-zero estimate: error: --offload-params needs --stage 3 (only stage 3 shards parameters)"
        )
    if args.offload_params and not args.offload_optimizer:
        raise SystemExit(
            "lightning-zero estimate: error: --offload-params needs --offload-optimizer (the sharded "
            "fp32 parameters are the optimizer's masters)"
        )
    hybrid = args.hybrid_shard_size
    if hybrid is not None and (args.world_size % hybrid or args.stage == 0):
        raise SystemExit(
            f"lightning-zero estimate: error: --hybrid-shard-size {hybrid} must divide --world-size "
            f"{args.world_size} and needs --stage 1, 2 or 3"
        )
    from rich.console import Console
    from rich.table import Table

    from lightning_zero.estimate.model_states import estimate_model_states_memory

    gib = 1024**3
    placement = (
        f"offload={args.offload}"
        if not any(precise.values())
        else f"offload_optimizer={args.offload_optimizer}, offload_params={args.offload_params}"
    )
    table = Table(
        title=f"{args.params:.3g} parameters, {args.world_size} ranks, {args.precision}, {placement}"
        + (f", hybrid shard groups of {hybrid}" if hybrid else "")
    )
    columns = ("stage", "accelerator at rest", "accelerator peak", "cpu at rest")
    for column in columns + (("cpu peak", "nvme") if offload == "nvme" else ()):
        table.add_column(column, justify="right")
    stages = [args.stage] if args.stage is not None else [s for s in (0, 1, 2, 3) if s or not (offload or hybrid)]
    for stage in stages:
        est = estimate_model_states_memory(
            int(args.params),
            stage,
            args.world_size,
            offload=args.offload,
            precision=args.precision,
            **precise,
            largest_unit_params=int(args.largest_unit_params) if args.largest_unit_params else None,
            hybrid_shard_size=hybrid,
        )
        cells = [
            f"{est.accelerator.total / gib:.2f} GiB",
            f"{est.accelerator_peak / gib:.2f} GiB",
            f"{est.cpu.total / gib:.2f} GiB",
        ]
        if offload == "nvme":
            cells += [f"{est.cpu_peak / gib:.2f} GiB", f"{est.nvme / gib:.2f} GiB"]
        table.add_row(str(stage), *cells)
    Console().print(table)
    return 0
