"""``lightning-zero estimate``: per-rank model-state memory for each ZeRO stage, before launching anything."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("estimate", help="estimate per-rank model-state memory for ZeRO stages 0-3")
    parser.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 7e9")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None, help="default: every stage")
    parser.add_argument("--offload", choices=["cpu"], default=None)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--largest-unit-params", type=float, default=None,
                        help="parameters of the largest block (stage-3 peak); default: all parameters")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lightning_zero.distributed.memory import estimate_model_states_memory

    gib = 1024 ** 3
    table = Table(title=f"{args.params:.3g} parameters, {args.world_size} ranks, {args.precision}, "
                        f"offload={args.offload}")
    for column in ("stage", "accelerator at rest", "accelerator peak", "cpu at rest"):
        table.add_column(column, justify="right")
    stages = [args.stage] if args.stage is not None else [s for s in (0, 1, 2, 3) if s or not args.offload]
    for stage in stages:
        est = estimate_model_states_memory(
            int(args.params), stage, args.world_size, offload=args.offload, precision=args.precision,
            largest_unit_params=int(args.largest_unit_params) if args.largest_unit_params else None)
        table.add_row(str(stage), f"{est.accelerator.total / gib:.2f} GiB", f"{est.accelerator_peak / gib:.2f} GiB",
                      f"{est.cpu.total / gib:.2f} GiB")
    Console().print(table)
    return 0
