"""The size search of benchmarks/memory.py: the largest model size whose worst stage fits a memory budget."""

# Apart from the driver because it is pure arithmetic on run records (dicts from memory.measure): no torch, no
# processes, so it can be read and checked on its own.

from __future__ import annotations

import math
from collections.abc import Callable


def predict(near: list[dict], budget: int, p: int, sizes: range) -> int:
    """The largest of ``sizes`` predicted to fit: the mean stage's model memory ~ size^p and its activations ~ size,
    each on the line through the runs ``near`` (through zero if only one), times the first one's worst/mean ratio."""
    (s1, m1, a1), (s2, m2, a2) = [
        (r["size"], *(sum(s[k] for s in r["stages"]) / r["K"] for k in ("model_bytes", "peak_activation_bytes")))
        for r in [*near, {"size": 0, "K": 1, "stages": []}][:2]
    ]
    ratio = near[0]["worst_bytes"] / max(m1 + a1, 1.0)

    def memory(s: int) -> float:
        return ratio * (m1 + (m2 - m1) * (s**p - s1**p) / (s2**p - s1**p) + a1 + (a2 - a1) * (s - s1) / (s2 - s1))

    return max((s for s in sizes if memory(s) <= budget), default=sizes.start)


def largest(
    runner: Callable[[int], dict], first: dict, spec: dict, budget: int, max_runs: int, seed: float | None = None
) -> dict:
    """Largest size whose worst stage fits ``budget``, bracketed by real runs (see METHOD); ``seed``: a first guess."""
    step, lo = spec["step"], spec["min"]
    runs = {first["size"]: first}
    for _ in range(max_runs):
        fits = [s for s, r in runs.items() if r["worst_bytes"] <= budget]
        over = [s for s, r in runs.items() if r["worst_bytes"] > budget]
        best = max(fits, default=None)
        if (best is not None and best + step in over) or (best is None and lo in over):
            break
        top = min(over) - step if over else max(4 * max(runs), int(seed or 0))  # inside the bracket; 4x at most
        near = sorted(runs.values(), key=lambda r: abs(math.log(r["worst_bytes"] / budget)))[:2]
        guess = seed if len(runs) == 1 and seed else predict(near, budget, spec["p"], range(lo, top + 1, step))
        cand = min(max(int(guess // step) * step, lo, best + step if best is not None else lo), top)
        if cand in runs:
            cand = cand + step if runs[cand]["worst_bytes"] <= budget else cand - step
        if cand in runs or cand < lo:
            break
        runs[cand] = runner(cand)
    best = max((s for s, r in runs.items() if r["worst_bytes"] <= budget), default=None)
    above = [r["worst_bytes"] > budget for s, r in runs.items() if best is None or s > best]
    verified = (best + step if best is not None else lo) in runs and all(above)
    chosen = runs.get(best) if best is not None else None
    return {"largest": best, "verified": verified, "run": chosen, "runs": [runs[s] for s in sorted(runs)]}
