"""``lightning-zero launch``: hostfile and include/exclude parsing, the fan-out commands, and real launches on two
simulated hosts (network namespaces where possible, loopback otherwise): two nodes train to the same weights as one
node, and a misconfigured network fails fast naming the problem."""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_zero.cli import build_parser
from lightning_zero.cli.launch import (
    _hosts,
    fanout_commands,
    find_env_file,
    parse_hostfile,
    read_env_file,
    select_resources,
    torchrun_command,
)
from lightning_zero.diagnostics.network import free_port
from tests.launch.hosts import make_netns_hosts, netns_unavailable, remove_netns_hosts

REPO = Path(__file__).resolve().parents[2]
JOB = str(REPO / "tests" / "launch" / "launch_job.py")
HOSTFILE = """
# a comment
node1 slots=4
node2 slots=4   # trailing comment
node3 slots=2
"""


def test_hostfile_parsing_and_errors():
    assert dict(parse_hostfile(HOSTFILE)) == {"node1": 4, "node2": 4, "node3": 2}
    for bad, match in (
        ("node1 4", "line 1"),
        ("node1 slots=0", "N >= 1"),
        ("a slots=1\na slots=2", "twice"),
        ("# only a comment", "no host"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_hostfile(bad)


def test_include_exclude_num_nodes_num_gpus():
    hosts = parse_hostfile(HOSTFILE)
    assert dict(select_resources(hosts, include="node1:0,1@node2:2,3")) == {"node1": [0, 1], "node2": [2, 3]}
    assert dict(select_resources(hosts, include="node2@node1")) == {"node1": [0, 1, 2, 3], "node2": [0, 1, 2, 3]}
    assert dict(select_resources(hosts, exclude="node3@node1:3", num_gpus=2)) == {"node1": [0, 1], "node2": [0, 1]}
    assert dict(select_resources(hosts, num_nodes=1)) == {"node1": [0, 1, 2, 3]}
    assert dict(select_resources(hosts, num_nodes=3, num_gpus=2)) == {h: [0, 1] for h in ("node1", "node2", "node3")}
    for kwargs, match in (
        (dict(include="node1", exclude="node2"), "mutually exclusive"),
        (dict(include="node9"), "node9.*not in the hostfile"),
        (dict(include="node1:4"), "outside its slots=0..3"),
        (dict(include="node1:0,0"), "repeated"),
        (dict(include="node1:x"), "integers"),
        (dict(num_nodes=4), "only 3 hosts"),
        (dict(num_gpus=3), "node3 have fewer"),
        # 4, 4, 2: the Trainer runs `devices` processes on every node; the error names two selections that work
        (dict(), "--num_gpus 2 .* or --include 'node1:0,1@node2:0,1@node3:0,1'"),
        (dict(include="node1:0,1,2,3@node2:0,1"), "--num_gpus 2 .* or --include 'node1:0,1@node2:0,1'"),
        (dict(exclude="node1@node2@node3"), "no host is left"),
    ):
        with pytest.raises(ValueError, match=match):
            select_resources(hosts, **kwargs)


def test_env_file(tmp_path, monkeypatch):
    path = tmp_path / ".deepspeed_env"
    path.write_text("# forwarded to every node\nNCCL_IB_DISABLE=1\nMY_VAR = a=b\n\n")
    assert read_env_file(str(path)) == {"NCCL_IB_DISABLE": "1", "MY_VAR": "a=b"}
    monkeypatch.chdir(tmp_path)
    assert find_env_file(None, {}) == str(path)
    with pytest.raises(FileNotFoundError, match="DS_ENV_FILE"):
        find_env_file(None, {"DS_ENV_FILE": str(tmp_path / "missing")})
    path.write_text("not a pair\n")
    with pytest.raises(ValueError, match="line 1"):
        read_env_file(str(path))


def test_dry_run_prints_the_torchrun_command_of_this_node(capsys, tmp_path, monkeypatch):
    from lightning_zero.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    assert cli_main(["launch", "--dry_run", "--nproc-per-node", "2", "train.py", "--lr", "1"]) == 0
    command = capsys.readouterr().out.split()
    assert "--nnodes=1" in command and "--nproc-per-node=2" in command and command[-3:] == ["train.py", "--lr", "1"]
    assert cli_main(["launch", "--dry_run", "--no_ssh", "--num_nodes", "2", "--nproc-per-node", "2", "t.py"]) == 1
    assert "--no_ssh with 2 nodes needs --node_rank" in capsys.readouterr().err
    assert cli_main(["launch", "--dry_run", "--no_ssh", "--num_nodes", "2", "--node_rank", "1", "t.py"]) == 1
    assert "need --master_addr" in capsys.readouterr().err
    # 0 is refused, never replaced by the default
    assert cli_main(["launch", "--dry_run", "--nproc-per-node", "1", "--rendezvous_timeout", "0", "t.py"]) == 1
    assert "rendezvous_timeout must be positive" in capsys.readouterr().err


def _args(**kwargs):
    defaults = dict(
        master_addr=None,
        master_port=29500,
        env=[],
        hostfile=None,
        rendezvous_timeout=None,
        env_file=None,
        max_restarts=0,
        module=False,
        no_python=False,
        skip_network_check=False,
        ssh_port=None,
        script="train.py",
        script_args=["--lr", "1e-3"],
    )
    return SimpleNamespace(**{**defaults, **kwargs})


def test_fanout_runs_this_command_on_every_node_with_its_node_rank():
    resources = select_resources(parse_hostfile(HOSTFILE), include="node1:0,1@node2:0,1")
    environ = {"NCCL_DEBUG": "WARN", "SECRET_TOKEN": "x", "HF_TOKEN": "y", "MY_VAR": "1 2", "PATH": "/bin"}
    ssh = fanout_commands(_args(env=["MY_VAR"]), resources, environ, "ssh")
    assert [c[3] for c in ssh] == ["node1", "node2"]
    for rank, command in enumerate(ssh):
        remote = command[4]
        assert f"--node_rank={rank}" in remote and "--num_nodes=2" in remote and "--master_addr=node1" in remote
        assert "export MY_VAR='1 2';" in remote and "export NCCL_DEBUG=WARN;" in remote
        assert "TOKEN" not in remote and "--no_ssh" in remote and remote.endswith("train.py --lr 1e-3")
        # each node gets the selection itself (the hostfile need not exist there) and picks its own slots
        argv = shlex.split(remote.split("&&", 1)[1])[3:]  # after `python -m lightning_zero`
        node_args = build_parser().parse_args(argv)
        assert dict(_hosts(node_args)) == {"node1": [0, 1], "node2": [0, 1]} and node_args.node_rank == rank
    (pdsh,) = fanout_commands(_args(), resources, environ, "pdsh")
    assert (
        pdsh[:10]
        == [
            "env",
            "PDSH_SSH_ARGS_APPEND=-o BatchMode=yes",
            "pdsh",
            "-R",
            "ssh",
            "-S",
            "-f",
            "1024",
            "-w",
            "node1,node2",
        ]
        and "--node_rank=%n" in pdsh[10]
    )
    with pytest.raises(ValueError, match="--env NOT_SET"):
        fanout_commands(_args(env=["NOT_SET"]), resources, environ, "ssh")


def test_pdsh_fanout_uses_ssh_on_the_given_port():
    # pdsh must be told to use ssh (-R ssh) and gets ssh options only through PDSH_SSH_ARGS_APPEND: --ssh_port was
    # dropped before. A PDSH_SSH_ARGS_APPEND the user set is kept in front.
    resources = select_resources(parse_hostfile(HOSTFILE), include="node1@node2")
    (pdsh,) = fanout_commands(_args(ssh_port=2222), resources, {"PDSH_SSH_ARGS_APPEND": "-i key"}, "pdsh")
    assert pdsh[:5] == ["env", "PDSH_SSH_ARGS_APPEND=-i key -o BatchMode=yes -p 2222", "pdsh", "-R", "ssh"]
    ssh = fanout_commands(_args(ssh_port=2222), resources, {}, "ssh")
    assert all(command[:5] == ["ssh", "-o", "BatchMode=yes", "-p", "2222"] for command in ssh)


def test_torchrun_command_is_a_static_rendezvous_with_a_bounded_wait():
    command = torchrun_command("train.py", ["--x"], 2, 1, 8, "10.0.0.1", 29400, 45.0)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    for part in (
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=8",
        "--master-addr=10.0.0.1",
        "--master-port=29400",
        "--rdzv-conf=timeout=45",
    ):
        assert part in command
    assert command[-2:] == ["train.py", "--x"]


# ----------------------------------------------------------------------------------- real launches, two "hosts"
def _launch(hosts, node, num_nodes, nproc, port, out, *extra, env=None, wait=True):
    command = hosts.prefix(node) + [
        sys.executable,
        "-m",
        "lightning_zero",
        "launch",
        "--no_ssh",
        f"--node_rank={node}",
        f"--num_nodes={num_nodes}",
        f"--nproc-per-node={nproc}",
        f"--master_addr={hosts.addresses[0]}",
        f"--master_port={port}",
        *extra,
        JOB,
        str(out),
    ]
    environment = {**os.environ, "PYTHONPATH": str(REPO), **hosts.env(node), **(env or {})}
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc


def _finish(proc, timeout=300):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its torchrun and workers: one session per launch
        out, _ = proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


@pytest.mark.slow
def test_two_node_launch_equals_one_node(hosts, tmp_path):
    """Stage 3, world size 2: 2 nodes x 1 process (two namespaces) against 1 node x 2 processes; bitwise equal."""
    start = time.perf_counter()
    one = _launch(hosts, 0, 1, 2, free_port(), tmp_path / "one.pt")
    code, log = _finish(one)
    one_node_s = time.perf_counter() - start
    assert code == 0, log[-3000:]
    start, port = time.perf_counter(), free_port()
    procs = [_launch(hosts, node, 2, 1, port, tmp_path / "two.pt", "--rendezvous_timeout=120") for node in (0, 1)]
    results = [_finish(p) for p in procs]
    two_node_s = time.perf_counter() - start
    for code, log in results:
        assert code == 0, log[-3000:]
    assert "node rank 1: host" in results[0][1]  # node rank 0 printed every node's identity
    one_node, two_nodes = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("one", "two"))
    assert (one_node["nodes"], one_node["nproc"], two_nodes["nodes"], two_nodes["nproc"]) == (1, 2, 2, 1)
    assert one_node["global_step"] == two_nodes["global_step"] == 4
    for key, value in one_node["weights"].items():
        assert torch.equal(two_nodes["weights"][key], value), key
    print(
        f"\n[{'netns' if hosts.namespaces else 'loopback'}] launch wall time: one node x 2 processes "
        f"{one_node_s:.1f} s, two nodes x 1 process {two_node_s:.1f} s; fit alone {one_node['seconds']:.2f} s vs "
        f"{two_nodes['seconds']:.2f} s"
    )


def test_loopback_interface_across_hosts_fails_fast_naming_it(tmp_path):
    """GLOO_SOCKET_IFNAME=lo on a two-host run: refused before torchrun, within seconds, naming node, interface."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    made = make_netns_hosts(f"{os.getpid() % 10000}m", subnet=os.getpid() % 200 + 1)
    try:
        start = time.perf_counter()
        proc = _launch(
            made, 1, 2, 1, free_port(), tmp_path / "x.pt", "--rendezvous_timeout=30", env={"GLOO_SOCKET_IFNAME": "lo"}
        )
        code, log = _finish(proc, timeout=60)
        assert time.perf_counter() - start < 60
        assert code == 1
        assert "GLOO_SOCKET_IFNAME=lo is the loopback interface on a 2-node run" in log, log
        assert "node rank 1 (host" in log and f"address {made.addresses[1]} on {made.ifnames[1]}" in log, log
        assert f"({made.ifnames[1]})" in log  # the interface to use instead
    finally:
        remove_netns_hosts(made)


def test_missing_node_and_unreachable_master_fail_within_the_rendezvous_timeout(hosts, tmp_path):
    """Node rank 0 alone names the node rank that never checked in; a node whose master does not answer names the
    address; both within --rendezvous_timeout instead of torchrun's 10 minutes."""
    start = time.perf_counter()
    alone = _launch(hosts, 0, 2, 1, free_port(), tmp_path / "x.pt", "--rendezvous_timeout=4")
    lost = _launch(hosts, 1, 2, 1, free_port(), tmp_path / "y.pt", "--rendezvous_timeout=4")  # nobody listens there
    (code0, log0), (code1, log1) = _finish(alone, 60), _finish(lost, 60)
    assert time.perf_counter() - start < 60
    assert code0 == 1 and "waited 4 s" in log0 and "node rank(s) [1], which never checked in" in log0, log0
    assert (
        code1 == 1
        and "node rank 1 (host" in log1
        and f"cannot reach MASTER_ADDR:MASTER_PORT {hosts.addresses[0]}:" in log1
    ), log1


@pytest.mark.slow
def test_two_node_srun_style_launch_uses_the_checked_rendezvous(hosts, tmp_path):
    """Processes started as srun starts them (SLURM_* variables, no torchrun agent store), one per simulated host:
    ZeroStrategy's own checked rendezvous joins them, and the weights match the single-process reference."""
    from tests.lightning_models import reference_weights

    port, procs = free_port(), []
    for node in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            **hosts.env(node),
            "MASTER_ADDR": hosts.addresses[0],
            "MASTER_PORT": str(port),
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_NNODES": "2",
            "SLURM_PROCID": str(node),
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": str(node),
            "SLURM_JOB_ID": "7",
            "SLURM_JOB_NAME": "train",
            "SLURM_NODELIST": "node[1-2]",
        }
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
            env.pop(name, None)
        procs.append(
            subprocess.Popen(
                hosts.prefix(node) + [sys.executable, JOB, str(tmp_path / "srun.pt"), "2"],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    for code, log in [_finish(p) for p in procs]:
        assert code == 0, log[-3000:]
    result = torch.load(tmp_path / "srun.pt", weights_only=True)
    assert (result["nodes"], result["nproc"]) == (2, 1)
    for key, value in reference_weights(4, 8).items():
        torch.testing.assert_close(result["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
def test_ssh_fanout_from_a_hostfile_trains_on_both_hosts(hosts, tmp_path):
    """`lightning-zero launch --hostfile` without --no_ssh: it runs itself on each host over `ssh` (a stand-in here
    that enters the host's namespace), each node checks in and starts torchrun; weights match the reference."""
    from tests.lightning_models import reference_weights

    names = hosts.addresses if hosts.namespaces else ["127.0.0.1", "localhost"]
    (tmp_path / "hostfile").write_text("".join(f"{name} slots=1\n" for name in names))
    enter = {
        name: " ".join(hosts.prefix(node)) + "".join(f" env {k}={v}" for k, v in hosts.env(node).items())
        for node, name in enumerate(names)
    }
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cases = "".join(f'  "{name}") exec {enter[name]} bash -c "$command";;\n' for name in names)
    (bin_dir / "ssh").write_text(
        f'#!/bin/bash\nhost="${{@: -2:1}}"; command="${{@: -1}}"\necho "$host" >> '
        f'{tmp_path}/ssh.log\ncase "$host" in\n{cases}esac\nexit 255\n'
    )
    (bin_dir / "ssh").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lightning_zero",
            "launch",
            "--hostfile",
            str(tmp_path / "hostfile"),
            "--launcher",
            "ssh",
            f"--master_port={free_port()}",
            "--rendezvous_timeout=120",
            JOB,
            str(tmp_path / "ssh.pt"),
            "2",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    code, log = _finish(proc)
    assert code == 0, log[-3000:]
    assert sorted((tmp_path / "ssh.log").read_text().split()) == sorted(names)  # one ssh per host
    assert "node rank 0: host" in log and "node rank 1: host" in log
    result = torch.load(tmp_path / "ssh.pt", weights_only=True)
    assert (result["nodes"], result["nproc"]) == (2, 1)
    for key, value in reference_weights(4, 8).items():
        torch.testing.assert_close(result["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)
