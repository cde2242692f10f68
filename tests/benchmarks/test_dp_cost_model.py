"""The dp reduction cost model: ring formulas, flat vs hierarchical."""

from __future__ import annotations

import pytest

from benchmarks.dp_cost_model import markdown, node_bytes, table


def test_ring_bytes_per_node_and_steps() -> None:
    assert node_bytes(100.0, 2, 2, hierarchical=False) == pytest.approx(2 * 3 / 4 * 100)
    assert node_bytes(100.0, 2, 2, hierarchical=True) == pytest.approx(2 * 1 / 2 * 100)
    assert node_bytes(100.0, 1, 4, hierarchical=True) == 0.0  # one node: nothing crosses a link
    rows = table(K=4, r=2, nodes=[2, 64])
    two = next(r for r in rows if r["nodes"] == 2)
    assert two["bytes ratio flat/hier"] == pytest.approx(1.5)
    assert (two["flat ring steps"], two["hierarchical inter-node steps"]) == (6, 2)
    assert all(r["bytes ratio flat/hier"] >= 1.0 for r in rows)  # type: ignore[operator]
    assert markdown(rows).count("\n") == len(rows) + 1
