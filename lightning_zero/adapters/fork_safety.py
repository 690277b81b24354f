"""``start_method="fork"``: ranks must not destroy process groups they inherited from the launching process.

[Note: an inherited gloo group hangs the rank that destroys it]
A forked rank gets a copy of every object of the launching process, but none of its threads. A gloo process group
that the launching process no longer uses but has not freed yet (an earlier fit's group kept alive by a reference
cycle, e.g. an FSDP module that points back at itself, until the cyclic garbage collector runs) is copied too.
When the rank's garbage collector later frees that copy, ``~ProcessGroupGloo`` signals and joins worker threads
that exist only in the launching process, and the rank hangs there, in whatever step happened to allocate enough
to trigger a collection (observed cases: ``docs/reliability.md``, "Starting and ending rank processes").

So, for the fork start method only:

- before forking, the launching process collects its garbage (:func:`collect_before_fork`), so a group already
  unreachable is destroyed there, where its threads are;
- each rank, first thing, moves everything it inherited into the collector's permanent generation
  (:func:`freeze_inherited`, ``gc.freeze()``), so an inherited object that becomes garbage in the rank is never
  collected there. The cost is that such objects stay allocated for the rank's life; they were allocated in the
  launching process anyway.

``spawn``/``forkserver`` ranks start from a fresh interpreter and need neither; ``popen`` ranks are new programs.
Both launchers use these: the Trainer's
:class:`~lightning_zero.strategies.multiprocessing_launcher.ZeroMultiProcessingLauncher` and
:class:`FabricMultiProcessingLauncher` below.
"""

from __future__ import annotations

import gc
from typing import Any

from lightning.fabric.strategies.launchers import _MultiProcessingLauncher


def collect_before_fork(start_method: str) -> None:
    if start_method == "fork":
        gc.collect()


def freeze_inherited(start_method: str) -> None:
    if start_method == "fork":
        gc.freeze()


class FabricMultiProcessingLauncher(_MultiProcessingLauncher):
    """Fabric's ``_MultiProcessingLauncher``, safe for ``fork`` (see the note); a subclass, so ``spawn`` can pickle
    it."""

    def launch(self, function, *args: Any, **kwargs: Any) -> Any:
        collect_before_fork(self._start_method)
        return super().launch(function, *args, **kwargs)

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> Any:
        freeze_inherited(self._start_method)
        return super()._wrapping_function(*args, **kwargs)
