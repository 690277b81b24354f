"""A save never deletes what the user owns, refuses paths it cannot honour, and fails cleanly on a full disk."""

from __future__ import annotations

import ctypes
import os
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from lightning_zero.checkpoint import (
    CheckpointSaveError,
    atomic,
    load_sharded_checkpoint,
    remove_sharded_checkpoint,
    save_sharded_checkpoint,
    wait_for_pending_saves,
)
from tests.ranks import run_distributed

META = {"epoch": 1}


def tiny(value: float, numel: int = 16) -> dict:
    return {"state_dict": {"w": torch.full((numel,), value)}, "optimizer_states": {"step": torch.tensor(value)}}


def value_at(path) -> float:
    target = tiny(0.0)
    load_sharded_checkpoint(path, target, strict=False)
    return target["optimizer_states"]["step"].item()


def test_existing_directory_file_or_link_that_is_not_a_checkpoint_is_refused_and_kept(tmp_path):
    precious = tmp_path / "run.ckpt"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    single_file = tmp_path / "model.ckpt"
    torch.save({"w": 1}, single_file)
    other = tmp_path / "data"
    other.mkdir()
    (other / "x").write_text("x")
    link = tmp_path / "link.ckpt"
    os.symlink("data", link)
    for path in (precious, single_file, link):
        with pytest.raises(CheckpointSaveError, match="refusing|Refusing"):
            save_sharded_checkpoint(path, tiny(1.0), META)
        with pytest.raises(CheckpointSaveError, match="delete"):
            remove_sharded_checkpoint(path)
    assert (precious / "notes.txt").read_text() == "mine" and sorted(os.listdir(precious)) == ["notes.txt"]
    assert torch.load(single_file) == {"w": 1} and (other / "x").read_text() == "x" and os.path.islink(link)
    assert not any(name.startswith(".") for name in os.listdir(tmp_path)), "a refused save left files behind"
    # what a save may replace: an empty directory, a checkpoint, a symlink to one (the link, not its target)
    empty = tmp_path / "empty.ckpt"
    empty.mkdir()
    save_sharded_checkpoint(empty, tiny(1.0), META)
    os.symlink("empty.ckpt", tmp_path / "last.ckpt")
    save_sharded_checkpoint(tmp_path / "last.ckpt", tiny(2.0), META)
    assert not os.path.islink(tmp_path / "last.ckpt") and value_at(tmp_path / "last.ckpt") == 2.0
    assert value_at(empty) == 1.0
    remove_sharded_checkpoint(tmp_path / "last.ckpt")
    assert not os.path.lexists(tmp_path / "last.ckpt")


def test_a_stranger_at_the_partial_path_is_not_deleted(tmp_path):
    stranger = tmp_path / ".x.ckpt.partial"
    stranger.mkdir()
    (stranger / "keep").write_text("k")
    with pytest.raises(CheckpointSaveError, match="not written by a lightning-zero save"):
        save_sharded_checkpoint(tmp_path / "x.ckpt", tiny(1.0), META)
    assert (stranger / "keep").read_text() == "k"


def _refused_worker(rank, world_size, path):
    with pytest.raises(CheckpointSaveError, match="not a lightning-zero checkpoint"):
        save_sharded_checkpoint(path, tiny(float(rank)), META)


def test_refusal_raises_on_every_rank(tmp_path):
    (tmp_path / "run.ckpt").mkdir()
    (tmp_path / "run.ckpt" / "notes.txt").write_text("mine")
    run_distributed(_refused_worker, 2, str(tmp_path / "run.ckpt"))  # a hang or a rank passing fails the test
    assert os.listdir(tmp_path / "run.ckpt") == ["notes.txt"]


@pytest.mark.parametrize("url", ["memory://bucket/x.ckpt", "s3://bucket/x.ckpt", "gs://b/x.ckpt"])
def test_remote_urls_are_refused_not_written_to_a_local_directory(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointSaveError, match="URL"):
        save_sharded_checkpoint(url, tiny(1.0), META)
    with pytest.raises(CheckpointSaveError, match="URL"):
        load_sharded_checkpoint(url, tiny(0.0))
    assert os.listdir(tmp_path) == []


def test_file_urls_are_local_paths(tmp_path):
    save_sharded_checkpoint(f"file://{tmp_path}/x.ckpt", tiny(3.0), META)
    assert value_at(tmp_path / "x.ckpt") == 3.0


# ------------------------------------------------------------------ node-local checkpoint directories


