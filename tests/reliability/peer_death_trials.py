"""A peer that dies: kill one node's ranks at a random point of a 2-node job, measure how the
survivors end and whether the restarted job resumes bit-exact.

    python -m tests.reliability.peer_death_trials --trials 20 [--seed 0] [--root DIR]

Two simulated hosts (network namespaces joined by a veth pair, ``tests/launch/hosts.py``; both "nodes" on loopback
where namespaces cannot be made, said in the output), one ``torchrun --nnodes 2 --nproc-per-node 1 --max-restarts 3``
agent on each with a c10d rendezvous hosted by node 0's agent, running :mod:`tests.reliability.peer_death_job`
(ZeRO-2, gloo, a checkpoint every 2 steps, 8 steps). Each trial draws a point (forward, backward, the gradient
collective, the optimizer step, the checkpoint save; in turn), a step and the node whose ranks die (SIGKILL, first
attempt only). A trial passes when

* (a) every surviving rank of the first attempt exits within ``hang_timeout`` + 30 s of the kill, its error naming
  the lost global rank and the lost node's host address;
* (b) both agents exit 0, the job finished on a later attempt, resumed from the newest checkpoint complete at the kill
  (from step 0 when none was) and its final weights equal, bit for bit, those of an uninterrupted run.

Modes: ``--nproc-per-node 2`` (4 ranks; each of the drawn node's ranks SIGKILLs itself when it reaches the point,
so a node-mate may instead fail first on its partner's death, and its agent then stops it); ``--fabric`` (the Fabric
loop of :mod:`tests.reliability.peer_death_fabric_job`); ``--partition`` (the drawn node's veth goes down at the
point instead, no process dies and no socket closes; the survivors must end within the bound through the hang
watchdog, the link comes back once they exited, and the job must resume under the same ``--max-restarts``).

``tests/reliability/test_peer_death.py`` runs one trial; this command runs the full count and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from tests.launch.hosts import LOOPBACK, Hosts, make_netns_hosts, netns_unavailable, remove_netns_hosts
from tests.reliability.peer_death_job import HANG_TIMEOUT, POINTS, STEPS, STEPS_PER_EPOCH

REPO = Path(__file__).resolve().parents[2]
BOUND = HANG_TIMEOUT + 30


@dataclass(frozen=True)
class Mode:
    """What a campaign runs: ranks per node, the Fabric job instead of the Trainer's, a partition instead of a kill."""

    nproc_per_node: int = 1
    fabric: bool = False
    partition: bool = False
    hold: float = 0.0  # a partition lasts at least this long (seconds after the cut)

    @property
    def job(self) -> str:
        return "tests.reliability.peer_death_fabric_job" if self.fabric else "tests.reliability.peer_death_job"

    def checkpoint_name(self, epochs_done: int) -> str:
        steps = epochs_done * STEPS_PER_EPOCH
        return f"step={steps}" if self.fabric else f"epoch={epochs_done - 1}-step={steps}.ckpt"


_CLEARED = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def _agent(
    hosts: Hosts, node: int, root: Path, port: int, run_id: str, env_extra: dict, mode: Mode
) -> subprocess.Popen:
    command = hosts.prefix(node) + [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        str(mode.nproc_per_node),
        "--max-restarts",
        "3",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{hosts.addresses[0]}:{port}",
        "--rdzv-id",
        run_id,
        # the address the workers reach this node's agent store at (torch's default, the FQDN, resolves to an address
        # the other namespace cannot reach)
        "--local-addr",
        hosts.addresses[node],
        # node 0's agent hosts the rendezvous store: torch's own guess compares the endpoint with the hostname's
        # addresses, which inside a namespace never match
        "--rdzv-conf",
        f"is_host={'true' if node == 0 else 'false'},join_timeout=120",
        "--monitor-interval",
        "0.2",
        "-m",
        mode.job,
        str(root),
    ]
    env = {key: value for key, value in os.environ.items() if key not in _CLEARED}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **hosts.env(node), **env_extra)
    log = open(root / f"agent{node}.log", "w")
    try:
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        log.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def run_job(
    hosts: Hosts,
    root: Path,
    port: int,
    point: str = "none",
    step: int = -1,
    node: int = 1,
    timeout: float = 420,
    mode: Mode = Mode(),
) -> dict:
    """Run both agents; returns exit codes and, once the kill (or the cut) happened, when each surviving rank
    exited. A partition: node ``node``'s veth goes down when its rank asks (at the drawn point) and comes back up
    once every survivor exited (or ``BOUND`` + 10 s after the cut)."""
    root.mkdir(parents=True)
    extra = {
        "PEER_DEATH_POINT": point,
        "PEER_DEATH_STEP": str(step),
        "PEER_DEATH_NODE": str(node),
        "PEER_DEATH_MODE": "partition" if mode.partition else "kill",
    }
    agents = [_agent(hosts, n, root, port, root.name, extra, mode) for n in (0, 1)]
    deadline, exits, link = time.time() + timeout, {}, {}
    try:
        while any(a.poll() is None for a in agents) and time.time() < deadline:
            if mode.partition and "down" not in link and list(root.glob("cut_request_rank*.json")):
                _set_link(hosts, node, "down")
                link["down"] = time.time()
                (root / "cut").write_text(repr(link["down"]))
            if point != "none" and list(root.glob("killed_rank*.json")):
                survivors = 0
                for pid_file in (root / "pids").glob("rank*"):
                    pid, pid_node = (int(v) for v in pid_file.read_text().split())
                    survivors += pid_node != node
                    if pid_node != node and pid_file.name not in exits and not _alive(pid):
                        exits[pid_file.name] = time.time()
                since = time.time() - link.get("down", time.time())
                if (
                    "down" in link
                    and "up" not in link
                    and ((len(exits) == survivors and since > mode.hold) or since > max(BOUND + 10, mode.hold))
                ):
                    _set_link(hosts, node, "up")
                    link["up"] = time.time()
            time.sleep(0.1)
    finally:
        if "down" in link and "up" not in link:
            _set_link(hosts, node, "up")
            link["up"] = time.time()
    timed_out = any(a.poll() is None for a in agents)
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
    if timed_out:
        _kill_workers_of(root)
    return {"codes": [a.returncode for a in agents], "timed_out": timed_out, "exits": exits, "link": link}


