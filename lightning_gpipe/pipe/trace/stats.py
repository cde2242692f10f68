"""Where a traced step's time went: per-stage shares of compute, waiting, bubble and update, vs GPipe's theory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_gpipe.pipe.trace.events import COMPUTE, KINDS, Event

# Every kind a stage records except "step", which spans whole phases and so overlaps the others.
PARTS = tuple(kind for kind in KINDS if kind != "step")


def theoretical_bubble(K: int, M: int, v: int = 1) -> float:
    """GPipe's idle fraction (K−1)/(M+K−1) when every unit of work costs the same; with v virtual stages per rank
    (interleaving, each unit 1/v as long), (K−1)/(vM+K−1)."""
    return (K - 1) / (v * M + K - 1)


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _phase_of(e: Event, phases: list[Event]) -> str:
    return next((p.label for p in phases if p.stage == e.stage and p.start_ns <= e.start_ns <= p.end_ns), "")


def _sender(e: Event, K: int, placement: str = "loop") -> tuple[int, int]:
    """The rank and chunk that sent what receive-wait ``e`` waited for: a gradient (label ``"gradient"``) comes
    from the next stage, an input from the previous one; with virtual stages (interleaving) across the ring's seam, from
    the neighbouring chunk (rank K − 1's chunk c feeds rank 0's chunk c + 1). In a V (``placement="v"``) chunk a's
    come as interleaving's and chunk b's from the other side (rank r's chunk b feeds rank r − 1's)."""
    if placement == "v":
        down = (e.label == "gradient") == (e.chunk == 0)  # from the rank below
        return (e.stage + 1 if down else e.stage - 1), e.chunk
    if e.label == "gradient":
        return (e.stage + 1, e.chunk) if e.stage + 1 < K else (0, e.chunk + 1)
    return (e.stage - 1, e.chunk) if e.stage > 0 else (K - 1, e.chunk - 1)


def transfer_ns(events: Sequence[Event], placement: str = "loop") -> dict[int, int]:
    """Per stage, the part of its receive waits spent on the transfer itself: from when the peer started sending (or
    the wait began, if later) to the wait's end. The rest of a wait is the peer still computing -- the bubble."""
    phases = [e for e in events if e.kind == "step"]
    K = 1 + max((e.stage for e in events), default=0)
    sends: dict[tuple[int, int, str, int, bool], int] = {}
    for e in events:
        if e.kind == "send" and not e.label.startswith("skip"):
            key = (e.stage, e.chunk, _phase_of(e, phases), e.micro_batch, e.label == "gradient")
            sends.setdefault(key, e.start_ns)
    out: dict[int, int] = {}
    for e in events:
        if e.kind != "recv-wait" or e.label.startswith("skip"):  # a long skip's sender is not a neighbour: not matched
            continue
        phase = _phase_of(e, phases)
        if e.label == "output" or (phase in ("forward", "evaluation") and e.micro_batch < 0):
            src, chunk = max(p.stage for p in phases), -1  # the last stage shares the output
        else:
            src, chunk = _sender(e, K, placement)
        sent = sends.get((src, chunk, phase, e.micro_batch, e.label == "gradient"))
        if sent is not None:
            out[e.stage] = out.get(e.stage, 0) + max(e.end_ns - max(sent, e.start_ns), 0)
    return out


