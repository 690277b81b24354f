"""The ``hosts`` fixture of the multi-node tests (``lightning-zero launch`` and ``fabric run``)."""

import os

import pytest

from tests.launch.hosts import LOOPBACK, make_netns_hosts, netns_unavailable, remove_netns_hosts


@pytest.fixture
def hosts():
    """Two network namespaces where root and `ip netns` exist, else both "nodes" on loopback (the reason printed)."""
    reason = netns_unavailable()
    if reason:
        print(f"two simulated hosts on loopback: {reason}")
        yield LOOPBACK
        return
    made = make_netns_hosts(f"{os.getpid() % 10000}", subnet=os.getpid() % 200 + 1)
    try:
        yield made
    finally:
        remove_netns_hosts(made)
