"""Host reads of device tensors in per-step code, counted on CPU.

On a GPU each read of a tensor's value by the host (``float(t)``, ``t.item()``, ``t.tolist()``, ``t.cpu()``,
``bool(t)``) waits for the device's queued work. Per-step code must read a fixed number of times per step, not once
per parameter; on CPU nothing waits, so the reads are counted instead.
"""

from types import SimpleNamespace

import pytest
import torch

from lightning_zero.ops import FusedAdam, fused_adam
from lightning_zero.pipeline import zero_pipeline

HOST_READS = ("__float__", "__int__", "__bool__", "item", "tolist", "cpu")


@pytest.fixture
def host_reads(monkeypatch):
    """A list that gets one entry per host read of a tensor while the test runs."""
    reads = []

    def counting(name, original):
        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    return reads


def _params(count=6):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(5, 3, generator=gen)
    return params


@pytest.mark.parametrize("bias_correction", [True, False])
def test_fused_adam_foreach_step_reads_the_step_counts_once(monkeypatch, host_reads, bias_correction):
    # no fused kernel for any device: the hand-written foreach path runs, bias correction on or off
    monkeypatch.setattr(fused_adam, "fused_kernel_devices", lambda: [])
    params = _params()
    opt = FusedAdam(params, lr=1e-2, bias_correction=bias_correction)
    opt.step()
    host_reads.clear()
    opt.step()
    assert opt.last_implementation == "foreach"
    assert len(host_reads) == (1 if bias_correction else 0), host_reads


def test_fused_adam_foreach_step_counts_stay_per_parameter(monkeypatch):
    """One read for all step counts still gives each parameter its own count (one skipped a step)."""
    monkeypatch.setattr(fused_adam, "fused_kernel_devices", lambda: [])
    params = _params(2)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedAdam(params, lr=1e-2)
    ref = torch.optim.Adam(reference, lr=1e-2)
    for step in range(3):
        for p, r in zip(params, reference):
            r.grad = None if (step == 1 and r is reference[1]) else torch.full_like(r, 0.1 * (step + 1))
            p.grad = None if r.grad is None else r.grad.clone()
        opt.step()
        ref.step()
    assert [float(opt.state[p]["step"]) for p in params] == [3.0, 2.0]
    for p, r in zip(params, reference):
        torch.testing.assert_close(p, r)


def _fake_pipeline(monkeypatch):
    """A one-stage pipeline runner and process group, enough for the gradient-norm functions."""
    monkeypatch.setattr(zero_pipeline.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(zero_pipeline.dist, "get_process_group_ranks", lambda group: [0])
    monkeypatch.setattr(zero_pipeline.dist, "all_reduce", lambda tensor, group=None: None)
    return SimpleNamespace(
        pp_group=object(), tied_groups=[], device=torch.device("cpu"), fully_sharded=False, dp_group=None
    )


def test_pipeline_clipping_reads_the_device_once_per_step(monkeypatch, host_reads):
    runner = _fake_pipeline(monkeypatch)
    params = _params()
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, reference):
        r.grad = p.grad.clone()
    norm = zero_pipeline.clip_by_global_norm(runner, params, max_norm=0.5)
    assert len(host_reads) == 1, host_reads
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm=0.5)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.grad, r.grad)