def _private_mount(target: str, size: str) -> None:
    """In this process only (a new mount namespace), hide ``target`` under an empty tmpfs: another "node"."""
    libc = ctypes.CDLL(None, use_errno=True)
    ms_rec, ms_private = 16384, 1 << 18
    if libc.unshare(0x00020000) != 0 or libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0:
        raise OSError(ctypes.get_errno(), "unshare/mount not permitted")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", target], check=True)


def _node_local_worker(rank, world_size, root):
    if rank == 1:
        _private_mount(root, "1m")
    with pytest.raises(CheckpointSaveError, match="not shared by all ranks"):
        save_sharded_checkpoint(os.path.join(root, "last.ckpt"), tiny(float(rank)), META)


def _can_unshare() -> bool:
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0 or not _can_unshare(), reason="needs root and mount namespaces")
def test_ranks_that_do_not_share_the_checkpoint_directory_are_refused(tmp_path):
    root = tmp_path / "ckpts"
    root.mkdir()
    run_distributed(_node_local_worker, 2, str(root))
    assert os.listdir(root) == [], "nothing may be written when the directory is node-local"


# ------------------------------------------------------------------ disk full


def _fill_disk_before_shards(directory: str):
    def hook(step: str) -> None:
        if step == "before_shards" and (not dist.is_initialized() or dist.get_rank() == 0):
            stats = os.statvfs(directory)
            with open(os.path.join(directory, "filler"), "wb") as file:  # another job fills the disk meanwhile
                file.write(b"\0" * max(stats.f_bavail * stats.f_frsize - 8192, 0))

    return hook


def _disk_full_worker(rank, world_size, disk, async_save):
    path = os.path.join(disk, "last.ckpt")
    save_sharded_checkpoint(path, tiny(1.0), META)
    # refused up front: 2 ranks x 4 MiB of shards on a 4 MiB disk
    with pytest.raises(CheckpointSaveError, match=r"not enough space .* needs about \d+ bytes .* \d+ bytes free"):
        save_sharded_checkpoint(path, tiny(2.0, numel=1 << 20), META, async_save=async_save)
    # fits at the check, then the disk fills up under the write
    atomic.FAULT_HOOK = _fill_disk_before_shards(disk)
    with pytest.raises(CheckpointSaveError, match=r"no space left .* needs about \d+ bytes, \d+ bytes free"):
        save_sharded_checkpoint(path, tiny(3.0, numel=1 << 16), META, async_save=async_save)
        wait_for_pending_saves()
    atomic.FAULT_HOOK = None
    assert value_at(path) == 1.0, "the previous checkpoint must stay intact"  # collective: every rank loads
    assert sorted(os.listdir(disk)) == ["filler", "last.ckpt"], "the partial directory must be removed"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_says_so_removes_the_partial_and_keeps_the_previous(small_disk, async_save):
    run_distributed(_disk_full_worker, 2, str(small_disk), async_save)


def test_ds_config_node_local_storage_is_refused_before_training():
    from lightning_zero.ds_config import translate_ds_config

    with pytest.raises(Exception, match="use_node_local_storage"):
        translate_ds_config({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"use_node_local_storage": True}})
    translate_ds_config({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"use_node_local_storage": False}})


def _async_failure_worker(rank, world_size, root):
    import errno

    def hook(step):
        if step == "after_info" and rank == 0:
            raise OSError(errno.EIO, "injected I/O error")

    path = os.path.join(root, "a.ckpt")
    save_sharded_checkpoint(path, tiny(1.0), META)
    atomic.FAULT_HOOK = hook
    save_sharded_checkpoint(path, tiny(2.0), META, async_save=True)
    if rank == 0:  # as ConsolidateCallback does mid-training: rank 0 alone waits (and learns of the failure)
        with pytest.raises(CheckpointSaveError, match="I/O error"):
            wait_for_pending_saves(barrier=False)
    wait_for_pending_saves()  # collective: must not hang although only rank 1 still has the save pending
    save_sharded_checkpoint(path, tiny(3.0), META, async_save=True)
    # only rank 0's finalisation failed; the next save reports it on every rank before writing anything
    with pytest.raises(CheckpointSaveError, match="I/O error"):
        save_sharded_checkpoint(path, tiny(4.0), META)
    atomic.FAULT_HOOK = None
    assert value_at(path) == 1.0 and not os.path.exists(atomic.partial_dir(path))


def test_a_failed_async_save_raises_on_every_rank_without_hanging(tmp_path):
    run_distributed(_async_failure_worker, 2, str(tmp_path))


