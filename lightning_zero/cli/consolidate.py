"""``lightning-zero consolidate CHECKPOINT (OUTPUT | --hf DIR) [--dtype ...] [--with-optimizer] [--strip-prefix P]``.

DeepSpeed's ``zero_to_fp32.py`` spellings are taken too (its ``main`` in ``deepspeed/utils/zero_to_fp32.py``):
``-t/--tag`` (the tag directory to read instead of the one the ``latest`` file names), ``--max_shard_size`` and
``--safe_serialization`` (a ``.safetensors`` OUTPUT, which the extension already chooses), and the underscore forms
of the other options. An existing OUTPUT is never replaced without ``--overwrite``.
"""

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
            "written one at a time. CHECKPOINT may also be a single-file Lightning checkpoint (a DDP run's .ckpt): "
            "OUTPUT is then its copy in another format or dtype, without its optimizer states unless "
            "--with-optimizer. An existing OUTPUT is refused unless --overwrite."
        ),
    )
    parser.add_argument(
        "checkpoint",
        help="lightning-zero sharded checkpoint, DeepSpeed checkpoint directory, or a single-file Lightning checkpoint",
    )
    parser.add_argument(
        "output", nargs="?", default=None, help="output file (.safetensors or a Lightning .ckpt/.pt); not with --hf"
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="convert floating-point tensors (default: keep stored dtypes)",
    )
    parser.add_argument("--overwrite", "--force", action="store_true", help="replace an existing OUTPUT")
    parser.add_argument(
        "-t",
        "--tag",
        default=None,
        help="DeepSpeed checkpoint: the tag directory to read (default, or 'latest': the tag the "
        "'latest' file names), as zero_to_fp32's --tag",
    )
    parser.add_argument(
        "--safe_serialization",
        "--safe-serialization",
        action="store_true",
        help="zero_to_fp32's flag for safetensors: OUTPUT must end in .safetensors (the extension chooses the format)",
    )
    parser.add_argument(
        "--with-optimizer",
        "--with_optimizer",
        action="store_true",
        help="also write optimizer states, in Lightning's format: the output resumes training under "
        "any strategy, e.g. Trainer(strategy='ddp').fit(model, ckpt_path=OUTPUT)",
    )
    parser.add_argument(
        "--hf",
        metavar="DIR",
        default=None,
        help="write a Hugging Face model directory: the LightningModule attribute holding the "
        "transformers.PreTrainedModel (recorded at save) with its prefix stripped, tied weights "
        "once, config.json",
    )
    parser.add_argument(
        "--strip-prefix",
        "--strip_prefix",
        metavar="P",
        default=None,
        help="keep only the keys under P (e.g. 'model'), without it: for --hf when the checkpoint "
        "records no transformers model, or for a .safetensors OUTPUT",
    )
    parser.add_argument(
        "--max-shard-size",
        "--max_shard_size",
        metavar="SIZE",
        default=None,
        help="with --hf: split the weights into model-0000i-of-0000n.safetensors files of at most "
        "SIZE (e.g. 2GB, 500MB) plus model.safetensors.index.json",
    )
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
        parser.error("--max-shard-size applies to --hf (one OUTPUT file is never split)")
    if args.safe_serialization and (args.output is None or not args.output.endswith(".safetensors")):
        parser.error("--safe_serialization writes safetensors: give an OUTPUT ending in .safetensors (or --hf DIR)")
    if args.output is not None:  # the rules of consolidate_checkpoint and ConsolidateCheckpoint, in the CLI's words
        from lightning_zero.checkpoint.consolidate import CLI_NAMES, options_problem

        problem = options_problem(args.output, args.dtype, args.with_optimizer, args.strip_prefix, CLI_NAMES)
        if problem:
            parser.error(problem)


def _source(args: argparse.Namespace) -> str:
    """CHECKPOINT, or its ``--tag`` directory (DeepSpeed's layout: ``DIR/latest`` names the tag ``DIR/<tag>``)."""
    import os

    from lightning_zero.checkpoint.deepspeed_reader import is_deepspeed_checkpoint

    if args.tag is None:
        return args.checkpoint
    if not (os.path.isdir(args.checkpoint) and is_deepspeed_checkpoint(args.checkpoint)):
        raise ValueError(
            f"--tag {args.tag}: {args.checkpoint} is not a DeepSpeed checkpoint directory, the only kind with tags"
        )
    if args.tag == "latest":
        return args.checkpoint
    tagged = os.path.join(args.checkpoint, args.tag)
    if not os.path.isdir(tagged):
        tags = sorted(d for d in os.listdir(args.checkpoint) if os.path.isdir(os.path.join(args.checkpoint, d)))
        raise ValueError(f"--tag {args.tag}: no directory {tagged}; the tags there are {tags}")
    return tagged


def _refuse_existing_output(args: argparse.Namespace) -> None:
    import os

    if args.output is not None and os.path.isfile(args.output) and not args.overwrite:
        raise ValueError(f"{args.output} exists; pass --overwrite to replace it, or give another OUTPUT")


def _single_file_note(args: argparse.Namespace) -> None:
    import os

    if args.output is not None and os.path.isfile(args.checkpoint) and not args.with_optimizer:
        print(
            f"lightning-zero consolidate: note: {args.checkpoint} is a single-file checkpoint: {args.output} "
            "holds its weights (a .ckpt also its other entries: loops, hyperparameters), not its optimizer states; "
            "--with-optimizer keeps them"
        )


def run(args: argparse.Namespace) -> int:
    from lightning_zero.checkpoint.consolidate import consolidate_checkpoint
    from lightning_zero.checkpoint.hf_export import export_hf

    _check_combination(args)
    start = time.perf_counter()
    try:
        _refuse_existing_output(args)
        args.checkpoint = _source(args)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if args.hf is not None:
                left_out = export_hf(
                    args.checkpoint,
                    args.hf,
                    strip_prefix=args.strip_prefix,
                    dtype=args.dtype,
                    max_shard_size=args.max_shard_size,
                )
            else:
                consolidate_checkpoint(
                    args.checkpoint,
                    args.output,
                    dtype=args.dtype,
                    with_optimizer=args.with_optimizer,
                    strip_prefix=args.strip_prefix,
                )
                left_out = []
    except Exception as err:  # one line per error; the traceback only with --debug
        if args.debug:
            raise
        return report("consolidate", err)
    _single_file_note(args)
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
