"""Lightning callbacks: checkpoint consolidation, throughput logging, collective diagnostics."""
