"""``ModelCheckpoint(save_last="link")`` killed at every filesystem step of its rotation, then
``fit(ckpt_path="last")``: ``last.ckpt`` is never missing, and the resume starts from the newest complete checkpoint,
never from step 0 (``[Note: re-pointing last.ckpt]`` in ``strategies/last_link.py``, ``[Note: "last" resumes the
newest complete checkpoint]`` in ``strategies/auto_resume.py``).

The rotation is what follows the save of a new checkpoint: top-k removal of the previous one (the strategy's
``remove_checkpoint``) and the re-pointing of ``last.ckpt`` (``ModelCheckpoint._link_checkpoint``). Each of its
``os.remove``/``unlink``/``rmdir``/``symlink``/``replace``/``rename`` calls is counted in a forked one-rank fit, and the
process exits (``os._exit``: no teardown, no ``finally``) just before call ``k + 1``, for every ``k``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import atomic
from lightning_zero.checkpoint.atomic import CheckpointSaveError, replace_link
from lightning_zero.checkpoint.directory import INFO_FILE, is_sharded_checkpoint
from lightning_zero.checkpoint.full_save import is_full_file
from lightning_zero.strategies import last_link
from tests.lightning_models import RegressionModule
from tests.ranks import run_distributed

SAVE_EVERY = 2
KILLED_SAVE = 4  # the global step whose rotation is killed: step=2 is the previous checkpoint
FS_STEPS = ("remove", "unlink", "rmdir", "symlink", "replace", "rename")
KILLED = 17


class _KilledRotation(ModelCheckpoint):
    """Counts the filesystem calls of the rotation that follows the save at ``KILLED_SAVE`` and exits the process
    before call ``kill_after + 1`` (never, with ``None``); ``record`` gets the calls' names."""

    def __init__(self, kill_after, record, **kwargs):
        super().__init__(**kwargs)
        self.kill_after, self.record, self.calls, self.saved = kill_after, record, [], {}

    def _save_checkpoint(self, trainer, filepath):
        super()._save_checkpoint(trainer, filepath)
        if trainer.global_step == KILLED_SAVE and not self.saved:
            for name in FS_STEPS:  # armed once the new checkpoint is complete: what follows is the rotation
                self.saved[name] = getattr(os, name)
                setattr(os, name, self._counted(name, self.saved[name]))

    def _counted(self, name, original):
        def step(*args, **kwargs):
            if self.kill_after is not None and len(self.calls) == self.kill_after:
                os._exit(KILLED)
            self.calls.append(" ".join([name, *(os.path.basename(str(arg)) for arg in args[:2])]))
            return original(*args, **kwargs)

        return step

    def _save_last_checkpoint(self, trainer, monitor_candidates):
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if self.saved:  # the rotation is over: disarm
            for name, original in self.saved.items():
                setattr(os, name, original)
            self.saved = {"done": True}
            with open(self.record, "w") as file:
                json.dump(self.calls, file)


