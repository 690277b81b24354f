"""The peers of one attempt of a job: which attempt all ranks are in, where each rank runs, and who is gone when a
collective fails because a peer died.

[Note: why the attempt is agreed, not read from TORCHELASTIC_RESTART_COUNT]
torchrun counts restarts per node agent: an agent whose own workers failed counts one more restart, an agent whose
workers were healthy when another node re-joined the rendezvous (a peer's node lost its ranks) restarts its workers
*without* counting. After a peer's death the nodes of one attempt can therefore carry different counts (one more on
the node that lost its rank than on the survivor's: ``docs/reliability.md``, "Why the restarted job hung before"),
and a store namespace named after the count puts the ranks of one attempt in different namespaces: the gloo group
never forms and the job waits out the store's timeout. :func:`agree_attempt` makes rank 0 the authority: it draws the
next attempt number from the store and hands it to each rank, keyed by that rank's own start number (``starts/<rank>``,
one more every time a process of that rank starts), so an offer left for a process of an earlier attempt is never read
by a later one. The agents stop every worker before a new round starts, so the processes of two attempts never overlap.

[Note: naming a lost peer]
A rank killed mid-run (SIGKILL, OOM-kill, a node lost) closes its sockets; gloo then fails the survivors' collectives
at once with "Connection closed by peer [ADDRESS]:PORT" or "Read error [ADDRESS]:PORT: Connection reset by peer",
which names an address and a port, not a rank. Every rank publishes its host name and the address gloo advertises
(:func:`publish_identity`); :func:`lost_peer_note` maps the address back to the ranks and host it belongs to.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, Optional

import torch.distributed as dist

from lightning_zero.diagnostics.network import interfaces, resolve
from lightning_zero.diagnostics.store_reads import all_values, present_values
from lightning_zero.torch_compat import default_store

log = logging.getLogger(__name__)
_PREFIX = "lightning_zero/attempts/"
_NOTE_HEAD = "lightning-zero: lost peer: "
_PEERS = "lightning_zero/peers/"
_agreed: Optional[int] = None
_GLOO_PEER = re.compile(
    r"(?:Connection closed by peer|Read error|Write error|Connection reset by peer|"
    r"Broken pipe|Socket closed)[^\[]*\[([^\]]+)\]:(\d+)"
)


def agreed_attempt() -> Optional[int]:
    """The attempt :func:`agree_attempt` settled in this process (``None`` before, or outside torchrun)."""
    return _agreed


def agree_attempt(store: dist.Store, rank: int, world_size: int, timeout: timedelta, poll: float = 0.05) -> int:
    """The number of this attempt, the same on every rank (0 for the first); see the note. Collective over the store:
    every rank of the attempt calls it once, before its process group forms."""
    global _agreed
    mine = store.add(f"{_PREFIX}starts/{rank}", 1)
    if rank != 0:
        store.wait([f"{_PREFIX}offer/{rank}/{mine}"], timeout)
        attempt = int(store.get(f"{_PREFIX}offer/{rank}/{mine}"))
        store.set(f"{_PREFIX}ack/{rank}/{mine}", str(attempt))
        _agreed = attempt
        return attempt
    attempt = store.add(f"{_PREFIX}count", 1) - 1
    pending, offered, deadline = list(range(1, world_size)), {}, time.monotonic() + timeout.total_seconds()
    while pending:
        # A sweep is at most five round trips whatever the world size ([Note: reading every rank's key] in
        # store_reads): every pending rank's start number once all started, the offers that are new, the answers.
        starts = all_values(store, [f"{_PREFIX}starts/{peer}" for peer in pending])
        if starts is not None:
            numbers = {peer: int(n) for peer, n in zip(pending, starts)}
            fresh = [peer for peer in pending if offered.get(peer) != numbers[peer]]
            if fresh:
                offers = [f"{_PREFIX}offer/{peer}/{numbers[peer]}" for peer in fresh]
                store.multi_set(offers, [str(attempt)] * len(offers))
                offered.update((peer, numbers[peer]) for peer in fresh)
            acks = all_values(store, [f"{_PREFIX}ack/{peer}/{numbers[peer]}" for peer in pending])
            if acks is not None:
                pending = [peer for peer, ack in zip(pending, acks) if int(ack) != attempt]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"lightning-zero: ranks {_not_answered(store, pending, attempt)} did not start within "
                f"{timeout.total_seconds():g} s of rank 0 (attempt {attempt} of this job)"
            )
        if pending:
            time.sleep(poll)
    _agreed = attempt
    return attempt


def _not_answered(store: dist.Store, pending: list[int], attempt: int) -> list[int]:
    """The ranks of ``pending`` that have not acknowledged ``attempt`` (read one by one where needed: an error path)."""
    starts = present_values(store, [f"{_PREFIX}starts/{peer}" for peer in pending])
    numbers = {peer: int(starts[f"{_PREFIX}starts/{peer}"]) for peer in pending if f"{_PREFIX}starts/{peer}" in starts}
    acks = present_values(store, [f"{_PREFIX}ack/{peer}/{n}" for peer, n in numbers.items()])
    return [
        peer for peer in pending if int(acks.get(f"{_PREFIX}ack/{peer}/{numbers.get(peer)}", -1)) != attempt
    ] or pending


def gloo_address() -> Optional[str]:
    """The address gloo advertises here: ``GLOO_SOCKET_IFNAME``'s interface's, else the host name's."""
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    by_name = {i.name: i.address for i in interfaces()} if names else {}
    for name in names:
        if by_name.get(name):
            return by_name[name]
    return resolve(socket.gethostname())


