"""Per-layer costs of a real model, for the split tests: the overhead benchmark's Transformer, layer by layer."""

from __future__ import annotations

# F + B per micro-batch (ms) of the overhead benchmark's Transformer, as its traced interleaved steps ran them on this
# VM: a source embedding, 6 encoder layers, a norm, a target embedding, 6 decoder layers, a norm, the vocabulary
# projection. solve() cuts it [5, 5, 3, 4]: the chunks' costs are nearly equal, but rank 0 (chunks 0 and 2) gets
# the two heavier ones and runs about 10 % longer than rank 1.
TRANSFORMER = [1.0, *[5.9] * 6, 0.1, 1.0, *[8.9] * 6, 0.1, 13.7]
