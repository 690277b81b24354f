"""Network checks that run on every node *before* any process group exists, and a bounded rendezvous.

A multi-node job whose network is misconfigured does not fail: it hangs. The TCPStore client of a node that cannot
reach ``MASTER_ADDR:MASTER_PORT`` retries for the whole process-group timeout (30 minutes under Lightning), and gloo
ranks that advertise a loopback address to their peers wait as long for connections that never come. Nothing in torch
looks at the configuration first, so this module does (framework-free, no Lightning, no process group):

* :func:`check_network`: host identity (hostname, what it resolves to, the interface and address that route to the
  master, node rank), the ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` sanity, ``MASTER_ADDR``/``MASTER_PORT``; it
  returns errors (the run cannot work) and warnings. Cheap: no connection is opened.
* :func:`startup_check`: :func:`check_network` once per process for the same inputs, so the strategies' checks
  before the process group, the rendezvous and the diagnostics callback share one report.
* :func:`wait_for_master`: a TCP connect to ``MASTER_ADDR:MASTER_PORT`` retried until a deadline, with an error that
  names the node, the address and the interface instead of torch's retry loop.
* :func:`checked_store`: the ``TCPStore`` for ``init_process_group`` where no launcher agent hosts one (``srun``, a
  manual launch): every rank checks in under its node rank; rank 0 waits at most ``rendezvous_timeout`` and then
  names the node ranks that never arrived.

[Note: why loopback is a red flag only across hosts]
gloo picks the address it advertises from ``GLOO_SOCKET_IFNAME`` or else from the hostname (a hostname that does not
resolve to a local address falls back to loopback). On one host that is fine; across hosts the peers would connect
to *their own* loopback. "Across hosts" means ``num_nodes > 1`` and a ``MASTER_ADDR`` that is not loopback: several
"nodes" on 127.0.0.1 share one host, and nothing is flagged there.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping, Optional

#: Seconds a node waits for the master (and rank 0 for every node) before failing with names.
#: [Note: the default rendezvous timeout] Nodes of one job start up to minutes apart (container pulls, a slow shared
#: file system); far below torch's default process-group timeout, which would otherwise be what ends a network
#: misconfiguration (``docs/launching.md``).
DEFAULT_RENDEZVOUS_TIMEOUT = 300.0

_CHECKIN = "lightning_zero/checkin/"


class NetworkError(RuntimeError):
    """The network cannot carry this run; the message names the node, the host, the address and the fix."""


def check_rendezvous_timeout(value) -> float:
    """``rendezvous_timeout`` as positive finite seconds (a number or a ``timedelta``), else ``ValueError``."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise ValueError(f"rendezvous_timeout must be positive seconds or a timedelta, got {value!r}")
    return float(seconds)


SKIP_ENV = "LIGHTNING_ZERO_SKIP_NETWORK_CHECK"  # the user's override of a check that misjudges their network


@dataclass(frozen=True)
class Interface:
    """A network interface: its IPv4 address (``None`` without one), whether it is up and whether it is loopback."""

    name: str
    address: Optional[str]
    up: bool
    loopback: bool


def _ioctl(name: str, request: int) -> Optional[bytes]:
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None


def interfaces() -> list[Interface]:
    """This host's interfaces (Linux ``SIOCGIFADDR``/``SIOCGIFFLAGS``; names only elsewhere)."""
    found = []
    for _, name in socket.if_nameindex():
        if not sys.platform.startswith("linux"):
            found.append(Interface(name, None, True, name.startswith("lo")))
            continue
        raw = _ioctl(name, 0x8915)  # SIOCGIFADDR: the primary IPv4 address
        flags_raw = _ioctl(name, 0x8913)  # SIOCGIFFLAGS
        flags = struct.unpack("H", flags_raw[16:18])[0] if flags_raw else 0
        address = socket.inet_ntoa(raw[20:24]) if raw else None
        found.append(Interface(name, address, bool(flags & 0x1), bool(flags & 0x8)))  # IFF_UP, IFF_LOOPBACK
    return found


def _is_loopback(address: Optional[str]) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> Optional[str]:
    """``host``'s IPv4 address, or ``None`` when it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def route_to(address: str) -> Optional[str]:
    """The local address the kernel would send from to reach ``address`` (no packet is sent), ``None``: no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))
            return sock.getsockname()[0]
        except OSError:
            return None


