"""Every measured figure README.md and docs/guide.md quote is the one in its results file (benchmarks/results/)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@cache
def results(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def throughput(name: str, model: str, K: int, M: int) -> tuple[float, float]:
    """(speed-up over K = 1 at the same M, that speed-up over GPipe's ideal K·M/(M+K−1)), as throughput.md has them."""
    rows = {(r["model"], r["K"], r["M"]): r["median_ms"] for r in results(name)["rows"]}
    speed_up = rows[(model, 1, M)] / rows[(model, K, M)]
    return speed_up, speed_up / (K * M / (M + K - 1))


def memory(model: str, config: str, key: str) -> float:
    largest = results("memory.json")["results"][model]["largest"][config]
    return largest["largest"] if key == "size" else largest["run"]["params"] / 1e6


def consistency(run: str) -> float:
    return max(d["max_rel"] for d in results("consistency.json")["diffs"][run].values())


def partition(K: int, split: str) -> float:
    rows = results("partition.json")["rows"]
    return next(r["flops_ratio"] for r in rows if r["model"].startswith("AmoebaNet") and r["K"] == K
                and r["partition"] == split)  # fmt: skip


def f2(x: float) -> str:
    return f"{x:.2f}"


def sci(x: float) -> str:
    """``1.2e-5``, as the README writes it (Python writes ``1.2e-05``)."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def f1(x: float) -> str:
    return f"{x:.1f}"


XEON = "xeon16/throughput.json"
README, GUIDE = ROOT / "README.md", ROOT / "docs" / "guide.md"
# The document, its phrase with {} where each figure stands → the figures, computed from the results, written as the
# document does.
FIGURES: list[tuple[Path, str, Callable[[], list[str]]]] = [
    (README, "K = 2 reaches {} of GPipe's ideal", lambda: [f2(throughput(XEON, "transformer", 2, 4)[1])]),
    (README, "K = 8 runs {}× faster than K = 1 at M = 8", lambda: [f2(throughput(XEON, "transformer", 8, 8)[0])]),
    (
        README,
        "AmoebaNet-D grows from {}M parameters (plain) to {}M with re-materialization alone, {}M at K = 2 and {}M at"
        " K = 4",
        lambda: [f1(memory("amoebanet", c, "params")) for c in ("Naive-1", "Pipeline-1", "Pipeline-2", "Pipeline-4")],
    ),
    (
        README,
        "a Transformer from {} to {}, {} and {} layers",
        lambda: [str(memory("transformer", c, "size")) for c in ("Naive-1", "Pipeline-1", "Pipeline-2", "Pipeline-4")],
    ),
    (README, "within {} with dropout", lambda: [sci(consistency("nmt dropout"))]),
    (README, "within {} after 60 Adam steps", lambda: [sci(consistency("nmt"))]),
    (GUIDE, "costliest stage does {}× the mean by parameters, {}× by FLOPs", lambda: [f2(partition(4, s)) for s in
                                                                                         ("parameters", "flops")]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("document", "phrase", "figures"),
    FIGURES,
    ids=[f"{d.name}: {p.split('{}')[0].strip()[-30:]}" for d, p, _ in FIGURES],
)
def test_the_docs_quote_the_results(document: Path, phrase: str, figures: Callable[[], list[str]]) -> None:
    text = document.read_text()
    expected = phrase.format(*figures())
    # The phrase with any figure in each slot: found, it tells which number the document has where it disagrees.
    pattern = r"\s+".join(re.escape(part) for part in phrase.split()).replace(re.escape("{}"), r"([0-9.e+-]+)")
    found = re.search(pattern, text)
    assert found, f"{document.name} no longer has the phrase {phrase!r}: update FIGURES with it"
    assert re.sub(r"\s+", " ", found.group(0)) == re.sub(r"\s+", " ", expected), (found.group(0), expected)
