"""The network check before the process group (``diagnostics/network.py``) and its use by ZeroStrategy: a clear error
naming the node, the interface and the address instead of a hang; no false alarm on one host."""

import os
import socket
import time
from datetime import timedelta

import pytest
from lightning.pytorch import Trainer

from lightning_zero import ZeroStrategy
from lightning_zero.diagnostics.network import (
    Interface,
    NetworkError,
    check_network,
    check_rendezvous_timeout,
    checked_store,
    free_port,
    interfaces,
    wait_for_master,
)
from tests.lightning_models import RegressionModule

TABLE = [
    Interface("lo", "127.0.0.1", True, True),
    Interface("eth0", "10.1.0.5", True, False),
    Interface("ib0", None, False, False),
]


def _route(address):
    return None if address.startswith("10.9.") else "127.0.0.1" if address.startswith("127.") else "10.1.0.5"


def _errors(environ, num_nodes=2, node_rank=1):
    return check_network(environ, num_nodes, node_rank, table=TABLE, route=_route).errors


def test_interfaces_lists_loopback_up():
    lo = next(i for i in interfaces() if i.loopback)
    assert lo.address == "127.0.0.1" and lo.up


def test_single_host_is_never_flagged():
    # one node, or several "nodes" around a loopback master: loopback everywhere is right
    assert _errors({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "lo"}) == []
    assert _errors({}, num_nodes=1, node_rank=0) == []
    assert _errors({"MASTER_ADDR": "localhost", "NCCL_SOCKET_IFNAME": "lo"}, num_nodes=1) == []