def _set_link(hosts: Hosts, node: int, state: str) -> None:
    """Take node ``node``'s end of the veth pair down or up: its sockets stay open, its packets go nowhere."""
    subprocess.run(
        hosts.prefix(node) + ["ip", "link", "set", hosts.ifnames[node], state], check=True, capture_output=True
    )


def _kill_workers_of(root: Path) -> None:
    """SIGKILL this job's workers left behind by killed agents (torchrun starts them in sessions of their own)."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.startswith(b"tests.reliability.peer_death") for a in argv) and str(root).encode() in argv:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):
                pass


def _expected_resume(point: str, step: int, mode: Mode) -> Optional[str]:
    """The newest checkpoint complete when the kill came (a ``save`` kill is in the save after ``step``)."""
    done_epochs = (step + 1) // STEPS_PER_EPOCH - 1 if point == "save" else step // STEPS_PER_EPOCH
    return mode.checkpoint_name(done_epochs) if done_epochs > 0 else None


def _named(message: str, ranks: list, addresses: list) -> bool:
    """``message`` names every rank in ``ranks`` (``rank R (...)`` each, or ``ranks [R, S]``) and each address."""
    return (f"ranks {sorted(ranks)}" in message or all(f"rank {r} (" in message for r in ranks)) and all(
        a in message for a in addresses
    )


def _messages(root: Path, survivors: dict) -> list:
    """Each surviving rank's error: the one its fit raised (``errors/``), else the watchdog's abort line in its
    node's agent log (the watchdog ends the process itself, so no error is raised)."""
    messages = []
    for name, survivor_node in survivors.items():
        error = root / "errors" / f"attempt0_{name}.json"
        if error.exists():
            messages.append(json.loads(error.read_text())["message"])
            continue
        marker = f"[lightning-zero watchdog] rank {name[len('rank') :]} aborting: "
        log = (root / f"agent{survivor_node}.log").read_text(errors="replace").splitlines()
        messages.append(next((line.split(marker, 1)[1] for line in log if marker in line), ""))
    return messages


def trial(
    hosts: Hosts,
    base: Path,
    index: int,
    point: str,
    step: int,
    node: int,
    port: int,
    reference: dict,
    mode: Mode = Mode(),
) -> dict:
    root = base / f"trial{index:02d}-{point}"
    job = run_job(hosts, root, port, point, step, node, mode=mode)
    killed = [json.loads(p.read_text()) for p in sorted(root.glob("killed_rank*.json"))]
    result = {
        "trial": index,
        "point": point,
        "step": step,
        "node": node,
        "codes": job["codes"],
        "killed": bool(killed),
        "killed_ranks": [k["rank"] for k in killed],
        "link": job["link"],
    }
    ranks = {p.name: [int(v) for v in p.read_text().split()] for p in (root / "pids").glob("rank*")} if killed else {}
    lost_ranks = sorted(int(name[len("rank") :]) for name, (_, n) in ranks.items() if n == node)
    lost_addresses = [hosts.addresses[0]] if node == 0 else [hosts.addresses[1]]
    if hosts.namespaces is None:  # both nodes on 127.0.0.1: the address names no node
        lost_addresses = []
    survivors = {name: n for name, (_, n) in ranks.items() if n != node}
    kill_time = min((k["time"] for k in killed), default=None)
    seconds = [job["exits"][s] - kill_time for s in survivors if s in job["exits"]]
    result["seconds"] = round(max(seconds), 1) if seconds and len(seconds) == len(survivors) else None
    result["messages"] = messages = _messages(root, survivors)
    result["named"] = bool(messages) and all(_named(m, lost_ranks, lost_addresses) for m in messages)
    result["in_bound"] = result["seconds"] is not None and result["seconds"] <= BOUND
    final_path = root / "final.pt"
    final = torch.load(final_path, weights_only=True) if final_path.exists() else None
    expected = _expected_resume(point, step, mode)
    resumed = Path(final["resumed_from"]).name if final and final["resumed_from"] else None
    result["resumed_from"], result["expected"] = resumed, expected
    result["attempt"] = final["attempt"] if final else None
    result["bit_exact"] = (
        bool(final)
        and final["global_step"] == STEPS
        and all(torch.equal(final["weights"][k], v) for k, v in reference["weights"].items())
    )
    result["ok"] = (
        killed != []
        and result["named"]
        and result["in_bound"]
        and job["codes"] == [0, 0]
        and final is not None
        and final["attempt"] >= 1
        and resumed == expected
        and result["bit_exact"]
    )
    if not result["ok"]:
        result["tail"] = "\n".join((root / f"agent{n}.log").read_text(errors="replace")[-2500:] for n in (0, 1))
    return result


