"""Predicted vs measured memory and step time for every runnable rung of the ladder, on the GPT example.

    python benchmarks/bench_memory.py                        # 2 CPU ranks, 6 layers x 384, seq 256, micro-batch 4
    python benchmarks/bench_memory.py --n-layer 2 --n-embd 64 --block-size 64 --steps 1   # quick
    python benchmarks/bench_memory.py --accelerator cuda --devices 1 --n-layer 24 --n-embd 2048

Each rung runs ``warmup + steps`` training steps in a fresh process (``lightning_zero.cli.advise_measure``, the
code behind ``lightning-zero advise --measure``). Columns, per rank (maximum over ranks):

- predicted: ``estimate_memory`` at rest (model states) plus one micro-batch's activations, device + CPU;
- tensors: what that prediction models, measured: ``model_state_memory`` before the optimizer step plus the bytes
  of the tensors autograd saved during forward (``saved_activation_bytes``);
- peak: what the process really used: on CPU the growth of the resident set's high-water mark (``VmHWM``) since the
  imports, which adds the allocator's slack, gradients of activations during backward, optimizer temporaries and
  communication buffers; on CUDA ``torch.cuda.max_memory_allocated``;
- predicted peak: ``estimate_memory``'s ``accelerator_peak + cpu_peak`` (gathered parameters included).

With activation checkpointing (``ZeroStrategy(activation_checkpointing=True[, cpu_checkpointing=True])``) the
tensors column also counts what a non-reentrant ``torch.utils.checkpoint`` keeps and rebuilds, which the plain
saved-tensor hook cannot see: the block inputs (counted where the block receives them, also when ``save_on_cpu``
holds CPU copies of them) and the largest block's activations, rebuilt one block at a time in backward (that block's
forward run once without checkpoint under the hook): ``lightning_zero.estimate.checkpointed_activations``.

Then it runs ``lightning-zero advise --measure`` on the same model and reports its choice and wall time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

if not __package__:  # run by path (python benchmarks/x.py): the repository root onto sys.path
    import _path  # noqa: F401

from benchmarks.common import ROOT  # noqa: E402

MIB = 2**20


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=65)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-advise", action="store_true", help="skip the `lightning-zero advise --measure` run")
    args = parser.parse_args(argv)

    from lightning_zero import TransformerShape
    from lightning_zero.cli.advise_measure import measure_rung
    from lightning_zero.cli.advise_model import ModelSpec, infer_shape, instantiate
    from lightning_zero.cli.ladder import Machine, available_cpu_memory, ladder, predict

    init_args = {
        "vocab_size": args.vocab,
        "block_size": args.block_size,
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "n_embd": args.n_embd,
    }
    spec = ModelSpec(os.path.join(ROOT, "examples", "gpt.py") + ":GPTModule", init_args)
    kwargs, params, unit = infer_shape(instantiate(spec), spec, {})
    shape = TransformerShape(micro_batch=args.micro_batch, **kwargs)
    cpu = available_cpu_memory()
    machine = Machine(args.devices, cpu // args.devices, cpu, args.accelerator)
    rungs = [r for r in ladder(args.micro_batch) if not r.reason and r.micro_batch == args.micro_batch]
    predictions = predict(rungs, params, shape, machine, args.precision, unit)
    rows = []
    for pred in predictions:
        est = pred.estimate
        at_rest = (
            est.states.accelerator.total + est.states.cpu.total + est.activations.accelerator + est.activations.cpu
        )
        started = time.perf_counter()
        result = measure_rung(
            {
                "model_class": spec.model_class,
                "init_args": init_args,
                "strategy": pred.rung.strategy_kwargs(),
                "precision": args.precision,
                "accelerator": args.accelerator,
                "devices": args.devices,
                "micro_batch": args.micro_batch,
                "seq_len": args.block_size,
                "vocab": args.vocab,
                "steps": args.steps,
                "warmup": args.warmup,
            }
        )
        print(f"{pred.rung.label}: {result} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        rows.append((pred.rung, at_rest, est.accelerator_peak + est.cpu_peak, result))
    print(
        f"\nGPT {params / 1e6:.1f}M parameters ({args.n_layer} layers x {args.n_embd}, {args.n_head} heads, "
        f"seq {args.block_size}, vocab {args.vocab}), micro-batch {args.micro_batch}, {args.devices} x "
        f"{args.accelerator}, {args.precision}, AdamW; median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(
        "| rung | predicted states+activations MiB | measured tensors MiB | error | predicted peak MiB | "
        "measured peak MiB | step time (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for rung, at_rest, peak, result in rows:
        if result["status"] != "ok":
            print(
                f"| {rung.label} | {at_rest / MIB:.0f} | {result['status']}: {result.get('message', '')} | | "
                f"{peak / MIB:.0f} | | |"
            )
            continue
        error = (at_rest - result["tensors"]) / result["tensors"]
        print(
            f"| {rung.label} | {at_rest / MIB:.0f} | {result['tensors'] / MIB:.0f} | {error:+.1%} | "
            f"{peak / MIB:.0f} | {result['peak'] / MIB:.0f} | {result['time']:.2f} |"
        )
    if args.no_advise:
        return
    command = [
        sys.executable,
        "-m",
        "lightning_zero",
        "advise",
        "--model",
        spec.model_class,
        "--init-args",
        *[f"{k}={v}" for k, v in init_args.items()],
        "--devices",
        str(args.devices),
        "--accelerator",
        args.accelerator,
        "--micro-batch",
        str(args.micro_batch),
        "--precision",
        args.precision,
        "--measure",
        "--steps",
        str(args.steps),
        "--output-dir",
        tempfile.mkdtemp(prefix="advise-"),
    ]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    winner = [line for line in proc.stdout.splitlines() if line.startswith("winner")]
    print(proc.stdout)
    print(
        f"\n`lightning-zero advise --measure`: {winner[0] if winner else proc.stderr[-500:]} "
        f"(wall time of the whole command: {time.perf_counter() - started:.0f} s; written to {command[-1]})"
    )


if __name__ == "__main__":
    main()
