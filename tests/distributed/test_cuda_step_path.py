"""The stage-2 training step a CUDA run takes: torch's engine as shipped, in at most six files of the package.

The step is traced on CPU (``tests/distributed/step_files.py``) with the package's one switch for CPU-only tuning,
``lightning_zero.distributed.cpu_tuning.cpu_tuning_enabled``, answering as on CUDA; ``docs/architecture.md``, "A
training step at stage 2", draws the same path.
"""

import pytest
import torch
from lightning.pytorch.strategies.strategy import _ForwardRedirection

from lightning_zero.distributed import cpu_tuning
from lightning_zero.strategies.forward_redirection import RootForwardRedirection, forward_redirection_for
from tests.distributed.step_files import trace_steps
from tests.ranks import run_distributed

# Every file of the package a stage-2 step (forward, backward, optimizer step) runs on CUDA: the Trainer's adapter,
# its precision plugin over the shared policy, the hang watchdog's marks and the preemption agreement at the batch's
# start. FSDP2, the optimizer and Lightning's forward redirection are torch's and Lightning's own.
CUDA_STEP_FILES = {
    "strategies/trainer_strategy.py",
    "strategies/trainer_precision.py",
    "adapters/precision_policy.py",
    "diagnostics/hang_guard.py",
    "diagnostics/watchdog.py",
    "strategies/preemption.py",
}
# What only a CPU run steps through (distributed/cpu_tuning.py's table), and the switch itself.
CPU_ONLY_FILES = {
    "distributed/cpu_tuning.py",
    "distributed/comm_buffers.py",
    "distributed/local_step.py",
    "ops/cpu_fused.py",
    "ops/step_override.py",
    "distributed/root_reentry.py",
    "strategies/forward_redirection.py",
}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_stage2_step_on_cuda_runs_torch_as_shipped_in_six_files(tmp_path, precision):
    found = trace_steps(tmp_path, precision=precision, cuda_decisions=True)
    files = set(found["files"])
    assert len(files) <= 6 and files == CUDA_STEP_FILES, f"a CUDA stage-2 step runs {sorted(files)}"
    assert not files & CPU_ONLY_FILES
    # the user's optimizer class (no generated subclass), FSDP2's own buffers, Lightning's own redirection
    assert found["optimizer_class_is_users"], found
    assert not found["buffer_pool"] and found["redirection"] == "_ForwardRedirection", found
    if precision == "32-true":  # the plain path trains what one process trains
        assert found["max_diff"] <= 1e-5, found


def test_stage2_step_on_cpu_keeps_its_tuning(tmp_path):
    found = trace_steps(tmp_path)
    files = set(found["files"])
    assert CPU_ONLY_FILES - {"distributed/cpu_tuning.py"} <= files, sorted(files)
    assert "distributed/cpu_tuning.py" not in files  # decided at setup, never asked during a step
    assert not found["optimizer_class_is_users"] and found["buffer_pool"], found
    assert found["redirection"] == "RootForwardRedirection" and found["max_diff"] <= 1e-5, found


def test_cpu_tuning_follows_where_the_work_runs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert cpu_tuning.cpu_tuning_enabled(cpu) and not cpu_tuning.cpu_tuning_enabled(cuda)
    # an optimizer holding CPU tensors (offloaded masters on a CUDA run) steps on the CPU, and is tuned there
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert cpu_tuning.steps_on(optimizer, cuda) == cpu
    assert cpu_tuning.steps_on(torch.optim.AdamW([{"params": []}]), cuda) == cuda  # nothing held: the compute device


def test_redirection_suspends_nested_root_calls_only_where_needed():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert type(forward_redirection_for(cuda, manual_optimization=False)) is _ForwardRedirection  # Lightning's own
    # manual optimization needs the root's forward open at manual_backward (distributed/manual_backward.py)
    assert isinstance(forward_redirection_for(cuda, manual_optimization=True), RootForwardRedirection)
    assert isinstance(forward_redirection_for(cpu, manual_optimization=False), RootForwardRedirection)


def _accumulation_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from lightning_zero.distributed.apply_zero import apply_zero, set_gradient_sync
    from lightning_zero.distributed.config import ZeroConfig
    from tests.lightning_models import Net

    calls = []
    public = FSDPModule.set_reshard_after_backward

    def record(self, reshard_after_backward, *, recurse=True):
        calls.append((self, reshard_after_backward, recurse))
        return public(self, reshard_after_backward, recurse=recurse)

    FSDPModule.set_reshard_after_backward = record  # this forked rank only
    for stage in (2, 3):
        torch.manual_seed(0)
        module = apply_zero(Net(), init_device_mesh("cpu", (world_size,)), ZeroConfig(stage=stage, unit_bytes=0))
        # stage 2 keeps every unit gathered from forward to backward; stage 3 the root and the last block
        kept = [module.blocks[1], module.blocks[0], module] if stage == 2 else [module.blocks[1], module]
        for enabled in (False, True):
            calls.clear()
            set_gradient_sync(module, enabled)
            assert calls == [(unit, enabled, False) for unit in kept], (stage, enabled, calls)


def test_accumulation_keeps_units_gathered_through_torchs_public_switch():
    run_distributed(_accumulation_worker, 2)