def _control_group_timeout_worker(rank, world_size):
    from datetime import timedelta

    from lightning_zero.checkpoint import save_guards
    from lightning_zero.checkpoint.save_guards import control_group
    from lightning_zero.distributed.group_timeout import set_package_group_timeout

    set_package_group_timeout(timedelta(seconds=2))  # what start_process_group records from ZeroStrategy(timeout=)
    # The default group serves CPU tensors here, so the control group would be that group (whose timeout is the
    # user's by construction); a world without a gloo CPU backend (NCCL alone) is where a group of the package's own
    # is made, and that one must take the user's timeout.
    save_guards.backend_serving = lambda device_type, group=None: None
    try:
        group = control_group(None)
        if rank == 0:  # rank 1 never joins: the agreement must fail after the user's timeout, not torch's 30 minutes
            start = time.monotonic()
            with pytest.raises(RuntimeError):
                dist.all_gather_object([None] * world_size, rank, group=group)
            elapsed = time.monotonic() - start
            assert elapsed < 10, f"the control group waited {elapsed:.0f} s for a hung peer"
        else:
            time.sleep(12)  # then leaves: without the timeout, rank 0's wait ends only with this exit (12 s)
    finally:
        set_package_group_timeout(None)
    os._exit(0)  # the groups are broken now; their teardown is not this test's subject


def test_the_packages_own_groups_take_the_users_timeout():
    # With ZeroStrategy(timeout=30 s) and a rank hung in training_step, teardown waited for pending saves
    # on the save control group, created with torch's 30-minute default, until the hang watchdog ended the job.
    run_distributed(_control_group_timeout_worker, 2)


def _sockets() -> int:
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # (the directory's own descriptor, closed by now)
            pass
    return sum(name.startswith("socket:") for name in names)


def _no_extra_group_worker(rank, world_size, root):
    from lightning_zero.checkpoint.save_guards import broadcast_object, control_group

    made = []
    original = dist.new_group

    def counting(*args, **kwargs):
        made.append(kwargs.get("backend"))
        return original(*args, **kwargs)

    dist.new_group = counting
    before = _sockets()
    try:
        path = os.path.join(root, "run.ckpt")
        save_sharded_checkpoint(path, tiny(1.0), META)
        assert broadcast_object(f"from rank {rank}", src=1) == "from rank 1"
        assert value_at(path) == 1.0
        group = control_group(None)
    finally:
        dist.new_group = original
    # A save's verdicts, a broadcast and a load ride the default group's gloo: a second world-sized gloo group would
    # connect another full mesh, N sockets and 3 threads more on every rank.
    assert made == [] and group is dist.group.WORLD, made
    assert _sockets() == before, (before, _sockets())


def test_a_save_connects_no_second_gloo_mesh(tmp_path):
    run_distributed(_no_extra_group_worker, 2, str(tmp_path))


def test_probes_of_killed_saves_are_removed_by_later_saves(tmp_path):
    # Kills (and a full disk) left hidden .lightning-zero-probe-* files that no later save removed
    from lightning_zero.checkpoint.save_guards import PROBE_PREFIX

    path = tmp_path / "last.ckpt"
    for name in ("last.ckpt-r0", "epoch=1.ckpt-r3", "a1b2c3d4"):  # this name, another name and world, an old-style one
        (tmp_path / f"{PROBE_PREFIX}{name}").write_text("0")
    save_sharded_checkpoint(str(path), tiny(1.0), META)
    assert value_at(path) == 1.0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(PROBE_PREFIX)] == []


def _space_count_worker(rank, world_size, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_zero.checkpoint.save_guards import all_gather, control_group, shard_bytes

    mesh = init_device_mesh("cpu", (world_size,))
    numel = 100_000
    state = {"replicated": torch.zeros(numel), "sharded": distribute_tensor(torch.zeros(numel), mesh, [Shard(0)])}
    counted = sum(all_gather(shard_bytes(state, writes_replicas=rank == 0), control_group(None)))
    assert counted == 2 * 4 * numel, counted  # one copy of each: what DCP writes, not a replica per rank
    path = os.path.join(root, "run.ckpt")
    save_sharded_checkpoint(path, state, META)
    written = sum(f.stat().st_size for f in os.scandir(path) if f.name.endswith(".distcp"))
    assert counted <= written < 1.02 * counted, (counted, written)  # DCP's headers are a few KB


def test_the_space_check_counts_a_replicated_tensor_once_as_dcp_writes_it(tmp_path):
    """A stage-0/1 save on W ranks was counted as W copies of the replicated weights: on 8 ranks a save the disk
    could hold was refused for eight times the space it needed."""
    run_distributed(_space_count_worker, 2, str(tmp_path))
