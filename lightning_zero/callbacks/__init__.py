"""Lightning callbacks: checkpoint consolidation, throughput logging, collective diagnostics.

``from lightning_zero.callbacks import ThroughputLogger, NCCLDiagnostics, ConsolidateCheckpoint, HuggingFaceExport``
(also importable from ``lightning_zero``).
"""

from lightning_zero.callbacks.consolidate import ConsolidateCheckpoint
from lightning_zero.callbacks.diagnostics import NCCLDiagnostics
from lightning_zero.callbacks.hf_save import HuggingFaceExport
from lightning_zero.callbacks.throughput import ThroughputLogger

__all__ = ["ConsolidateCheckpoint", "HuggingFaceExport", "NCCLDiagnostics", "ThroughputLogger"]