class _StartStep(Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def _trainer(callback, max_steps, state_dict_type):
    return Trainer(
        strategy=ZeroStrategy(stage=2, state_dict_type=state_dict_type),
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=os.path.dirname(callback.dirpath),
    )


def _checkpoint_kwargs(root):
    return dict(
        dirpath=os.path.join(root, "checkpoints"),
        save_last="link",
        save_top_k=1,
        every_n_train_steps=SAVE_EVERY,
        filename="{step}",
    )


def _killed_fit(rank, world_size, root, state_dict_type, kill_after):
    torch.manual_seed(0)
    callback = _KilledRotation(kill_after, os.path.join(root, "rotation.json"), **_checkpoint_kwargs(root))
    _trainer(callback, KILLED_SAVE, state_dict_type).fit(RegressionModule())


def _is_complete(path):
    return is_sharded_checkpoint(path) or is_full_file(path)


def _newest_complete_step(directory):
    steps = [
        int(match.group(1))
        for match in map(re.compile(r"step=(\d+)\.ckpt").fullmatch, os.listdir(directory))
        if match and _is_complete(os.path.join(directory, match.group(0)))
    ]
    return max(steps, default=0)


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _resumes(rank, world_size, roots, state_dict_type, results):
    found = {}
    warnings = _Warnings()
    logging.getLogger("lightning_zero.strategies.auto_resume").addHandler(warnings)
    for root in roots:
        callback = ModelCheckpoint(**_checkpoint_kwargs(root))
        newest = _newest_complete_step(callback.dirpath)
        start = _StartStep()
        trainer = _trainer(callback, KILLED_SAVE + SAVE_EVERY, state_dict_type)
        trainer.callbacks.append(start)
        torch.manual_seed(1)
        warnings.messages.clear()
        trainer.fit(RegressionModule(), ckpt_path="last")
        found[os.path.basename(root)] = {
            "newest": newest,
            "resumed": start.step,
            "end": trainer.global_step,
            "from": os.path.basename(str(trainer.ckpt_path)),
            "warnings": list(warnings.messages),
        }
    with open(results, "w") as file:
        json.dump(found, file)


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_a_kill_at_every_step_of_a_last_link_rotation_resumes_from_the_newest_complete_checkpoint(
    tmp_path, state_dict_type
):
    run_distributed(_killed_fit, 1, str(tmp_path / "whole"), state_dict_type, None)  # the calls, uninterrupted
    with open(tmp_path / "whole" / "rotation.json") as file:
        rotation = json.load(file)
    assert any(call.endswith(" last.ckpt") for call in rotation), rotation  # the link is re-pointed in it
    roots, missing = {}, []
    for kill_after in range(len(rotation)):
        root = tmp_path / f"k{kill_after}"
        with pytest.raises(Exception, match=f"exit code {KILLED}"):
            run_distributed(_killed_fit, 1, str(root), state_dict_type, kill_after)
        roots[root.name] = f"killed before {rotation[kill_after]!r}"
        if not _is_complete(str(root / "checkpoints" / "last.ckpt")):
            missing.append(roots[root.name])
    # Lightning's own "last" lookup finds nothing at all: the newest complete checkpoint is resumed instead
    shutil.copytree(tmp_path / "whole", tmp_path / "nolast", symlinks=True)
    os.remove(tmp_path / "nolast" / "checkpoints" / "last.ckpt")
    roots["nolast"] = "no last.ckpt"
    run_distributed(
        _resumes, 1, [str(tmp_path / name) for name in roots], state_dict_type, str(tmp_path / "results.json")
    )
    with open(tmp_path / "results.json") as file:
        results = json.load(file)
    wrong = {
        roots[name]: result
        for name, result in results.items()
        if not (result["resumed"] == result["newest"] == KILLED_SAVE and result["end"] == KILLED_SAVE + SAVE_EVERY)
    }
    assert not missing and not wrong, "\n".join(
        [*rotation, *(f"no complete last.ckpt: {m}" for m in missing), *(f"{k}: {r}" for k, r in wrong.items())]
    )
    nolast = results["nolast"]
    assert nolast["from"] == f"step={KILLED_SAVE}.ckpt", nolast
    assert any("found no last*.ckpt" in m and f"step={KILLED_SAVE}.ckpt" in m for m in nolast["warnings"]), nolast


def _fake_checkpoint(path, age=0.0):
    os.makedirs(path)
    for name in (".metadata", INFO_FILE):
        with open(os.path.join(path, name), "w"):
            pass
    os.utime(os.path.join(path, INFO_FILE), (os.path.getmtime(path) - age,) * 2)
    return str(path)


@pytest.mark.parametrize("dangling", [False, True], ids=["missing", "dangling-link"])
def test_an_explicit_missing_last_ckpt_beside_complete_checkpoints_is_refused_naming_the_newest(tmp_path, dangling):
    """A path is loaded as given or refused, never replaced by another checkpoint: ``"last"`` is the name that asks
    for the newest. Refused before any process starts, where it used to fail after setup with a bare
    ``FileNotFoundError``."""
    directory = tmp_path / "checkpoints"
    _fake_checkpoint(directory / "step=2.ckpt", age=10)
    newest = _fake_checkpoint(directory / "step=4.ckpt")
    last = directory / "last.ckpt"
    if dangling:
        os.symlink("step=6.ckpt", last)
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(FileNotFoundError, match=re.escape(f"ckpt_path={newest!r}")) as refused:
        trainer.fit(RegressionModule(), ckpt_path=str(last))
    assert "last.ckpt" in str(refused.value) and '"last"' in str(refused.value)
    assert ("link to 'step=6.ckpt'" in str(refused.value)) == dangling


def test_replace_link_is_one_rename_over_a_link_or_a_file_and_a_swap_over_a_directory_of_ours(tmp_path):
    first, second = _fake_checkpoint(tmp_path / "step=2.ckpt"), _fake_checkpoint(tmp_path / "step=4.ckpt")
    link = str(tmp_path / "last.ckpt")
    os.symlink("gone", atomic.relink_staging(link))  # left by a kill between the two steps of an earlier re-link
    replace_link(first, link)
    assert os.readlink(link) == "step=2.ckpt"
    replace_link(second, link)
    assert os.readlink(link) == "step=4.ckpt" and not os.path.lexists(atomic.relink_staging(link))
    for exchange in (True, False):  # a last.ckpt that is a checkpoint of ours (an earlier save_last=True)
        os.remove(link)
        _fake_checkpoint(link)
        atomic.USE_EXCHANGE = exchange
        try:
            replace_link(first, link)
        finally:
            atomic.USE_EXCHANGE = True
        assert os.readlink(link) == "step=2.ckpt"
        assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    os.remove(link)
    os.makedirs(os.path.join(link, "notes"))  # not ours: refused, nothing changed
    with pytest.raises(CheckpointSaveError, match="not a lightning-zero checkpoint"):
        replace_link(first, link)
    assert os.listdir(link) == ["notes"] and not os.path.lexists(atomic.relink_staging(link))


def test_replace_link_copies_where_the_filesystem_has_no_symlinks(tmp_path, monkeypatch):
    directory = _fake_checkpoint(tmp_path / "step=2.ckpt")
    (tmp_path / "step=4.ckpt").write_bytes(b"a full file")
    link = str(tmp_path / "last.ckpt")
    os.symlink("step=2.ckpt", link)

    def no_symlinks(*args, **kwargs):
        raise PermissionError("symlinks are not supported here")

    monkeypatch.setattr(os, "symlink", no_symlinks)
    replace_link(str(tmp_path / "step=4.ckpt"), link)  # a file copied over a link
    assert not os.path.islink(link) and open(link, "rb").read() == b"a full file"
    replace_link(directory, link)  # a directory copied over a file: swapped in
    assert is_sharded_checkpoint(link) and not os.path.islink(link)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]


def test_a_save_sweeps_a_relink_left_by_a_kill(tmp_path):
    staging = atomic.relink_staging(str(tmp_path / "last.ckpt"))
    os.symlink("step=2.ckpt", staging)
    atomic.sweep_leftovers(str(tmp_path), keep="")
    assert not os.path.lexists(staging)


def test_install_gives_each_link_callback_its_own_atomic_link_and_leaves_the_rest(tmp_path):
    class OwnLink(ModelCheckpoint):
        @staticmethod
        def _link_checkpoint(trainer, filepath, linkpath):
            pass

    link, copy, own = ModelCheckpoint(save_last="link"), ModelCheckpoint(save_last=True), OwnLink(save_last="link")
    last_link.install_atomic_links([link, copy, own])
    assert isinstance(vars(link)["_link_checkpoint"], last_link.AtomicLink)
    assert "_link_checkpoint" not in vars(copy) and "_link_checkpoint" not in vars(own)
    assert ModelCheckpoint._link_checkpoint is not vars(link)["_link_checkpoint"]  # the class is untouched
    assert isinstance(pickle.loads(pickle.dumps(link))._link_checkpoint, last_link.AtomicLink)  # spawn pickles it
