"""Activation checkpointing on CUDA: the device memory held from forward to backward drops, and with
cpu_checkpointing the kept block inputs leave the device (pinned CPU copies), with the same gradients.

Runs as `python -m pytest tests/gpu -q` on a machine with a GPU; skipped cleanly elsewhere.
"""

import pytest
import torch

from lightning_zero import ActivationCheckpointConfig, apply_activation_checkpointing
from tests.distributed.test_activation_checkpointing import WIDTH, SixBlockNet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _held_between_forward_and_backward(config):
    torch.manual_seed(0)
    model = SixBlockNet().cuda()
    if config is not None:
        apply_activation_checkpointing(model, config)
    x = torch.randn(4096, 8, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = model(x).square().mean()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before  # what autograd keeps for backward (plus the scalar loss)
    loss.backward()
    return held, [p.grad.clone() for p in model.parameters()]


def test_device_memory_held_for_backward_drops():
    plain, plain_grads = _held_between_forward_and_backward(None)
    kept, kept_grads = _held_between_forward_and_backward(ActivationCheckpointConfig())
    offloaded, offloaded_grads = _held_between_forward_and_backward(ActivationCheckpointConfig(cpu_checkpointing=True))
    assert kept * 2 <= plain, (kept, plain)
    block_inputs = 6 * 4096 * WIDTH * 4
    assert offloaded <= kept - block_inputs + 4096 * WIDTH * 4, (offloaded, kept)  # at most one input stays
    for a, b, c in zip(plain_grads, kept_grads, offloaded_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=0, atol=1e-6)
