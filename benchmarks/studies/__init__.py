"""One-off comparisons that decided a design, kept runnable: python -m benchmarks.studies.<name>."""