def breakdown(events: Sequence[Event], placement: str = "loop") -> dict[str, Any]:
    """Shares of a traced step, per stage and averaged, from the events of every stage of one pipeline.

    ``span``: from the first event to the last on any stage. ``pipeline span``: from the first forward phase's
    start to the last backward phase's end (the loss and the weight update lie outside the pipeline's own time).
    Per stage, ``bubble`` is the share of the pipeline span in which the stage computed nothing (no forward,
    recompute or backward) -- waits for peers, sends and the loss between the phases included -- which is what
    GPipe's (K−1)/(M+K−1) predicts. ``transfer`` is the part of the receive waits spent moving data (see
    :func:`transfer_ns`); the rest of ``recv-wait`` is waiting for a peer's compute. ``load imbalance`` is
    (max − mean) of the stages' compute time over the pipeline span; ``other`` is the part of the span covered by
    no event (the user's loss, Lightning's loop, idling after the stage's last work).

    ``efficiency`` is the ideal GPipe step over the measured one: all the step's work (every stage's forward,
    recompute, backward and update, and the loss once: the last stage's) spread evenly over the K stages and
    stretched by GPipe's fill and drain, (M+K−1)/M, against ``span``. 1.0 means nothing but GPipe's own bubble;
    work done twice (the loss on every stage) counts once, so duplicated work lowers it too. ``placement``: where
    each rank's chunks sit (``registry.Placement``), which tells who sent what a receive waited for.
    """
    if not events:
        raise ValueError("no events: was the timeline enabled during the step?")
    stages = sorted({e.stage for e in events})
    start, end = min(e.start_ns for e in events), max(e.end_ns for e in events)
    phases = [e for e in events if e.kind == "step"]
    # A step with the loss inside the pipeline is one "train" phase (see pipe.run.loss_inside).
    fwd = [e.start_ns for e in phases if e.label in ("forward", "train")] or [start]
    bwd = [e.end_ns for e in phases if e.label in ("backward", "train")] or [end]
    p_start, p_end = min(fwd), max(bwd)
    span, p_span = end - start, max(p_end - p_start, 1)
    M = max((e.micro_batch for e in events if e.kind == "forward"), default=-1) + 1
    transfers = transfer_ns(events, placement)
    per_stage: dict[int, dict[str, float]] = {}
    for k in stages:
        mine = [e for e in events if e.stage == k and e.kind != "step"]
        ms = {kind: sum(e.end_ns - e.start_ns for e in mine if e.kind == kind) / 1e6 for kind in PARTS}
        # A micro-batch's loss (m ≥ 0) is the last stage's work inside the pipeline; the whole batch's is not.
        inside = [e for e in mine if e.kind in COMPUTE or (e.kind == "loss" and e.micro_batch >= 0)]
        busy = [(max(e.start_ns, p_start), min(e.end_ns, p_end)) for e in inside]
        compute_in_pipeline = _union_ns([iv for iv in busy if iv[1] > iv[0]])
        covered = _union_ns([(e.start_ns, e.end_ns) for e in mine])
        per_stage[k] = {
            **{f"{kind}_ms": v for kind, v in ms.items()},
            "compute_ms": sum(ms[kind] for kind in COMPUTE),
            "transfer_ms": transfers.get(k, 0) / 1e6,
            "other_ms": (span - covered) / 1e6,
            "bubble": 1.0 - compute_in_pipeline / p_span,
        }
    computes = [s["compute_ms"] for s in per_stage.values()]
    K = len(stages)
    v = 1 + max((e.chunk for e in events), default=0)
    work_ms = sum(s["compute_ms"] + s["update_ms"] for s in per_stage.values()) + per_stage[stages[-1]]["loss_ms"]
    ideal_ms = work_ms / K * (M + K - 1) / M if M else None

    def share(key: str) -> float:
        return sum(s[key] for s in per_stage.values()) / K / (span / 1e6)

    return {
        "K": K,
        "M": M,
        "span_ms": span / 1e6,
        "pipeline_span_ms": p_span / 1e6,
        "bubble": sum(s["bubble"] for s in per_stage.values()) / K,
        "theoretical_bubble": theoretical_bubble(K, M) if M else None,
        "chunks_per_rank": v,
        "load_imbalance": (max(computes) - sum(computes) / K) / (p_span / 1e6),
        "ideal_step_ms": ideal_ms,
        "efficiency": ideal_ms / (span / 1e6) if ideal_ms is not None else None,
        "shares": {
            **{kind: share(f"{kind}_ms") for kind in PARTS},
            "transfer": share("transfer_ms"),
            "other": share("other_ms"),
        },
        "stages": {str(k): v for k, v in per_stage.items()},
    }


def summary_line(stats: dict[str, Any]) -> str:
    """One line for a log: K, M, the measured bubble beside the theoretical one, and the biggest shares."""
    shares = ", ".join(
        f"{kind} {100 * v:.0f}%" for kind, v in sorted(stats["shares"].items(), key=lambda kv: -kv[1]) if v >= 0.005
    )
    theory, efficiency = stats["theoretical_bubble"], stats.get("efficiency")
    ideal = f", efficiency {efficiency:.2f} (ideal GPipe step / step)" if efficiency is not None else ""
    return (
        f"K={stats['K']}, M={stats['M']}: step {stats['span_ms']:.1f} ms, bubble {100 * stats['bubble']:.1f}% "
        f"measured vs {100 * theory:.1f}% = (K−1)/(M+K−1){ideal}; time per stage: {shares}"
    )
