"""``lightning-zero launch``: DeepSpeed's launcher conventions, running ``torchrun`` on every node.

    lightning-zero launch --hostfile hosts --include "node1:0,1@node2:0,1" train.py --lr 1e-4
    lightning-zero launch --no_ssh --node_rank 1 --num_nodes 2 --nproc-per-node 8 --master_addr 10.0.0.1 train.py

* The hostfile is DeepSpeed's: one ``host slots=N`` per line, ``#`` comments. ``--include``/``--exclude`` take
  ``host`` or ``host:slot,slot`` joined by ``@``; ``--num_nodes`` keeps the first N hosts, ``--num_gpus`` (alias
  ``--nproc-per-node``) the first N slots of each; every node must be left with the same number (``check_even``).
  Slots picked by ``--include``/``--exclude`` become ``CUDA_VISIBLE_DEVICES``.
* ``--no_ssh``: this command runs on each node by hand (or by a scheduler) with its ``--node_rank``. Otherwise the
  first host fans out over ``pdsh`` (when installed) or ``ssh`` to every host, running this same command there with
  ``--no_ssh --node_rank k``: one code path per node either way.
* Each node checks its network first (:mod:`lightning_zero.diagnostics.network`) and, on more than one node, checks
  in with node rank 0 on ``MASTER_ADDR:MASTER_PORT`` within ``--rendezvous_timeout`` seconds: a node that cannot
  reach the master, or a master waiting for a node that never comes, fails naming the node ranks, hosts, addresses
  and interfaces, instead of torchrun's 10-minute (or the process group's 30-minute) wait. Then ``torchrun`` starts
  with that node's ``--node-rank`` and a static rendezvous at ``MASTER_ADDR:MASTER_PORT``.
* Environment: the fan-out forwards variables with the prefixes in ``FORWARDED_PREFIXES`` and every ``--env NAME``;
  a ``.deepspeed_env``-style file (``KEY=VALUE`` lines; ``$DS_ENV_FILE``, else ``./.deepspeed_env``, else
  ``~/.deepspeed_env``, or ``--env_file``) is applied on every node, ``--no_ssh`` included.

Why not DeepSpeed's own runner: it needs ``deepspeed`` installed on every node and starts its own per-rank launcher;
this starts torch's maintained ``torchrun`` (restarts, elastic agent, TorchElastic environment) per node.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections import OrderedDict
from datetime import timedelta
from typing import Mapping, Optional, Sequence

from lightning_zero.cli.errors import add_debug_flag, report

FORWARDED_PREFIXES = (
    "NCCL_",
    "GLOO_",
    "TORCH_",
    "PYTHON",
    "CUDA_",
    "OMP_",
    "LIGHTNING_",
    "PL_",
    "UCX_",
    "HF_",
    "MASTER_PORT",
)
DEFAULT_PORT = 29500
_CHECKIN = "lightning_zero/launch/"


def parse_hostfile(text: str, origin: str = "hostfile") -> "OrderedDict[str, int]":
    """DeepSpeed's hostfile: ``host slots=N`` per line, in order; ``#`` starts a comment. Errors name the line."""
    hosts: "OrderedDict[str, int]" = OrderedDict()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit() or int(parts[1][6:]) < 1:
            raise ValueError(f"{origin} line {number}: {raw.strip()!r} is not 'hostname slots=N' with N >= 1")
        if parts[0] in hosts:
            raise ValueError(f"{origin} line {number}: host {parts[0]!r} is listed twice")
        hosts[parts[0]] = int(parts[1][6:])
    if not hosts:
        raise ValueError(f"{origin} lists no host")
    return hosts


def _parse_filter(text: str, flag: str, hosts: Mapping[str, int]) -> dict[str, Optional[list[int]]]:
    """``host:0,1@host2`` -> ``{"host": [0, 1], "host2": None}`` (``None``: every slot); unknown hosts/slots refused."""
    picked: dict[str, Optional[list[int]]] = {}
    for item in [i.strip() for i in text.split("@")]:
        name, _, slots = item.partition(":")
        if not name or name not in hosts:
            raise ValueError(f"{flag}={text!r}: host {name!r} is not in the hostfile ({', '.join(hosts)})")
        if name in picked:
            raise ValueError(f"{flag}={text!r}: host {name!r} appears twice")
        if not slots:
            picked[name] = None
            continue
        try:
            numbers = [int(s) for s in slots.split(",")]
        except ValueError:
            raise ValueError(f"{flag}={text!r}: slots of {name!r} must be integers, got {slots!r}") from None
        bad = [s for s in numbers if not 0 <= s < hosts[name]]
        if bad or len(set(numbers)) != len(numbers):
            raise ValueError(
                f"{flag}={text!r}: slots {bad or numbers} of {name!r} are repeated or outside its "
                f"slots=0..{hosts[name] - 1}"
            )
        picked[name] = sorted(numbers)
    return picked


