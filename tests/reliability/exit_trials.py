"""Launch many finished two-rank jobs and count the ones that exit non-zero after training.

    python -m tests.reliability.exit_trials --jobs 200 [--launcher torchrun|fork] [--concurrency 2] [--out F.jsonl]

Each job runs :mod:`tests.reliability.exit_job` on two gloo CPU ranks, cycling over Trainer and Fabric and stages
0-3. A job *finished* when both ranks printed the completed line (:data:`tests.reliability.exit_job.COMPLETED`); a
finished job that exits non-zero failed at interpreter teardown, the failure this counts (target: none).

``--launcher torchrun`` (the default) starts ``torchrun --standalone --nproc-per-node 2 -m tests.reliability.exit_job
KIND STAGE ROOT`` per job, as a user would, and parses the exit codes and signals torchrun reports per rank from its
failure summary. Each job imports torch and Lightning three times (agent and ranks): about 17 CPU-seconds.

``--launcher fork`` is the same job at a tenth of the cost: this process imports everything once and forks each rank,
which sets torchrun's environment variables, runs the job and then ends like a script does (``SystemExit`` unwinds
to the interpreter, which runs its atexit handlers, joins threads and finalises: the teardown the abort happened in).
The exit status is the rank's own, from ``waitpid``.

One JSON line per job goes to ``--out`` as it ends; the table is printed at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from lightning_zero.diagnostics.network import free_port
from tests.reliability import exit_job
from tests.reliability.exit_job import COMPLETED

REPO = Path(__file__).resolve().parents[2]
KINDS = ("trainer", "fabric")
STAGES = (0, 1, 2, 3)
_RANK_EXIT = re.compile(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", re.S)


def _env() -> dict:
    # none of a caller's process-group variables (a test process may hold them): torchrun sets its own
    env = {
        key: value
        for key, value in os.environ.items()
        if key
        not in (
            "MASTER_ADDR",
            "MASTER_PORT",
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "NODE_RANK",
            "GROUP_RANK",
            "TORCHELASTIC_RUN_ID",
        )
    }
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return env


def run_job(root: Path, kind: str, stage: int, timeout: float = 300) -> dict:
    """One torchrun job; ``finished`` (both ranks completed), torchrun's exit code and the per-rank failures."""
    root.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "tests.reliability.exit_job",
        kind,
        str(stage),
        str(root),
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = "timeout"
    completed, failures = parse_output(out)
    return {
        "kind": kind,
        "stage": stage,
        "finished": completed == [0, 1],
        "exit": code,
        "ranks_failed": failures,
        "seconds": round(time.perf_counter() - start, 1),
        "tail": "" if code == 0 else out[-2500:],
    }


def parse_output(out: str) -> tuple:
    """``(ranks that printed the completed line, {rank: exit code} from torchrun's failure summary)``."""
    completed = sorted(int(rank) for rank in re.findall(rf"rank (\d+): {COMPLETED}", out))
    return completed, {int(rank): int(code) for rank, code in _RANK_EXIT.findall(out)}


