"""The test suite, grouped like the code: engine, strategy, models, examples, benchmarks; shared parts in helpers."""
