"""A peer that dies: the survivors' error names the lost rank and host, and a restarted torchrun
job resumes bit-exact. The full campaign is ``python -m tests.reliability.peer_death_trials --trials 20``."""

import json
import re
import time

import pytest
import torch
import torch.distributed as dist

from lightning_zero.diagnostics.peers import lost_peer_note, name_lost_peer, publish_identity
from lightning_zero.diagnostics.watchdog import HANG_EXIT_CODE, HangWatchdog

GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[10.77.5.2]:4253. This is typically caused by a remote worker crashing."
)
GLOO_RESET = "[pair.cc:537] Read error [10.77.5.2]:25295: Connection reset by peer. This is typically caused by"


def _store_with_two_nodes(monkeypatch, ranks_per_node=1):
    store = dist.HashStore()
    for rank in range(2 * ranks_per_node):
        node = rank // ranks_per_node
        address, host = [("10.77.5.1", "alpha"), ("10.77.5.2", "beta")][node]
        monkeypatch.setattr("lightning_zero.diagnostics.peers.gloo_address", lambda a=address: a)
        monkeypatch.setattr("socket.gethostname", lambda h=host: h)
        publish_identity(store, rank, node_rank=node)
    return store


def test_a_gloo_error_from_a_dead_peer_names_its_rank_and_host(monkeypatch):
    store = _store_with_two_nodes(monkeypatch)
    for text in (GLOO_CLOSED, GLOO_RESET):
        note = lost_peer_note(RuntimeError(text), store, 2)
        assert "lost peer: rank 1 (node rank 1, host beta, address 10.77.5.2) is gone" in note, note
    # the peer error raised while handling another (teardown after a failed step) is found through the chain
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as first:
            raise ValueError("teardown failed too") from first
    except ValueError as err:
        assert "rank 1" in lost_peer_note(err, store, 2)
    assert lost_peer_note(RuntimeError("CUDA out of memory"), store, 2) is None
    # an address no rank published, and a store that is gone with the peer: the address is still named
    assert "at address 10.9.9.9 (no published rank" in lost_peer_note(
        RuntimeError(GLOO_CLOSED.replace("10.77.5.2", "10.9.9.9")), store, 2
    )

    class GoneStore:
        def check(self, keys):
            raise ConnectionError("store host died")

    assert "peer at 10.77.5.2 is gone" in lost_peer_note(RuntimeError(GLOO_CLOSED), GoneStore(), 2)


def test_several_ranks_on_the_lost_host_are_named_in_the_plural(monkeypatch):
    store = _store_with_two_nodes(monkeypatch, ranks_per_node=2)
    note = lost_peer_note(RuntimeError(GLOO_CLOSED), store, 4)
    assert (
        "lost peer: ranks [2, 3] (node rank 1, host beta, address 10.77.5.2) are gone (their processes died or "
        "their host is unreachable)" in note
    ), note


def test_the_note_goes_in_front_of_the_error_message(monkeypatch):
    store = _store_with_two_nodes(monkeypatch)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    err = RuntimeError(GLOO_CLOSED)
    note = name_lost_peer(err, 2)
    assert str(err).startswith(note) and str(err).endswith(GLOO_CLOSED)
    name_lost_peer(err, 2)  # a second guard on the way out (a barrier inside a broadcast) does not add it again
    assert str(err).count("lost peer") == 1


def test_the_trials_check_the_note_names_every_lost_rank():
    from tests.reliability.peer_death_trials import Mode, _expected_resume, _named

    plural = "lost peer: ranks [2, 3] (node rank 1, host vm, address 10.7.7.2) are gone"
    assert _named(plural, [2, 3], ["10.7.7.2"]) and not _named(plural, [1], ["10.7.7.2"])
    assert _named("Unreachable: rank 1 (node rank 1, host vm, address 10.7.7.2)", [1], ["10.7.7.2"])
    assert not _named("Unreachable: rank 12 (node rank 1, host vm, address 10.7.7.2)", [1], ["10.7.7.2"])
    assert _expected_resume("save", 5, Mode(fabric=True)) == "step=4"
    assert _expected_resume("forward", 5, Mode()) == "epoch=1-step=4.ckpt"
    assert _expected_resume("forward", 1, Mode(fabric=True)) is None


