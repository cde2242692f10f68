"""What the benchmarks share and never run on their own: measurement, launch, workloads, meters, the report writer."""
