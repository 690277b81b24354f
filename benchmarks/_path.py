"""Imported first by an entry point run by path (``python benchmarks/bench_stages.py``): Python then puts
``benchmarks/`` on ``sys.path``, not the repository root, so ``from benchmarks import ...`` and the checkout's
``lightning_zero`` need the root put there once. Run as a module (``python -m benchmarks.bench_stages``) or
imported as ``benchmarks.*``, nothing imports this."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
