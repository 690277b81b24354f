"""``LightningModule.toggle_optimizer`` over stage-1 partitioned optimizers and optimizers holding offloaded CPU
masters (the GAN pattern at stage 1, and with ``offload_optimizer`` at any stage).

[Note: toggling sees every parameter]
Lightning's ``toggle_optimizer(opt)`` freezes every parameter found in ``trainer.optimizers[*].param_groups`` and
unfreezes those of ``opt``; ``untoggle_optimizer`` restores them. At stage 1 a partitioned optimizer's
``param_groups`` hold only this rank's partition (or its CPU masters, with offload; see
:mod:`lightning_zero.distributed.optimizer`), so the other ranks' parameters of the *other* optimizer would stay
trainable on this rank: they collect gradients the step was meant not to produce, the ranks disagree on which
parameters DDP reduces, and ``zero_grad`` (which reaches only the partition) leaves those gradients to pollute the
next step. The result is silently wrong weights. So while Lightning's own toggle runs, each partitioned optimizer
shows all of its module parameters; the logic stays Lightning's (and a subclass's override is kept). The same holds
at any stage when the optimizer offload put CPU masters in ``param_groups``: freezing the masters would leave every
module parameter trainable.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Iterable, Iterator

from lightning_zero.distributed.optimizer import get_sharding


@contextmanager
def full_param_groups(optimizers: Iterable) -> Iterator[None]:
    """Within the block, every stage-1 partitioned or master-holding optimizer's ``param_groups`` list all its
    module parameters."""
    swapped = []
    try:
        for optimizer in optimizers:
            sharding = get_sharding(getattr(optimizer, "_optimizer", optimizer))
            if sharding is None or (sharding.config.stage != 1 and not sharding.masters):
                continue  # other stages hold the module's parameters themselves (unless they hold CPU masters)
            for group, params in zip(optimizer.param_groups, sharding.model_params):
                swapped.append((group, group["params"]))
                group["params"] = params
        yield
    finally:
        for group, held in swapped:
            group["params"] = held


def install_partition_aware_toggle(module) -> None:
    """Bind ``toggle_optimizer``/``untoggle_optimizer`` on ``module`` (the instance; removed at teardown by
    :func:`uninstall_partition_aware_toggle`) so they act on every parameter; see the module note."""
    toggle, untoggle = type(module).toggle_optimizer, type(module).untoggle_optimizer

    def toggle_optimizer(self, optimizer) -> None:
        with full_param_groups(self.trainer.optimizers):
            toggle(self, optimizer)

    def untoggle_optimizer(self, optimizer) -> None:
        with full_param_groups(self.trainer.optimizers):
            untoggle(self, optimizer)

    module.toggle_optimizer = types.MethodType(toggle_optimizer, module)
    module.untoggle_optimizer = types.MethodType(untoggle_optimizer, module)


def uninstall_partition_aware_toggle(module) -> None:
    module.__dict__.pop("toggle_optimizer", None)
    module.__dict__.pop("untoggle_optimizer", None)
