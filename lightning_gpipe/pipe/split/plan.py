"""The schedule that chooses itself (``schedule="auto"``): schedules, M, v and re-materialization ranked by simulation.

:func:`plan` builds the grid (:func:`candidates`), splits the layers for each candidate, runs it on the simulator
(``pipe.schedule.simulator``) with costs measured at setup (:class:`Profile`), and ranks the candidates that fit a
memory budget by predicted step. What :func:`predict` assumes:

* Time. A layer of cost c (seconds of forward + backward on the whole mini-batch of N samples, the part that grows
  with the samples) and fixed cost f (seconds of forward + backward whatever the samples: kernel launches, a small
  batch's poorer use of the device) costs c·n/N + f on a micro-batch of n samples, n = N/M (the mean: the
  simulator's costs are per chunk, not per micro-batch). A chunk of layers of cost c runs F = R = c/3, B = 2c/3
  (as ``solve_virtual_stages`` weighs them); a split backward moves to W the weight gradients of the ops that split
  at the candidate's K and M (``Profile.weight_ops``, priced as ``split_cost.pays`` decides: their W time and the
  split's cost), I keeps the rest of B (I = W = c/3 without ``weight_ops``). Each action costs ``host_per_action``
  besides: the engine's launch and bookkeeping of an action, which a smaller micro-batch does not shrink either. A
  message costs bytes·n/N / ``bandwidth`` on its link and ``message_host`` on each end's host (``Costs.send_host``,
  ``recv_host``).
* Memory, per rank: the parameter bytes of its layers times ``state_bytes_per_param_byte`` (weight, gradient and
  optimizer state), plus, over the rank's actions in order, what each (micro-batch, chunk) pair holds between its F
  and its B (or W): a kept graph (``keeps_graph``) holds the chunk's activation bytes from its F on; a dropped one
  its input (the boundary: the previous layer's output, or the model's input on stage 0) until its B or I, which
  recomputes the activations from it; they go when the B or W ends (W needs what I kept). Each pair is scaled by
  its own micro-batch's size (``micro_batch_sizes``: the runtime's uneven split). Not counted: buffers in flight
  between ranks, temporaries inside a layer, the allocator's fragmentation; tied weights count once per use.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_gpipe.pipe._torch_internals import tree_map
from lightning_gpipe.pipe.microbatch import micro_batch_sizes, tensors
from lightning_gpipe.pipe.schedule.registry import (
    SCHEDULES,
    Action,
    Placement,
    chunk_of,
    executed,
    keeps_graph,
    lookup,
    rank_of,
    stage_of,
)
from lightning_gpipe.pipe.schedule.simulator import Costs, simulate
from lightning_gpipe.pipe.schedule.split_cost import HOST_SECONDS, pays
from lightning_gpipe.pipe.split.balance import solve
from lightning_gpipe.pipe.split.virtual_stages import SIMULATED_ACTIONS, solve_virtual_stages
from lightning_gpipe.pipe.state.rematerialize import CHECKPOINT_MODES, Checkpoint
from lightning_gpipe.pipe.state.rng import cuda_devices_of

# "fill-drain" exists for a loss that needs the whole batch's forward (a mixture of experts' routers), a property of
# the model that no measured cost shows: it is chosen by name, never by the plan.
EXCLUDED = frozenset({"fill-drain"})
# check(): a measured step this far from its prediction says the model missed something.
MISS = 0.10
# check(): another candidate is named only when predicted faster than the measured step by this share (the
# correction of the model is itself a guess).
MARGIN = 0.05
MiB = 2**20
# solve's weight of the last stage's layers: under except_last it keeps its graphs where the others recompute (F + B
# against F + R + B: 3 : 4); under "always" it recomputes as they do, under "never" none does.
_LAST_STAGE: dict[Checkpoint, float] = {"always": 1.0, "except_last": 0.75, "never": 1.0}


@dataclass(frozen=True)
class Profile:
    """What the plan knows of the backbone's L layers, per layer and for the whole mini-batch of N samples.

    ``costs``: seconds of forward + backward on the N samples, the part that grows with them; ``fixed_costs``: the
    part that does not, per micro-batch (``costs_by_time`` at two micro-batch sizes, fitted: ``fit_layer_costs``);
    ``activation_bytes``: what autograd keeps for the layer's backward; ``output_bytes``: its output (what the next
    stage receives, and what a dropped graph keeps); ``parameter_bytes``: its weights; ``input_bytes``: the model's
    input (stage 0's boundary). ``state_bytes_per_param_byte``: weight, gradient and optimizer state per weight byte
    (4: AdamW in the weights' dtype). ``host_per_action``: seconds each action of a chunk costs whatever its size;
    ``bandwidth``: bytes/s of a link between ranks; ``message_host``: seconds of a rank's host per message sent or
    received. ``weight_ops``: per layer, each op a split schedule could defer, as (its W's seconds on the N samples,
    the share of it that splitting adds): ``weight_grad.weight_ops`` (none given: every layer's W is a third of its
    cost)."""

    N: int
    costs: Sequence[float]
    activation_bytes: Sequence[float]
    output_bytes: Sequence[float]
    parameter_bytes: Sequence[float]
    input_bytes: float = 0
    state_bytes_per_param_byte: float = 4.0
    host_per_action: float = 0.0
    bandwidth: float = math.inf
    message_host: float = 0.0
    fixed_costs: Sequence[float] = ()
    weight_ops: Sequence[Sequence[tuple[float, float]]] = ()

    def __post_init__(self) -> None:
        if isinstance(self.N, bool) or not isinstance(self.N, int) or self.N < 1:
            raise ValueError(f"Profile.N is the mini-batch's number of samples, an int ≥ 1; got {self.N!r}")
        L = len(self.costs)
        if not self.fixed_costs:
            object.__setattr__(self, "fixed_costs", (0.0,) * L)
        for name in ("costs", "activation_bytes", "output_bytes", "parameter_bytes", "fixed_costs"):
            values = tuple(float(x) for x in getattr(self, name))
            object.__setattr__(self, name, values)  # tuples: a frozen profile is not changed behind the plan's back
            if len(values) != L or L == 0:
                raise ValueError(f"Profile.{name} has {len(values)} entries; give one per layer, as costs ({L} ≥ 1)")
            if bad := [i for i, x in enumerate(values) if not (math.isfinite(x) and x >= 0)]:
                raise ValueError(f"Profile.{name}[{bad[0]}] is {values[bad[0]]}; every entry must be finite and ≥ 0")
        if self.weight_ops and len(self.weight_ops) != L:
            raise ValueError(f"Profile.weight_ops has {len(self.weight_ops)} entries; give one per layer ({L}) or none")
        ops = tuple(tuple((float(t), float(e)) for t, e in layer) for layer in self.weight_ops)
        object.__setattr__(self, "weight_ops", ops)
        for name in ("input_bytes", "state_bytes_per_param_byte", "host_per_action", "message_host"):
            if not (math.isfinite(x := getattr(self, name)) and x >= 0):
                raise ValueError(f"Profile.{name} is {x}; it must be finite and ≥ 0")
        if not self.bandwidth > 0:
            raise ValueError(f"Profile.bandwidth is {self.bandwidth} bytes/s; it must be > 0 (math.inf: free links)")

    @property
    def L(self) -> int:
        return len(self.costs)

    def micro_costs(self, M: int) -> list[float]:
        """Each layer's forward + backward on one of M micro-batches (what the split balances)."""
        return [c / M + f for c, f in zip(self.costs, self.fixed_costs)]


@dataclass(frozen=True, order=True)
class Candidate:
    """One way to run a step: a registered schedule, M micro-batches, v virtual stages a rank, re-materialization."""

    schedule: str
    M: int
    v: int
    checkpoint: Checkpoint

    def __str__(self) -> str:
        return f"schedule={self.schedule!r}, M={self.M}, v={self.v}, checkpoint={self.checkpoint!r}"


@dataclass(frozen=True)
class Prediction:
    """A simulated candidate: the layer counts of its vK stages, the step (seconds), the bubble (the simulator's idle
    share, recomputes included), each rank's peak bytes, whether it fits the budget, and the most actions one rank
    runs (recomputes included), with which :func:`check` spreads a missed step."""

    candidate: Candidate
    balance: list[int]
    step: float
    bubble: float
    peak_bytes: list[int]
    fits: bool = True
    actions: int = 0


class NoPlanFits(ValueError):
    """No candidate fits the memory budget; ``predictions`` holds them all, ranked, each with ``fits=False``."""

    def __init__(self, message: str, predictions: list[Prediction]) -> None:
        super().__init__(message)
        self.predictions = predictions

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.predictions)  # it crosses processes, as rank 0's error


def default_schedules() -> list[str]:
    """Every registered schedule the plan may choose (all but ``EXCLUDED``)."""
    return [name for name in SCHEDULES if name not in EXCLUDED]


def default_Ms(K: int, N: int) -> list[int]:
    """K, 2K, 4K and 8K micro-batches, those ≤ N (N when N < K): fewer than K leaves a rank idle for most of the
    step, and the interleaved schedules' rounds of M / (M // K) take these M whatever K."""
    return [M for M in (K, 2 * K, 4 * K, 8 * K) if M <= N] or [N]


def candidates(
    K: int,
    N: int,
    schedules: Collection[str] | None = None,
    Ms: Collection[int] | None = None,
    vs: Collection[int] = (1, 2, 3),
    checkpoints: Collection[Checkpoint] = CHECKPOINT_MODES,
    L: int | None = None,
) -> list[Candidate]:
    """The grid: each schedule (default: :func:`default_schedules`) with each M ≤ N (default: :func:`default_Ms`;
    the runtime splits N samples into at most N micro-batches), each v it accepts (with vK ≤ L layers) and each
    re-materialization mode, leaving out what the registry refuses (interleaving's M must fill its rounds)."""
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ValueError(f"K (the pipeline's ranks) must be an int ≥ 1, got {K!r}")
    names = default_schedules() if schedules is None else list(schedules)
    for name in names:
        lookup(name)  # its clear error for an unknown name
        if name in EXCLUDED:
            raise ValueError(
                f"schedule {name!r} is for a loss that needs the whole batch's forward (a mixture of experts' "
                "routers): choose it by name, not among the candidates of schedule='auto'"
            )
    Ms = default_Ms(K, N) if Ms is None else sorted(set(Ms))
    if bad := [M for M in Ms if isinstance(M, bool) or not isinstance(M, int) or M < 1]:
        raise ValueError(f"micro-batch counts must be ints ≥ 1, got {bad[0]!r}")
    for mode in checkpoints:
        if mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint={mode!r} is not one of {list(CHECKPOINT_MODES)}")
    grid = []
    for name, v, M, mode in itertools.product(names, sorted(set(vs)), Ms, checkpoints):
        if M > N or (v > 1 and K == 1) or (L is not None and v * K > L):
            continue
        try:
            lookup(name).actions(K, M, v)
        except ValueError:
            continue
        grid.append(Candidate(name, M, v, mode))
    return grid


def predict(profile: Profile, candidate: Candidate, K: int, search: bool = True) -> Prediction:
    """``candidate`` on K ranks: its split (the shortest simulated step: ``solve_virtual_stages``, or for a V a
    search from ``solve``'s; ``search=False``: ``solve``'s alone, quick on a large grid), then its step, bubble and
    peak memory per rank simulated on ``profile`` (the model in the module's docstring)."""
    name, M, v, mode = candidate.schedule, candidate.M, candidate.v, candidate.checkpoint
    if not 1 <= M <= profile.N:
        raise ValueError(f"{candidate}: M must be between 1 and N = {profile.N} (the runtime runs min(M, N))")
    if v * K > profile.L:
        raise ValueError(f"{candidate}: {v * K} stages (v·K) need as many layers; the profile has {profile.L}")
    placement = lookup(name).placement
    actions = executed(name, K, M, v)
    if not search:
        balance = solve(profile.micro_costs(M), v * K, _LAST_STAGE[mode])
    elif placement == "loop":
        balance = solve_virtual_stages(profile.micro_costs(M), K, v, M, mode, name)
    else:
        balance = _search_split(profile, candidate, K, actions, placement)
    result = simulate(actions, K, v, _costs(profile, balance, K, M, placement), checkpoint=mode, placement=placement)
    most = max(
        len(ops) + sum(a.kind in ("B", "I") and not keeps_graph(mode, ops, a.m, a.c) for a in ops) for ops in actions
    )
    peaks = _peaks(profile, balance, candidate, K, actions)
    return Prediction(candidate, balance, result.makespan, result.bubble, peaks, actions=most)


def plan(
    profile: Profile,
    K: int,
    budget_bytes: int | None = None,
    *,
    schedules: Collection[str] | None = None,
    Ms: Collection[int] | None = None,
    vs: Collection[int] = (1, 2, 3),
    checkpoints: Collection[Checkpoint] = CHECKPOINT_MODES,
    searched: int = 8,
) -> list[Prediction]:
    """Every candidate (:func:`candidates`) predicted, those whose peak on every rank is ≤ ``budget_bytes`` first
    (None: no limit), each group by predicted step (then peak, then actions: the leaner of equals); the first is the
    plan. :class:`NoPlanFits` (a ValueError naming the leanest candidate and the budget) when none fits.

    Each candidate is predicted on ``solve``'s split, then the ``searched`` fastest that fit on the split of the
    shortest simulated step (:func:`predict`; seconds each on a deep model), kept where it predicts shorter."""
    if budget_bytes is not None and not budget_bytes > 0:
        raise ValueError(f"budget_bytes is {budget_bytes}; give the bytes a rank may hold (> 0), or None: no limit")
    grid = candidates(K, profile.N, schedules, Ms, vs, checkpoints, profile.L)
    if not grid:
        raise ValueError(
            f"no candidate to plan for K = {K}, N = {profile.N}, L = {profile.L}: every schedule refused every M and "
            "v asked for; give other micro-batch counts (Ms) or virtual stages (vs)"
        )

    def ranked(predictions: list[Prediction]) -> list[Prediction]:
        marked = [replace(p, fits=budget_bytes is None or max(p.peak_bytes) <= budget_bytes) for p in predictions]
        return sorted(marked, key=lambda p: (not p.fits, p.step, max(p.peak_bytes), p.actions, p.candidate))

    quick = ranked([predict(profile, c, K, search=False) for c in grid])
    found = ranked([predict(profile, p.candidate, K) for p in quick[:searched] if p.fits])
    better = {p.candidate: p for p in found if p.fits}
    ranks = ranked([min(p, better.get(p.candidate, p), key=lambda q: q.step) for p in quick])
    if not ranks[0].fits:
        leanest = min(ranks, key=lambda p: max(p.peak_bytes))
        fix = "" if "always" in checkpoints else ", re-materialization (checkpoint='always' among the candidates)"
        raise NoPlanFits(
            f"no candidate fits the memory budget of {_mib(budget_bytes or 0)} MiB per rank: the leanest, "
            f"{leanest.candidate}, peaks at {_mib(max(leanest.peak_bytes))} MiB; raise the budget, or use more "
            f"ranks (K), fewer samples per step (N){fix}",
            ranks,
        )
    return ranks


def describe(predictions: Sequence[Prediction], top: int = 5) -> str:
    """The first ``top`` predictions as a table for rank 0 to print: schedule, M, v, re-materialization, predicted
    step, bubble, each rank's peak memory."""
    rows = [("schedule", "M", "v", "re-materialization", "step (ms)", "bubble", "peak per rank (MiB)", "fits")]
    for p in predictions[:top]:
        c, peaks = p.candidate, " / ".join(_mib(b) for b in p.peak_bytes)
        step, bubble = f"{p.step * 1e3:.3f}", f"{p.bubble:.1%}"
        rows.append((c.schedule, str(c.M), str(c.v), c.checkpoint, step, bubble, peaks, "yes" if p.fits else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def check(prediction: Prediction, measured_step: float, others: Sequence[Prediction]) -> Verdict | None:
    """After a few steps: None when the measured step is within ``MISS`` of the prediction; else what was missed, with
    a candidate among ``others`` (that fits) predicted faster by ``MARGIN`` once the model is corrected, if any.

    The correction: a step slower than predicted is taken as a time per action the profile missed (spread over the
    busiest rank's actions, added to every candidate by its own count: it favours fewer micro-batches); a faster one
    as every cost overestimated by one factor (every prediction rescaled by measured / predicted)."""
    if not (math.isfinite(measured_step) and measured_step > 0):
        raise ValueError(f"the measured step must be a positive number of seconds, got {measured_step}")
    ratio = measured_step / prediction.step
    if abs(ratio - 1) <= MISS:
        return None
    extra = (measured_step - prediction.step) / max(1, prediction.actions)

    def corrected(p: Prediction) -> float:
        return p.step + extra * p.actions if extra > 0 else p.step * ratio

    text = (
        f"schedule='auto' chose {prediction.candidate}, predicted {prediction.step * 1e3:.3f} ms a step; the traced "
        f"steps took {measured_step * 1e3:.3f} ms ({ratio - 1:+.0%})"
    )
    rivals = [p for p in others if p.fits and p.candidate != prediction.candidate]
    better = min(rivals, key=corrected, default=None)
    if better is not None and corrected(better) < (1 - MARGIN) * measured_step:
        how = f"{extra * 1e3:.3f} ms more per action" if extra > 0 else f"every cost × {ratio:.2f}"
        return Verdict(
            f"{text}. Corrected for it ({how}), {better.candidate} would take {corrected(better) * 1e3:.3f} ms: "
            "pass it explicitly (schedule, chunks, virtual_stages, checkpoint) to try it",
            better,
        )
    text += f". Corrected for it, no other candidate is predicted faster by {MARGIN:.0%}: the choice stands"
    return Verdict(text, None)


class Verdict(NamedTuple):
    """:func:`check`'s finding: what it says, and the candidate it names instead (None: the choice stands)."""

    message: str
    better: Prediction | None


def layer_bytes(module: nn.Sequential, sample: Any) -> tuple[list[float], list[float], list[float]]:
    """Per layer of ``module`` on ``sample`` (fed through the layers before it, as a stage's input requiring grad):
    the bytes autograd saves for its backward (its parameters and what an earlier layer saved already left out), its
    output's bytes, and its parameters' (a weight tied to an earlier layer's counted there). One forward under grad,
    nothing kept; buffers (BatchNorm's statistics) and the RNG streams as they were."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    saved, seen = _Saved(), set()
    activation, output, parameters = [], [], []
    leaf = lambda t: t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t  # noqa: E731
    x = tree_map(leaf, sample)
    cuda = cuda_devices_of(*module.parameters(), *tensors(sample))
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        for layer in module:
            params = [p for p in layer.parameters() if id(p) not in seen]
            seen |= {id(p) for p in params}
            parameters.append(float(sum(p.nbytes for p in params)))
            saved.begin(layer)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                x = layer(x)
            activation.append(saved.layer_bytes)
            output.append(float(sum(t.nbytes for t in tensors(x))))
    with torch.no_grad():
        for b, before in buffers:
            b.copy_(before)
    return activation, output, parameters


class _Saved:
    """What autograd saves while one layer runs: each storage once over all layers, the layer's weights left out."""

    def __init__(self) -> None:
        self.storages: set[int] = set()
        self.weights: set[int] = set()
        self.layer_bytes = 0.0

    def begin(self, layer: nn.Module) -> None:
        self.weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        self.layer_bytes = 0.0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in self.weights and key not in self.storages:
            self.storages.add(key)
            self.layer_bytes += t.untyped_storage().nbytes()
        return t


def fit_layer_costs(
    small: Sequence[float], large: Sequence[float], n_small: int, n_large: int, N: int
) -> tuple[list[float], list[float]]:
    """Each layer's (part that grows with the samples, on N; fixed part) from its forward + backward time on
    ``n_small`` and on ``n_large`` samples: the line through the two, its slope and intercept kept ≥ 0."""
    if not 0 < n_small < n_large:
        raise ValueError(f"two sample counts 0 < n_small < n_large are needed, got {n_small} and {n_large}")
    costs, fixed = [], []
    for a, b in zip(small, large, strict=True):
        slope = max(0.0, (b - a) / (n_large - n_small))
        costs.append(slope * N)
        fixed.append(max(0.0, a - slope * n_small))
    return costs, fixed


def _bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """Each stage's layers as [start, end)."""
    ends = list(itertools.accumulate(balance))
    return list(zip([0, *ends[:-1]], ends))


def _costs(
    profile: Profile, balance: Sequence[int], K: int, M: int, placement: Placement
) -> dict[tuple[int, int], Costs]:
    """Per (rank, chunk): the Costs of the stage there on a micro-batch of N/M samples (the module's docstring)."""
    share, out = 1 / M, {}
    for s, (a, b) in enumerate(_bounds(balance)):
        c = sum(profile.costs[a:b]) * share + sum(profile.fixed_costs[a:b])
        # the stage's output goes down, the gradient of its input (the previous layer's output) comes back up
        sent = profile.output_bytes[b - 1] * share / profile.bandwidth
        received = (profile.output_bytes[a - 1] if a else profile.input_bytes) * share / profile.bandwidth
        f, h = c / 3 + profile.host_per_action, profile.message_host
        i, w = (f, f) if not profile.weight_ops else _split(profile.weight_ops[a:b], c, K, M, profile.host_per_action)
        out[rank_of(s, K, placement), chunk_of(s, K, placement)] = Costs(
            F=f, B=f + c / 3, I=i, W=w, R=f, transfer=sent, grad_transfer=received, send_host=h, recv_host=h
        )
    return out


def _split(ops: Sequence[Sequence[tuple[float, float]]], c: float, K: int, M: int, host: float) -> tuple[float, float]:
    """(I, W) of a chunk of cost c a micro-batch whose layers hold ``ops``: W gets the ops that split at (K, M)
    (``split_cost.pays``, as the runtime decides) with what the split costs each, I the rest of the backward's 2c/3
    (at least half of it: the input gradients)."""
    moved = cost = 0.0
    for layer in ops:
        for t, extra in layer:
            if pays(t / M, extra, K, M):
                moved += t / M
                cost += HOST_SECONDS + extra * t / M
    moved = min(moved, c / 3)
    return 2 * c / 3 - moved + host, moved + cost + host


def _search_split(
    profile: Profile, candidate: Candidate, K: int, actions: list[list[Action]], placement: Placement
) -> list[int]:
    """The split of the shortest simulated step: every split when they fit in ``SIMULATED_ACTIONS``, else from
    ``solve``'s, one cut moved one layer at a time while it shortens (``solve_virtual_stages`` does the same on the
    loop placement, whose (rank, chunk) it keys its costs by: a V needs its own)."""
    M, v, mode, L = candidate.M, candidate.v, candidate.checkpoint, profile.L

    def step(counts: list[int]) -> float:
        costs = _costs(profile, counts, K, M, placement)
        return simulate(actions, K, v, costs, checkpoint=mode, placement=placement).makespan

    best = solve(profile.micro_costs(M), v * K, _LAST_STAGE[mode])
    budget = max(1, SIMULATED_ACTIONS // sum(map(len, actions)))
    if math.comb(L - 1, v * K - 1) <= budget:  # solve's split first: it stays among equals
        every = (
            [b - a for a, b in zip((0, *cuts), (*cuts, L))] for cuts in itertools.combinations(range(1, L), v * K - 1)
        )
        return min(itertools.chain([best], every), key=step)
    best_step = step(best)
    while budget > 0:
        moves = [
            [n + d * ((i == k) - (i == k + 1)) for i, n in enumerate(best)]
            for k in range(len(best) - 1)
            for d in (-1, 1)
        ]
        tried = [(step(m), m) for m in moves[:budget] if min(m) >= 1]
        budget -= len(moves)
        found = min(tried, default=(math.inf, best))
        if found[0] >= best_step:
            break
        best_step, best = found
    return best


def _peaks(
    profile: Profile, balance: Sequence[int], candidate: Candidate, K: int, actions: list[list[Action]]
) -> list[int]:
    """Each rank's peak bytes (the module's docstring). A rank's memory changes only in its own actions, so their
    order decides its peak, whatever the timing: the running sum over its actions, each taking before it releases."""
    bounds, sizes, mode = _bounds(balance), micro_batch_sizes(profile.N, candidate.M), candidate.checkpoint
    placement, peaks = lookup(candidate.schedule).placement, []
    for r, ops in enumerate(actions):
        stages = [bounds[stage_of(c, r, K, placement)] for c in range(candidate.v)]
        held = sum(sum(profile.parameter_bytes[a:b]) for a, b in stages) * profile.state_bytes_per_param_byte
        top = held
        for act in ops:
            a, b = stages[act.c]
            share = sizes[act.m] / profile.N
            graph = sum(profile.activation_bytes[a:b]) * share
            boundary = (profile.output_bytes[a - 1] if a else profile.input_bytes) * share
            kept = keeps_graph(mode, ops, act.m, act.c)
            if act.kind == "F":
                held += graph if kept else boundary
            elif act.kind in ("B", "I") and not kept:  # the recompute rebuilds the graph from the boundary
                held += graph - boundary
            top = max(top, held)
            if act.kind in ("B", "W"):
                held -= graph
        peaks.append(round(top))
    return peaks


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"