def identity(node_rank: Optional[int]) -> dict:
    """Where this process runs: host name, gloo's address, node rank, pid."""
    return {"host": socket.gethostname(), "address": gloo_address(), "node_rank": node_rank, "pid": os.getpid()}


def publish_identity(store: dist.Store, rank: int, node_rank: int) -> None:
    """Record where this rank runs (:func:`identity`) for the others to name it."""
    store.set(f"{_PEERS}{rank}", json.dumps(identity(node_rank)))


def lost_peer_note(error: BaseException, store: Optional[dist.Store], world_size: int) -> Optional[str]:
    """A sentence naming the ranks and host a failed gloo collective lost (``None`` when ``error`` is not one)."""
    found = {m.group(1) for e in _chain(error) for m in _GLOO_PEER.finditer(str(e))}
    if not found:
        return None
    peers = {}
    try:
        if store is not None:  # every rank's key in a few round trips, not two per rank
            published = present_values(store, [f"{_PEERS}{rank}" for rank in range(world_size)])
            peers = {
                rank: json.loads(published[f"{_PEERS}{rank}"])
                for rank in range(world_size)
                if f"{_PEERS}{rank}" in published
            }
    except Exception as err:  # noqa: BLE001 - the store's host may be the peer that died
        return (
            f"{_NOTE_HEAD}a peer at {', '.join(sorted(found))} is gone (its process died or its host is "
            f"unreachable); the job's store is unreachable too ({type(err).__name__}), so its rank is unknown"
        )
    named, several = [], False
    for address in sorted(found):
        ranks = sorted(r for r, p in peers.items() if p.get("address") == address)
        hosts = sorted({peers[r]["host"] for r in ranks})
        nodes = sorted({peers[r]["node_rank"] for r in ranks})
        several = several or len(ranks) > 1
        named.append(f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}")
        named[-1] += (
            f" (node rank {', '.join(map(str, nodes))}, host {', '.join(hosts)}, address {address})"
            if ranks
            else f" at address {address} (no published rank has that address)"
        )
    gone = (
        "are gone (their processes died or their host is unreachable)"
        if several or len(named) > 1
        else "is gone (its process died or its host is unreachable)"
    )
    return (
        f"{_NOTE_HEAD}{'; '.join(named)} {gone} and the collective this rank was in cannot complete. Check that "
        f"node's logs (OOM-killer, signals)."
    )


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def name_lost_peer(error: BaseException, world_size: int) -> Optional[str]:
    """Put :func:`lost_peer_note` in front of ``error``'s message (its own text is kept); returns the note."""
    try:
        store = default_store() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a group without a store: the address alone is named
        store = None
    note = lost_peer_note(error, store, world_size)
    if note and str(error).startswith(_NOTE_HEAD):
        return note  # named already, by a guard further in (a barrier inside a broadcast, the forward in a step)
    if note and error.args and isinstance(error.args[0], str):
        error.args = (f"{note}\n\n{error.args[0]}", *error.args[1:])
    return note


class LostPeer:
    """Whether a collective of this run failed because a peer died, for both adapters: :meth:`check` names the lost
    peer on an error (:func:`name_lost_peer`) and logs it; :attr:`lost` then tells teardown to skip its agreement
    with the others (it would only fail again on the lost peer and raise its own error over this one)."""

    def __init__(self) -> None:
        self.lost = False

    def check(self, error: BaseException, world_size: Optional[int] = None) -> Optional[str]:
        """Name the lost peer on ``error`` if it is a dead peer's gloo error (``None`` when it is not)."""
        if world_size is None:  # (the forward's guard, in the precision plugin, does not know it)
            try:
                world_size = dist.get_world_size()
            except Exception:  # noqa: BLE001 - no process group: only rank 0 can be looked up
                world_size = 1
        note = name_lost_peer(error, world_size)
        if note:
            if not self.lost:
                log.error(note)
            self.lost = True
        return note

    @contextmanager
    def naming(self, world_size: Optional[int] = None) -> Iterator[None]:
        """Around a call whose collectives may meet a dead peer (a frameworks' hook with no exception hook of its
        own): its error, re-raised, names the peer."""
        try:
            yield
        except Exception as err:
            self.check(err, world_size)
            raise
