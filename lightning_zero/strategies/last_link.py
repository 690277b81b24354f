"""``ModelCheckpoint(save_last="link")`` under ZeroStrategy: ``last.ckpt`` re-pointed in one atomic step.

[Note: re-pointing last.ckpt]
Lightning re-points the link in ``ModelCheckpoint._link_checkpoint`` (``lightning/pytorch/callbacks/
model_checkpoint.py``, the same code in 2.4, 2.5 and 2.6): ``os.remove`` (or ``shutil.rmtree``) of ``last.ckpt``, then
``os.symlink`` to the new checkpoint, then ``trainer.strategy.barrier()``. It calls no strategy hook before the
removal, so a kill between the two calls left no ``last.ckpt``: ``fit(ckpt_path="last")`` started again from step 0
with only Lightning's warning, with complete checkpoints beside it. The strategy's ``remove_checkpoint`` is not on
that path (Lightning calls it for top-k rotation only), so at setup :func:`install_atomic_links` gives each
``ModelCheckpoint`` with ``save_last="link"`` its own ``_link_checkpoint`` (an instance attribute: the class, and every
other Trainer's callbacks, are untouched; Lightning calls it as ``self._link_checkpoint(trainer, filepath, linkpath)``
from ``_save_last_checkpoint``). It makes the new link under a hidden name and ``os.replace``s it over ``last.ckpt``
(:func:`lightning_zero.checkpoint.atomic.replace_link`), so ``last.ckpt`` is at every instant the previous link or the
new one. A subclass that defines its own ``_link_checkpoint`` keeps it. Where the filesystem cannot make symlinks, a
copy is renamed into place instead (Lightning copies too, after the removal).

What a resume does when ``last.ckpt`` is missing or older than the newest complete checkpoint anyway (a run killed
by an older version, or between the save and the re-link): ``[Note: "last" resumes the newest complete checkpoint]``
in :mod:`lightning_zero.strategies.auto_resume`.
"""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero.checkpoint.atomic import CheckpointSaveError, replace_link


def install_atomic_links(checkpoint_callbacks: list) -> None:
    """Give each ``ModelCheckpoint(save_last="link")`` in ``checkpoint_callbacks`` the atomic re-link (see the
    note above); other callbacks, and subclasses with their own ``_link_checkpoint``, are left alone."""
    lightnings = getattr(ModelCheckpoint, "_link_checkpoint", None)
    for callback in checkpoint_callbacks:
        if (
            isinstance(callback, ModelCheckpoint)
            and callback.save_last == "link"
            and lightnings is not None
            and getattr(type(callback), "_link_checkpoint", None) is lightnings
        ):
            callback._link_checkpoint = AtomicLink()


class AtomicLink:
    """``ModelCheckpoint._link_checkpoint`` with the link replaced atomically (a class, not a closure, so that a
    callback that carries it can still be pickled, as a spawning launcher does with the Trainer). Rank 0 re-links and
    broadcasts its failure, if any, so every rank raises it; the broadcast also holds the other ranks until the link
    is in place, as Lightning's barrier there does."""

    def __call__(self, trainer, filepath: str, linkpath: str) -> None:
        error = None
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            try:
                replace_link(os.path.abspath(filepath), os.path.abspath(linkpath))
            except (OSError, CheckpointSaveError) as err:  # the latter: a last.ckpt that is not ours is refused
                error = f"re-pointing {linkpath} at {filepath} failed: {err}"
        error = trainer.strategy.broadcast(error)
        if error:
            raise CheckpointSaveError(error)
