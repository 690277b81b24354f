"""``start_method="spawn"``/``"fork"`` with the Trainer: the trained weights reach the launching process whole.

[Note: what Lightning's multiprocessing launcher sends back]
When the Trainer starts its own rank processes, rank 0 saves ``lightning_module.state_dict()`` to a temporary file
at the end of ``fit`` and the launching process loads it into its copy of the module (non-strict), so that the
user's ``model`` object holds the trained weights afterwards. At stages 2-3 that state dict holds DTensor shards:
rank 0 would send only its shard, which the launching process cannot even load (``torch.load`` with a callable
``map_location`` refuses DTensors) - the fit ended with an exception after training had finished. Here every rank
gathers each sharded tensor to a full one (a collective, in state-dict order, so every rank takes part) and rank 0
sends full CPU tensors, which load into the launching process's plain module as with DDP. Swapped-out parameters
(NVMe) are made resident first. Stages 0-1 hold full tensors already and are left as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_zero.offload.param_swapper import resident_parameters


def _full_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    resident_parameters(module)
    return {name: value.full_tensor().cpu() if isinstance(value, DTensor) else value
            for name, value in module.state_dict().items()}


def send_full_weights_back(launcher: Any) -> Any:
    """Lightning's Trainer ``_MultiProcessingLauncher``, sending full weights to the launching process (see the note).

    Patches the instance; ``_collect_rank_zero_results`` runs in every rank, so the gather is collective."""
    collect = launcher._collect_rank_zero_results

    def collect_full(trainer, results):
        module = trainer.lightning_module
        if not any(isinstance(value, DTensor) for value in module.state_dict().values()):
            return collect(trainer, results)
        full = _full_state_dict(module)
        module.state_dict = lambda *args, **kwargs: full  # what Lightning's collection reads, for this call only
        try:
            return collect(trainer, results)
        finally:
            del module.state_dict

    launcher._collect_rank_zero_results = collect_full
    return launcher
