"""NVMe offload (ZeRO-Infinity): the asynchronous I/O engine and the optimizer-state swapper. Imports only torch."""
