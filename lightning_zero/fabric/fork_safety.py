"""``start_method="fork"``: ranks must not destroy process groups they inherited from the launching process.

[Note: an inherited gloo group hangs the rank that destroys it]
A forked rank gets a copy of every object of the launching process, but none of its threads. A gloo process group
that the launching process no longer uses but has not freed yet (an earlier fit's group kept alive by a reference
cycle, e.g. an FSDP module that points back at itself, until the cyclic garbage collector runs) is copied too.
When the rank's garbage collector later frees that copy, ``~ProcessGroupGloo`` signals and joins worker threads
that exist only in the launching process, and the rank hangs there, in whatever step happened to allocate enough
to trigger a collection (seen in this project's own test ranks: a DCP save hung in ``gather_object``).

So, for the fork start method only, the launcher is wrapped twice:

- before forking, the launching process collects its garbage, so a group already unreachable is destroyed there,
  where its threads are;
- each rank, first thing, moves everything it inherited into the collector's permanent generation
  (``gc.freeze()``), so an inherited object that becomes garbage in the rank is never collected there. The cost is
  that such objects stay allocated for the rank's life; they were allocated in the launching process anyway.

``spawn``/``forkserver`` ranks start from a fresh interpreter and need neither; ``popen`` ranks are new programs.
"""

from __future__ import annotations

import gc
from typing import Any


def guard_forked_ranks(launcher: Any) -> Any:
    """Lightning's ``_MultiProcessingLauncher`` (Trainer's or Fabric's), made safe for ``fork`` (see the note).

    Patches the instance (Lightning's ``isinstance`` checks still see its class); other start methods are returned
    unchanged, since their rank entry must stay picklable.
    """
    if getattr(launcher, "_start_method", None) != "fork":
        return launcher
    launch, rank_entry = launcher.launch, launcher._wrapping_function

    def launch_after_collecting(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        return launch(*args, **kwargs)

    def rank_entry_with_frozen_inheritance(*args: Any, **kwargs: Any) -> Any:
        gc.freeze()
        return rank_entry(*args, **kwargs)

    launcher.launch = launch_after_collecting
    launcher._wrapping_function = rank_entry_with_frozen_inheritance
    return launcher
