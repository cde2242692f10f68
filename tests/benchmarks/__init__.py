"""Tests of the benchmarks: each runs end to end in its smoke mode."""
