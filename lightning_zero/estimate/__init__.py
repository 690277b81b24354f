"""Memory and FLOP models: per-rank model-state bytes, activation bytes, FLOPs and MFU. Framework-free."""