def test_misconfigured_interfaces_and_master_are_named():
    master = {"MASTER_ADDR": "10.1.0.1", "MASTER_PORT": "29500"}
    (error,) = _errors({**master, "GLOO_SOCKET_IFNAME": "lo"})
    assert "GLOO_SOCKET_IFNAME=lo is the loopback interface on a 2-node run" in error and "(eth0)" in error
    (error,) = _errors({**master, "GLOO_SOCKET_IFNAME": "eth9"}, num_nodes=1)
    assert "'eth9', which this host does not have" in error and "eth0=10.1.0.5" in error
    (error,) = _errors({**master, "GLOO_SOCKET_IFNAME": "ib0"})
    assert "'ib0' is down" in error
    (error,) = _errors({**master, "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=lo"})
    assert "NCCL_SOCKET_IFNAME==lo selects only loopback" in error
    (error,) = _errors({**master, "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "en"})
    assert "matches no interface" in error
    assert _errors({**master, "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "^lo,ib"}) == []
    assert "no route from this host to MASTER_ADDR=10.9.0.1" in _errors({"MASTER_ADDR": "10.9.0.1"})[0]
    assert "MASTER_ADDR is not set" in _errors({})[0]
    assert "does not resolve" in _errors({"MASTER_ADDR": "no-such-host.invalid"})[0]
    assert "not a port number" in _errors({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"})[0]


def test_hostname_resolving_to_loopback_is_flagged_across_hosts(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")  # resolves to 127.0.0.1 everywhere
    report = check_network({"MASTER_ADDR": "10.1.0.1"}, 2, 1, table=TABLE, route=_route)
    assert any("hostname 'localhost' resolves to 127.0.0.1, a loopback address" in e for e in report.errors)
    with pytest.raises(NetworkError, match=r"network check on node rank 1 \(host localhost"):
        report.raise_errors()
    assert (
        check_network({"MASTER_ADDR": "10.1.0.1", "GLOO_SOCKET_IFNAME": "eth0"}, 2, 1, table=TABLE, route=_route).errors
        == []
    )


def test_rendezvous_timeout_is_validated():
    assert check_rendezvous_timeout(5) == 5.0
    for bad in (0, -1, float("inf"), None, True, "10"):
        with pytest.raises(ValueError, match="rendezvous_timeout"):
            ZeroStrategy(rendezvous_timeout=bad)


def test_unreachable_master_and_missing_node_fail_within_the_bound():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(NetworkError, match=rf"node rank 1 .* cannot reach MASTER_ADDR:MASTER_PORT 127.0.0.1:{port}"):
        wait_for_master("127.0.0.1", port, 1.0, "node rank 1 (host h)")
    # 2 nodes x 2 ranks, only rank 0 arrived: node 0 (rank 1) and node 1 (ranks 2, 3) are named
    with pytest.raises(
        NetworkError,
        match=r"node rank\(s\) \[0, 1\] \(global ranks \[1, 2, 3\]\) did not check in "
        r"within rendezvous_timeout=1 s; arrived: node rank 0 on",
    ):
        checked_store("127.0.0.1", port, 0, 4, 0, 2, timedelta(seconds=30), 1.0, {"hostname": socket.gethostname()})
    assert time.monotonic() - start < 15


def _fit_as_node_zero_of_two(monkeypatch, tmp_path, **env):
    """ZeroStrategy on node rank 0 of a 2-node job (a manual launch: LightningEnvironment), whose node 1 never
    starts."""
    for key, value in dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        NODE_RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="1",
        **env,
    ).items():
        monkeypatch.setenv(key, value)
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2, rendezvous_timeout=2),
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(RegressionModule())


def test_strategy_names_the_node_that_never_arrives(monkeypatch, tmp_path):
    start = time.monotonic()
    with pytest.raises(
        NetworkError,
        match=r"node rank\(s\) \[1\] \(global ranks \[1\]\) did not check in within "
        r"rendezvous_timeout=2 s",
    ):
        _fit_as_node_zero_of_two(monkeypatch, tmp_path)
    assert time.monotonic() - start < 30


def test_strategy_refuses_a_missing_interface_before_the_process_group(monkeypatch, tmp_path):
    with pytest.raises(NetworkError, match=r"node rank 0 .*GLOO_SOCKET_IFNAME=nosuch0 names interface 'nosuch0'"):
        _fit_as_node_zero_of_two(monkeypatch, tmp_path, GLOO_SOCKET_IFNAME="nosuch0")
    # the explicit override lets it through to the rendezvous (which then names the missing node)
    with pytest.raises(NetworkError, match=r"node rank\(s\) \[1\]"):
        _fit_as_node_zero_of_two(
            monkeypatch, tmp_path, GLOO_SOCKET_IFNAME="nosuch0", LIGHTNING_ZERO_SKIP_NETWORK_CHECK="1"
        )


def test_cli_diagnose_network_only_names_the_problem(monkeypatch, capsys):
    from lightning_zero.cli import main as cli_main

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    assert cli_main(["diagnose", "--network-only", "--num-nodes", "2"]) == 1
    captured = capsys.readouterr()
    assert "network: node rank 0: host" in captured.out
    assert "GLOO_SOCKET_IFNAME=nosuch0 names interface 'nosuch0'" in captured.err
    # the override the error names holds in diagnose too (one place decides: NetworkReport.raise_errors)
    monkeypatch.setenv("LIGHTNING_ZERO_SKIP_NETWORK_CHECK", "1")
    assert cli_main(["diagnose", "--network-only", "--num-nodes", "2"]) == 0
    monkeypatch.delenv("LIGHTNING_ZERO_SKIP_NETWORK_CHECK")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert cli_main(["diagnose", "--network-only"]) == 0


def _two_node_audit_worker(rank, world_size):
    """Two "nodes" of one process each: the callback audits both hosts, not only node 0, with their identity."""
    import warnings

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero.callbacks.diagnostics import NCCLDiagnostics

    os.environ.update(NODE_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if rank == 1:
        os.environ["NCCL_P2P_DISABLE"] = "1"  # a setting only node 1 has
    callback = NCCLDiagnostics(probe=False, hang_timeout=None)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        logger=False,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=1,
        limit_val_batches=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(RegressionModule())
    if rank == 0:
        assert [a.network["node_rank"] for a in callback.audits] == [0, 1]
        assert all(a.network["hostname"] == socket.gethostname() and a.network["address"] for a in callback.audits)
        assert any("(node rank 1): NCCL_P2P_DISABLE=1" in str(w.message) for w in caught)


def test_diagnostics_callback_audits_every_node():
    from tests.ranks import run_distributed

    run_distributed(_two_node_audit_worker, 2)


def _count_network_checks(monkeypatch):
    from lightning_zero.diagnostics import network

    calls = []
    original = network.check_network

    def counted(*args, **kwargs):
        calls.append(args[1:3])
        return original(*args, **kwargs)

    monkeypatch.setattr(network, "check_network", counted)
    monkeypatch.setattr(network, "_STARTUP", {})  # nothing remembered from another test of this process
    return calls


def test_trainer_start_up_checks_the_network_once(monkeypatch, tmp_path):
    # The check before the process group and the rendezvous store's node identity: one check_network, not two.
    calls = _count_network_checks(monkeypatch)
    with pytest.raises(NetworkError, match=r"node rank\(s\) \[1\]"):
        _fit_as_node_zero_of_two(monkeypatch, tmp_path)
    assert calls == [(2, 0)]


def test_fabric_start_up_checks_the_network_once(monkeypatch):
    from lightning.fabric import Fabric

    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy

    calls = _count_network_checks(monkeypatch)
    for key, value in dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        NODE_RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="1",
    ).items():
        monkeypatch.setenv(key, value)
    fabric = Fabric(
        strategy=FabricZeroStrategy(stage=2, rendezvous_timeout=2), accelerator="cpu", devices=1, num_nodes=2
    )
    with pytest.raises(NetworkError, match=r"node rank\(s\) \[1\]"):
        fabric.launch()
    assert calls == [(2, 0)]
