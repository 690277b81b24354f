"""lightning-zero: DeepSpeed's ZeRO toolbox for PyTorch Lightning on torch-native engines.

Importing the package registers the strategy names ``zero``, ``zero_stage_1``, ``zero_stage_2``,
``zero_stage_2_offload``, ``zero_stage_3``, ``zero_stage_3_offload`` and ``zero_stage_3_offload_nvme`` (parameters
and optimizer states swapped to NVMe; needs ``nvme_path``) with Lightning's Trainer and with Fabric
(:class:`lightning_zero.fabric.ZeroStrategy`).
"""

from lightning_zero.callbacks import ConsolidateCheckpoint, HuggingFaceExport, NCCLDiagnostics, ThroughputLogger
from lightning_zero.checkpoint import export_hf, save_hf_pretrained
from lightning_zero.cli.toplevel import __version__
from lightning_zero.distributed.activation_checkpointing import (
    ActivationCheckpointConfig,
    apply_activation_checkpointing,
)
from lightning_zero.distributed.apply_zero import apply_zero
from lightning_zero.distributed.comm_buffers import CommBufferPool, comm_buffer_pool
from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.distributed.module_classes import find_repeated_blocks
from lightning_zero.estimate.activations import TransformerShape, activation_bytes, saved_activation_bytes
from lightning_zero.estimate.model_states import (
    FullEstimate,
    MemoryEstimate,
    MemoryReport,
    StateBytes,
    estimate_memory,
    estimate_model_states_memory,
    model_state_memory,
    zero_formula,
)
from lightning_zero.pipeline import LayerSpec, PipelineModule, TiedLayerSpec, build_pipeline
from lightning_zero.strategies import LossScaleConfig, ZeroPrecision, ZeroStrategy

import lightning_zero.fabric  # noqa: E402, F401  # isort: skip  (registers the names with Fabric, after strategies)

__all__ = [
    "ActivationCheckpointConfig",
    "CommBufferPool",
    "ConsolidateCheckpoint",
    "FullEstimate",
    "HuggingFaceExport",
    "LayerSpec",
    "LossScaleConfig",
    "MemoryEstimate",
    "MemoryReport",
    "NCCLDiagnostics",
    "PipelineModule",
    "StateBytes",
    "ThroughputLogger",
    "TiedLayerSpec",
    "TransformerShape",
    "ZeroConfig",
    "ZeroPrecision",
    "ZeroStrategy",
    "__version__",
    "activation_bytes",
    "apply_activation_checkpointing",
    "apply_zero",
    "build_pipeline",
    "comm_buffer_pool",
    "estimate_memory",
    "estimate_model_states_memory",
    "export_hf",
    "find_repeated_blocks",
    "model_state_memory",
    "save_hf_pretrained",
    "saved_activation_bytes",
    "zero_formula",
]
