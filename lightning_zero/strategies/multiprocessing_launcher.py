"""The Trainer's launcher for ``start_method="spawn"|"fork"|"forkserver"``: Lightning's, plus three things.

- ``ckpt_path`` is checked before any process starts
(:func:`~lightning_zero.strategies.ckpt_path_check.check_ckpt_path`).
- The fork start method does not let ranks destroy process groups they inherited (``adapters/fork_safety.py``).
- The trained weights reach the launching process whole (the note below).

A subclass rather than patched instance methods: with ``spawn`` the launcher is pickled into every rank, and a
closure stored on the instance cannot be (``docs/reliability.md``, "Starting and ending rank processes").

[Note: what Lightning's multiprocessing launcher sends back]
When the Trainer starts its own rank processes, rank 0 saves ``lightning_module.state_dict()`` to a temporary file at
the end of ``fit`` and the launching process loads it into its copy of the module (non-strict), so that the user's
``model`` object holds the trained weights afterwards. At stages 2-3 that state dict holds DTensor shards: rank 0 would
send only its shard, which the launching process cannot even load (``torch.load`` with a callable ``map_location``
refuses DTensors), so the fit would end with an exception after training. Here every rank gathers each sharded tensor to
a full one (a collective, in state-dict order, so every rank takes part) and rank 0 sends full CPU tensors, which load
into the launching process's plain module as with DDP. Swapped-out parameters (NVMe) are made resident first. Stages 0-1
hold full tensors already and are left as they are.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from torch.distributed.tensor import DTensor

from lightning_zero.adapters.fork_safety import collect_before_fork, freeze_inherited
from lightning_zero.offload.param_swapper import resident_parameters
from lightning_zero.strategies.ckpt_path_check import check_ckpt_path


class ZeroMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's Trainer ``_MultiProcessingLauncher`` with the additions listed in the module docstring."""

    def launch(self, function, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        check_ckpt_path(function, args, kwargs, trainer)
        collect_before_fork(self._start_method)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> Any:
        freeze_inherited(self._start_method)
        return super()._wrapping_function(*args, **kwargs)

    def _collect_rank_zero_results(self, trainer, results):
        module = trainer.lightning_module
        resident_parameters(module)
        state = module.state_dict()
        if not any(isinstance(value, DTensor) for value in state.values()):
            return super()._collect_rank_zero_results(trainer, results)
        # collective, in state-dict order: _collect_rank_zero_results runs in every rank
        full = {
            name: value.full_tensor().cpu() if isinstance(value, DTensor) else value for name, value in state.items()
        }
        module.state_dict = lambda *args, **kwargs: full  # what Lightning's collection reads, for this call only
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
