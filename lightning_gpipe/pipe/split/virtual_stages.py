"""Virtual stages (v ≥ 2 per rank): the stages a rank holds -- interleaved, rank r the stages r, r + K, …, r +
(v−1)K, or in a V, stages r and 2K − 1 − r (``registry.Placement``) -- and the split of a backbone into vK stages
(v = 1: K) for the shortest simulated step."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe.schedule.registry import Action, Placement, chunk_of, executed, lookup, rank_of, stage_of
from lightning_gpipe.pipe.schedule.simulator import Costs, simulate
from lightning_gpipe.pipe.split.balance import Balance, agree_on_balance, local_name, shared_parameters, solve

if TYPE_CHECKING:
    from lightning_gpipe.pipe.state.rematerialize import Checkpoint

# How many actions solve_virtual_stages may simulate in all (a few seconds): every split when they fit, else a search.
SIMULATED_ACTIONS = 200_000
# What solve_virtual_stages' model of a step cannot tell apart (each chunk's F : B : R fixed at 1 : 2 : 1 on costs that
# are themselves estimates): a split replaces solve's only when it simulates shorter by more than this share.
SIMULATION_TOLERANCE = 0.02


def held_stages(rank: int, K: int, v: int, placement: Placement = "loop") -> list[int]:
    """The stages (of vK) that rank ``rank`` of K holds, in order: chunk c is stage c·K + rank, or in a V rank and
    2K − 1 − rank."""
    return [stage_of(c, rank, K, placement) for c in range(v)]


def homes(K: int, v: int, placement: Placement = "loop") -> tuple[int, ...]:
    """The rank of each of the vK stages."""
    return tuple(rank_of(s, K, placement) for s in range(v * K))


def rank_holders(stages: Sequence[int], K: int, placement: Placement = "loop") -> tuple[int, ...]:
    """The ranks that hold ``stages`` (of vK): a weight tied across two stages of one rank is one parameter there."""
    return tuple(sorted({rank_of(s, K, placement) for s in stages}))


def shared_over_ranks(
    module: nn.Sequential,
    balance: Sequence[int],
    K: int,
    rank: int,
    layers: list[tuple[str, nn.Module]],
    placement: Placement = "loop",
) -> list[tuple[str, tuple[int, ...], str | None]]:
    """Tied weights used on several ranks: (first name, the ranks holding it, the name of one of its uses among
    ``layers``, this rank's, or None); ``balance`` has a count per stage (vK with virtual stages)."""
    return [
        (name, ranks, local_name(layers, module.get_parameter(name)) if rank in ranks else None)
        for name, stages in shared_parameters(module, balance)
        if len(ranks := rank_holders(stages, K, placement)) > 1
    ]


def check_virtual_stages(v: object, K: int) -> int:
    """``virtual_stages`` as an int ≥ 1, or a clear ValueError (also for v ≥ 2 on a pipeline of one rank)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(
            f"virtual_stages (v, the stages each rank holds) must be an int ≥ 1, got {v!r}; 1 runs one contiguous "
            "stage per rank, v ≥ 2 interleaves (schedule='interleaved-1f1b')"
        )
    if v > 1 and K == 1:
        raise ValueError(
            f"virtual_stages={v} interleaves stages over the ranks of a pipeline, but this pipeline has one rank "
            "(torch.distributed is not initialized, or the group has one rank): there is no bubble to shrink; use "
            "virtual_stages=1"
        )
    return v


def checked_placement(placement: object, v: int) -> Placement:
    """``placement`` as given, or a clear ValueError: a V holds two chunks per rank."""
    if placement not in ("loop", "v"):
        raise ValueError(
            f"placement={placement!r}: 'loop' (rank r holds stages r, r + K, …) or 'v' (rank r holds stages r and "
            "2K − 1 − r, for schedule='zb-v')"
        )
    if placement == "v" and v != 2:
        raise ValueError(
            f"placement='v' holds two stages per rank (r and 2K − 1 − r), but virtual_stages={v}; use virtual_stages=2"
        )
    return placement


def solve_virtual_stages(
    costs: Sequence[float], K: int, v: int, M: int, checkpoint: Checkpoint, schedule: str = "interleaved-1f1b"
) -> list[int]:
    """The layer counts of the vK virtual stages (v = 1: the K stages) whose step under ``schedule``, simulated, is
    shortest, with the loss inside the pipeline (the last stage runs each micro-batch's backward after its forward).

    Each rank runs all its virtual stages, so what bounds the step is each rank's virtual stages together, and the
    cheapest costliest chunk (``solve``) may load one rank more than another: with few layers per chunk, the rounding of
    each chunk adds up on a rank. With one chunk per rank, which stage is the heavier matters too: a last stage heavier
    by some time stalls the backwards of the stages before it, a first one by as much mostly itself (two such cuts of
    the benchmarks' Transformer: benchmarks/README.md, "Where the time goes"). A chunk holding layers of
    cost c is simulated as F = c/3, B = 2c/3 (I = W = c/3 where the schedule splits B) and, before the backward of
    a micro-batch whose graph was dropped (``schedules.keeps_graph``), R = F (``simulated_step``). Every split is
    simulated when they fit in ``SIMULATED_ACTIONS``; otherwise, within it, runs of consecutive chunk boundaries are
    shifted together from ``solve``'s split while the step shortens (moving layers between two virtual stages of a
    rank through those between them leaves those as they are). Within ``SIMULATION_TOLERANCE`` of ``solve``'s split,
    which the model cannot tell apart from it, ``solve``'s stays (on the README's main command, FLOPs put the two
    cuts nearest the middle within 0.1 % of each other, where the one solve chose ran a third faster).
    """
    if not lookup(schedule).accepts(v):
        lookup(schedule).actions(K, M, v)  # its clear error
    S, L = v * K, len(costs)
    # The per-chunk optimum, the last chunk weighed as it runs (F + B, where the others recompute: about 3 : 4; under
    # "always" it recomputes as they do, under "never" none does).
    start = solve(costs, S, 0.75 if checkpoint == "except_last" else 1.0)
    actions = _admitted_actions(K, M, v, schedule)

    def step(cuts: Sequence[int]) -> float:
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, L])]
        return simulate(actions, K, v, _chunk_costs(costs, counts, K, placement), **how).makespan

    placement = lookup(schedule).placement
    how: dict[str, Any] = {"checkpoint": checkpoint, "placement": placement}
    best_cuts = list(itertools.accumulate(start))[:-1]
    best = start_step = step(best_cuts)
    budget = max(1, SIMULATED_ACTIONS // sum(map(len, actions)))  # simulations
    if math.comb(L - 1, S - 1) <= budget:
        for cuts in itertools.combinations(range(1, L), S - 1):
            if (t := step(cuts)) < best:
                best, best_cuts = t, list(cuts)
    else:
        reach = max(1, L // S)
        while budget > 0:
            moves = (
                [c + d if i <= k <= j else c for k, c in enumerate(best_cuts)]
                for i in range(S - 1)
                for j in range(i, S - 1)
                for d in (*range(-reach, 0), *range(1, reach + 1))
            )
            valid = itertools.islice((m for m in moves if all(a < b for a, b in zip([0, *m], [*m, L]))), budget)
            tried = [(step(m), m) for m in valid]
            budget -= len(tried)
            found = min(tried, default=(math.inf, best_cuts))
            if found[0] >= best:
                break
            best, best_cuts = found
    if best > (1 - SIMULATION_TOLERANCE) * start_step:
        return list(start)
    return [b - a for a, b in zip([0, *best_cuts], [*best_cuts, L])]


def simulated_step(
    costs: Sequence[float],
    counts: Sequence[int],
    K: int,
    v: int,
    M: int,
    checkpoint: Checkpoint,
    schedule: str = "interleaved-1f1b",
) -> float:
    """The step ``solve_virtual_stages`` weighs for the split ``counts``, in the costs' unit."""
    actions, placement = _admitted_actions(K, M, v, schedule), lookup(schedule).placement
    chunks = _chunk_costs(costs, counts, K, placement)
    return simulate(actions, K, v, chunks, checkpoint=checkpoint, placement=placement).makespan


def _chunk_costs(
    costs: Sequence[float], counts: Sequence[int], K: int, placement: Placement = "loop"
) -> dict[tuple[int, int], Costs]:
    """Per (rank, chunk): a chunk of layers of cost c runs F = c/3, B = 2c/3, I = W = c/3, R = F (a layer's backward
    is about twice its forward; only the ratios matter)."""
    out, start = {}, 0
    for s, n in enumerate(counts):
        c = float(sum(costs[start : start + n]))
        start += n
        where = rank_of(s, K, placement), chunk_of(s, K, placement)
        out[where] = Costs(F=c / 3, B=2 * c / 3, I=c / 3, W=c / 3, R=c / 3)
    return out


def _admitted_actions(K: int, M: int, v: int, schedule: str) -> list[list[Action]]:
    """``schedule``'s actions for M micro-batches (as the executor runs them: ``fuse_halves``), or for the most
    below M it admits: a stage built for an M it refuses still runs ``stage(x)`` and ``backward()``, and only
    ``forward_backward`` raises the schedule's error."""
    for m in range(M, 0, -1):
        with contextlib.suppress(ValueError):
            return executed(schedule, K, m, v)
    raise AssertionError(f"{schedule} admits M = 1")


def agree_on_virtual_stages(
    module: nn.Sequential,
    K: int,
    v: int,
    balance: Balance,
    sample: Any,
    group: dist.ProcessGroup | None,
    M: int = 8,
    checkpoint: Checkpoint = "except_last",
    schedule: str = "interleaved-1f1b",
) -> list[int]:
    """The layer counts of the vK stages (virtual stages), the same on every rank (see ``agree_on_balance``); with v ≥
    2, a balance solved from costs is the split with the shortest simulated step under ``schedule``
    (``solve_virtual_stages``)."""

    def interleaved(costs: Sequence[float], S: int) -> list[int]:
        return solve_virtual_stages(costs, K, v, M, checkpoint, schedule)

    try:
        return agree_on_balance(
            module, K * v, balance, sample=sample, group=group, solver=solve if v == 1 else interleaved
        )
    except ValueError as e:
        if v == 1:
            raise
        held = f"r and {2 * K - 1} − r" if lookup(schedule).placement == "v" else f"r, r + {K}, …"
        raise ValueError(
            f"{e} (virtual_stages={v}: the pipeline's stages are its K·v = {K}·{v} = {K * v} virtual stages, rank r "
            f"holding stages {held}; a balance gives one layer count per virtual stage)"
        ) from e


class ChunkLayers(nn.Module):
    """One chunk's layers under their global names: what its executor runs, normalizes and watches.

    Never registered in the stage (its state dict holds each layer once, under the plain module's key); it looks its
    layers up in the stage before every phase, as a layer may be replaced there (a BatchNorm reverted, say)."""

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__()
        self.names = list(names)

    def refresh(self, layers: Mapping[str, nn.Module | None]) -> None:
        for name in self.names:
            self._modules[name] = layers[name]
