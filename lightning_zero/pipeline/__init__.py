"""Pipeline parallelism: DeepSpeed's ``PipelineModule`` interface on ``torch.distributed.pipelining``."""

from lightning_zero.pipeline.module import PipelineModule, StageModule
from lightning_zero.pipeline.partition import partition_layers
from lightning_zero.pipeline.schedules import PipelineConfig, PipelineRunner, build_pipeline
from lightning_zero.pipeline.specs import LayerSpec, TiedLayerSpec

__all__ = [
    "LayerSpec",
    "PipelineConfig",
    "PipelineModule",
    "PipelineRunner",
    "StageModule",
    "TiedLayerSpec",
    "build_pipeline",
    "partition_layers",
]
