"""Refuse optimizers that hold tensors the sharded model no longer uses.

At stages 2-3 ``fully_shard`` replaces every parameter of the module with a new DTensor parameter. An optimizer
built before that (in ``__init__`` or ``configure_model`` and merely returned by ``configure_optimizers``) keeps the
old tensors: they never receive a gradient, so the optimizer silently steps nothing and the model never trains.
Neither FSDP2 nor the optimizer can notice (both are consistent on their own), so the check is done here.
"""

from __future__ import annotations

import torch


def check_optimizer_params(optimizer: torch.optim.Optimizer, module: torch.nn.Module, index: int = 0) -> None:
    """Raise if ``optimizer`` holds a tensor that is not a parameter of the (already sharded) ``module``.

    Args:
        optimizer: the user's optimizer, before :func:`~lightning_zero.distributed.optimizer.shard_optimizer`.
        module: the module after :func:`~lightning_zero.distributed.apply_zero.apply_zero` (stages 2-3).
        index: the optimizer's position, for the message.
    """
    owned = {id(param) for param in module.parameters()}
    stale = sum(1 for group in optimizer.param_groups for param in group["params"] if id(param) not in owned)
    if stale:
        raise ValueError(
            f"optimizer {index} ({type(optimizer).__name__}) holds {stale} tensor(s) that are not parameters of the "
            "sharded model, so they would never be trained. At ZeRO stages 2-3 the parameters are replaced when the "
            "model is sharded: create the optimizer inside configure_optimizers from self.parameters(), not earlier "
            "(in __init__ or configure_model), and do not pass tensors that are not module parameters.")
