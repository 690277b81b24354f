"""``lightning-zero diagnose``: the NCCLDiagnostics audit and collective probe, outside training.

Two ways to run it:

* ``lightning-zero diagnose --nproc-per-node 8`` starts 8 local processes itself (fork for gloo, spawn for
  NCCL so no CUDA state is inherited);
* ``torchrun --nnodes 2 --nproc-per-node 8 ... --no-python lightning-zero diagnose`` across nodes: detected by
  ``RANK``/``WORLD_SIZE`` in the environment, each process joins the group torchrun describes.

Under a launcher every process first checks its node's network, before the process group (hostname resolution,
interfaces, ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, ``MASTER_ADDR``): a broken one fails naming the node
instead of hanging in the rendezvous; ``--network-only`` does only that (and a connect to ``MASTER_ADDR:MASTER_PORT``
from node ranks > 0). Local rank 0 of every node audits its environment; rank 0 prints one audit per node with its
identity (hostname, node rank, address, interface), the probe table (with the nccl-tests ``busbw`` column) and
slow-rank flags, and ``--json`` writes all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from lightning_zero.diagnostics.byte_sizes import parse_size
from lightning_zero.diagnostics.probes import COLLECTIVES

DEFAULT_SIZES = ("1K", "64K", "1M", "16M")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "diagnose",
        help="audit the distributed environment and measure collective bandwidth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="local processes to start (default: CUDA device count, or 2 without CUDA); not "
        "allowed under torchrun, which starts the processes itself",
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=list(DEFAULT_SIZES),
        help="message sizes in the nccl-tests sense: bytes or with K/M/G (default: %(default)s)",
    )
    parser.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=COLLECTIVES)
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per size (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per size (default: %(default)s)")
    parser.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="process-group backend; auto = nccl with CUDA, else gloo",
    )
    parser.add_argument(
        "--slow-rank-tolerance",
        type=float,
        default=0.5,
        help="flag a rank slower than the median by this fraction (default: %(default)s)",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="write audit and probe results as JSON")
    parser.add_argument(
        "--network-only",
        action="store_true",
        help="only check this node's network (no process group): hostname, interfaces, "
        "GLOO/NCCL_SOCKET_IFNAME, MASTER_ADDR:PORT reachability; exit 1 on a problem",
    )
    parser.add_argument(
        "--num-nodes",
        type=int,
        default=None,
        help="nodes of the job, for --network-only outside a launcher (default: from "
        "WORLD_SIZE/LOCAL_WORLD_SIZE, else 1)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds --network-only tries to reach MASTER_ADDR:MASTER_PORT (default: %(default)s)",
    )
    parser.set_defaults(func=run)


def _options(args: argparse.Namespace) -> dict:
    import torch

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise SystemExit("diagnose: --backend nccl needs CUDA, which is not available here; use --backend gloo")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit(f"diagnose: --iters must be >= 1 and --warmup >= 0, got {args.iters}, {args.warmup}")
    try:
        sizes = [parse_size(size) for size in args.sizes]
    except ValueError as err:
        raise SystemExit(f"diagnose: --sizes: {err}") from None
    return {
        "backend": backend,
        "sizes": sizes,
        "collectives": list(args.collectives),
        "iters": args.iters,
        "warmup": args.warmup,
        "json": args.json,
        "tolerance": args.slow_rank_tolerance,
    }


def _node_layout(num_nodes: Optional[int] = None) -> tuple[int, int]:
    """(number of nodes, this node's rank) from the launcher's environment (torchrun, SLURM, deepspeed, manual)."""
    env = os.environ
    if num_nodes is None:
        world, local = int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1)))
        num_nodes = max(1, world // max(1, local))
    for name in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID", "CROSS_RANK"):
        if env.get(name, "").isdigit():
            return num_nodes, int(env[name])
    return num_nodes, 0


def network_check(
    num_nodes: Optional[int] = None, connect_timeout: Optional[float] = None, verbose: bool = True
) -> dict:
    """This node's network check (before any process group): prints identity, warnings; raises on errors."""
    from lightning_zero.diagnostics.network import check_network, identity_line, wait_for_master

    nodes, node_rank = _node_layout(num_nodes)
    report = check_network(os.environ, nodes, node_rank)
    for line in [f"network: {identity_line(report.identity)}"] + [f"network WARNING: {w}" for w in report.warnings]:
        if verbose:
            print(line, flush=True)
    report.raise_errors()
    master, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if connect_timeout and master and port and node_rank > 0:
        wait_for_master(master, int(port), connect_timeout, report.who())
        print(f"network: {master}:{port} accepts connections", flush=True)
    return report.identity


def run(args: argparse.Namespace) -> int:
    if args.network_only:
        from lightning_zero.diagnostics.network import NetworkError

        try:
            network_check(args.num_nodes, args.connect_timeout)
        except NetworkError as err:
            print(f"lightning-zero diagnose: error: {err}", file=sys.stderr)
            return 1
        return 0
    options = _options(args)
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_launcher:
        if args.nproc_per_node is not None:
            raise SystemExit(
                "diagnose: RANK/WORLD_SIZE are set (torchrun or similar started this process), so "
                "--nproc-per-node is the launcher's job; drop it"
            )
        return _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), options, init_from_env=True)
    import torch
    import torch.multiprocessing as mp

    nproc = args.nproc_per_node
    if nproc is None:
        nproc = torch.cuda.device_count() if options["backend"] == "nccl" else 2
    if nproc < 1:
        raise SystemExit(f"diagnose: --nproc-per-node must be >= 1, got {nproc}")
    from lightning_zero.diagnostics.network import free_port

    port = free_port()
    if nproc == 1:
        return _spawned_entry(0, 1, port, options)
    method = "spawn" if options["backend"] == "nccl" else "fork"
    mp.start_processes(_spawned_entry, args=(nproc, port, options), nprocs=nproc, join=True, start_method=method)
    return 0


