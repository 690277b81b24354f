"""``lightning-zero consolidate CHECKPOINT OUTPUT [--dtype fp32|bf16|fp16]``."""

from __future__ import annotations

import argparse
import time

from lightning_zero.cli.errors import add_debug_flag, report


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "consolidate",
        help="merge a sharded lightning-zero or DeepSpeed ZeRO checkpoint into one file (streaming)",
        description=(
            "Write CHECKPOINT (a lightning-zero sharded .ckpt directory, or a DeepSpeed ZeRO checkpoint directory "
            "with a 'latest' tag file) as one file: safetensors if OUTPUT ends in .safetensors, otherwise a "
            "Lightning checkpoint readable by LightningModule.load_from_checkpoint and "
            "torch.load(..., weights_only=True). Tensors are read and written one at a time."
        ),
    )
    parser.add_argument("checkpoint", help="sharded checkpoint directory or DeepSpeed checkpoint directory")
    parser.add_argument("output", help="output file (.safetensors or a Lightning .ckpt/.pt)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="convert floating-point tensors (default: keep stored dtypes)")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="also write optimizer states, in Lightning's format: the output resumes training under "
                             "any strategy, e.g. Trainer(strategy='ddp').fit(model, ckpt_path=OUTPUT)")
    add_debug_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lightning_zero.checkpoint.consolidate import consolidate_checkpoint

    start = time.perf_counter()
    try:
        consolidate_checkpoint(args.checkpoint, args.output, dtype=args.dtype, with_optimizer=args.with_optimizer)
    except Exception as err:  # one line per error; the traceback only with --debug
        if args.debug:
            raise
        return report("consolidate", err)
    print(f"wrote {args.output} in {time.perf_counter() - start:.1f} s")
    return 0