@dataclass
class NetworkReport:
    """What :func:`check_network` found: this node's identity, ``errors`` (the run cannot work) and ``warnings``."""

    identity: dict
    errors: list = field(default_factory=list)
    warnings: list = field(default_factory=list)

    def who(self) -> str:
        i = self.identity
        return (
            f"node rank {i['node_rank']} (host {i['hostname']}, address {i['address'] or '?'} on "
            f"{i['interface'] or '?'})"
        )

    def raise_errors(self) -> None:
        """Raise the errors as one :class:`NetworkError`, unless the user overrode the check
        (``LIGHTNING_ZERO_SKIP_NETWORK_CHECK=1``, the override the message names): then log them and go on. Every
        caller (the strategies, ``diagnose``, ``launch``) goes through here, so the override holds everywhere."""
        if self.errors and os.environ.get(SKIP_ENV) == "1":
            logging.getLogger(__name__).warning(
                f"{SKIP_ENV}=1: continuing despite the network check on {self.who()}: {self.errors}"
            )
            return
        if self.errors:
            raise NetworkError(
                f"network check on {self.who()} failed before the process group: "
                + " ".join(f"({n}) {e}" for n, e in enumerate(self.errors, 1))
                + " (LIGHTNING_ZERO_SKIP_NETWORK_CHECK=1, or launch --skip_network_check, overrides)"
            )


