"""NVMe offload (optimizer-state swapping): the I/O engine alone, the swapper's pipeline, parity with CPU offload
at 2 ranks, checkpoints across NVMe/CPU offload, and that swap files exist during training and are gone after."""

import copy
import errno
import os
import shutil

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.distributed.optimizer import get_sharding, shard_optimizer
from lightning_zero.offload import aio as aio_module
from lightning_zero.offload.aio import AioSettings, AsyncFileIO, SwapIOError, align_up, aligned_buffer
from lightning_zero.offload.nvme_config import NvmeConfig, nvme_config_from_arguments
from lightning_zero.offload.optimizer_swapper import SwappedOut, attach_swapper, detach_swapper, get_swapper
from lightning_zero.torch_compat import local_tensor as _local
from tests.lightning_models import RegressionModule, full_state, quiet_trainer, reference_weights
from tests.ranks import run_distributed

BATCH = 4
STEPS = 4


# ------------------------------------------------------------------ the I/O engine alone
@pytest.mark.parametrize(
    "settings",
    [
        AioSettings(block_size=4096, queue_depth=3, thread_count=2),
        AioSettings(single_submit=True, overlap_events=False),
        AioSettings(use_direct=False),
    ],
)
def test_engine_round_trips_aligned_buffers_at_offsets(tmp_path, settings):
    io = AsyncFileIO(settings)
    path = str(tmp_path / "swap.bin")
    io.open(path)
    first, second = aligned_buffer(10_000), aligned_buffer(3 * 4096)
    assert first.data_ptr() % 4096 == 0 and first.numel() == align_up(10_000)
    first.copy_(torch.randint(0, 256, (first.numel(),), dtype=torch.uint8))
    second.copy_(torch.randint(0, 256, (second.numel(),), dtype=torch.uint8))
    futures = [io.write(path, first, 0), io.write(path, second, first.numel())]
    assert [f.result() for f in futures] == [first.numel(), second.numel()]
    back = aligned_buffer(first.numel() + second.numel())
    io.read(path, back).result()
    io.close()
    assert torch.equal(back[: first.numel()], first) and torch.equal(back[first.numel() :], second)
    assert os.path.getsize(path) == first.numel() + second.numel()


@pytest.mark.parametrize(
    "settings, depth",
    [
        (AioSettings(block_size=4096, queue_depth=4, thread_count=1), 4),
        (AioSettings(block_size=4096, queue_depth=3, thread_count=2), 6),
        (AioSettings(block_size=4096, queue_depth=4, single_submit=True), 1),
    ],
)
def test_engine_keeps_thread_count_times_queue_depth_requests_in_flight(tmp_path, monkeypatch, settings, depth):
    import threading
    import time

    real_pwritev, lock, seen = os.pwritev, threading.Lock(), {"now": 0, "most": 0}

    def slow(fd, buffers, offset):
        with lock:
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        time.sleep(0.05)  # long enough for every free slot to issue its request meanwhile
        try:
            return real_pwritev(fd, buffers, offset)
        finally:
            with lock:
                seen["now"] -= 1

    monkeypatch.setattr(os, "pwritev", slow)
    io = AsyncFileIO(settings)
    path = str(tmp_path / "swap.bin")
    io.open(path)
    io.write(path, aligned_buffer(16 * 4096)).result()
    io.close()
    assert seen["most"] == depth, f"{seen['most']} requests were in flight at once, the settings ask for {depth}"
    assert io.stats["write"][0] == 16 * 4096 and io.throughput("write") > 0


def test_engine_returns_to_the_caller_before_a_transfer_larger_than_the_queue_completes(tmp_path, monkeypatch):
    """The swapped step computes while its reads and writes run: submitting a transfer of more requests than are
    in flight at once must not wait for the extra ones (they queue in the engine, not in the caller)."""
    import threading

    real_pwritev, release, done = os.pwritev, threading.Event(), []

    def held(fd, buffers, offset):
        release.wait(2)  # (bounded: a blocking caller would otherwise never set it)
        done.append(offset)
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", held)
    io = AsyncFileIO(AioSettings(block_size=4096, queue_depth=2, thread_count=1))
    path = str(tmp_path / "swap.bin")
    io.open(path)
    future = io.write(path, aligned_buffer(16 * 4096))  # 16 requests, 2 in flight
    returned_with = len(done)
    release.set()
    assert future.result() == 16 * 4096
    io.close()
    assert returned_with == 0, f"write() waited for {returned_with} of its requests before returning"


