"""Lightning callbacks: checkpoint consolidation, throughput logging, collective diagnostics.

``from lightning_zero.callbacks import ThroughputLogger, NCCLDiagnostics, ConsolidateCheckpoint`` (also importable
from ``lightning_zero``).
"""

from lightning_zero.callbacks.consolidate import ConsolidateCheckpoint
from lightning_zero.callbacks.diagnostics import NCCLDiagnostics
from lightning_zero.callbacks.throughput import ThroughputLogger

__all__ = ["ConsolidateCheckpoint", "NCCLDiagnostics", "ThroughputLogger"]
