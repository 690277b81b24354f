"""lightning-zero: DeepSpeed's ZeRO toolbox for PyTorch Lightning on torch-native engines."""

from lightning_zero.config import ZeroConfig

__version__ = "0.1.0"
__all__ = ["ZeroConfig", "__version__"]