def test_engine_falls_back_to_buffered_io_with_a_warning_where_o_direct_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(aio_module.os, "open", no_direct)
    io = AsyncFileIO()
    with pytest.warns(UserWarning, match="O_DIRECT is not supported"):
        assert io.open(str(tmp_path / "a.bin")) is False
    buf = aligned_buffer(4096).fill_(7)
    io.write(str(tmp_path / "a.bin"), buf).result()
    io.close()
    with pytest.raises(SwapIOError, match="use_direct=True"):
        AsyncFileIO(AioSettings(use_direct=True)).open(str(tmp_path / "b.bin"))


def test_engine_reports_a_full_disk_naming_the_folder_and_bytes(tmp_path, monkeypatch):
    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(aio_module.os, "pwritev", full)
    io = AsyncFileIO()
    path = str(tmp_path / "full.bin")
    io.open(path)
    with pytest.raises(SwapIOError, match=rf"nvme_path \('{tmp_path}'\) is full \(8192 more bytes"):
        io.write(path, aligned_buffer(8192)).result()
    io.close()


# ------------------------------------------------------------------ configuration
def test_nvme_arguments_are_validated_before_any_process_group(tmp_path):
    with pytest.raises(ValueError, match="needs nvme_path"):
        ZeroStrategy(stage=2, offload="nvme")
    with pytest.raises(ValueError, match="needs nvme_path"):
        ZeroStrategy(stage=3, offload_optimizer="nvme", offload_params="cpu")
    with pytest.raises(ValueError, match="offload_params='nvme' .* needs nvme_path"):
        ZeroStrategy(stage=3, offload_optimizer="cpu", offload_params="nvme")
    with pytest.raises(ValueError, match="not an existing directory"):
        ZeroStrategy(stage=1, offload="nvme", nvme_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="need offload_optimizer='nvme'"):
        ZeroStrategy(stage=2, offload="cpu", nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="only apply to NVMe offload"):
        ZeroStrategy(stage=2, buffer_count=8)
    with pytest.raises(ValueError, match="at least 3"):
        ZeroStrategy(stage=2, offload="nvme", nvme_path=str(tmp_path), buffer_count=2)
    with pytest.raises(ValueError, match="max_in_cpu=10 only drives parameter swapping"):
        ZeroStrategy(stage=2, offload="nvme", nvme_path=str(tmp_path), max_in_cpu=10)
    with pytest.raises(ValueError, match="buffer_size=10 only drives parameter swapping"):
        ZeroStrategy(stage=3, offload_optimizer="nvme", offload_params="cpu", nvme_path=str(tmp_path), buffer_size=10)
    config = ZeroStrategy(stage=3, offload="nvme", nvme_path=str(tmp_path), max_in_cpu=10).zero_config
    assert (config.offload_optimizer, config.offload_params, config.nvme.max_in_cpu) == ("nvme", "nvme", 10)
    assert config.swaps_parameters and config.swaps_optimizer_states
    with pytest.raises(ValueError, match="unknown keys"):
        ZeroStrategy(stage=2, offload="nvme", nvme_path=str(tmp_path), aio={"queue_dept": 4})
    with pytest.raises(ValueError, match="without offload_optimizer is not supported"):
        ZeroStrategy(stage=3, offload_params="cpu")
    with pytest.raises(ValueError, match="needs stage 3"):
        ZeroStrategy(stage=2, offload_params="cpu")
    with pytest.raises(ValueError, match="not both"):
        ZeroStrategy(stage=2, offload="cpu", offload_optimizer="cpu")
    strategy = ZeroStrategy(
        stage=3,
        offload_optimizer="nvme",
        offload_params="cpu",
        nvme_path=str(tmp_path),
        sub_group_size=1000,
        aio={"queue_depth": 2, "block_size": 65536},
    )
    config = strategy.zero_config
    assert (config.offload, config.offload_optimizer, config.offload_params) == ("nvme", "nvme", "cpu")
    assert config.nvme.sub_group_size == 1000 and config.nvme.aio.queue_depth == 2
    assert ZeroConfig(stage=1, offload="nvme", nvme=nvme_config_from_arguments(str(tmp_path))).swaps_optimizer_states