def _spawned_entry(rank: int, world_size: int, port: int, options: dict) -> int:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    return _rank_main(rank, world_size, options, init_from_env=False)


def _rank_main(rank: int, world_size: int, options: dict, init_from_env: bool) -> int:
    import torch
    import torch.distributed as dist

    from lightning_zero.diagnostics.env_audit import audit_environment, audit_text
    from lightning_zero.diagnostics.probes import all_gather_json, probe_collectives, probe_table, slow_outliers

    backend = options["backend"]
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cpu")
    if backend == "nccl":
        from lightning_zero.diagnostics.watchdog import enable_flight_recorder

        enable_flight_recorder()  # for the probe's own NCCL group: must precede init_process_group
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    # The network is checked before the process group, whose rendezvous would otherwise hang on a broken one.
    identity = network_check(verbose=local_rank == 0)
    if init_from_env:
        dist.init_process_group(backend, init_method="env://")
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        audit = audit_environment(
            backend=backend, world_size=world_size, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        )
        audit.network = identity
        audits = all_gather_json(audit.to_dict() if local_rank == 0 else None, device=device)
        results = probe_collectives(
            options["collectives"], options["sizes"], options["iters"], options["warmup"], device=device
        )
        if rank == 0:
            _report(audits, results, options, world_size, audit_text, probe_table, slow_outliers)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _report(audits, results, options, world_size, audit_text, probe_table, slow_outliers) -> None:
    from lightning_zero.diagnostics.env_audit import EnvAudit
    from lightning_zero.diagnostics.probes import rich_console

    console = rich_console()
    host_audits = [EnvAudit(**a) for a in audits if a is not None]
    for audit in host_audits:
        print(audit_text(audit), flush=True)
    console.print(probe_table(results, title=f"collective bandwidth ({options['backend']}, {world_size} ranks)"))
    flags = slow_outliers(results, options["tolerance"])
    for flag in flags:
        console.print(f"SLOW: {flag}", markup=False)
    if options["json"]:
        payload = {
            "backend": options["backend"],
            "world_size": world_size,
            "audits": [a.to_dict() for a in host_audits],
            "probe": [r.to_dict() for r in results],
            "slow_ranks": flags,
        }
        with open(options["json"], "w") as handle:
            json.dump(payload, handle, indent=2)
        console.print(f"wrote {options['json']}", markup=False)


def main(argv: Optional[list] = None) -> int:  # `python -m lightning_zero.cli.diagnose`
    from lightning_zero.cli import main as cli_main

    return cli_main(["diagnose", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
