"""``lightning-zero consolidate CHECKPOINT (OUTPUT | --hf DIR) [--dtype ...] [--with-optimizer] [--strip-prefix P]``."""

from __future__ import annotations

import argparse
import time
import warnings

from lightning_zero.cli.errors import add_debug_flag, report


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "consolidate",
        help="merge a sharded lightning-zero or DeepSpeed ZeRO checkpoint into one file (streaming)",
        description=(
            "Write CHECKPOINT (a lightning-zero sharded .ckpt directory, or a DeepSpeed ZeRO checkpoint directory "
            "with a 'latest' tag file) as one file: safetensors if OUTPUT ends in .safetensors, otherwise a "
            "Lightning checkpoint readable by LightningModule.load_from_checkpoint and "
            "torch.load(..., weights_only=True); or, with --hf DIR, as a Hugging Face model directory "
            "(model.safetensors + config.json) that AutoModel*.from_pretrained(DIR) loads. Tensors are read and "
            "written one at a time."
        ),
    )
    parser.add_argument("checkpoint", help="sharded checkpoint directory or DeepSpeed checkpoint directory")
    parser.add_argument("output", nargs="?", default=None,
                        help="output file (.safetensors or a Lightning .ckpt/.pt); not with --hf")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="convert floating-point tensors (default: keep stored dtypes)")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="also write optimizer states, in Lightning's format: the output resumes training under "
                             "any strategy, e.g. Trainer(strategy='ddp').fit(model, ckpt_path=OUTPUT)")
    parser.add_argument("--hf", metavar="DIR", default=None,
                        help="write a Hugging Face model directory: the LightningModule attribute holding the "
                             "transformers.PreTrainedModel (recorded at save) with its prefix stripped, tied weights "
                             "once, config.json")
    parser.add_argument("--strip-prefix", metavar="P", default=None,
                        help="keep only the keys under P (e.g. 'model'), without it: for --hf when the checkpoint "
                             "records no transformers model, or for a .safetensors OUTPUT")
    parser.add_argument("--max-shard-size", metavar="SIZE", default=None,
                        help="with --hf: split the weights into model-0000i-of-0000n.safetensors files of at most "
                             "SIZE (e.g. 2GB, 500MB) plus model.safetensors.index.json")
    add_debug_flag(parser)
    parser.set_defaults(func=run, parser=parser)


def _check_combination(args: argparse.Namespace) -> None:
    """Usage errors (argparse's exit code 2) before anything is read."""
    parser = args.parser
    if (args.output is None) == (args.hf is None):
        parser.error("give exactly one of OUTPUT and --hf DIR")
    if args.hf is not None and args.with_optimizer:
        parser.error("--with-optimizer writes a resumable Lightning checkpoint; it cannot go with --hf")
    if args.max_shard_size is not None and args.hf is None:
        parser.error("--max-shard-size applies to --hf")
    if args.output is not None:  # the rules of consolidate_checkpoint and ConsolidateCheckpoint, in the CLI's words
        from lightning_zero.checkpoint.consolidate import CLI_NAMES, options_problem

        problem = options_problem(args.output, args.dtype, args.with_optimizer, args.strip_prefix, CLI_NAMES)
        if problem:
            parser.error(problem)


def run(args: argparse.Namespace) -> int:
    from lightning_zero.checkpoint.consolidate import consolidate_checkpoint
    from lightning_zero.checkpoint.hf_export import export_hf

    _check_combination(args)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if args.hf is not None:
                left_out = export_hf(args.checkpoint, args.hf, strip_prefix=args.strip_prefix, dtype=args.dtype,
                                     max_shard_size=args.max_shard_size)
            else:
                consolidate_checkpoint(args.checkpoint, args.output, dtype=args.dtype,
                                       with_optimizer=args.with_optimizer, strip_prefix=args.strip_prefix)
                left_out = []
    except Exception as err:  # one line per error; the traceback only with --debug
        if args.debug:
            raise
        return report("consolidate", err)
    for warning in caught:
        if "lightning_zero" in warning.filename:  # ours: what was left out or is not carried over
            print(f"lightning-zero consolidate: note: {warning.message}")
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if left_out:
        shown = ", ".join(left_out[:8]) + (" ..." if len(left_out) > 8 else "")
        print(f"left out {len(left_out)} key(s) outside the exported prefix: {shown}")
    print(f"wrote {args.hf if args.hf is not None else args.output} in {time.perf_counter() - start:.1f} s")
    return 0