def test_registered_nvme_name_needs_an_nvme_path():
    with pytest.raises(ValueError, match="needs nvme_path"):
        Trainer(strategy="zero_stage_3_offload_nvme", accelerator="cpu", devices=1, logger=False)


# ------------------------------------------------------------------ the swapper alone
def test_swapped_step_pipelines_sub_groups_and_matches_the_plain_optimizer(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    swapper = attach_swapper(opt, NvmeConfig(str(tmp_path), sub_group_size=520, buffer_count=3))
    assert len(swapper.subgroups) >= 4
    events = []
    real_read, real_write = swapper.io.read, swapper.io.write
    swapper.io.read = lambda path, *a: events.append(("read", path[-5])) or real_read(path, *a)
    swapper.io.write = lambda path, *a: events.append(("write", path[-5])) or real_write(path, *a)
    base = type(opt).__bases__[0].step  # the class the swapped one derives from
    for step in range(3):
        x = torch.randn(8, 16)
        for net, optimizer in ((model, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            net(x).square().mean().backward()
            optimizer.step()
        if step == 0:
            events.clear()
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got, want), "swapping changed the optimizer's numbers"
    # Read-ahead: sub-group 1 is read before sub-group 0 is written back (its step happens in between).
    assert events.index(("read", "1")) < events.index(("write", "0")) < events.index(("read", "2"))
    assert swapper.peak_buffers <= 3, "host memory for swapped states must stay within buffer_count buffers"
    # Between steps the per-element states are on disk only, with the expected file sizes.
    state = opt.state[next(iter(model.parameters()))]
    assert isinstance(state["exp_avg"], SwappedOut) and torch.is_tensor(state["step"])
    for index, group in enumerate(swapper.subgroups):
        expected = sum(align_up(p.numel() * 4) * 2 for p in group)
        assert os.path.getsize(swapper.path(index)) >= expected - 4096
    saved = opt.state_dict()  # reads the states back
    assert torch.equal(saved["state"][0]["exp_avg"], ref_opt.state_dict()["state"][0]["exp_avg"])
    assert base is torch.optim.AdamW.step
    folder = swapper.run_folder
    detach_swapper(opt)
    assert not os.path.exists(folder) and type(opt) is torch.optim.AdamW
    assert torch.equal(
        opt.state[next(iter(model.parameters()))]["exp_avg_sq"],
        ref_opt.state[next(iter(reference.parameters()))]["exp_avg_sq"],
    )


def test_refuses_to_start_when_the_disk_has_less_free_space_than_the_states(tmp_path, monkeypatch):
    model = nn.Linear(100, 100)
    opt = torch.optim.Adam(model.parameters())
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(SwapIOError, match=rf"nvme_path='{tmp_path}' has 1000 bytes free .* need about \d+ bytes"):
        attach_swapper(opt, NvmeConfig(str(tmp_path)))


# ------------------------------------------------------------------ through the Trainer at 2 ranks
def _trainer(strategy, world_size, **kwargs):
    return quiet_trainer(strategy, world_size, **{"max_steps": STEPS, **kwargs})


class _SwapWitness(Callback):
    """After each step: the swap files exist with the bytes the layout says, and no state tensor is resident."""

    def __init__(self):
        self.checked = 0
        self.folder = None

    def on_train_batch_end(self, trainer, *args):
        swapper = get_swapper(trainer.optimizers[0])
        if swapper is None or not swapper.layouts:
            return
        self.folder = swapper.run_folder
        assert swapper.folder.startswith(swapper.nvme.nvme_path)
        for index, entries in swapper.layouts.items():
            assert os.path.getsize(swapper.path(index)) == align_up(entries[-1].offset + entries[-1].nbytes)
        for state in trainer.optimizers[0].state.values():
            assert all(isinstance(v, SwappedOut) for k, v in state.items() if k != "step")
        # the fp32 masters (stage 1: plain tensors; stages 2-3: DTensors over the shards) are on disk too: their
        # local tensors hold nothing between steps, so host memory for masters and states is the swap buffers
        sharding = get_sharding(trainer.optimizers[0])
        masters = sharding.masters.values()
        if sharding.config.offloads_optimizer_only:
            assert masters and all(_local(m).numel() == 0 for m in masters)
            assert all(_local(m).untyped_storage().nbytes() == 0 for m in masters)
        assert swapper.peak_buffers <= swapper.nvme.buffer_count
        # each buffer holds one sub-group: host memory for masters and states is buffer_count sub-groups at most
        largest = max(align_up(e[-1].offset + e[-1].nbytes) for e in swapper.layouts.values())
        assert swapper.peak_buffer_bytes <= largest
        self.checked += 1


NVME_CASES = [
    (1, dict(offload_optimizer="nvme")),
    (2, dict(offload="nvme")),
    (3, dict(offload_optimizer="nvme", offload_params="cpu")),
    (3, dict(offload_optimizer="nvme")),
]  # optimizer-only at stage 3: DTensor masters swapped


def _parity_worker(rank, world_size, root):
    for stage, nvme_kwargs in NVME_CASES:
        finals = {}
        for label, kwargs in (
            ("nvme", dict(nvme_kwargs, nvme_path=root, sub_group_size=64, buffer_count=3)),
            ("cpu", dict(offload="cpu")),
        ):
            torch.manual_seed(0)
            module = RegressionModule(batch_size=BATCH)
            witness = _SwapWitness()
            trainer = _trainer(
                ZeroStrategy(stage=stage, **kwargs),
                world_size,
                accumulate_grad_batches=2,
                gradient_clip_val=0.05,
                callbacks=[witness],
            )
            trainer.fit(module)
            finals[label] = full_state(module)
            if label == "nvme":
                # the masters are swapped from the start (the states join them after the first step); stage 3 with
                # the parameters in CPU memory has no masters, so its swap starts with the first step
                want = 2 * STEPS - 1 if nvme_kwargs.get("offload_params") == "cpu" else 2 * STEPS
                assert witness.checked == want, "the swap was not observed after every batch since the first step"
                assert not os.path.exists(witness.folder), "teardown must remove the run's swap folder"
                state = trainer.optimizers[0].state
                assert state and all(torch.is_tensor(v) for s in state.values() for v in s.values()), (
                    "after teardown the optimizer holds its states in memory again"
                )
        worst = max((finals["nvme"][k] - finals["cpu"][k]).abs().max().item() for k in finals["cpu"])
        assert worst <= 1e-6, f"stage {stage}: NVMe offload differs from CPU offload by {worst:.2e}"
        expected = reference_weights(STEPS, BATCH * world_size * 2, 2, 0.05)
        worst = max((finals["nvme"][k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-5, f"stage {stage}: NVMe offload differs from the single-process reference by {worst:.2e}"
    assert not [name for name in os.listdir(root) if name.startswith("lz-swap-")]


def test_nvme_offload_matches_cpu_offload_at_every_stage(tmp_path):
    run_distributed(_parity_worker, 2, str(tmp_path))


class _Boom(Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 2:
            raise RuntimeError("boom mid-training")


def _exception_worker(rank, world_size, root):
    witness = _SwapWitness()
    trainer = _trainer(ZeroStrategy(stage=1, offload="nvme", nvme_path=root), world_size, callbacks=[witness, _Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(RegressionModule(batch_size=BATCH))
    assert witness.checked == 2 and witness.folder is not None, "the swap must have happened before the exception"
    assert not os.path.exists(witness.folder), "an exception must not leave this rank's swap files behind"


def test_swap_files_are_removed_after_an_exception(tmp_path):
    run_distributed(_exception_worker, 2, str(tmp_path))
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ checkpoints across NVMe and CPU offload
def _offload_kwargs(kind, root):
    if kind == "cpu":
        return dict(offload="cpu")
    return dict(offload_optimizer="nvme", nvme_path=root, sub_group_size=64)


def _ckpt_trainer(stage, kind, world_size, epochs, root):
    from tests.strategies.test_strategy_checkpoint import STEPS_PER_EPOCH

    kwargs = _offload_kwargs(kind, root)
    if stage == 3:
        kwargs["offload_params"] = "cpu"
        kwargs.pop("offload", None)
        kwargs.setdefault("offload_optimizer", "cpu")
    return Trainer(
        strategy=ZeroStrategy(stage=stage, **kwargs),
        accelerator="cpu",
        devices=world_size,
        max_epochs=epochs,
        limit_train_batches=STEPS_PER_EPOCH,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
    )


class _SaveWhileSwapping(Callback):
    """Saves during fit, while the states are on disk (after teardown they are back in memory)."""

    def __init__(self, path):
        self.path = path

    def on_train_epoch_end(self, trainer, module):
        trainer.save_checkpoint(self.path)


def _ckpt_save_worker(rank, world_size, path, stage, kind, root):
    torch.manual_seed(0)
    trainer = _ckpt_trainer(stage, kind, world_size, 1, root)
    trainer.callbacks.append(_SaveWhileSwapping(path))
    trainer.fit(RegressionModule(batch_size=BATCH))


def _ckpt_resume_worker(rank, world_size, path, stage, kind, root, saved_world_size):
    from tests.strategies.test_strategy_checkpoint import STEPS_PER_EPOCH, _reference

    torch.manual_seed(123)  # every weight and state must come from the checkpoint
    module = RegressionModule(batch_size=BATCH * saved_world_size // world_size)
    trainer = _ckpt_trainer(stage, kind, world_size, 2, root)
    trainer.fit(module, ckpt_path=path)
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    expected = _reference(2, BATCH * saved_world_size)
    got = full_state(module)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"resumed under {kind} offload at stage {stage}: max abs diff {worst:.2e}"


# (saved stage, offload, world size) -> (resumed stage, offload, world size)
# the last two resume into swapped masters (plain at stage 1, DTensors at stage 2): they start empty, so the state
# initialisation before the load must give their module parameters the zero gradients
CKPT_CASES = [
    ((2, "nvme", 2), (3, "cpu", 1)),
    ((1, "cpu", 2), (3, "nvme", 2)),
    ((2, "cpu", 2), (1, "nvme", 2)),
    ((1, "cpu", 2), (2, "nvme", 2)),
]


@pytest.mark.parametrize(
    "saved,resumed",
    CKPT_CASES,
    ids=["nvme-s2x2-to-cpu-s3x1", "cpu-s1x2-to-nvme-s3x2", "cpu-s2x2-to-nvme-s1x2", "cpu-s1x2-to-nvme-s2x2"],
)
def test_checkpoint_moves_between_nvme_and_cpu_offload(tmp_path, saved, resumed):
    root = str(tmp_path)
    path = str(tmp_path / "run.ckpt")
    run_distributed(_ckpt_save_worker, saved[2], path, saved[0], saved[1], root)
    run_distributed(_ckpt_resume_worker, resumed[2], path, resumed[0], resumed[1], root, saved[2])
    assert not [name for name in os.listdir(root) if name.startswith("lz-swap-")]


# ------------------------------------------------------------------ ds_config translation
def _nvme_config(root, **zero):
    return {
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 2048,
            "offload_optimizer": {"device": "nvme", "nvme_path": root, "buffer_count": 6},
            "offload_param": {"device": "cpu"},
            **zero,
        },
        "aio": {
            "block_size": 262144,
            "queue_depth": 4,
            "intra_op_parallelism": 2,
            "single_submit": True,
            "overlap_events": False,
        },
    }


def test_ds_config_nvme_sections_and_aio_translate_to_the_strategy_arguments(tmp_path):
    from lightning_zero.ds_config import DeepSpeedConfigWarning, translate_ds_config

    config = ZeroStrategy(config=_nvme_config(str(tmp_path))).zero_config
    assert (config.offload_optimizer, config.offload_params) == ("nvme", "cpu")
    assert (config.nvme.nvme_path, config.nvme.buffer_count, config.nvme.sub_group_size) == (str(tmp_path), 6, 2048)
    assert config.nvme.aio == AioSettings(
        block_size=262144, queue_depth=4, thread_count=2, single_submit=True, overlap_events=False
    )
    notes = dict(translate_ds_config(_nvme_config(str(tmp_path))).notes)
    assert notes["zero_optimization.sub_group_size"].startswith("-> sub_group_size")
    assert notes["zero_optimization.offload_optimizer.nvme_path"] == "-> nvme_path"
    # an explicit non-NVMe offload wins over the config, and the config's NVMe knobs go with its device
    assert ZeroStrategy(config=_nvme_config(str(tmp_path)), offload="cpu").zero_config.nvme is None
    # the parameter section on NVMe: parameter swapping with its own knobs, under the same nvme_path
    both = _nvme_config(
        str(tmp_path),
        offload_param={"device": "nvme", "nvme_path": str(tmp_path), "buffer_size": 1e6, "max_in_cpu": 5e6},
    )
    config = ZeroStrategy(config=both).zero_config
    assert (config.offload_optimizer, config.offload_params) == ("nvme", "nvme")
    assert (config.nvme.buffer_size, config.nvme.max_in_cpu, config.nvme.buffer_count) == (10**6, 5 * 10**6, 6)
    notes = dict(translate_ds_config(both).notes)
    assert notes["zero_optimization.offload_param.max_in_cpu"].startswith("-> max_in_cpu")
    assert notes["zero_optimization.offload_param.buffer_count"].startswith("no effect")  # 5 (default) vs 6
    # refused, each naming what: two NVMe paths, a missing nvme_path, GPUDirect Storage
    with pytest.raises(Exception, match="differ"):
        ZeroStrategy(config=_nvme_config(str(tmp_path), offload_param={"device": "nvme", "nvme_path": "/x"}))
    missing = _nvme_config(str(tmp_path))
    del missing["zero_optimization"]["offload_optimizer"]["nvme_path"]
    with pytest.raises(Exception, match="nvme_path is missing"):
        ZeroStrategy(config=missing)
    gds = _nvme_config(str(tmp_path))
    gds["aio"]["use_gds"] = True
    with pytest.raises(Exception, match="use_gds"):
        ZeroStrategy(config=gds)
    cpu_only = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "aio": {"queue_depth": 2}}
    with pytest.warns(DeepSpeedConfigWarning, match=r"aio\.queue_depth=2"):  # DeepSpeed ignores it too: said by name
        notes = dict(translate_ds_config(cpu_only).notes)
    assert notes["aio.queue_depth"].startswith("no effect")


# ------------------------------------------------------------------ estimator
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_estimator_reports_nvme_bytes_and_the_bounded_cpu_peak(stage):
    from lightning_zero.estimate.model_states import estimate_model_states_memory

    params, ranks = 7_000_000, 2
    cpu = estimate_model_states_memory(params, stage, ranks, offload="cpu")
    nvme = estimate_model_states_memory(
        params,
        stage,
        ranks,
        offload="nvme",
        sub_group_size=100_000,
        buffer_count=4,
        max_in_cpu=500_000,
        buffer_size=10_000,
        largest_unit_params=100_000,
    )
    if stage in (1, 2):  # the fp32 masters are swapped too; their gradients exist for one sub-group at a time
        assert nvme.nvme == params * (8 + 4) // ranks and cpu.nvme == 0
        assert nvme.cpu.total == cpu.cpu.total - nvme.nvme - params * 4 // ranks
        assert nvme.cpu_peak == nvme.cpu.total + 4 * 100_000 * 12 + 100_000 * 4
    else:
        # at stage 3 the fp32 parameter shards are on disk too; at the peak max_in_cpu of them kept, the units in use
        # (two of the largest, 100_000 parameters each, sharded over the ranks) and the staging buffers
        shards = params * 4 // ranks if stage == 3 else 0
        assert nvme.nvme == params * 8 // ranks + shards and cpu.nvme == 0
        assert nvme.cpu.total == cpu.cpu.total - nvme.nvme
        swapped_params_peak = (500_000 + 2 * 100_000 // ranks + 4 * 10_000) * 4 if stage == 3 else 0
        assert nvme.cpu_peak == nvme.cpu.total + 4 * 100_000 * 8 + swapped_params_peak
    assert nvme.accelerator == cpu.accelerator
    assert ("nvme (GiB)", f"{nvme.nvme / 1024**3:.2f}") in nvme.as_table()


def test_a_parameter_that_starts_training_later_joins_its_swapped_sub_group_exactly(tmp_path):
    # The late parameter's new states shift the sub-group's file layout; its buffer (a larger one, recycled from
    # the big sub-group) is reused, so states must not be copied over states not yet moved.
    torch.manual_seed(0)
    first, late, last, big = (torch.randn(n, requires_grad=True) for n in (300, 300, 300, 3000))
    ours = (first, late, last, big)
    reference = [t.detach().clone().requires_grad_() for t in ours]
    opt = torch.optim.Adam(ours, lr=0.1)
    ref_opt = torch.optim.Adam(reference, lr=0.1)
    swapper = attach_swapper(opt, NvmeConfig(str(tmp_path), sub_group_size=1000, buffer_count=3))
    assert [len(g) for g in swapper.subgroups] == [3, 1]
    for step in range(4):
        swapper._free.sort(key=lambda buf: -buf.numel())  # largest free buffer first: the small group gets it
        for params, optimizer in ((ours, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            used = params if step >= 2 else (params[0], params[2], params[3])  # `late` trains from step 2 on
            sum((p * (i + step + 1.0)).square().sum() for i, p in enumerate(used)).backward()
            optimizer.step()
    for got, want in zip(ours, reference):
        assert torch.equal(got, want)
    detach_swapper(opt)


def test_a_full_disk_mid_step_names_nvme_path_and_teardown_still_removes_the_files(tmp_path, monkeypatch):
    model = nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    swapper = attach_swapper(opt, NvmeConfig(str(tmp_path)))
    model(torch.randn(2, 64)).sum().backward()
    opt.step()

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(aio_module.os, "pwritev", full)
    with pytest.raises(SwapIOError, match=rf"nvme_path \('{swapper.folder}'\) is full"):
        opt.step()
    monkeypatch.undo()
    detach_swapper(opt)  # the states of the last complete write are read back
    assert not os.path.exists(swapper.run_folder)
    assert all(torch.is_tensor(v) for state in opt.state.values() for v in state.values())


def _ds_config_worker(rank, world_size, root):
    config = {
        "zero_optimization": {
            "stage": 2,
            "sub_group_size": 100,
            "offload_optimizer": {"device": "nvme", "nvme_path": root, "buffer_count": 3},
        },
        "aio": {"queue_depth": 2, "thread_count": 2},
    }
    torch.manual_seed(0)
    module = RegressionModule(batch_size=BATCH)
    witness = _SwapWitness()
    trainer = _trainer(ZeroStrategy(config=config), world_size, callbacks=[witness])
    trainer.fit(module)
    assert witness.checked == STEPS
    expected = reference_weights(STEPS, BATCH * world_size)
    got = full_state(module)
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5


def test_a_ds_config_with_nvme_optimizer_offload_trains(tmp_path):
    run_distributed(_ds_config_worker, 2, str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_layout_of_the_same_length_with_another_parameter_is_repacked(tmp_path):
    # One parameter's state is dropped (as a resume does for states the checkpoint lacks) while another one starts:
    # the sub-group's layout has as many entries as before, naming another parameter.
    torch.manual_seed(0)
    a, b = torch.randn(50, requires_grad=True), torch.randn(50, requires_grad=True)
    opt = torch.optim.Adam([a, b], lr=0.1)
    attach_swapper(opt, NvmeConfig(str(tmp_path), sub_group_size=1000))
    a.grad = torch.ones(50)
    opt.step()
    opt.state.pop(a)
    a.grad, b.grad = None, torch.ones(50)
    opt.step()
    assert isinstance(opt.state[b]["exp_avg"], SwappedOut) and a not in opt.state
    detach_swapper(opt)
    assert torch.allclose(opt.state[b]["exp_avg"], torch.full((50,), 0.1))


def _stage1_pair(tmp_path, sub_group_size=300, buffer_count=3):
    """The same model and AdamW twice: stage-1 NVMe offload and stage-1 CPU offload (one process, no group)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 4))
    reference = copy.deepcopy(model)
    nvme = NvmeConfig(str(tmp_path), sub_group_size=sub_group_size, buffer_count=buffer_count)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    sharding = shard_optimizer(opt, ZeroConfig(stage=1, offload_optimizer="nvme", nvme=nvme))
    shard_optimizer(ref_opt, ZeroConfig(stage=1, offload="cpu"))
    return model, reference, opt, ref_opt, sharding


def _train(pairs, steps):
    for _ in range(steps):
        x = torch.randn(8, 16)
        for net, optimizer in pairs:
            net(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()


def test_stage1_fp32_masters_live_in_the_swap_files_and_match_cpu_offload(tmp_path):
    model, reference, opt, ref_opt, sharding = _stage1_pair(tmp_path)
    swapper = sharding.swapper
    assert sharding.swaps_masters() and len(swapper.subgroups) >= 3
    # Written at attach, one sub-group at a time: never all masters in memory.
    assert all(m.numel() == 0 for m in sharding.masters.values()) and swapper.peak_buffers <= 3
    _train([(model, opt), (reference, ref_opt)], 4)
    for got, want in zip(model.parameters(), reference.parameters()):
        assert (got - want).abs().max().item() <= 1e-6, "NVMe masters changed the numbers of CPU offload"
    # Between steps the masters hold nothing in memory; their bytes are in the files, equal to the module's values.
    largest = 0
    for index, entries in swapper.layouts.items():
        with open(swapper.path(index), "rb") as handle:
            data = torch.frombuffer(bytearray(handle.read()), dtype=torch.uint8)
        largest = max(largest, len(data))
        masters = [e for e in entries if e.key == "__master__"]
        assert len(masters) == len(swapper.subgroups[index])
        for entry in masters:
            assert entry.param.numel() == 0
            stored = data[entry.offset : entry.offset + entry.nbytes].view(torch.float32)
            module_param = swapper.companions[id(entry.param)]
            assert torch.equal(stored, module_param.detach().reshape(-1)), "the master's bytes are not in its file"
        # masters + AdamW's two moments: 12 bytes per element of the sub-group
        assert len(data) >= sum(12 * swapper._numel(m.param) for m in masters)
    # Host memory for masters and states: at most buffer_count buffers of one sub-group's bytes.
    assert swapper.peak_buffers <= swapper.nvme.buffer_count and swapper.peak_buffer_bytes <= largest
    # A load into the module reaches the masters (sync_masters reads them back first, not into empty tensors).
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
    sharding.sync_masters()
    get_sharding(ref_opt).sync_masters()
    _train([(model, opt), (reference, ref_opt)], 2)
    for got, want in zip(model.parameters(), reference.parameters()):
        assert (got - want).abs().max().item() <= 1e-6, "a load into the module was undone by stale masters"
    folder = swapper.run_folder
    sharding.remove()
    assert not os.path.exists(folder)
    assert all(m.shape == p.shape for p, m in zip(model.parameters(), sharding.masters.values()))


# torch 2.11's Adagrad reads the states its constructor made and never makes missing ones; under NVMe swapping they
# are not made again at setup (docs/compatibility.md), so that case needs torch >= 2.13 (2.12 was not checked)
ADAGRAD_MAKES_MISSING_STATES = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)


@pytest.mark.parametrize(
    "offload",
    [
        "cpu",
        pytest.param(
            "nvme",
            marks=pytest.mark.skipif(not ADAGRAD_MAKES_MISSING_STATES, reason="torch 2.11's Adagrad (see above)"),
        ),
    ],
)
def test_adagrad_built_with_its_states_steps_with_swapped_or_offloaded_masters(tmp_path, offload):
    """Adagrad's constructor makes its states; sharding the optimizer drops them (they belong to the module's
    parameters). With CPU masters they are made again for the masters; with masters swapped to NVMe (empty
    placeholders between steps) the swapped step makes them, never with the placeholders' empty shape."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))
    reference = copy.deepcopy(model)
    extra = {"nvme": NvmeConfig(str(tmp_path), sub_group_size=300)} if offload == "nvme" else {}
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    shard_optimizer(opt, ZeroConfig(stage=1, offload_optimizer=offload, **extra))
    _train([(model, opt), (reference, ref_opt)], 3)
    for got, want in zip(model.parameters(), reference.parameters()):
        assert (got - want).abs().max().item() <= 1e-6
