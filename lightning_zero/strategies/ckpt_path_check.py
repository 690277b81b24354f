"""``ckpt_path`` checked before any rank starts: the launchers of ``ZeroStrategy`` (the Trainer's) refuse a path it
cannot load before the processes exist, instead of after every rank set up the model."""

from __future__ import annotations

import inspect
import os
from typing import Any

from lightning_zero.checkpoint.atomic import local_path
from lightning_zero.checkpoint.deepspeed_reader import is_deepspeed_checkpoint
from lightning_zero.checkpoint.directory import checkpoint_directory, is_sharded_checkpoint
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.full_file import describe_full_checkpoint_file
from lightning_zero.strategies.auto_resume import newest_complete_checkpoint

# ``ckpt_path`` values Lightning resolves itself (from callbacks, a SLURM/HPC save, a model registry) after launch.
_SYMBOLIC_CKPT_PATHS = ("last", "best", "hpc", "registry")


def check_ckpt_path(function: Any, args: tuple, kwargs: dict, trainer: Any = None) -> None:
    """Refuse a ``ckpt_path`` given to ``fit/validate/test/predict`` that ZeroStrategy cannot load, before any rank
    starts: a URL, a file that is no checkpoint (neither a torch.save file nor safetensors), a path inside a sharded
    checkpoint, an incomplete directory, a missing path beside complete checkpoints (:func:`check_missing_path`). A
    single checkpoint file and a DeepSpeed ZeRO checkpoint directory are loaded (``checkpoint/load_full.py``).
    Lightning passes it to the launched function only (its signature is read, not assumed); symbolic names are
    resolved later, by Lightning, before the strategy sees the path: so ``trainer.strategy.ckpt_path_asked`` keeps
    what was asked, for ``"last"`` to also take a newer complete checkpoint (:mod:`.auto_resume`)."""
    try:
        path = inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):
        path = None
    if trainer is not None:
        trainer.strategy.ckpt_path_asked = path if isinstance(path, str) else None
    if path is None or not isinstance(path, (str, os.PathLike)):
        return
    text = os.fspath(path)
    if text in _SYMBOLIC_CKPT_PATHS or text.startswith("registry:"):
        return
    local = local_path(text)  # refuses remote URLs, naming them
    parent = os.path.dirname(local.rstrip(os.sep))
    if os.path.isfile(local) and is_sharded_checkpoint(parent):
        raise ValueError(
            f"ckpt_path={text!r} is a file inside the sharded checkpoint {parent}: pass the directory, "
            f"ckpt_path={parent!r}"
        )
    if os.path.isfile(local):
        problem = describe_full_checkpoint_file(local)
        if problem:
            raise CheckpointError(problem, local)
        return
    if is_deepspeed_checkpoint(local):
        return
    if os.path.exists(local) or os.path.exists(os.path.join(os.path.dirname(local), f".{os.path.basename(local)}.old")):
        checkpoint_directory(local)  # a CheckpointError naming what is wrong (a single file, an incomplete directory)
    else:
        check_missing_path(text, local)


def check_missing_path(text: str, local: str) -> None:
    """A ``ckpt_path`` with nothing at it (or a link to nothing) beside complete checkpoints: refused, naming the
    newest of them. Not loaded in its place: a path is loaded as given, and ``ckpt_path="last"`` is the name that asks
    for the newest (``[Note: "last" resumes the newest complete checkpoint]`` in :mod:`.auto_resume`). Without
    checkpoints beside it the path is left to Lightning, which says it is missing."""
    newest = newest_complete_checkpoint([os.path.dirname(local)])
    if newest is None:
        return
    what = f"is a link to {os.readlink(local)!r}, which does not exist" if os.path.islink(local) else "does not exist"
    raise FileNotFoundError(
        f"ckpt_path={text!r} {what}; the newest complete checkpoint beside it is {newest}. Pass "
        f'ckpt_path={newest!r}, or ckpt_path="last" to resume the newest complete checkpoint of '
        "the ModelCheckpoint directory"
    )


class ValidatingLauncher:
    """The launcher ZeroStrategy uses where processes are started externally (torchrun, SLURM, ...), where Lightning
    has none: it only runs :func:`check_ckpt_path` before the Trainer function, as :func:`check_launch` adds to
    Lightning's own launchers."""

    is_interactive_compatible = True

    def launch(self, function, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        check_ckpt_path(function, args, kwargs, trainer)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        pass  # the external launcher owns the processes


def check_launch(launcher: Any) -> Any:
    """``launcher`` (one of Lightning's), with ``ckpt_path`` checked before it starts any process."""
    launch = launcher.launch

    def checked_launch(function, *args: Any, **kwargs: Any) -> Any:
        check_ckpt_path(function, args, {k: v for k, v in kwargs.items() if k != "trainer"}, kwargs.get("trainer"))
        return launch(function, *args, **kwargs)

    launcher.launch = checked_launch  # on the instance: Lightning's isinstance checks still see its class
    return launcher