def select_resources(
    hosts: Mapping[str, int], include: str = "", exclude: str = "", num_nodes: int = -1, num_gpus: int = -1
) -> "OrderedDict[str, list[int]]":
    """The hosts and slots a launch uses, in hostfile order (DeepSpeed's semantics; errors instead of guesses)."""
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive")
    chosen: "OrderedDict[str, list[int]]" = OrderedDict((h, list(range(n))) for h, n in hosts.items())
    if include:
        picked = _parse_filter(include, "--include", hosts)
        chosen = OrderedDict(
            (h, s if s is not None else list(range(hosts[h])))
            for h, s in ((h, picked[h]) for h in hosts if h in picked)
        )
    elif exclude:
        dropped = _parse_filter(exclude, "--exclude", hosts)
        for host, slots in dropped.items():
            chosen[host] = [] if slots is None else [s for s in chosen[host] if s not in slots]
        chosen = OrderedDict((h, s) for h, s in chosen.items() if s)
    if num_nodes > 0:
        if num_nodes > len(chosen):
            raise ValueError(f"--num_nodes={num_nodes} but only {len(chosen)} hosts are selected ({', '.join(chosen)})")
        chosen = OrderedDict(list(chosen.items())[:num_nodes])
    if num_gpus > 0:
        short = [h for h, s in chosen.items() if len(s) < num_gpus]
        if short:
            raise ValueError(f"--num_gpus={num_gpus} but {', '.join(short)} have fewer selected slots")
        chosen = OrderedDict((h, s[:num_gpus]) for h, s in chosen.items())
    if not chosen:
        raise ValueError("no host is left after --include/--exclude")
    check_even(chosen)
    return chosen


def check_even(chosen: Mapping[str, list[int]]) -> None:
    """Refuse a selection with more processes on one node than another, naming two selections that work.

    torchrun itself could run one (each node's agent publishes its own ``--nproc-per-node`` and rank 0's agent
    numbers the workers by cumulative sum: ``SimpleElasticAgent._assign_worker_ranks`` in
    ``torch/distributed/elastic/agent/server/api.py``), but the scripts this launches could not: Lightning's Trainer
    and Fabric run ``devices`` processes on each of ``num_nodes`` nodes and split the data ``devices x num_nodes``
    ways (``DDPStrategy.distributed_sampler_kwargs``), and ``ZeroStrategy`` refuses a launch that differs
    (``check_launcher_world_size``): no ``Trainer(devices=...)`` matches 4 processes on one node and 8 on another.
    """
    counts = {h: len(s) for h, s in chosen.items()}
    if len(set(counts.values())) <= 1:
        return
    fewest = min(counts.values())
    include = "@".join(f"{h}:{','.join(map(str, s[:fewest]))}" for h, s in chosen.items())
    raise ValueError(
        f"the selection runs {counts} processes per node, but Lightning's Trainer and Fabric run the same number "
        f"(devices) on every node: select {fewest} on each, with --num_gpus {fewest} (the first {fewest} selected "
        f"slots of each host) or --include {include!r}"
    )


