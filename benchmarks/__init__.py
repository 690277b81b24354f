"""The benchmarks (benchmarks/README.md). Each entry point runs from the repository root either as a module,
``python -m benchmarks.bench_stages ...``, or by path, ``python benchmarks/bench_stages.py ...``."""
