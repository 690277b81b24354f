"""Reading one key per rank from the job's c10d store in a number of round trips that does not grow with the world.

[Note: reading every rank's key]
A diagnosis that reads each rank's key with ``check`` and ``get`` makes two round trips per rank: at 1,024 ranks,
every rank that diagnoses at the same moment makes two thousand, and the store's host serves two million
(``docs/scale.md``). ``Store.check`` takes a list of keys and ``Store.multi_get`` returns the values of a list in one
round trip (public on ``torch.distributed.Store``; torch's own ``torch/distributed/elastic/utils/store.py``,
``get_all``, reads every rank's key with it). ``multi_get`` waits for a missing key until the store's timeout, so the
keys are checked first: when all are present (the usual case) that is two round trips whatever the world size; when
some are missing (a rank that never reported), the list is halved until the missing keys are isolated, a few round
trips per missing key. Keys are never deleted, so a key found present is still there for the ``multi_get``.
"""

from __future__ import annotations

from typing import Optional, Sequence


def all_values(store, keys: Sequence[str]) -> Optional[list[bytes]]:
    """The values of ``keys`` in order, in two round trips, or ``None`` (one round trip) while any is missing."""
    keys = list(keys)
    if not keys:
        return []
    return list(store.multi_get(keys)) if store.check(keys) else None


def present_values(store, keys: Sequence[str]) -> dict[str, bytes]:
    """The value of each key of ``keys`` that exists in ``store``, by key (missing keys are left out)."""
    keys = list(dict.fromkeys(keys))
    if not keys:
        return {}
    found: dict[str, bytes] = {}
    pending = [keys]
    while pending:
        part = pending.pop()
        if store.check(part):
            found.update(zip(part, store.multi_get(part)))
        elif len(part) > 1:
            middle = len(part) // 2
            pending += [part[:middle], part[middle:]]
    return found
