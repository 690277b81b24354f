"""lightning-zero: DeepSpeed's ZeRO toolbox for PyTorch Lightning on torch-native engines.

Importing the package registers the strategy names ``zero``, ``zero_stage_1``, ``zero_stage_2``,
``zero_stage_2_offload``, ``zero_stage_3``, ``zero_stage_3_offload`` and ``zero_stage_3_offload_nvme`` (optimizer
states swapped to NVMe; needs ``nvme_path``) with Lightning.
"""

from lightning_zero.callbacks import ConsolidateCheckpoint, NCCLDiagnostics, ThroughputLogger
from lightning_zero.config import ZeroConfig
from lightning_zero.distributed.buffers import CommBufferPool, comm_buffer_pool
from lightning_zero.distributed.memory import (
    MemoryEstimate,
    MemoryReport,
    StateBytes,
    estimate_model_states_memory,
    model_state_memory,
    zero_formula,
)
from lightning_zero.distributed.zero import apply_zero, find_repeated_blocks
from lightning_zero.pipeline import LayerSpec, PipelineModule, TiedLayerSpec, build_pipeline
from lightning_zero.strategies import LossScaleConfig, ZeroPrecision, ZeroStrategy

__version__ = "0.1.0"
__all__ = [
    "CommBufferPool",
    "ConsolidateCheckpoint",
    "LayerSpec",
    "LossScaleConfig",
    "MemoryEstimate",
    "MemoryReport",
    "NCCLDiagnostics",
    "PipelineModule",
    "StateBytes",
    "ThroughputLogger",
    "TiedLayerSpec",
    "ZeroConfig",
    "ZeroPrecision",
    "ZeroStrategy",
    "__version__",
    "apply_zero",
    "build_pipeline",
    "comm_buffer_pool",
    "estimate_model_states_memory",
    "find_repeated_blocks",
    "model_state_memory",
    "zero_formula",
]
