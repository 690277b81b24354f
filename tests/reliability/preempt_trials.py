"""Preempt a training job with async saves at random moments, then resume it both ways.

    python -m tests.reliability.preempt_trials --trials 20 [--seed 0] [--root DIR]

Each trial starts :mod:`tests.reliability.preempt_trial_job` (2 CPU ranks, ``async_save=True``, a save every two
steps) and sends SIGTERM from outside, to one rank or to both (as SLURM does), in turn. Trial ``i`` aims at phase
``PHASES[i % 5]``: after a random number of steps it polls the phase the job reports and, once the aimed phase has
begun, waits a random fraction of that phase's length before signalling. Where the signal really landed is what the
job's own handler recorded (the aim can miss on a loaded machine: the table shows both). A trial passes when

- the job exits with ``128 + SIGTERM`` = 143 (``lightning_zero.strategies.preemption``) and leaves no leftover of a
  save (``.partial``/``.old`` directories, probes, staging names);
- the newest complete checkpoint it left is the preemption checkpoint, one or two steps after the signal;
- resumed with ``ckpt_path="last"`` and with that checkpoint's path (each in a copy of the run's directory), the job
  starts from that step, exits 0 and ends with weights, optimizer state and LR scheduler state equal, bit for bit
  (``torch.equal``), to those of a run never interrupted.

``tests/reliability/test_preempt_trials.py`` runs two trials; this command runs the full count and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from lightning_zero.strategies.preemption import PREEMPTED_CHECKPOINT
from tests.reliability.kill_trials import leftovers, newest_complete, start_job, step_of
from tests.reliability.preempt_trial_job import STEPS, STRETCH_S

PHASES = ("forward", "backward", "optimizer_step", "write", "rename")
TARGETS = ("rank 1", "both", "rank 0", "both")
PREEMPTED_EXIT = 128 + int(signal.SIGTERM)
JOB = "tests.reliability.preempt_trial_job"


def _start(arguments: list) -> subprocess.Popen:
    return start_job(JOB, arguments)


def _wait(proc: subprocess.Popen, timeout: float = 400) -> tuple:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -1, out
    return proc.returncode, out


def _phase(root: Path, kind: str, rank: int) -> tuple:
    try:
        phase, step = (root / f"{kind}-r{rank}").read_text().split()
        return phase, int(step)
    except (OSError, ValueError):
        return None, -1


def _aim_and_signal(proc, root: Path, rng: random.Random, phase: str, target: str) -> Optional[float]:
    """Wait for ``phase`` at or after a random step, then signal ``target`` a random fraction into the phase.
    Returns the seconds since the job started at which the signal was sent (``None``: the job ended first)."""
    ranks = [0, 1] if target == "both" else [int(target[-1])]
    watched = 0 if phase == "rename" else rng.choice(ranks)  # rank 0 alone finalizes (renames) a save
    kind = "bg" if phase in ("write", "rename") else "phase"
    from_step = rng.randint(1, STEPS - 5)  # leaves steps for the signal to be acted on and saved
    start = time.monotonic()
    while proc.poll() is None:
        seen, step = _phase(root, kind, watched)
        if seen == phase and step >= from_step:
            time.sleep(rng.uniform(0.0, 0.8 * STRETCH_S[phase]))
            for rank in ranks:
                os.kill(int((root / f"pid-r{rank}").read_text()), signal.SIGTERM)
            return time.monotonic() - start
        time.sleep(0.002)
    return None


def _landed(root: Path) -> str:
    cells = []
    for rank in (0, 1):
        path = root / f"landed-r{rank}.json"
        if path.exists():
            first = json.loads(path.read_text().splitlines()[0])
            background = f" + {first['bg']}" if first["bg"] != "idle" else ""
            cells.append(f"r{rank}: {first['main']}{background} @{first['step']}")
    return "; ".join(cells) or "nowhere"


def compare(final: Path, reference: dict) -> str:
    """``"bit-exact"`` or what differs from the uninterrupted run."""
    if not final.exists():
        return "no final.pt"
    got = torch.load(final, weights_only=True)
    if got["weights"].keys() != reference["weights"].keys():
        return "different keys"
    differing = [k for k, v in reference["weights"].items() if not torch.equal(got["weights"][k], v)]
    if differing:
        return f"differs: {differing[:3]}"
    if got["lrs"] != reference["lrs"] or got["scheduler"] != reference["scheduler"]:
        return "LR/scheduler differ"
    return "bit-exact" if got["global_step"] == reference["global_step"] else f"ended at {got['global_step']}"


def _copies(base: Path, index: int, root: Path, newest: Optional[Path]) -> list:
    """``[(root, ckpt_path)]`` of the two resumes of a trial: ``"last"`` in the run's own directory (as a restarted
    job would; the checkpoints' ``ModelCheckpoint`` state names it) and the newest checkpoint's path in a copy."""
    copy = base / f"trial{index}-path"
    shutil.copytree(root, copy, symlinks=True)
    for where in (root, copy):
        for name in ("started.json", "final.pt", "landed-r0.json", "landed-r1.json"):
            (where / name).unlink(missing_ok=True)
    return [(str(root), "last"), (str(copy), str(copy / "checkpoints" / newest.name) if newest is not None else "-")]


def _resume_result(where: Path, reference: dict) -> dict:
    started = where / "started.json"
    error = where / "error.txt"
    return {
        "started": json.loads(started.read_text())["step"] if started.exists() else None,
        "equal": error.read_text()[:300] if error.exists() else compare(where / "final.pt", reference),
        "left": leftovers(where / "checkpoints"),
    }


def preempt(base: Path, index: int, rng: random.Random) -> dict:
    """Start a job, signal it aimed at ``PHASES[index % 5]`` and let it exit; what it left."""
    phase, target = PHASES[index % len(PHASES)], TARGETS[index % len(TARGETS)]
    root = base / f"trial{index}"
    root.mkdir(parents=True)
    proc = _start([str(root)])
    sent = _aim_and_signal(proc, root, rng, phase, target)
    code, out = _wait(proc)
    checkpoints = root / "checkpoints"
    newest, newest_step = newest_complete(checkpoints)
    preempted = checkpoints / PREEMPTED_CHECKPOINT
    return {
        "trial": index,
        "aimed": phase,
        "target": target,
        "sent_s": sent,
        "landed": _landed(root),
        "exit": code,
        "newest": newest.name if newest is not None else None,
        "newest_step": newest_step,
        "preempted_step": step_of(preempted) if preempted.exists() else None,
        "last_step": step_of(checkpoints / "last.ckpt") if (checkpoints / "last.ckpt").exists() else None,
        "left": leftovers(checkpoints),
        "tail": out[-2000:] if code != PREEMPTED_EXIT else "",
        "resumes": _copies(base, index, root, newest),
    }


def judge(result: dict, reference: dict, resume_exit: int, resume_tail: str) -> dict:
    result["resume"] = {"exit": resume_exit, "tail": resume_tail}
    for how, (where, _) in zip(("last", "path"), result.pop("resumes")):
        res = result["resume"][how] = _resume_result(Path(where), reference)
        res["ok"] = res["equal"] == "bit-exact" and not res["left"] and res["started"] == result["newest_step"]
    result["ok"] = (
        result["exit"] == PREEMPTED_EXIT
        and not result["left"]
        and result["sent_s"] is not None
        and result["preempted_step"] == result["newest_step"]
        and all(result["resume"][how]["ok"] for how in ("last", "path"))
    )
    return result


def run_trials(count: int, seed: int = 0, base: Optional[Path] = None, first: int = 0, per_process: int = 4) -> list:
    """``count`` trials; their resumes run ``per_process`` trials (two fits each) to a process, the first process
    starting with the uninterrupted reference run (one job start fewer)."""
    base = Path(base or tempfile.mkdtemp(prefix="lz-preempt-"))
    rng = random.Random(seed)
    reference_root = base / "reference"
    reference_root.mkdir(parents=True)
    results, reference = [], None
    indices = list(range(first, first + count))
    for chunk in (indices[i : i + per_process] for i in range(0, len(indices), per_process)):
        preempted = [preempt(base, index, rng) for index in chunk]
        fits = [(str(reference_root), "-")] if reference is None else []
        fits += [pair for result in preempted for pair in result["resumes"]]
        code, out = _wait(_start([argument for pair in fits for argument in pair]), timeout=300 + 120 * len(fits))
        if reference is None:
            if not (reference_root / "final.pt").exists():
                raise RuntimeError(f"the uninterrupted run failed ({code}):\n{out[-3000:]}")
            reference = torch.load(reference_root / "final.pt", weights_only=True)
        results += [judge(result, reference, code, out[-2000:] if code else "") for result in preempted]
    return results


def table(results: list) -> str:
    lines = [
        "| trial | SIGTERM to | aimed at | landed in (rank: phase + background @step) | exit | checkpoint left "
        "(step) | resume `last`: start, result | resume by path: start, result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:

        def cell(how: str) -> str:
            res = r["resume"][how]
            return f"{res['started']}, {res['equal']}" + (f" left={res['left']}" if res["left"] else "")

        left = f" left={r['left']}" if r["left"] else ""
        lines.append(
            f"| {r['trial']} | {r['target']} | {r['aimed']} | {r['landed']} | {r['exit']} | "
            f"{r['newest']} ({r['newest_step']}){left} | {cell('last')} | {cell('path')} |"
        )
    lines.append(f"\n{sum(r['ok'] for r in results)}/{len(results)} trials passed")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0, help="index of the first trial (sets its phase and target)")
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args()
    results = run_trials(args.trials, args.seed, args.root, args.first)
    print(table(results))
    for r in results:
        if not r["ok"]:
            print(
                f"\ntrial {r['trial']}: {json.dumps({k: v for k, v in r.items() if k != 'tail'}, default=str)}"
                f"\n{r['tail']}\n{r['resume']['tail']}"
            )
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