def _fabric_strategy(monkeypatch):
    """A Fabric ZeroStrategy of a 2-rank job whose default store holds both ranks' identities (no process group)."""
    from lightning.fabric.accelerators import CPUAccelerator
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_zero.fabric import ZeroStrategy

    store = _store_with_two_nodes(monkeypatch)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(ZeroStrategy, "world_size", property(lambda self: 2))
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    return ZeroStrategy(
        stage=2,
        hang_timeout=None,  # (the watchdog would start on the patched dist)
        accelerator=CPUAccelerator(),
        cluster_environment=LightningEnvironment(),
    )


def _gloo_failure(*args, **kwargs):
    raise RuntimeError(GLOO_RESET)


def test_fabric_names_the_lost_peer_where_its_collectives_fail(monkeypatch):
    """Fabric has no exception hook: backward, optimizer.step, the forward and the strategy's collectives name the
    lost peer on the error the user's loop sees."""
    from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer

    import lightning_zero.fabric.fabric_strategy as fabric_strategy

    named = re.escape("lost peer: rank 1 (node rank 1, host beta, address 10.77.5.2) is gone")
    strategy = _fabric_strategy(monkeypatch)
    weight = torch.ones(2, requires_grad=True)
    loss = (weight * 2).sum()
    weight.register_hook(_gloo_failure)  # as FSDP2's post-backward reduce-scatter failing inside autograd
    with pytest.raises(RuntimeError, match=named):
        strategy.backward(loss, None)
    assert strategy.lost_peer.lost

    optimizer = torch.optim.SGD([weight], lr=0.1)
    optimizer.step = _gloo_failure
    with pytest.raises(RuntimeError, match=named):
        _FabricOptimizer(optimizer, strategy).step()

    class Dying(torch.nn.Module):
        def forward(self, x):
            _gloo_failure()

    with pytest.raises(RuntimeError, match=named):
        _FabricModule(Dying(), strategy)(torch.ones(1))

    monkeypatch.setattr(fabric_strategy, "_distributed_is_initialized", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda *a: "cpu:gloo,cuda:gloo")
    monkeypatch.setattr(dist, "barrier", _gloo_failure)
    monkeypatch.setattr(fabric_strategy, "broadcast_object", _gloo_failure)
    monkeypatch.setattr(fabric_strategy, "_sync_ddp_if_available", _gloo_failure)
    for collective in (strategy.barrier, lambda: strategy.broadcast("path"), lambda: strategy.all_reduce(weight)):
        with pytest.raises(RuntimeError, match=named):
            collective()


def test_fabric_teardown_skips_the_pending_save_agreement_after_a_lost_peer(monkeypatch):
    import lightning_zero.adapters.runtime_steps as runtime_steps  # both adapters' teardown waits there

    barriers = []
    monkeypatch.setattr(runtime_steps, "_distributed_is_initialized", lambda: True)
    monkeypatch.setattr(runtime_steps, "wait_for_pending_saves", lambda barrier: barriers.append(barrier))
    healthy = _fabric_strategy(monkeypatch)
    healthy.teardown()
    strategy = _fabric_strategy(monkeypatch)
    with pytest.raises(RuntimeError):
        with strategy.precision.forward_context():  # the forward meets the dead peer
            _gloo_failure()
    strategy.teardown()
    assert barriers == [True, False]  # with a lost peer each rank waits for its own saves only


def test_trainer_on_exception_names_the_lost_peer_and_teardown_skips_the_agreement(monkeypatch):
    from lightning_zero import ZeroStrategy

    store = _store_with_two_nodes(monkeypatch)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(ZeroStrategy, "world_size", property(lambda self: 2))
    strategy = ZeroStrategy(stage=2)
    err = RuntimeError(GLOO_CLOSED)
    strategy.on_exception(err)
    assert str(err).startswith("lightning-zero: lost peer: rank 1 (") and strategy.lost_peer.lost


def _wait_for_abort(dog, exits, seconds=15.0):
    deadline = time.monotonic() + seconds
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()