def read_env_file(path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (``#`` comments, blank lines) of a ``.deepspeed_env``-style file; errors name the line."""
    values = {}
    with open(path) as handle:
        for number, raw in enumerate(handle, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip().isidentifier():
                raise ValueError(f"{path} line {number}: {line!r} is not KEY=VALUE")
            values[key.strip()] = value.strip()
    return values


def find_env_file(explicit: Optional[str], environ: Mapping[str, str]) -> Optional[str]:
    """``--env_file``, else ``$DS_ENV_FILE``, else ``./.deepspeed_env``, else ``~/.deepspeed_env`` (first existing)."""
    if explicit:
        if not os.path.isfile(explicit):
            raise FileNotFoundError(f"--env_file {explicit} does not exist")
        return explicit
    named = environ.get("DS_ENV_FILE")
    if named:
        if not os.path.isfile(named):
            raise FileNotFoundError(f"DS_ENV_FILE={named} does not exist")
        return named
    for candidate in (os.path.join(os.getcwd(), ".deepspeed_env"), os.path.expanduser("~/.deepspeed_env")):
        if os.path.isfile(candidate):
            return candidate
    return None


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="start a training script with torchrun on one or many nodes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-H", "--hostfile", default=None, help="DeepSpeed hostfile: 'host slots=N' lines")
    parser.add_argument("-i", "--include", default="", help="hosts/slots to use: 'host1:0,1@host2'")
    parser.add_argument("-e", "--exclude", default="", help="hosts/slots to leave out: 'host1:0@host3'")
    parser.add_argument("--num_nodes", "--num-nodes", type=int, default=-1, help="use the first N hosts")
    parser.add_argument(
        "--num_gpus",
        "--num-gpus",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="num_gpus",
        type=int,
        default=-1,
        help="processes (GPUs) per node",
    )
    parser.add_argument("--node_rank", "--node-rank", type=int, default=None, help="this node's rank (--no_ssh)")
    parser.add_argument("--master_addr", "--master-addr", default=None, help="node rank 0's address")
    parser.add_argument(
        "--master_port",
        "--master-port",
        type=int,
        default=None,
        help=f"node rank 0's port (default: {DEFAULT_PORT}; a free port on a single node)",
    )
    parser.add_argument("--no_ssh", "--no-ssh", action="store_true", help="run this node only (one command per node)")
    parser.add_argument(
        "--launcher",
        choices=("auto", "pdsh", "ssh"),
        default="auto",
        help="fan-out without --no_ssh (auto: pdsh when installed, else ssh)",
    )
    parser.add_argument("--ssh_port", "--ssh-port", type=int, default=None)
    parser.add_argument("--env", action="append", default=[], metavar="NAME", help="also forward this variable")
    parser.add_argument("--env_file", "--env-file", default=None, help="KEY=VALUE file applied on every node")
    parser.add_argument(
        "--rendezvous_timeout",
        "--rendezvous-timeout",
        type=float,
        default=None,
        help="seconds a node waits for the others before failing with their names (default 300)",
    )
    parser.add_argument("--max_restarts", "--max-restarts", type=int, default=0, help="torchrun --max-restarts")
    parser.add_argument("--module", "-m", action="store_true", help="the script is a Python module (python -m)")
    parser.add_argument("--no_python", "--no-python", action="store_true", help="run the script as an executable")
    parser.add_argument(
        "--skip_network_check",
        "--skip-network-check",
        action="store_true",
        help="do not refuse a network configuration the pre-flight check finds broken",
    )
    parser.add_argument("--dry_run", "--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--world_info", default=None, help=argparse.SUPPRESS)  # the fan-out's selection, to each node
    add_debug_flag(parser)
    parser.add_argument("script", help="training script (or module with --module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    parser.set_defaults(func=run)


def _hosts(args) -> Optional["OrderedDict[str, list[int]]"]:
    if getattr(args, "world_info", None):  # set by the fan-out: the hostfile need not exist on this node
        return OrderedDict(json.loads(base64.urlsafe_b64decode(args.world_info.encode()).decode()))
    if args.hostfile is None:
        if args.include or args.exclude:
            raise ValueError("--include/--exclude need a --hostfile")
        return None
    with open(args.hostfile) as handle:
        hosts = parse_hostfile(handle.read(), args.hostfile)
    return select_resources(hosts, args.include, args.exclude, args.num_nodes, args.num_gpus)


def _nproc(args, resources) -> int:
    if resources is not None:
        return len(next(iter(resources.values())))
    if args.num_gpus > 0:
        return args.num_gpus
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    raise ValueError("no CUDA device here: give the number of processes per node with --nproc-per-node/--num_gpus")


def torchrun_command(
    script: str,
    script_args: Sequence[str],
    num_nodes: int,
    node_rank: int,
    nproc: int,
    master_addr: str,
    master_port: int,
    rendezvous_timeout: float,
    max_restarts: int = 0,
    module: bool = False,
    no_python: bool = False,
) -> list[str]:
    """The ``torchrun`` command of one node: a static rendezvous at ``master_addr:master_port``."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={num_nodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        f"--rdzv-conf=timeout={int(max(1, rendezvous_timeout))}",
        f"--max-restarts={max_restarts}",
    ]
    if module:
        command.append("-m")
    if no_python:
        command.append("--no-python")
    return command + [script, *script_args]


def fanout_commands(args, resources, environ: Mapping[str, str], launcher: str) -> list[list[str]]:
    """The remote commands (one per host for ssh; one for pdsh, which substitutes ``%n`` by the node's rank)."""
    hosts = list(resources)
    master = args.master_addr or hosts[0]
    # a prefix match never forwards what looks like a credential (it would show on the remote command line)
    forwarded = {
        k: v
        for k, v in environ.items()
        if k in args.env
        or k.startswith(FORWARDED_PREFIXES)
        and not any(word in k for word in ("TOKEN", "SECRET", "PASSWORD", "KEY"))
    }
    missing = [name for name in args.env if name not in environ]
    if missing:
        raise ValueError(f"--env {', '.join(missing)}: not set in this environment, nothing to forward")
    exports = " ".join(f"export {k}={shlex.quote(v)};" for k, v in sorted(forwarded.items()))
    base = [
        sys.executable,
        "-m",
        "lightning_zero",
        "launch",
        "--no_ssh",
        f"--num_nodes={len(hosts)}",
        f"--master_addr={master}",
        f"--master_port={args.master_port or DEFAULT_PORT}",
    ]
    base.append("--world_info=" + base64.urlsafe_b64encode(json.dumps(list(resources.items())).encode()).decode())
    for flag, value in (("--rendezvous_timeout", args.rendezvous_timeout), ("--env_file", args.env_file)):
        if value is not None:
            base.append(f"{flag}={value}")
    base += (
        [f"--max_restarts={args.max_restarts}"]
        + (["--module"] if args.module else [])
        + (["--no_python"] if args.no_python else [])
        + (["--skip_network_check"] if args.skip_network_check else [])
    )
    cd = f"cd {shlex.quote(os.getcwd())} &&"
    ssh = ["ssh", "-o", "BatchMode=yes"] + (["-p", str(args.ssh_port)] if args.ssh_port else [])

    def remote(rank: str) -> str:
        argv = base + [f"--node_rank={rank}", args.script, *args.script_args]
        return f"{exports} {cd} {' '.join(shlex.quote(a) if a != '--node_rank=%n' else a for a in argv)}"

    if launcher == "pdsh":
        # pdsh runs ssh only when told (its default remote command module may be rsh or another one: `-R ssh`),
        # and takes ssh options only from PDSH_SSH_ARGS_APPEND (kept, when the user set one): the port and
        # BatchMode go there, as on the ssh path.
        options = " ".join([environ.get("PDSH_SSH_ARGS_APPEND", "").strip(), *ssh[1:]]).strip()
        return [
            [
                "env",
                f"PDSH_SSH_ARGS_APPEND={options}",
                "pdsh",
                "-R",
                "ssh",
                "-S",
                "-f",
                "1024",
                "-w",
                ",".join(hosts),
                remote("%n"),
            ]
        ]
    return [ssh + [host, remote(str(k))] for k, host in enumerate(hosts)]


def _checkin(
    master_addr: str, port: int, node_rank: int, num_nodes: int, nproc: int, timeout: float, identity: dict
) -> None:
    """Every node checks in on ``MASTER_ADDR:MASTER_PORT`` before torchrun (see the module docstring)."""
    from lightning_zero.diagnostics.network import NetworkError, identity_line, missing_after, rendezvous_store

    who = (
        f"node rank {node_rank} (host {identity['hostname']}, address {identity['address']} on {identity['interface']})"
    )
    limit = timedelta(seconds=timeout)
    store = rendezvous_store(master_addr, port, node_rank == 0, timeout, who, limit)
    store.set(f"{_CHECKIN}node/{node_rank}", json.dumps({**identity, "nproc": nproc, "num_nodes": num_nodes}))
    keys = [f"{_CHECKIN}node/{k}" for k in range(num_nodes)]
    if node_rank == 0:
        missing = missing_after(store, keys, timeout)
        if missing:
            raise NetworkError(
                f"node rank 0 waited {timeout:g} s at {master_addr}:{port} for node rank(s) "
                f"{missing}, which never checked in: check that they were started and can reach "
                f"{master_addr}:{port} (their own launch names the problem)"
            )
        nodes = [json.loads(store.get(k)) for k in keys]
        for node in nodes:
            print(f"lightning-zero launch: {identity_line(node)}, {node['nproc']} processes", flush=True)
        odd = [n["node_rank"] for n in nodes if (n["nproc"], n["num_nodes"]) != (nproc, num_nodes)]
        if odd:
            store.set(f"{_CHECKIN}verdict", "mismatch")
            raise ValueError(
                f"node rank(s) {odd} were started with other --num_nodes/--nproc-per-node than node rank "
                f"0 ({num_nodes} nodes x {nproc}): {[(n['num_nodes'], n['nproc']) for n in nodes]}"
            )
        store.set(f"{_CHECKIN}verdict", "go")
        # torchrun's agent binds the same port next: wait until every node read the verdict, then free the port
        store.wait([f"{_CHECKIN}read/{k}" for k in range(1, num_nodes)], limit)
    else:
        store.wait([f"{_CHECKIN}verdict"], limit)
        verdict = store.get(f"{_CHECKIN}verdict").decode()
        store.set(f"{_CHECKIN}read/{node_rank}", "1")
        if verdict != "go":
            raise ValueError(f"node rank 0 refused the launch ({verdict}): see its output")
    del store


def run_node(args, resources, environ: dict) -> int:
    """This node's part: env file, network check, check-in, then torchrun (replacing nothing the user set)."""
    from lightning_zero.diagnostics.network import (
        DEFAULT_RENDEZVOUS_TIMEOUT,
        check_network,
        check_rendezvous_timeout,
        free_port,
    )

    timeout = check_rendezvous_timeout(
        DEFAULT_RENDEZVOUS_TIMEOUT if args.rendezvous_timeout is None else args.rendezvous_timeout
    )  # 0 is refused, not replaced
    env_file = find_env_file(args.env_file, environ)
    if env_file:
        environ.update(read_env_file(env_file))
    hosts = list(resources) if resources is not None else None
    num_nodes = len(hosts) if hosts else max(1, args.num_nodes)
    node_rank = args.node_rank if args.node_rank is not None else 0
    if args.node_rank is None and num_nodes > 1:
        raise ValueError(f"--no_ssh with {num_nodes} nodes needs --node_rank (0..{num_nodes - 1}) on each node")
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"--node_rank={node_rank} is outside 0..{num_nodes - 1} for {num_nodes} nodes")
    master = args.master_addr or (hosts[0] if hosts else None)
    if master is None:
        if num_nodes > 1:
            raise ValueError(f"{num_nodes} nodes need --master_addr (node rank 0's address) or a --hostfile")
        master = "127.0.0.1"
    nproc = _nproc(args, resources)
    if resources is not None:
        slots = resources[hosts[node_rank]]
        if slots != list(range(len(slots))) or args.include or args.exclude:
            if "CUDA_VISIBLE_DEVICES" in environ and environ["CUDA_VISIBLE_DEVICES"] != ",".join(map(str, slots)):
                raise ValueError(
                    f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']} is set, and "
                    f"--include/--exclude select slots {slots} on {hosts[node_rank]}: choose one"
                )
            environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    port = args.master_port or (DEFAULT_PORT if num_nodes > 1 else free_port())
    environ.update(MASTER_ADDR=master, MASTER_PORT=str(port))
    command = torchrun_command(
        args.script,
        args.script_args,
        num_nodes,
        node_rank,
        nproc,
        master,
        port,
        timeout,
        args.max_restarts,
        args.module,
        args.no_python,
    )
    if args.dry_run:
        print(shlex.join(command))
        return 0
    network = check_network(environ, num_nodes, node_rank)
    for warning in network.warnings:
        print(f"lightning-zero launch: warning: {network.who()}: {warning}", file=sys.stderr)
    if not args.skip_network_check:
        network.raise_errors()
    if num_nodes > 1:
        _checkin(master, port, node_rank, num_nodes, nproc, timeout, network.identity)
    return subprocess.call(command, env=environ)


def run(args: argparse.Namespace) -> int:
    try:
        if args.script_args[:1] == ["--"]:
            args.script_args = args.script_args[1:]
        resources = _hosts(args)
        environ = dict(os.environ)
        if (
            args.no_ssh
            or resources is None
            or len(resources) == 1
            and args.master_addr is None
            and _is_local(next(iter(resources)))
        ):
            return run_node(args, resources, environ)
        launcher = args.launcher if args.launcher != "auto" else ("pdsh" if shutil.which("pdsh") else "ssh")
        commands = fanout_commands(args, resources, environ, launcher)
        if args.dry_run:
            for command in commands:
                print(shlex.join(command))
            return 0
        procs = [subprocess.Popen(c) for c in commands]
        codes = [p.wait() for p in procs]
        return next((c for c in codes if c), 0)
    except (ValueError, OSError, RuntimeError) as err:
        if args.debug:
            raise
        return report("launch", err)


def _is_local(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", socket.gethostname())