def _fork_rank(kind: str, stage: int, root: Path, rank: int, port: int) -> int:
    """Fork one rank of a ``--launcher fork`` job; returns its pid. The child never returns here."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    # the child: torchrun's environment, output to a log, the job, then the interpreter's own exit
    try:
        gc.freeze()  # nothing inherited is collected here (tests/ranks.py, [Note: a forked rank ...])
        os.setpgid(0, 0)
        log = os.open(root / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            ROLE_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            ROLE_WORLD_SIZE="2",
            TORCHELASTIC_RUN_ID=f"exit-trials-{port}",
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            OMP_NUM_THREADS="1",
        )
        exit_job.main(kind, str(stage), str(root))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # failed before finishing: counted as such, whatever teardown would do
    raise SystemExit(0)  # unwinds to the interpreter (no frame above catches it): a script's ordinary end


def run_job_forked(root: Path, kind: str, stage: int, timeout: float = 300) -> dict:
    """One ``--launcher fork`` job; the same fields as :func:`run_job`."""
    root.mkdir(parents=True, exist_ok=True)
    start, port = time.perf_counter(), free_port()
    pids = {_fork_rank(kind, stage, root, rank, port): rank for rank in range(2)}
    codes = {}
    while len(codes) < 2:
        for pid, rank in pids.items():
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        if len(codes) < 2 and time.perf_counter() - start > timeout:
            for pid, rank in pids.items():
                if rank not in codes:
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[rank] = "timeout"
        time.sleep(0.05)
    out = "".join((root / f"rank{rank}.log").read_text(errors="replace") for rank in range(2))
    completed = parse_output(out)[0]
    failures = {rank: code for rank, code in codes.items() if code != 0}
    code = next((c for c in codes.values() if c == "timeout"), None) or (1 if failures else 0)
    return {
        "kind": kind,
        "stage": stage,
        "finished": completed == [0, 1],
        "exit": code,
        "ranks_failed": {rank: (-9 if c == "timeout" else c) for rank, c in failures.items()},
        "seconds": round(time.perf_counter() - start, 1),
        "tail": "" if code == 0 else out[-2500:],
    }


def describe_exit(code: int) -> str:
    """``-6`` -> ``SIGABRT``; ``1`` -> ``exit 1``."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def run_trials(
    jobs: int,
    concurrency: int = 2,
    base: Optional[Path] = None,
    out: Optional[Path] = None,
    kinds: tuple = KINDS,
    stages: tuple = STAGES,
    launcher: str = "torchrun",
) -> list:
    base = Path(base or tempfile.mkdtemp(prefix="lz-exit-"))
    plan = [(i, kinds[i % len(kinds)], stages[(i // len(kinds)) % len(stages)]) for i in range(jobs)]

    def one(entry):
        index, kind, stage = entry
        run = run_job if launcher == "torchrun" else run_job_forked
        result = {"job": index, "launcher": launcher, **run(base / f"job{index}", kind, stage)}
        if out is not None:
            with open(out, "a") as handle:
                handle.write(json.dumps(result) + "\n")
        return result

    if launcher == "fork":  # sequential: forking from a process with threads may copy a lock another one holds
        import lightning.fabric  # noqa: F401  (imported once here rather than in every rank)

        import lightning_zero.fabric  # noqa: F401

        return [one(entry) for entry in plan]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, plan))


def table(results: list) -> str:
    rows = defaultdict(list)
    for result in results:
        rows[(result["kind"], result["stage"])].append(result)
    lines = [
        "| kind | stage | jobs | finished | non-zero exit after finishing | exits (rank: signal/code) |"
        " failed before finishing |",
        "|---|---|---|---|---|---|---|",
    ]
    totals = [0, 0, 0, 0]
    for (kind, stage), group in sorted(rows.items()):
        finished = [r for r in group if r["finished"]]
        bad = [r for r in finished if r["exit"] != 0]
        before = [r for r in group if not r["finished"]]
        codes = sorted(
            {f"{rank}: {describe_exit(code)}" for r in bad + before for rank, code in r["ranks_failed"].items()}
            | {str(r["exit"]) for r in bad + before if r["exit"] == "timeout"}
        )
        lines.append(
            f"| {kind} | {stage} | {len(group)} | {len(finished)} | {len(bad)} | {', '.join(codes) or '-'} |"
            f" {len(before)} |"
        )
        for i, value in enumerate((len(group), len(finished), len(bad), len(before))):
            totals[i] += value
    lines.append(f"| **all** | | **{totals[0]}** | **{totals[1]}** | **{totals[2]}** | | **{totals[3]}** |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--launcher", choices=("torchrun", "fork"), default="torchrun")
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help="comma-separated: trainer, fabric, bare (the "
        "control: a gloo group without this package and without destroy_process_group)",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="jobs at once (torchrun only)")
    parser.add_argument("--root", type=Path, default=None, help="where the jobs write (default: a new temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per job here")
    args = parser.parse_args(argv)
    results = run_trials(
        args.jobs, args.concurrency, args.root, args.out, kinds=tuple(args.kinds.split(",")), launcher=args.launcher
    )
    for result in results:
        if result["exit"] != 0:
            print(
                f"--- job {result['job']} ({result['kind']}, stage {result['stage']}): exit {result['exit']}\n"
                f"{result['tail']}"
            )
    print(table(results))
    return 0 if all(r["finished"] and r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
