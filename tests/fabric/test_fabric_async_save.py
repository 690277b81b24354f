"""``fabric.save`` with ``ZeroStrategy(async_save=True)``: written in the background, awaited by ``fabric.load`` (on
every rank, before any rank reads), by ``teardown``, and at interpreter exit (locally, never silently)."""

import os
import time

import torch

from lightning_zero.checkpoint import io as checkpoint_io
from lightning_zero.checkpoint.directory import is_sharded_checkpoint
from lightning_zero.checkpoint.io import pending_save_paths, save_sharded_checkpoint
from lightning_zero.fabric import ZeroStrategy
from lightning_zero.fabric.fabric_checkpoints import settle_saves_at_exit
from tests.distributed.test_zero_parity import STEPS, TinyNet, make_optimizer
from tests.fabric.test_fabric_checkpoint import _unwrapped
from tests.fabric.test_fabric_parity import fabric_train, full_weights, make_fabric
from tests.ranks import run_distributed


def _slow_commit(seconds=1.5):
    """Delay rank 0's background commit (zero.json + swap), so the save is certainly still pending afterwards."""
    write_info = checkpoint_io._write_info

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return write_info(*args, **kwargs)

    checkpoint_io._write_info = slow


def _async_roundtrip_worker(rank, world_size, path):
    _slow_commit()
    fabric = make_fabric(ZeroStrategy(stage=3, async_save=True))
    model, optimizer = fabric_train(fabric, rank, world_size, steps=range(1))
    at_save = full_weights(_unwrapped(model))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    assert pending_save_paths() == [path]  # returned before the write was committed: it runs in the background
    if rank == 0:
        assert not os.path.exists(path)
    # Training goes on while the write runs; the staged copy is what is written.
    fabric_train(fabric, rank, world_size, steps=range(1, STEPS), model=model, optimizer=optimizer)
    uninterrupted = full_weights(_unwrapped(model))

    torch.manual_seed(123)
    with fabric.init_module():
        module = TinyNet()
    fresh, fresh_optimizer = fabric.setup(module, make_optimizer(module))
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    fabric.load(path, state)  # waits for the commit on rank 0 before any rank reads the directory
    assert state["step"] == 1 and pending_save_paths() == []
    loaded = full_weights(_unwrapped(fresh))
    for key in at_save:
        torch.testing.assert_close(loaded[key], at_save[key], rtol=0, atol=0, msg=key)
    fabric_train(fabric, rank, world_size, steps=range(1, STEPS), model=fresh, optimizer=fresh_optimizer)
    resumed = full_weights(_unwrapped(fresh))
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=0, atol=0, msg=key)


def test_async_save_continue_training_load_is_exact(tmp_path):
    path = str(tmp_path / "async.ckpt")
    run_distributed(_async_roundtrip_worker, 2, path)
    assert is_sharded_checkpoint(path)


def _teardown_worker(rank, world_size, path):
    _slow_commit()
    fabric = make_fabric(ZeroStrategy(stage=1, async_save=True))
    model, optimizer = fabric_train(fabric, rank, world_size, steps=range(1))
    fabric.save(path, {"model": model, "optimizer": optimizer})
    assert pending_save_paths() == [path]
    fabric.strategy.teardown()
    assert pending_save_paths() == [] and is_sharded_checkpoint(path)  # committed and seen by every rank


def test_pending_async_save_is_completed_by_teardown(tmp_path):
    path = str(tmp_path / "teardown.ckpt")
    run_distributed(_teardown_worker, 2, path)
    assert is_sharded_checkpoint(path)


def test_exit_handler_finishes_a_pending_save_and_reports_a_failed_one(tmp_path, capsys, monkeypatch):
    write_info = checkpoint_io._write_info
    monkeypatch.setattr(checkpoint_io, "_write_info", lambda *a, **k: (time.sleep(1.0), write_info(*a, **k)))
    done = str(tmp_path / "done.ckpt")
    save_sharded_checkpoint(done, {"w": torch.ones(3)}, {"step": 1}, async_save=True)
    assert pending_save_paths() == [done]
    settle_saves_at_exit()
    assert is_sharded_checkpoint(done) and pending_save_paths() == []
    assert "still pending" in capsys.readouterr().err

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_io, "_write_info", broken)
    failed = str(tmp_path / "failed.ckpt")
    save_sharded_checkpoint(failed, {"w": torch.ones(3)}, {"step": 1}, async_save=True)
    settle_saves_at_exit()
    err = capsys.readouterr().err
    assert "FAILED" in err and "disk full" in err and not os.path.exists(failed)
    settle_saves_at_exit()  # nothing pending: silent
    assert capsys.readouterr().err == ""


def test_a_script_ending_with_a_failing_pending_save_reports_it_at_exit(tmp_path):
    """A real interpreter exit (no teardown): the handler runs before the process group goes; without it the
    background failure would vanish with the process."""
    import subprocess
    import sys

    path = str(tmp_path / "exit.ckpt")
    script = os.path.join(os.path.dirname(__file__), "async_exit_script.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, script, path, "fail"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert f"saved ['{path}']" in done.stdout, done.stderr  # the save was still pending when the script ended
    assert "still pending" in done.stderr and "FAILED" in done.stderr and "disk full" in done.stderr, done.stderr
    assert not os.path.exists(path)