def _nccl_matches(spec: str, names: list[str]) -> list[str]:
    """Interfaces ``NCCL_SOCKET_IFNAME`` selects: comma-separated prefixes, ``=`` exact names, ``^`` excludes."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    parts = [p for p in spec.lstrip("=").split(",") if p]
    hit = [n for n in names if any(n == p if exact else n.startswith(p) for p in parts)]
    return [n for n in names if n not in hit] if exclude else hit


def check_network(
    environ: Mapping[str, str], num_nodes: int, node_rank: int, table: Optional[list[Interface]] = None, route=route_to
) -> NetworkReport:
    """Check this node's network configuration for a run of ``num_nodes`` nodes (see the module docstring).

    ``environ`` supplies ``MASTER_ADDR``/``MASTER_PORT`` and the ``*_SOCKET_IFNAME`` variables; ``table`` the
    interfaces (default: this host's), ``route`` the source-address lookup (tests replace both). Nothing is
    connected and nothing is raised: see :meth:`NetworkReport.raise_errors`.
    """
    table = interfaces() if table is None else table
    by_name = {i.name: i for i in table}
    hostname = socket.gethostname()
    resolved = resolve(hostname)
    master = environ.get("MASTER_ADDR", "").strip()
    master_ip = resolve(master) if master else None
    source = route(master_ip) if master_ip else None
    via = next((i.name for i in table if source and i.address == source), None)
    report = NetworkReport(
        {
            "hostname": hostname,
            "resolves_to": resolved,
            "node_rank": node_rank,
            "num_nodes": num_nodes,
            "master": master or None,
            "interface": via,
            "address": source,
        }
    )
    errors = report.errors
    port = environ.get("MASTER_PORT", "").strip()
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        errors.append(f"MASTER_PORT={port!r} is not a port number (1-65535).")
    if num_nodes > 1 and not master:
        errors.append(f"MASTER_ADDR is not set, but this run has {num_nodes} nodes: set it to node rank 0's address.")
    if master and master_ip is None:
        errors.append(f"MASTER_ADDR={master!r} does not resolve on this host (check DNS or /etc/hosts).")
    across_hosts = num_nodes > 1 and master_ip is not None and not _is_loopback(master_ip)
    if across_hosts and source is None:
        errors.append(
            f"no route from this host to MASTER_ADDR={master} ({master_ip}): check the interfaces and the "
            f"routing table (`ip route get {master_ip}`)."
        )
    names = ", ".join(f"{i.name}={i.address or 'no IPv4'}" for i in table)
    _check_gloo_interfaces(report, environ, table, names, hostname, resolved, across_hosts)
    _check_nccl_interfaces(report, environ, by_name, names, across_hosts)
    return report


def _check_gloo_interfaces(
    report: NetworkReport,
    environ: Mapping[str, str],
    table: list,
    names: str,
    hostname: str,
    resolved: Optional[str],
    across_hosts: bool,
) -> None:
    """``GLOO_SOCKET_IFNAME``'s interfaces exist, are up and reach the other nodes; without it, the address gloo
    would advertise (the host name's) is one the other nodes can reach."""
    errors, warnings = report.errors, report.warnings
    by_name = {i.name: i for i in table}
    master, via = report.identity["master"], report.identity["interface"]
    num_nodes = report.identity["num_nodes"]
    local_addresses = {i.address for i in table if i.address and i.up}
    gloo = environ.get("GLOO_SOCKET_IFNAME", "").strip()
    for name in [n.strip() for n in gloo.split(",") if n.strip()]:
        iface = by_name.get(name)
        if iface is None:
            errors.append(
                f"GLOO_SOCKET_IFNAME={gloo} names interface {name!r}, which this host does not have (it has: {names})."
            )
        elif not iface.up or iface.address is None:
            errors.append(
                f"GLOO_SOCKET_IFNAME={gloo}: interface {name!r} is "
                f"{'down' if not iface.up else 'without an IPv4 address'}."
            )
        elif across_hosts and iface.loopback:
            errors.append(
                f"GLOO_SOCKET_IFNAME={gloo} is the loopback interface on a {num_nodes}-node run: gloo would "
                f"advertise {iface.address} to the other nodes, which cannot reach it; use the interface "
                f"that routes to MASTER_ADDR={master}" + (f" ({via})." if via else ".")
            )
        elif across_hosts and via is not None and via != name:
            warnings.append(
                f"GLOO_SOCKET_IFNAME={gloo} but the route to MASTER_ADDR={master} leaves through {via}: "
                f"check that the other nodes can reach {iface.address}."
            )
    if across_hosts and not gloo:
        if resolved is None or _is_loopback(resolved) or resolved not in local_addresses:
            what = (
                "does not resolve"
                if resolved is None
                else f"resolves to {resolved}, "
                + ("a loopback address" if _is_loopback(resolved) else "which no interface of this host has")
            )
            errors.append(
                f"hostname {hostname!r} {what}, so gloo would advertise a loopback address to the other "
                "nodes; set GLOO_SOCKET_IFNAME" + (f"={via}" if via else "") + " (the interface that "
                "routes to MASTER_ADDR) or fix the hostname's entry in DNS or /etc/hosts."
            )


def _check_nccl_interfaces(
    report: NetworkReport, environ: Mapping[str, str], by_name: dict, names: str, across_hosts: bool
) -> None:
    """``NCCL_SOCKET_IFNAME``'s prefixes match an interface of this host, and not only loopback across hosts."""
    errors, num_nodes = report.errors, report.identity["num_nodes"]
    nccl = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if nccl:
        picked = _nccl_matches(nccl, list(by_name))
        if not picked:
            errors.append(f"NCCL_SOCKET_IFNAME={nccl} matches no interface of this host (it has: {names}).")
        elif across_hosts and all(by_name[n].loopback for n in picked):
            errors.append(
                f"NCCL_SOCKET_IFNAME={nccl} selects only loopback ({', '.join(picked)}) on a "
                f"{num_nodes}-node run: the other nodes cannot reach it."
            )


#: What :func:`check_network` reads from the environment; with the host name and the node ranks, the key of
#: :func:`startup_check`'s memo (another value of any of them is another check).
_READS = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_STARTUP: dict = {}


def startup_check(environ: Mapping[str, str], num_nodes: int, node_rank: int) -> NetworkReport:
    """:func:`check_network` of this host, run once per process for the same inputs (the last one is kept).

    A start-up asks for it up to three times (the check before the process group, the node's identity for the
    rendezvous store, the diagnostics callback's audit); each would resolve the host name and the master again,
    which is slow exactly where DNS is misconfigured. Callers that must see the host as it is now (``diagnose``,
    ``launch``, tests with their own interface table) call :func:`check_network`."""
    key = (num_nodes, node_rank, socket.gethostname(), *(environ.get(name, "") for name in _READS))
    report = _STARTUP.get(key)
    if report is None:
        report = check_network(environ, num_nodes, node_rank)
        _STARTUP.clear()
        _STARTUP[key] = report
    return report


def free_port() -> int:
    """A TCP port free on this host now (the kernel's pick on 127.0.0.1), for a one-node rendezvous: two jobs on one
    machine then do not collide on a fixed port. Used by ``launch``, ``diagnose`` and ``advise --measure``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_master(address: str, port: int, deadline_s: float, who: str, interval: float = 0.5) -> None:
    """Connect to ``address:port`` until it accepts or ``deadline_s`` seconds pass; ``NetworkError`` naming ``who``.

    "Connection refused" is retried (the master may not listen yet); "no route"/"unreachable" fails at once.
    """
    end = time.monotonic() + deadline_s
    last: Optional[OSError] = None
    while True:
        try:
            with socket.create_connection((address, port), timeout=min(2.0, max(0.1, end - time.monotonic()))):
                return
        except OSError as err:
            last = err
            if getattr(err, "errno", None) in (101, 113):  # ENETUNREACH, EHOSTUNREACH
                break
        if time.monotonic() >= end:
            break
        time.sleep(interval)
    raise NetworkError(
        f"{who} cannot reach MASTER_ADDR:MASTER_PORT {address}:{port} "
        f"({type(last).__name__}: {last}) within {deadline_s:g} s: is node rank 0 started, is "
        f"{address} the right address, does a firewall block port {port}?"
    )


def rendezvous_store(
    master_addr: str, master_port: int, host: bool, rendezvous_timeout: float, who: str, timeout: timedelta
):
    """The ``TCPStore`` at ``master_addr:master_port``: hosted here when ``host``, else connected to once the master
    accepts (:func:`wait_for_master`, at most ``rendezvous_timeout`` seconds, ``NetworkError`` naming ``who``).
    ``timeout`` is the store's timeout afterwards. Shared by :func:`checked_store` and ``launch``'s node check-in."""
    import torch.distributed as dist

    if host:
        return dist.TCPStore(master_addr, master_port, None, True, timeout=timeout, wait_for_workers=False)
    wait_for_master(master_addr, master_port, rendezvous_timeout, who)
    store = dist.TCPStore(master_addr, master_port, None, False, timeout=timedelta(seconds=rendezvous_timeout))
    store.set_timeout(timeout)
    return store


def missing_after(store, keys: list, deadline_s: float) -> list:
    """Wait up to ``deadline_s`` seconds for every key of ``keys`` in ``store``; the indexes of those still missing
    then (empty: all arrived)."""
    end = time.monotonic() + deadline_s
    while not store.check(keys):
        if time.monotonic() >= end:
            return [i for i, key in enumerate(keys) if not store.check([key])]
        time.sleep(0.2)
    return []


def checked_store(
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    node_rank: int,
    num_nodes: int,
    timeout: timedelta,
    rendezvous_timeout: float,
    identity: Optional[dict] = None,
):
    """A ``TCPStore`` for ``init_process_group(store=...)`` after every rank checked in (see the module docstring).

    Rank 0 hosts the store and waits at most ``rendezvous_timeout`` seconds for the others; the error names the
    node ranks (and global ranks) that never arrived and the hosts that did. Other ranks first wait for the master
    with :func:`wait_for_master` (same bound). ``timeout`` is the store's timeout for the process group afterwards.
    """
    who = f"node rank {node_rank} (rank {rank}, host {socket.gethostname()})"
    store = rendezvous_store(master_addr, master_port, rank == 0, rendezvous_timeout, who, timeout)
    store.set(f"{_CHECKIN}{rank}", json.dumps({"node_rank": node_rank, "rank": rank, **(identity or {})}))
    if rank == 0:
        keys = [f"{_CHECKIN}{r}" for r in range(world_size)]
        missing = missing_after(store, keys, rendezvous_timeout)
        if missing:
            raise NetworkError(
                _missing_message(
                    store, keys, missing, world_size, num_nodes, master_addr, master_port, rendezvous_timeout
                )
            )
    return store


def _missing_message(store, keys, missing, world_size, num_nodes, address, port, waited) -> str:
    per_node = max(1, world_size // max(1, num_nodes))
    nodes = sorted({r // per_node for r in missing})
    arrived = [json.loads(store.get(k)) for r, k in enumerate(keys) if r not in missing]
    hosts = sorted({f"node rank {a['node_rank']} on {a.get('hostname', '?')}" for a in arrived})
    return (
        f"rendezvous at {address}:{port}: node rank(s) {nodes} (global ranks {missing}) did not check in within "
        f"rendezvous_timeout={waited:g} s; arrived: {', '.join(hosts)}. Check that those nodes started and can "
        f"reach {address}:{port} (`lightning-zero diagnose --network-only` on them names the problem)."
    )


def identity_line(identity: dict) -> str:
    """One line naming a node: node rank, hostname, the address and interface that route to the master."""
    where = (
        f"node rank {identity.get('node_rank')}: host {identity.get('hostname')} "
        f"(resolves to {identity.get('resolves_to')})"
    )
    if identity.get("address") is None:  # no route was looked up: say why rather than "address None on None"
        master = identity.get("master")
        return where + (
            f", no route to MASTER_ADDR={master}"
            if master
            else ", no MASTER_ADDR set, so no route to node rank 0 was looked up"
        )
    return f"{where}, address {identity.get('address')} on {identity.get('interface') or 'an unlisted interface'}"
