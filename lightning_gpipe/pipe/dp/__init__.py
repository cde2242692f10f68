"""Data parallelism over the replicas of a stage: gradient reduction, ready buckets and clipping."""
