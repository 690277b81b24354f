"""Two simulated hosts for multi-node tests: two network namespaces joined by a veth pair (10.77.x.1/24 and .2/24,
addresses that exist inside those namespaces only), where root and ``ip netns`` are available; else loopback.

Each "node" runs its command through :meth:`Hosts.prefix` (``ip netns exec <ns>``) with :meth:`Hosts.env`
(``GLOO_SOCKET_IFNAME`` = that namespace's veth, since the hostname resolves to loopback there)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional


@dataclass
class Hosts:
    namespaces: Optional[list]  # None: loopback, both "nodes" on this host
    addresses: list
    ifnames: list

    def prefix(self, node: int) -> list:
        return ["ip", "netns", "exec", self.namespaces[node]] if self.namespaces else []

    def env(self, node: int) -> dict:
        return {"GLOO_SOCKET_IFNAME": self.ifnames[node]} if self.namespaces else {}


def netns_unavailable() -> Optional[str]:
    """Why two namespaces cannot be made here (``None``: they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"`ip netns` does not work here: {probe.stderr.strip()}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def make_netns_hosts(tag: str, subnet: int) -> Hosts:
    """Create the two namespaces and the veth pair (names unique by ``tag``); :func:`remove_netns_hosts` undoes it."""
    names, ifnames = [f"lz{tag}a", f"lz{tag}b"], [f"lz{tag}va", f"lz{tag}vb"]
    addresses = [f"10.77.{subnet}.1", f"10.77.{subnet}.2"]
    hosts = Hosts(names, addresses, ifnames)
    try:
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", ifnames[0], "type", "veth", "peer", "name", ifnames[1])
        for name, ifname, address in zip(names, ifnames, addresses):
            _ip("link", "set", ifname, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", ifname)
            _ip("-n", name, "link", "set", ifname, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except Exception:
        remove_netns_hosts(hosts)
        raise
    return hosts


def remove_netns_hosts(hosts: Hosts) -> None:
    """Delete the namespaces (which deletes the veth pair with them); missing ones are fine."""
    for name in hosts.namespaces or []:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for ifname in hosts.ifnames:  # a veth not yet moved into a namespace lives in ours
        subprocess.run(["ip", "link", "del", ifname], capture_output=True)


LOOPBACK = Hosts(None, ["127.0.0.1", "127.0.0.1"], ["lo", "lo"])
