"""What ``ZeroStrategy`` does around training that is not ZeRO itself: the DDP settings manual optimization needs,
Lightning's layer sync (``sync_batchnorm``), callbacks it refuses, and an undo-only-what-was-done teardown."""

from __future__ import annotations

from typing import Any


def ddp_kwargs(module) -> dict[str, Any]:
    """``DistributedDataParallel`` arguments for stages 0-1.

    With manual optimization a step usually back-propagates through part of the model only (a GAN's discriminator
    loss never reaches the generator, ``toggle_optimizer`` freezes the other optimizer's parameters). DDP then
    waits forever for those gradients and fails on the next step ("Expected to have finished reduction"), so
    unused parameters are found per backward, as Lightning's ``ddp_find_unused_parameters_true`` does.
    """
    return {} if module.automatic_optimization else {"find_unused_parameters": True}
