"""Per-layer state under micro-batching: BatchNorm, random streams, buffers and re-materialization."""
