"""Kill a saving job from outside at random instants, then resume it both ways.

    python -m tests.reliability.kill_trials --trials 20 [--seed 0] [--root DIR]

Each trial starts :mod:`tests.reliability.kill_job` (2 CPU ranks, a save after every step) in the mode of its turn
(``sync``, ``async``, ``link``), SIGKILLs its whole process group at a uniformly random instant within the span a
calibration run took to train, copies what it left, and resumes it twice: with ``ckpt_path="last"`` and with the
path of the newest complete checkpoint. A resume passes when it exits 0, ends at the last step, starts from the step
of the checkpoint it was given (``last.ckpt``'s for "last", the newest complete one otherwise), and leaves no
temporary file of a save behind (``.partial``/``.old`` directories, probes, relink and staging names).
``tests/reliability/test_kill_trials.py`` runs a few trials; this command runs the full count and prints the table.
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

from lightning_zero.checkpoint.directory import is_sharded_checkpoint
from lightning_zero.checkpoint.safe_load import load_meta
from lightning_zero.diagnostics.network import free_port
from tests.reliability.kill_job import STEPS

REPO = Path(__file__).resolve().parents[2]
MODES = ("sync", "async", "link")
LEFTOVER_MARKS = (".partial", ".old", ".lightning-zero-probe-", ".lz-relink", ".lz-staging")


def _start(root: Path, mode: str, ckpt: Optional[str] = None) -> subprocess.Popen:
    return start_job("tests.reliability.kill_job", [str(root), mode] + ([ckpt] if ckpt else []))


def start_job(module: str, arguments: list) -> subprocess.Popen:
    """``python -m module *arguments`` in its own session (so its whole process group can be killed)."""
    command = [sys.executable, "-m", module, *arguments]
    # a fresh rendezvous port per job, and none of a caller's process-group variables (a test process may hold them)
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
        )
    }
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _run(root: Path, mode: str, ckpt: Optional[str] = None, timeout: float = 300) -> tuple:
    proc = _start(root, mode, ckpt)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -1, out
    return proc.returncode, out


def step_of(path: Path) -> Optional[int]:
    """The global step a complete checkpoint holds, ``None`` if it is not one."""
    if not is_sharded_checkpoint(str(path)):
        return None
    return int(load_meta(str(path)).get("global_step", -1))


def newest_complete(directory: Path) -> tuple:
    """``(path, step)`` of the complete checkpoint with the highest step (``(None, 0)`` without one)."""
    best = (None, 0)
    if directory.is_dir():
        for entry in directory.iterdir():
            if entry.name.startswith(".") or entry.name == "last.ckpt":
                continue
            step = step_of(entry)
            if step is not None and step > best[1]:
                best = (entry, step)
    return best


def leftovers(directory: Path) -> list:
    return (
        sorted(p.name for p in directory.iterdir() if any(mark in p.name for mark in LEFTOVER_MARKS))
        if directory.is_dir()
        else []
    )


def _resume(root: Path, mode: str, ckpt: str, expected_start: int) -> dict:
    code, out = _run(root, mode, ckpt)
    started = json.loads((root / "started.json").read_text())["step"] if (root / "started.json").exists() else None
    final = json.loads((root / "final.json").read_text())["step"] if (root / "final.json").exists() else None
    left = leftovers(root / "checkpoints")
    # a job killed after its last save has nothing left to train: Lightning then ends without starting the loop
    ok = (
        code == 0
        and final == STEPS
        and not left
        and (started == expected_start or (started is None and expected_start == STEPS))
    )
    return {
        "ok": ok,
        "exit": code,
        "started": started,
        "expected": expected_start,
        "final": final,
        "left": left,
        "tail": "" if ok else out[-1500:],
    }


def trial(base: Path, index: int, mode: str, kill_after: float) -> dict:
    root = base / f"trial{index}"
    root.mkdir(parents=True)
    proc = _start(root, mode)
    _wait_for_training(root, proc)
    time.sleep(kill_after)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    checkpoints = root / "checkpoints"
    newest, newest_step = newest_complete(checkpoints)
    last = checkpoints / "last.ckpt"
    last_step = step_of(last) if os.path.lexists(last) else None
    by_path = base / f"trial{index}-path"
    shutil.copytree(root, by_path, symlinks=True)
    for name in ("started.json", "final.json"):
        for where in (root, by_path):
            (where / name).unlink(missing_ok=True)
    result = {"trial": index, "mode": mode, "kill_s": round(kill_after, 2), "newest": newest_step, "last": last_step}
    result["last_resume"] = _resume(root, mode, "last", last_step or 0)
    explicit = str(by_path / "checkpoints" / newest.name) if newest is not None else None
    result["path_resume"] = (
        _resume(by_path, mode, explicit, newest_step) if explicit else {"ok": True, "skipped": "none saved"}
    )
    return result


def _wait_for_training(root: Path, proc: subprocess.Popen) -> None:
    """Until rank 0 has started the training loop (``started.json``) or the job has ended. Kill instants count from
    here, not from the launch: start-up (imports, the process group) takes from 5 s to over 20 s with the machine's
    load, and instants drawn from the launch landed before the first save or after the last one when the load
    changed between the calibration and the trials."""
    while proc.poll() is None and not (root / "started.json").exists():
        time.sleep(0.02)


def calibrate(base: Path) -> tuple:
    """``(first_save_s, end_s)`` of an uninterrupted run, counted from the start of its training loop: when its first
    checkpoint appeared and when it ended."""
    root = base / "calibration"
    root.mkdir(parents=True)
    proc = _start(root, "sync")
    _wait_for_training(root, proc)
    start = time.perf_counter()
    first = None
    while proc.poll() is None:
        if first is None and (root / "checkpoints").is_dir() and any((root / "checkpoints").iterdir()):
            first = time.perf_counter() - start
        time.sleep(0.05)
    end = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"the calibration run failed:\n{proc.stdout.read()[-3000:]}")
    return (first or end * 0.5), end


def run_trials(count: int, seed: int = 0, base: Optional[Path] = None, modes: tuple = MODES) -> list:
    base = Path(base or tempfile.mkdtemp(prefix="lz-kill-"))
    first, end = calibrate(base)
    rng = random.Random(seed)
    # from just before the first save to just before the end of training: the save-heavy span
    window = (max(0.0, first - 0.2), first + 0.9 * (end - first))
    return [trial(base, i, modes[i % len(modes)], rng.uniform(*window)) for i in range(count)]


def table(results: list) -> str:
    lines = [
        "| trial | mode | kill (s into training) | newest step | last.ckpt step | resume 'last' | resume path |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:

        def cell(res: dict) -> str:
            if res.get("skipped"):
                return "n/a (" + res["skipped"] + ")"
            return (
                "ok"
                if res["ok"]
                else f"FAIL exit={res['exit']} start={res['started']}/{res['expected']} "
                f"end={res['final']} left={res['left']}"
            )

        lines.append(
            f"| {r['trial']} | {r['mode']} | {r['kill_s']} | {r['newest']} | {r['last']} | "
            f"{cell(r['last_resume'])} | {cell(r['path_resume'])} |"
        )
    resumes = [res for r in results for res in (r["last_resume"], r["path_resume"]) if not res.get("skipped")]
    lines.append(f"\n{sum(res['ok'] for res in resumes)}/{len(resumes)} resumes passed over {len(results)} kills")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args()
    results = run_trials(args.trials, args.seed, args.root)
    print(table(results))
    for r in results:
        for res in (r["last_resume"], r["path_resume"]):
            if not res.get("ok"):
                print(f"\ntrial {r['trial']} ({r['mode']}):\n{res.get('tail', '')}")
    sys.exit(0 if all(res.get("ok") for r in results for res in (r["last_resume"], r["path_resume"])) else 1)


if __name__ == "__main__":
    main()
