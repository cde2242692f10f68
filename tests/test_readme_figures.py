"""Every measured figure README.md quotes is the one in its committed results file (benchmarks/results/)."""

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


def run1_over_ideal(model: str, K: int, M: int) -> float:
    """Run 1 of the 2-core throughput table exists only as markdown: its "speed-up / ideal" column."""
    section = (RESULTS / "throughput_run1.md").read_text().split(f"## {model}:")[1].split("\n## ")[0]
    row = re.search(rf"^\| {K} \| {M} \|(.*)$", section, re.M)
    assert row, (model, K, M)
    return float(row.group(1).split("|")[4])


def peers_ratio(key: str, M: int) -> float:
    return next(r[key] for r in results("peers.json")["ratios"] if r["M"] == M)


def peers_variable() -> float:
    rate = {r["system"]: r["tokens_per_s"] for r in results("peers.json")["variable"]}
    return rate["ours except_last"] / rate["plain"]


def memory(model: str, config: str, key: str) -> float:
    largest = results("memory.json")["results"][model]["largest"][config]
    return largest["largest"] if key == "size" else largest["run"]["params"] / 1e6


def overhead(field: str, files: tuple[str, ...]) -> tuple[float, float]:
    values = [r[field] for f in files for r in results(f)["rows"]]
    return min(values), max(values)


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
OVERHEAD = ("overhead.json", "xeon16/overhead.json")
# README phrase, with {} where each figure stands → the figures, computed from the results, written as README does.
FIGURES: list[tuple[str, Callable[[], list[str]]]] = [
    ("at M = 4 on the 16-core machine ({} of it)", lambda: [f2(throughput(XEON, "transformer", 2, 4)[1])]),
    (
        "vary from run to run: {}–{})",
        lambda: [f2(throughput("throughput.json", "amoebanet", 2, 4)[1]), f2(run1_over_ideal("amoebanet", 2, 4))],
    ),
    ("a Transformer runs {}× faster than K = 1 at M = 8", lambda: [f2(throughput(XEON, "transformer", 8, 8)[0])]),
    (
        "with the same re-materialization {}× its GPipe schedule at M = 4 and {}× at M = 8, with ours' default {}× and"
        " {}×",
        lambda: [f2(peers_ratio(k, M)) for k in ("gpipe_torch", "gpipe_el_torch") for M in (4, 8)],
    ),
    ("ours runs ({}× the plain model", lambda: [f2(peers_variable())]),
    (
        "AmoebaNet-D grows from {}M parameters (plain) to {}M with re-materialization alone, {}M at K = 2 and {}M at"
        " K = 4",
        lambda: [f1(memory("amoebanet", c, "params")) for c in ("Naive-1", "Pipeline-1", "Pipeline-2", "Pipeline-4")],
    ),
    (
        "a Transformer from {} to {}, {} and {} layers",
        lambda: [str(memory("transformer", c, "size")) for c in ("Naive-1", "Pipeline-1", "Pipeline-2", "Pipeline-4")],
    ),
    ("recomputation {}–{} % of a step", lambda: [f"{x:.0f}" for x in overhead("recompute", OVERHEAD)]),
    ("transfers {}–{} %", lambda: [f"{x:.0f}" for x in overhead("transfer", ("xeon16/overhead.json",))]),
    ("within {} with dropout", lambda: [sci(consistency("nmt dropout"))]),
    ("within {} after 60 Adam steps", lambda: [sci(consistency("nmt"))]),
    ("costliest stage does {}× the mean by parameters, {}× by FLOPs", lambda: [f2(partition(4, s)) for s in
                                                                                  ("parameters", "flops")]),
]  # fmt: skip


@pytest.mark.parametrize(("phrase", "figures"), FIGURES, ids=[p.split("{}")[0].strip()[-30:] for p, _ in FIGURES])
def test_the_readme_quotes_the_results(phrase: str, figures: Callable[[], list[str]]) -> None:
    readme = (ROOT / "README.md").read_text()
    expected = phrase.format(*figures())
    # The phrase with any figure in each slot: found, it tells which number the README has where it disagrees.
    pattern = r"\s+".join(re.escape(part) for part in phrase.split()).replace(re.escape("{}"), r"([0-9.e+-]+)")
    found = re.search(pattern, readme)
    assert found, f"README.md no longer has the phrase {phrase!r}: update FIGURES with it"
    assert re.sub(r"\s+", " ", found.group(0)) == re.sub(r"\s+", " ", expected), (found.group(0), expected)
