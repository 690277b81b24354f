"""Path handling and the atomic directory swap of sharded checkpoint saves.

Everything here is local-filesystem and single-process (rank 0 calls it); the collective checks that precede a save
live in :mod:`lightning_zero.checkpoint.save_guards`.

[Note: atomic saves]
A save writes into the hidden sibling ``.X.ckpt.partial`` and then swaps it into place at ``X.ckpt``:

* **Exchange (Linux, local filesystems):** ``renameat2(partial, X.ckpt, RENAME_EXCHANGE)`` swaps the two names in one
  atomic step, so ``X.ckpt`` is at every instant either the complete previous checkpoint or the complete new one.
  Afterwards ``.X.ckpt.partial`` holds the previous checkpoint and is deleted. Python has no binding for
  ``renameat2``, hence the ctypes call.
* **Fallback (no ``renameat2``, or a filesystem that refuses ``RENAME_EXCHANGE``):** two renames,
  ``X.ckpt -> .X.ckpt.old`` then ``.X.ckpt.partial -> X.ckpt``. A crash between them leaves no ``X.ckpt`` but a
  complete ``.X.ckpt.old``. Recovery rule: when ``X.ckpt`` is missing and ``.X.ckpt.old`` is complete, loading reads
  ``.X.ckpt.old`` and the next save (and :func:`recover_interrupted_swap`) renames it back to ``X.ckpt`` first.

What may be deleted: a save replaces ``X.ckpt`` only when it is a complete lightning-zero checkpoint (``zero.json``
and ``.metadata``), a symlink to one (the link is replaced, its target untouched), or an empty directory; anything
else is refused with :class:`CheckpointSaveError`. Leftovers ``.X.ckpt.partial`` / ``.X.ckpt.old`` are deleted only
when they carry this module's marker file or are complete checkpoints, i.e. when lightning-zero made them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
from typing import Callable, Optional, Union

PathLike = Union[str, os.PathLike]

INFO_FILE = "zero.json"
PARTIAL_MARKER = ".lightning-zero-partial"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

# Fault injection for the reliability tests: called with a step name at each step of a save (see FAULT_STEPS).
FAULT_HOOK: Optional[Callable[[str], None]] = None
FAULT_STEPS = ("before_shards", "after_metadata", "after_info", "mid_swap", "mid_delete")


class CheckpointSaveError(RuntimeError):
    """A checkpoint save was refused or failed; the message names the path and what to do. The previous
    checkpoint at that path, if any, is intact."""


def fault_point(step: str) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(step)


def local_path(path: PathLike) -> str:
    """The absolute local path for ``path``; ``file://`` URLs are accepted, other URLs refused.

    Why refuse ``s3://``, ``memory://`` ...: the save's atomicity rests on POSIX ``rename`` of directories, which object
    stores do not have, and ``os.path`` would silently turn ``memory://x`` into a local directory named ``memory:``.
    """
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    match = _URL.match(text)
    if match:
        if match.group(1).lower() != "file":
            raise CheckpointSaveError(
                f"checkpoint path {text!r} is a {match.group(1)}:// URL; sharded checkpoints need a local or mounted "
                "POSIX filesystem (atomic directory renames). Save to a local or network-mounted directory and copy "
                "the finished checkpoint directory to remote storage afterwards"
            )
        text = text[len(match.group(0)) :]
    return os.path.abspath(text).rstrip(os.sep) or os.sep


def partial_dir(path: str) -> str:
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")


def old_dir(path: str) -> str:
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old")


def is_complete(path: str) -> bool:
    """True when ``path`` (or what it links to) is a complete lightning-zero sharded checkpoint directory."""
    return (
        os.path.isdir(path)
        and os.path.isfile(os.path.join(path, INFO_FILE))
        and os.path.isfile(os.path.join(path, ".metadata"))
    )


def _made_by_us(path: str) -> bool:
    if os.path.islink(path):
        return is_complete(path)  # the previous X.ckpt was a link to a checkpoint (save_last="link")
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, PARTIAL_MARKER)) or is_complete(path) or not os.listdir(path)
    )


def _delete(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        delete_checkpoint_directory(path)
    elif os.path.lexists(path):
        os.remove(path)


def delete_checkpoint_directory(path: str) -> None:
    """Delete a checkpoint directory of ours so that a kill at any instant leaves something recognisably ours.

    [Note: deleting a checkpoint] ``shutil.rmtree`` removes entries in directory order, so a kill could leave the
    shards without ``.metadata``/``zero.json``: a directory that no longer looks like ours, which the next save would
    refuse to delete (a crash loop under ``torchrun --max-restarts``). So :data:`PARTIAL_MARKER` (which a save
    writes into its partial directory, and older checkpoints may lack) is made sure of first and removed last:
    every intermediate state is a marked leftover that the next save (or rotation) deletes. And ``zero.json``, the
    record a save writes last, goes first: from the first removal on the directory is no longer complete
    (:func:`is_complete`); removed after a shard, a kill between the two would leave ``zero.json`` and ``.metadata``
    standing, a half-deleted directory that passes for a checkpoint.
    """
    marker = os.path.join(path, PARTIAL_MARKER)
    with open(marker, "a"):
        pass
    entries = sorted(os.scandir(path), key=lambda entry: entry.name != INFO_FILE)  # zero.json first
    for entry in entries:
        if entry.name == PARTIAL_MARKER:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.remove(entry.path)
        fault_point("mid_delete")
    os.remove(marker)
    os.rmdir(path)


def delete_leftover(path: str) -> None:
    """Delete a ``.partial`` / ``.old`` leftover of an earlier save; refuse one lightning-zero did not make."""
    if not os.path.lexists(path):
        return
    if not _made_by_us(path):
        raise CheckpointSaveError(
            f"{path} exists but was not written by a lightning-zero save (no {PARTIAL_MARKER} marker, not a "
            "checkpoint); it is not deleted. Move it away and save again"
        )
    _delete(path)


def why_not_replaceable(path: str) -> Optional[str]:
    """``None`` when a save may replace what is at ``path``; otherwise the reason it may not."""
    if not os.path.lexists(path):
        return None
    if os.path.islink(path):
        if is_complete(path):
            return None
        return (
            f"{path} is a symlink to {os.readlink(path)!r}, which is not a complete lightning-zero checkpoint; "
            "refusing to replace it. Remove the link or choose another path"
        )
    if os.path.isdir(path):
        if is_complete(path) or not os.listdir(path) or os.path.isfile(os.path.join(path, PARTIAL_MARKER)):
            return None  # ours: complete, empty, or a marked leftover (a kill mid-write or mid-delete)
        return (
            f"{path} is an existing directory that is not a lightning-zero checkpoint (no {INFO_FILE} and "
            ".metadata); saving would replace it and delete its contents. Refusing: choose another path or move "
            "the directory away"
        )
    return (
        f"{path} is an existing file, not a lightning-zero checkpoint directory (e.g. a single-file torch.save "
        "checkpoint); refusing to replace it. Choose another path or move the file away"
    )


def recover_interrupted_swap(path: str) -> bool:
    """Put ``.X.ckpt.old`` back at ``X.ckpt`` when a fallback swap died between its two renames. True if it did."""
    old = old_dir(path)
    if not os.path.lexists(path) and os.path.lexists(old) and is_complete(old):
        os.rename(old, path)
        _fsync_dir(os.path.dirname(path))
        return True
    return False


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories; the renames are still atomic
    finally:
        os.close(fd)


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _libc()
USE_EXCHANGE = True  # tests switch it off to exercise the two-rename fallback


def exchange(first: str, second: str) -> bool:
    """Atomically swap the names ``first`` and ``second`` (both must exist). False when the platform or filesystem
    cannot; any other failure raises ``OSError``."""
    if _RENAMEAT2 is None or not USE_EXCHANGE:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), first, None, second)


def swap_into_place(partial: str, path: str) -> None:
    """Move the finished ``partial`` directory to ``path``; see ``[Note: atomic saves]``."""
    if not os.path.lexists(path):
        os.rename(partial, path)
        _fsync_dir(os.path.dirname(path))
        return
    if exchange(partial, path):
        _fsync_dir(os.path.dirname(path))
        fault_point("mid_swap")
        _delete(partial)  # now the previous checkpoint
        return
    old = old_dir(path)
    delete_leftover(old)
    os.rename(path, old)
    fault_point("mid_swap")
    os.rename(partial, path)
    _fsync_dir(os.path.dirname(path))
    _delete(old)


def relink_staging(link: str) -> str:
    """The hidden name a new link is made under before it replaces ``link``."""
    return os.path.join(os.path.dirname(link), f".{os.path.basename(link)}.lz-relink")


def replace_link(target: str, link: str) -> None:
    """Point ``link`` at ``target`` (relative, as Lightning's ``ModelCheckpoint._link_checkpoint`` links) so that at
    no instant is there nothing at ``link``: the new link is made under :func:`relink_staging` and renamed over what is
    at ``link`` (``os.replace``, one atomic step, over a link or a file; a directory of ours is swapped as
    :func:`swap_into_place` swaps one; anything else is refused with :class:`CheckpointSaveError`, nothing changed).
    Where the filesystem cannot make symlinks, a copy of ``target`` is made under that name instead (Lightning's
    fallback is a copy too), and swapped in the same way."""
    if os.path.isdir(link) and not os.path.islink(link) and why_not_replaceable(link):
        raise CheckpointSaveError(why_not_replaceable(link))
    staging = relink_staging(link)
    _remove_staging(staging)  # a kill between the two steps of an earlier re-link
    try:
        os.symlink(os.path.relpath(target, os.path.dirname(link)), staging)
    except OSError:
        (shutil.copytree if os.path.isdir(target) else shutil.copy)(target, staging)
    if any(os.path.isdir(path) and not os.path.islink(path) for path in (staging, link)):
        swap_into_place(staging, link)  # rename(2) puts no directory over a non-directory, nor the reverse
        return
    os.replace(staging, link)
    _fsync_dir(os.path.dirname(link))


def _remove_staging(staging: str) -> None:
    if os.path.isdir(staging) and not os.path.islink(staging):
        shutil.rmtree(staging)  # the name is ours alone: a copy a kill left half made is still ours to delete
    elif os.path.lexists(staging):
        os.remove(staging)


def sweep_leftovers(directory: str, keep: str) -> None:
    """Delete the leftovers of killed saves in ``directory``: ``.X.partial`` and ``.X.lz-staging`` directories made
    by us (marked or complete), ``.X.lz-relink`` links (:func:`replace_link`), and ``.X.old`` once ``X`` is complete
    again (a lone ``.X.old`` is put back at ``X`` instead, as :func:`recover_interrupted_swap` does). ``keep``: the
    partial directory of the save in progress. Called by a save's rank 0 once no earlier save of this process is
    pending (``save_sharded_checkpoint`` settles them first), so no other save of this job is writing there; anything
    not ours is left alone."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith(".") and name.endswith(".lz-relink") and os.path.islink(path):
            os.remove(path)  # a link made by replace_link, killed before it was renamed into place
            continue
        if not name.startswith(".") or path == keep or not os.path.isdir(path) or os.path.islink(path):
            continue
        if name.endswith(".partial") or name.endswith(".lz-staging"):
            if _made_by_us(path):
                delete_checkpoint_directory(path)
        elif name.endswith(".old"):
            target = os.path.join(directory, name[1 : -len(".old")])
            if not recover_interrupted_swap(target) and is_complete(target) and _made_by_us(path):
                delete_checkpoint_directory(path)
