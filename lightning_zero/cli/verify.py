"""``lightning-zero verify CHECKPOINT``: check a sharded checkpoint against the sizes and checksums it was written
with, and its metadata for consistency, without loading it."""

from __future__ import annotations

import argparse
import os
import sys
import time

from lightning_zero.cli.errors import add_debug_flag, one_line, report


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check a sharded checkpoint's files against the sizes and CRC-32s recorded in its zero.json",
        description=__doc__,
    )
    parser.add_argument("checkpoint", help="lightning-zero sharded checkpoint directory")
    parser.add_argument(
        "--no-checksums", action="store_true", help="check sizes and metadata only, without reading every file (fast)"
    )
    add_debug_flag(parser)
    parser.set_defaults(func=run)


def _deepspeed_note(path: str) -> str:
    """What to tell of a DeepSpeed directory: not damage, but a format whose files carry no sizes or checksums."""
    from lightning_zero.checkpoint.deepspeed_reader import resolve_deepspeed_dir

    return (
        f"{path} is a DeepSpeed checkpoint directory (tag {os.path.basename(resolve_deepspeed_dir(path))}), "
        "not a lightning-zero sharded checkpoint: DeepSpeed records no file sizes or checksums to verify "
        "against. It can be read as it is: `lightning-zero consolidate "
        f"{path} model.safetensors` for the weights, or Trainer.fit(ckpt_path=...) / fabric.load with "
        "ZeroStrategy to carry the run on (docs/full_checkpoints.md)"
    )


def run(args: argparse.Namespace) -> int:
    from lightning_zero.checkpoint.deepspeed_reader import is_deepspeed_checkpoint
    from lightning_zero.checkpoint.directory import verify_checkpoint

    start = time.perf_counter()
    if is_deepspeed_checkpoint(args.checkpoint):
        print(f"lightning-zero verify: not verified: {_deepspeed_note(args.checkpoint)}", file=sys.stderr)
        return 1
    try:
        problems = verify_checkpoint(args.checkpoint, checksums=not args.no_checksums)
    except Exception as err:
        if args.debug:
            raise
        return report("verify", err)
    for problem in problems:
        print(f"lightning-zero verify: error: {one_line(problem)}", file=sys.stderr)
    if problems:
        return 1
    from lightning_zero.checkpoint.directory import checkpoint_directory, read_checkpoint_info

    directory = checkpoint_directory(args.checkpoint)
    files = read_checkpoint_info(directory).get("files")
    if files is None:
        print(
            f"{directory}: metadata consistent; no file records to check (written before lightning-zero recorded them)"
        )
        return 0
    total = sum(record["size"] for record in files.values())
    what = "sizes and CRC-32 checksums" if not args.no_checksums else "sizes"
    print(
        f"{directory}: OK ({len(files)} files, {total / 2**20:.1f} MiB: {what} match, metadata consistent; "
        f"{time.perf_counter() - start:.2f} s)"
    )
    return 0
