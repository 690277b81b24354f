"""torch's multi-tensor (``_foreach_*``) kernels and the devices its fused optimizer kernels support.

The ``_foreach_*`` ops are what ``torch.optim``'s ``foreach=True`` paths run: one kernel launch (or one threaded CPU
loop) per list instead of one per tensor. They are underscored but part of the op registry (``aten::_foreach_*``)
and stable across 2.11-2.13; nothing public does the same. Naming them here keeps every use in one list: a renamed
op fails :mod:`tests.test_torch_compat` and the optimizer tests on the same torch.
"""

from __future__ import annotations

import torch

foreach_add = torch._foreach_add
foreach_add_ = torch._foreach_add_
foreach_addcmul_ = torch._foreach_addcmul_
foreach_lerp_ = torch._foreach_lerp_
foreach_maximum_ = torch._foreach_maximum_
foreach_mul_ = torch._foreach_mul_
#: ``ord=inf`` propagates inf and NaN, which the loss scaler's overflow check relies on.
foreach_norm = torch._foreach_norm


def fused_kernel_devices() -> list[str]:
    """The device types torch's ``fused=True`` optimizer kernels run on
    (``torch.utils._foreach_utils._get_fused_kernels_supported_devices``, the list ``_default_to_fused_or_foreach`` in
    ``torch/optim/optimizer.py`` checks against)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()