def draw(rng: random.Random, index: int) -> tuple:
    """(point, step, node): the points in turn, a random step (an epoch's last step for ``save``), a random node."""
    point = POINTS[index % len(POINTS)]
    if point == "save":
        step = rng.randrange(STEPS_PER_EPOCH - 1, STEPS, STEPS_PER_EPOCH)
    else:
        step = rng.randrange(STEPS)
    return point, step, rng.randrange(2)


def run_trials(
    count: int,
    seed: int = 0,
    base: Optional[Path] = None,
    reference: Optional[dict] = None,
    only: Optional[list] = None,
    mode: Mode = Mode(),
) -> tuple:
    """``(results, where)``: ``where`` says whether the hosts were namespaces or loopback (and why). ``reference``:
    the uninterrupted run's ``final.pt`` (else one is run first on the same two hosts). ``only``: run just these
    trials of the ``count`` drawn (the same draws as the full campaign)."""
    base = Path(base or tempfile.mkdtemp(prefix="lz-peer-death-"))
    rng = random.Random(seed)
    reason = netns_unavailable()
    if reason and mode.partition:
        raise RuntimeError(f"a partition needs the two network namespaces: {reason}")
    hosts = LOOPBACK if reason else make_netns_hosts(f"{os.getpid() % 10000}", subnet=os.getpid() % 200 + 1)
    where = f"loopback ({reason})" if reason else f"network namespaces {hosts.namespaces} {hosts.addresses}"
    port = 29400 + rng.randrange(500) * 2
    try:
        if reference is None:
            ref = run_job(hosts, base / "reference", port, mode=mode)
            if ref["codes"] != [0, 0]:
                raise RuntimeError("the uninterrupted run failed:\n" + (base / "reference" / "agent0.log").read_text())
            reference = torch.load(base / "reference" / "final.pt", weights_only=True)
        results = []
        for index in range(count):
            point, step, node = draw(rng, index)
            if only is not None and index not in only:
                continue
            results.append(trial(hosts, base, index, point, step, node, port + 1 + index, reference, mode))
            print(row(results[-1]), flush=True)
    finally:
        if not reason:
            remove_netns_hosts(hosts)
    return results, where


def row(r: dict) -> str:
    return (
        f"| {r['trial']} | {r['point']} | {r['step']} | {r['node']} | {'yes' if r['named'] else 'no'} | "
        f"{r['seconds']} | {r['resumed_from'] or 'step 0'} | {'yes' if r['bit_exact'] else 'no'} | "
        f"{'ok' if r['ok'] else 'FAIL (exit codes ' + str(r['codes']) + ')'} |"
    )


def table(results: list, where: str) -> str:
    lines = [
        f"hosts: {where}; bound: hang_timeout + 30 s = {BOUND:g} s",
        "| trial | point | step | node killed | survivor's error names the lost rank and host | seconds to exit "
        "| resumed from | bit-exact | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row(r) for r in results]
    lines.append(f"\n{sum(r['ok'] for r in results)}/{len(results)} trials passed")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument("--only", type=int, nargs="+", default=None, help="rerun just these trials of the campaign")
    parser.add_argument("--reference", type=Path, default=None, help="an uninterrupted run's final.pt to reuse")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node (all of a node's ranks die)")
    parser.add_argument("--fabric", action="store_true", help="the Fabric job (peer_death_fabric_job)")
    parser.add_argument(
        "--partition",
        action="store_true",
        help="cut the node's veth at the point instead of killing its ranks; restore it once the survivors exited",
    )
    parser.add_argument(
        "--hold-seconds",
        type=float,
        default=0.0,
        help="with --partition: keep the link down at least this long after the cut",
    )
    args = parser.parse_args()
    reference = torch.load(args.reference, weights_only=True) if args.reference else None
    mode = Mode(args.nproc_per_node, args.fabric, args.partition, args.hold_seconds)
    results, where = run_trials(args.trials, args.seed, args.root, reference, args.only, mode)
    print(f"mode: {mode}")
    print(table(results, where))
    for r in results:
        if not r["ok"]:
            print(
                f"\ntrial {r['trial']} ({r['point']} at step {r['step']}, node {r['node']}): {r['messages']}\n"
                f"{r.get('tail', '')}"
            )
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
