"""Hand-written numerics that no maintained library provides in the form ZeRO needs (loss scaling, fused optimizers)."""