def test_the_watchdog_names_a_rank_whose_heartbeat_stopped():
    """A partition: the cut-off rank's counters stay where they were (the same step as this rank's), so only its
    stopped heartbeat tells it from a rank that waits in the same collective."""
    store = dist.HashStore()
    store.set("hb/1", "2|training_step 3: backward")
    store.add("alive/1", 7)  # it beat until the cut, then never again
    store.set("id/1", json.dumps({"host": "beta", "address": "10.77.5.2", "node_rank": 1, "pid": 9}))
    exits = []
    dog = HangWatchdog(store, rank=0, world_size=2, timeout=0.3, poll_interval=0.05, grace=0.2, on_exit=exits.append)
    dog.arm("training_step 3")
    dog.beat("training_step 3: backward")
    dog.start()
    _wait_for_abort(dog, exits)
    assert exits == [HANG_EXIT_CODE]
    assert (
        "Unreachable: rank 1 (node rank 1, host beta, address 10.77.5.2): its heartbeat stopped" in dog.hang_message
    ), dog.hang_message


def test_ranks_that_time_out_together_do_not_name_each_other_unreachable():
    """Every rank past its timeout measures the others' heartbeats at about the same moment: a watchdog thread that
    only slept while measuring looked stopped to the other (a rank hung in a save was reported "unreachable")."""
    import threading

    store = dist.HashStore()
    dogs = [
        HangWatchdog(store, rank=r, world_size=2, timeout=0.3, poll_interval=0.05, on_exit=lambda code: None)
        for r in range(2)
    ]
    for rank in range(2):
        store.add(f"alive/{rank}", 1)
    found = {}
    threads = [threading.Thread(target=lambda d=d: found.setdefault(d.rank, d._stopped_heartbeats({}))) for d in dogs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found == {0: {}, 1: {}}, found


@pytest.mark.parametrize("cut", ["raises", "blocks"])
def test_the_watchdog_names_the_store_host_when_the_store_is_cut_off(cut):
    """A survivor on the far side of a partition from the store (rank 0's node) names that node, and exits without
    waiting for acknowledgements it cannot read; also when the store call never returns (a cut link: no RST)."""

    class CutStore:
        def __init__(self):
            self.inner, self.cut = dist.HashStore(), False

        def __getattr__(self, name):
            def call(*args):
                if self.cut and cut == "blocks":
                    time.sleep(3600)
                if self.cut:
                    raise RuntimeError("Socket Timeout")
                return getattr(self.inner, name)(*args)

            return call

    store = CutStore()
    store.inner.set("id/0", json.dumps({"host": "alpha", "address": "10.77.5.1", "node_rank": 0, "pid": 8}))
    exits = []
    dog = HangWatchdog(
        store,
        rank=1,
        world_size=2,
        timeout=0.3,
        poll_interval=0.05,
        grace=30,
        on_exit=exits.append,
        identity={"host": "beta", "address": "10.77.5.2", "node_rank": 1},
    )
    dog.arm("training_step 3")
    dog.start()
    time.sleep(0.2)  # a few polls: rank 0's identity is read while the store still answers
    store.cut = True
    started = time.monotonic()
    _wait_for_abort(dog, exits)
    assert exits == [HANG_EXIT_CODE] and time.monotonic() - started < 8  # not the 30 s grace
    assert (
        "rank 0 (node rank 0, host alpha, address 10.77.5.1), whose node hosts the store, died or is cut off"
        in dog.hang_message
    ), dog.hang_message


@pytest.mark.slow  # two torchrun agents, a kill and a restart
def test_a_node_killed_mid_step_is_named_and_the_restart_resumes_bit_exact(tmp_path):
    """One trial of the campaign (seed 0: node 1's rank killed in the forward of step 6 of 8); the uninterrupted
    reference runs on forked ranks (bit-equal to the two-host torchrun run, checked by hand), which is cheaper."""
    import torch

    from tests.ranks import run_distributed
    from tests.reliability.peer_death_job import reference_worker
    from tests.reliability.peer_death_trials import row, run_trials

    (tmp_path / "reference").mkdir()
    run_distributed(reference_worker, 2, str(tmp_path / "reference" / "final.pt"))
    reference = torch.load(tmp_path / "reference" / "final.pt", weights_only=True)
    results, where = run_trials(1, seed=0, base=tmp_path / "trials", reference=reference)
    assert results[0]["ok"], (where, row(results[0]), results[0]["messages"], results[0].get("tail"))
