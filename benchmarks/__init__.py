"""GPipe's paper experiments and timings against peers; run from the repo root: python -m benchmarks.<name>."""
