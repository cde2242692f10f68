"""A traced step as a PNG Gantt chart: one row per stage, F/R/B (I/W) blocks by micro-batch (and chunk), waits below."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lightning_gpipe.pipe.trace.events import COMMUNICATION, Event, chunk_letter
from lightning_gpipe.pipe.trace.stats import breakdown, theoretical_bubble

# Compute on the upper band of a stage's row; waits, sends and reductions on a thin band below it.
COLORS = {
    "forward": "#4C78A8",
    "recompute": "#F58518",
    "backward": "#54A24B",
    "backward-input": "#88D27A",
    "backward-weight": "#2E7D32",
    "loss": "#EECA3B",
    "update": "#B279A2",
    "reduce": "#9D755D",
    "recv-wait": "#BAB0AC",
    "send": "#E45756",
    "status": "#79706E",
}
LETTERS = {"forward": "F", "recompute": "R", "backward": "B", "backward-input": "I", "backward-weight": "W"}
LOWER = (*COMMUNICATION, "status")


def block_label(e: Event) -> str:
    """A compute block's text as schedules draw it: F3, R3, B3, I3, W3; interleaved, with the chunk: F3b.
    Empty for what is not one micro-batch's compute."""
    letter = LETTERS.get(e.kind)
    return f"{letter}{e.micro_batch}{chunk_letter(e.chunk)}" if letter and e.micro_batch >= 0 else ""


def plot_timeline(
    events: Sequence[Event], path: str | os.PathLike, title: str = "", placement: str = "loop"
) -> dict[str, Any]:
    """Draw ``events`` (every stage of one pipeline, one step) to ``path``; returns :func:`breakdown`'s statistics
    (``placement``: where each rank's chunks sit).

    Needs matplotlib (``pip install "lightning-gpipe[timeline]"``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as missing:  # pragma: no cover - depends on the environment
        message = "drawing a pipeline timeline needs matplotlib: pip install 'lightning-gpipe[timeline]'"
        raise ImportError(message) from missing

    stats = breakdown(events, placement)
    origin = min(e.start_ns for e in events)
    stages = sorted({e.stage for e in events})
    span_ms = stats["span_ms"]
    fig, ax = plt.subplots(figsize=(12, 0.9 + 0.75 * len(stages)))
    for e in events:
        if e.kind == "step" or e.kind not in COLORS:
            continue
        x, w = (e.start_ns - origin) / 1e6, (e.end_ns - e.start_ns) / 1e6
        row = stages.index(e.stage)
        lower = e.kind in LOWER
        y, h = (row + 0.3, 0.18) if lower else (row - 0.3, 0.55)
        ax.broken_barh([(x, w)], (y, h), facecolors=COLORS[e.kind], edgecolor="white", linewidth=0.4)
        text = block_label(e)
        # Label a block only where its text fits (about 0.8 % of the span per character).
        if text and w > 0.008 * span_ms * len(text):
            ax.text(x + w / 2, row - 0.3 + h / 2, text, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(stages)), [f"stage {k}" for k in stages])
    ax.set_ylim(len(stages) - 0.4, -0.5)
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("ms since the step began")
    kinds = [k for k in COLORS if any(e.kind == k for e in events)]
    ax.legend(
        handles=[Patch(color=COLORS[k], label=k) for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if len(stages) < 3 else -0.2),
        ncol=len(kinds),
        fontsize=8,
        frameon=False,
    )
    head = f"{title} — " if title else ""
    ax.set_title(
        f"{head}K={stats['K']}, M={stats['M']}: bubble {100 * stats['bubble']:.1f}% measured, "
        f"{100 * stats['theoretical_bubble']:.1f}% = (K−1)/(M+K−1){_interleaved(stats)}; step {span_ms:.0f} ms",
        fontsize=10,
    )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return stats


def _interleaved(stats: dict) -> str:
    """With v virtual stages per rank, the interleaved schedule's own bubble beside GPipe's."""
    v = stats.get("chunks_per_rank", 1)
    if v <= 1:
        return ""
    return f", {100 * theoretical_bubble(stats['K'], stats['M'], v):.1f}% with v={v} virtual stages: (K−1)/(vM+K−1)"
