"""Lightning adapters over :mod:`lightning_zero.distributed`."""
