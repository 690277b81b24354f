"""Kill a rank at every step of a sharded save: the previous or the new checkpoint always loads, and Lightning's
``ckpt_path="last"`` lookup always finds the newest complete one.

Scenarios: save step x {sync, async} x {plain directory, ``last.ckpt`` a symlink as ``save_last="link"`` leaves it},
with the atomic exchange swap, plus the mid-swap kill with the two-rename fallback. The state is one row-sharded
DTensor and a step counter, so each scenario costs one two-rank fork.
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_zero.checkpoint import (
    CheckpointSaveError,
    atomic,
    load_sharded_checkpoint,
    remove_sharded_checkpoint,
    save_sharded_checkpoint,
    wait_for_pending_saves,
)
from lightning_zero.checkpoint.directory import resolve_checkpoint_dir
from tests.ranks import kill_rank_at_save_step, run_distributed

ROWS, COLS = 8, 3
META = {"epoch": 1}
# the step a rank dies at, and which rank: the shard steps kill a non-coordinator, the finalisation steps rank 0
STEPS = {"before_shards": 1, "after_shards": 1, "after_metadata": 0, "after_info": 0, "mid_swap": 0}


def full_weight(version: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * (1 if version == 1 else -3)


def state(version: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    rank = mesh.get_local_rank()
    rows = ROWS // world_size
    local = full_weight(version)[rank * rows : (rank + 1) * rows].clone()
    weight = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return {"state_dict": {"w": weight}, "optimizer_states": {"step": torch.tensor(float(version))}}


def plain_state(version: int) -> dict:
    """The same checkpoint content for a single process (no process group)."""
    return {"state_dict": {"w": full_weight(version)}, "optimizer_states": {"step": torch.tensor(float(version))}}


def saved_version(path: str) -> int:
    """Load ``path`` in one process (no process group) and say which version it holds; check it is whole."""
    target = {"state_dict": {"w": torch.zeros(ROWS, COLS)}, "optimizer_states": {"step": torch.tensor(0.0)}}
    assert load_sharded_checkpoint(path, target) == META
    version = int(target["optimizer_states"]["step"].item())
    assert torch.equal(target["state_dict"]["w"], full_weight(version)), "a torn checkpoint: weights of two saves"
    return version


def _kill_worker(rank, world_size, root, step, async_save, link, exchange):
    atomic.USE_EXCHANGE = exchange
    path = os.path.join(root, "last.ckpt")
    if link:  # what ModelCheckpoint(save_last="link") leaves: last.ckpt -> a top-k checkpoint
        save_sharded_checkpoint(os.path.join(root, "step1.ckpt"), state(1, world_size), META)
        if rank == 0:
            os.symlink("step1.ckpt", path)
    else:
        save_sharded_checkpoint(path, state(1, world_size), META)
    kill_rank_at_save_step(step, STEPS[step])
    save_sharded_checkpoint(path, state(2, world_size), META, async_save=async_save)
    wait_for_pending_saves()
    raise AssertionError(f"rank {STEPS[step]} should have died at {step}")


def lightning_last(root: str) -> set:
    """The candidates ``Trainer.fit(ckpt_path="last")`` resumes from (Lightning's own lookup)."""
    return ModelCheckpoint(dirpath=root)._find_last_checkpoints(trainer=None)


SCENARIOS = [(step, mode, link, True) for step in STEPS for mode in ("sync", "async") for link in (False, True)]
SCENARIOS += [("mid_swap", mode, link, False) for mode in ("sync", "async") for link in (False, True)]


@pytest.mark.parametrize(
    "step,mode,link,exchange",
    SCENARIOS,
    ids=[f"{s}-{m}-{'link' if k else 'plain'}{'' if x else '-fallback'}" for s, m, k, x in SCENARIOS],
)
def test_kill_at_every_save_step_leaves_a_complete_checkpoint(tmp_path, step, mode, link, exchange):
    root = str(tmp_path)
    path = os.path.join(root, "last.ckpt")
    with pytest.raises(Exception, match="exit code|17"):
        run_distributed(_kill_worker, 2, root, step, mode == "async", link, exchange)
    # Killed after the swap committed: the new checkpoint; killed earlier: the previous one, untouched.
    expected = 2 if step == "mid_swap" and exchange else 1
    assert saved_version(path) == expected
    if link:
        assert saved_version(os.path.join(root, "step1.ckpt")) == 1, "the link's target must never be modified"
    if exchange:
        # "last" resolution never misses the checkpoint: at no instant is last.ckpt absent
        assert lightning_last(root) == {path}
        assert os.path.realpath(resolve_checkpoint_dir(path)) == os.path.realpath(path)
    else:
        # the two-rename fallback died between its renames: loading reads .old; the next save restores it first
        assert not os.path.lexists(path) and resolve_checkpoint_dir(path) == atomic.old_dir(path)
    # The next save (here on one process) recovers and cleans every leftover of the killed one.
    atomic.USE_EXCHANGE = exchange
    try:
        save_sharded_checkpoint(path, plain_state(2), META)
    finally:
        atomic.USE_EXCHANGE = True
    assert saved_version(path) == 2
    assert not os.path.lexists(atomic.partial_dir(path)) and not os.path.lexists(atomic.old_dir(path))
    assert sorted(os.listdir(root)) == (["last.ckpt", "step1.ckpt"] if link else ["last.ckpt"])


def test_fallback_recovery_on_the_next_save_restores_last_before_replacing_it(tmp_path):
    """The recovery rule alone: a save that finds only ``.X.old`` (killed between the two renames) puts it back at
    ``X`` before anything else, so a refused or failed save still leaves ``X`` loadable."""
    path = str(tmp_path / "last.ckpt")
    save_sharded_checkpoint(path, plain_state(1), META)
    os.rename(path, atomic.old_dir(path))
    assert lightning_last(str(tmp_path)) == set()  # what Lightning would see: nothing to resume from
    bad = plain_state(2)
    with pytest.raises(CheckpointSaveError, match="reserved"):  # a save that fails at finalisation
        save_sharded_checkpoint(path, bad, META, info={"world_size": 3})
    assert saved_version(path) == 1 and lightning_last(str(tmp_path)) == {path}


class _Killed(BaseException):
    """Stands for a kill at a fault point: nothing after it runs, what is on disk stays as it is."""


def _kill_at(step: str):
    def hook(at: str) -> None:
        if at == step:
            raise _Killed(at)

    return hook


def _remove_killed(path: str, hook) -> None:
    """Top-k removal of ``path``, killed where ``hook`` raises :class:`_Killed`."""
    atomic.FAULT_HOOK = hook
    try:
        with pytest.raises(_Killed):
            remove_sharded_checkpoint(path)
    finally:
        atomic.FAULT_HOOK = None


def test_a_kill_while_a_checkpoint_is_deleted_leaves_a_leftover_the_next_save_removes(tmp_path):
    # Killed while the swapped-out previous checkpoint was being deleted, the next run refused to save
    # ("... .partial exists but was not written by a lightning-zero save"): a crash loop under torchrun restarts.
    path = str(tmp_path / "last.ckpt")
    save_sharded_checkpoint(path, plain_state(1), META)
    atomic.FAULT_HOOK = _kill_at("mid_delete")
    try:
        with pytest.raises(_Killed):
            save_sharded_checkpoint(path, plain_state(2), META)
    finally:
        atomic.FAULT_HOOK = None
    assert saved_version(path) == 2  # the swap had committed
    leftover = atomic.partial_dir(path)
    assert os.path.isdir(leftover) and os.listdir(leftover), "the half-deleted previous checkpoint"
    save_sharded_checkpoint(path, plain_state(1), META)
    assert saved_version(path) == 1 and not os.path.lexists(leftover)
    # the same for top-k rotation killed mid-delete: the half-deleted checkpoint is still ours to delete or replace
    other = str(tmp_path / "step1.ckpt")
    save_sharded_checkpoint(other, plain_state(1), META)

    def once_incomplete(at: str) -> None:  # killed as soon as the directory no longer looks complete
        if at == "mid_delete" and not atomic.is_complete(other):
            raise _Killed(at)

    _remove_killed(other, once_incomplete)
    assert os.path.isdir(other) and not atomic.is_complete(other)
    save_sharded_checkpoint(other, plain_state(2), META)
    assert saved_version(other) == 2
    remove_sharded_checkpoint(other)
    assert not os.path.lexists(other)


def _link_kill_worker(rank, world_size, root):
    from lightning_zero import ZeroStrategy
    from tests.lightning_models import RegressionModule, quiet_trainer

    every = ModelCheckpoint(
        dirpath=root,
        filename="{step}",
        every_n_train_steps=1,
        save_top_k=1,
        monitor="step",
        mode="max",
        save_last="link",
    )
    trainer = quiet_trainer(
        ZeroStrategy(stage=2), world_size, max_steps=3, enable_checkpointing=True, callbacks=[every]
    )
    atomic.FAULT_HOOK = _kill_at("mid_delete")  # the first deletion: step=1, which last.ckpt points to
    try:
        with pytest.raises(_Killed):
            trainer.fit(RegressionModule())
    finally:
        atomic.FAULT_HOOK = None


def test_a_kill_while_rotation_deletes_the_target_of_last_never_leaves_it_dangling(tmp_path):
    # Killed while top-k rotation deleted the checkpoint last.ckpt linked to, before Lightning re-linked
    # it, last.ckpt dangled and the job resumed from step 0. The link now moves to the newest save first.
    run_distributed(_link_kill_worker, 1, str(tmp_path))
    last = tmp_path / "last.ckpt"
    assert os.path.islink(last) and atomic.is_complete(str(last)), os.readlink(last)
    assert os.path.realpath(last) == os.path.realpath(tmp_path / "step=2.ckpt")
    assert lightning_last(str(tmp_path)) == {str(last)}


def test_a_later_save_sweeps_the_leftovers_of_killed_saves_of_other_names(tmp_path):
    # A save killed mid-write leaves .X.partial (and a full-file save .X.lz-staging); if X is never saved again no
    # later save removed it. Each save's rank 0 now sweeps its directory (nothing else of this job writes there then).
    import shutil

    save_sharded_checkpoint(str(tmp_path / "c.ckpt"), plain_state(1), META)
    shutil.copytree(tmp_path / "c.ckpt", tmp_path / ".b.ckpt.lz-staging")  # a complete staging copy
    shutil.copytree(tmp_path / "c.ckpt", tmp_path / ".c.ckpt.old")  # stale: c.ckpt is complete
    shutil.copytree(tmp_path / "c.ckpt", tmp_path / ".d.ckpt.old")  # killed mid-swap: d.ckpt is missing
    (tmp_path / ".a.ckpt.partial").mkdir()
    (tmp_path / ".a.ckpt.partial" / atomic.PARTIAL_MARKER).write_text("")
    (tmp_path / ".a.ckpt.partial" / "__0_0.distcp").write_text("half")
    (tmp_path / ".e.partial").mkdir()  # not ours: no marker
    (tmp_path / ".e.partial" / "notes.txt").write_text("mine")
    save_sharded_checkpoint(str(tmp_path / "last.ckpt"), plain_state(2), META)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".e.partial", "c.ckpt", "d.ckpt", "last.ckpt"]
    assert saved_version(str(tmp_path / "d.ckpt")) == 1


def test_a_checkpoint_being_deleted_is_never_complete_at_any_kill_point(tmp_path):
    """Killed at any step of a deletion, what is left must not pass as a complete checkpoint: the random kill trials
    found a half-deleted ``step=2.ckpt`` with ``zero.json`` and ``.metadata`` still there and ``meta.pt`` gone, which
    ``is_complete`` (and a resume choosing the newest complete checkpoint) took for a checkpoint."""
    from lightning_zero.checkpoint.directory import is_sharded_checkpoint

    path = str(tmp_path / "step1.ckpt")
    save_sharded_checkpoint(path, plain_state(1), META)
    entries = len(os.listdir(path))
    for kill in range(1, entries):
        save_sharded_checkpoint(path, plain_state(1), META)
        steps = []

        def kill_at(at: str, steps=steps, kill=kill) -> None:
            if at == "mid_delete":
                steps.append(at)
                if len(steps) == kill:
                    raise _Killed(at)

        _remove_killed(path, kill_at)
        assert not atomic.is_complete(path) and not is_sharded_checkpoint(path), (kill, sorted(os.listdir(path)))
