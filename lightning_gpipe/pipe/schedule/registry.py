"""Pipeline schedules as data: per rank, the ordered forward and backward actions of each micro-batch on each chunk.

A schedule is, per rank, a list of actions; the sends and receives follow from it (``pipe.schedule.simulator``
derives them, checks the lists and times them). F m = forward of micro-batch m; B m = its backward (on the last
stage it begins with the loss of micro-batch m, so it can start as soon as its forward ends); I m and W m = B m's
halves, the input gradient (which the previous stage waits for) and the weight gradient (which nobody waits for).
With v virtual stages per rank, a letter names the chunk: rank r holds stages r (a), r + K (b), … Drawn by
``simulator.draw``: every action one unit long, sends that never stall ('.' = idle); "peak live": most micro-batches
(per chunk) between F and B or W.

K = 3 ranks, M = 4 micro-batches:

    "gpipe"                                     "1f1b" (warm-up: min(M, K − k) forwards)
     t |  0  1  2  3  4  5  6  7  8  9 10 11     t |  0  1  2  3  4  5  6  7  8  9 10 11
    r0 | F0 F1 F2 F3  .  . B0 B1  . B2  . B3    r0 | F0 F1 F2  .  . B0 F3 B1  . B2  . B3
    r1 |  . F0 F1 F2 F3 B0 B1  . B2  . B3       r1 |  . F0 F1  . B0 F2 B1 F3 B2  . B3
    r2 |  .  . F0 B0 F1 B1 F2 B2 F3 B3          r2 |  .  . F0 B0 F1 B1 F2 B2 F3 B3
    peak live per rank: 4, 4, 1                 peak live per rank: 3, 2, 1

Both take 2(M + K − 1) units, GPipe's bubble and nothing else: no stage waits for a loss computed on the whole
batch between the phases. 1F1B keeps at most K − k micro-batches' activations on rank k instead of M. Under NCCL
with sends that wait for their receive, GPipe's middle ranks cannot run ahead of the last one: on one downstream
communicator a rank's receive from rank k − 1 queues behind its send to rank k + 1 (``simulate``, ``nccl=True``).

A loss that needs every micro-batch's forward (a mixture of experts' load-balancing loss: a product of two means over
the whole batch) runs under GPipe's order on the last rank too, which then holds M micro-batches; as long:

    "fill-drain"
     t |  0  1  2  3  4  5  6  7  8  9 10 11
    r0 | F0 F1 F2 F3  .  .  .  . B0 B1 B2 B3
    r1 |  . F0 F1 F2 F3  .  . B0 B1 B2 B3
    r2 |  .  . F0 F1 F2 F3 B0 B1 B2 B3
    peak live per rank: 4, 4, 4

ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"; torch's ZB1P with one chunk per rank): 1F1B's order with
B split, rank k deferring its W's by k backwards, which then fill the cool-down. With I = W = 1 it takes
3M + K − 1 units where 1F1B (B = 2) takes 3(M + K − 1); every rank holds min(M, K), 1F1B's rank 0 peak:

    "zb-h1"
     t |  0  1  2  3  4  5  6  7  8  9 10 11 12 13
    r0 | F0 F1 F2  .  . I0 W0 F3 I1 W1 I2 W2 I3 W3
    r1 |  . F0 F1  . I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
    r2 |  .  . F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3
    peak live per rank: 3, 3, 3

Interleaved 1F1B (Narayanan et al. 2021; the order of torch's ScheduleInterleaved1F1B, without its idle padding),
K = 2, M = 4, v = 2, each chunk half a stage: the bubble shrinks by v, for more activations in flight:

    "interleaved-1f1b"
     t |   0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17
    r0 | F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a   . B2b   . B3b B2a B3a
    r1 |   . F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a
    peak live per rank: 5, 3

Interleaved zero bubble (torch's ScheduleInterleavedZeroBubble, without its idle padding): interleaving's order with
each backward split as ZB-H1's, a shorter warm-up, rank r deferring its W's by r backwards; the activations of 1F1B
(4 half stages here), the bubble of interleaving and zero bubble together. Two ranks exchange activations and
gradients in each direction here, each end in its own order of the two: they travel apart (``Transport``'s tags):

    "interleaved-zb"
     t |   0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17  18  19  20  21  22  23  24
    r0 | F0a F1a F0b F1b   . I0b W0b F2a I1b W1b F3a I0a W0a F2b I1a W1a F3b I2b W2b I3b W3b I2a W2a I3a W3a
    r1 |   . F0a F1a F0b I0b F1b I1b W0b F2a I0a W1b F3a I1a W0a F2b I2b W1a F3b I3b W2b I2a W3b I3a W2a W3a
    peak live per rank: 4, 4

ZB-V (the same paper, section 6; torch's ScheduleZBVZeroBubble): two chunks per rank placed in a V, rank r holding
stage r (a) and stage 2K − 1 − r (b), so a micro-batch goes down the ranks and back up: rank K − 1 hands it from its
chunk a to its chunk b, rank 0 holds the first and the last stage. With F = I = W per chunk it has no bubble but the
ramp, at 1F1B's activation memory (a chunk holds half a stage's), K = 2, M = 4, v = 2:

    "zb-v"
     t |   0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17  18  19  20  21  22  23  24
    r0 | F0a F1a F2a F0b I0b W0b F1b I1b W1b F3a I0a W0a F2b I2b W2b I1a W1a F3b I3b W3b I2a W2a I3a W3a
    r1 |   . F0a F0b F1a F1b I0b W0b F2a I0a W0a F2b I1b W1b F3a I1a W1a F3b I2b W2b I2a I3b I3a W2a W3b W3a
    peak live per rank: 4, 4
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:  # the registry and the simulator need no torch
    from lightning_gpipe.pipe.state.rematerialize import Checkpoint

# The registered schedules' names (SCHEDULES below holds one spec each).
ScheduleName = Literal["gpipe", "fill-drain", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb", "zb-v"]
# Where a rank's chunks sit in the backbone: "loop" (interleaving), chunk c of rank r is stage c·K + r; "v" (two
# chunks), rank r holds stage r on the way down and 2K − 1 − r on the way back, so rank K − 1 holds the middle two
# (a hand-off, no transfer) and rank 0 the first and the last.
Placement = Literal["loop", "v"]

Kind = Literal["F", "B", "I", "W"]


class Action(NamedTuple):
    """One unit of a rank's work: F (forward), B (backward), or B's halves I (input gradient: what the previous
    stage waits for) and W (weight gradient: nobody waits for it), of micro-batch ``m`` on the rank's chunk ``c``.

    Rank r of K holds virtual stages (chunks) c = 0 … v−1, the stages r, r + K, …, r + (v−1)K: chunk c is stage c·K + r.
    """

    kind: Kind
    m: int
    c: int = 0

    def label(self, v: int) -> str:
        """As drawn: kind, micro-batch, and the chunk as a letter (a, b, …) when the rank holds several."""
        return f"{self.kind}{self.m}" + (chr(ord("a") + self.c) if v > 1 else "")


Build = Callable[[int, int, int], list[list[Action]]]


def stage_of(c: int, r: int, K: int, placement: Placement = "loop") -> int:
    """The stage chunk c of rank r is."""
    if placement == "v":
        return r if c == 0 else 2 * K - 1 - r
    return c * K + r


def rank_of(s: int, K: int, placement: Placement = "loop") -> int:
    """The rank holding stage s."""
    if placement == "v":
        return s if s < K else 2 * K - 1 - s
    return s % K


def chunk_of(s: int, K: int, placement: Placement = "loop") -> int:
    """Which of its rank's chunks stage s is."""
    return s // K


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered schedule: ``build(K, M, v)`` gives each rank's actions; ``v`` from ``v_min`` to ``v_max``
    (None: no bound); ``example``: (K, M, v) drawn above."""

    name: ScheduleName
    build: Build
    description: str
    v_min: int = 1
    v_max: int | None = 1
    example: tuple[int, int, int] = (3, 4, 1)
    placement: Placement = "loop"

    def accepts(self, v: int) -> bool:
        return self.v_min <= v and (self.v_max is None or v <= self.v_max)

    def actions(self, K: int, M: int, v: int = 1) -> list[list[Action]]:
        """Each rank's actions for K ranks, M micro-batches, v virtual stages a rank; a clear ValueError if refused."""
        for what, n in (("K", K), ("M", M), ("v", v)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"schedule {self.name!r}: {what} must be a positive integer, got {n!r}")
        if not self.accepts(v):
            allowed = f"v = {self.v_min}" if self.v_max == self.v_min else f"v ≥ {self.v_min}"
            raise ValueError(
                f"schedule {self.name!r} takes {allowed} virtual stages per rank, got v = {v}"
                + ("; with several virtual stages per rank use 'interleaved-1f1b'" if self.v_max == 1 else "")
                + ("; with one chunk per rank use '1f1b'" if self.v_min > 1 else "")
            )
        return self.build(K, M, v)


def gpipe(K: int, M: int, v: int) -> list[list[Action]]:
    """Every forward, then every backward; the last stage runs each backward right after its forward."""
    last = [a for m in range(M) for a in (Action("F", m), Action("B", m))]
    fill_drain = [Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)]
    return [last if k == K - 1 else list(fill_drain) for k in range(K)]


def fill_drain(K: int, M: int, v: int) -> list[list[Action]]:
    """GPipe's order on every rank, the last one too: every forward before the first loss (r2 above runs F0 … F3,
    then B0 … B3), for a loss that needs the forward of the whole batch (a mixture of experts' load-balancing loss,
    ``lightning_gpipe.hf``). The last stage keeps its M micro-batches until their backward."""
    return [[Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)] for _ in range(K)]


def one_f_one_b(K: int, M: int, v: int) -> list[list[Action]]:
    """min(M, K − k) forwards on rank k, then a backward and a forward by turns, then the remaining backwards."""
    ranks = []
    for k in range(K):
        warm_up = min(M, K - k)
        ops = [Action("F", m) for m in range(warm_up)]
        for m in range(M):
            ops.append(Action("B", m))
            if warm_up + m < M:
                ops.append(Action("F", warm_up + m))
        ranks.append(ops)
    return ranks


def zb_h1(K: int, M: int, v: int) -> list[list[Action]]:
    """1F1B with each backward split into I and W; rank k defers its W's by k backwards into the cool-down."""
    ranks = []
    for k in range(K):
        warm_up = min(M, K - k)
        ops = [Action("F", m) for m in range(warm_up)]
        w = 0
        for m in range(M):
            ops.append(Action("I", m))
            if m >= k:
                ops.append(Action("W", w))
                w += 1
            if warm_up + m < M:
                ops.append(Action("F", warm_up + m))
        ops += [Action("W", m) for m in range(w, M)]
        ranks.append(ops)
    return ranks


def _per_round(name: str, K: int, M: int) -> int:
    """Micro-batches per round of torch's interleaved schedules: M / max(1, M // K), which must divide M."""
    rounds = max(1, M // K)
    if M % rounds:
        fits = sorted({n for n in (M - M % K, M + K - M % K) if n and n % max(1, n // K) == 0})
        raise ValueError(
            f"schedule {name!r} runs M micro-batches in rounds of M / max(1, M // K) (as torch's interleaved "
            f"schedules do), which needs M to be a multiple of max(1, M // K) = {rounds}: "
            f"M = {M} with K = {K} is not; use M < {2 * K}, or M = {' or '.join(map(str, fits))}"
        )
    return M // rounds


def interleaved_1f1b(K: int, M: int, v: int) -> list[list[Action]]:
    """torch.distributed.pipelining's ScheduleInterleaved1F1B (Megatron's order), without its idle padding: the
    micro-batches go in rounds of M / max(1, M // K), each round through chunk 0, 1, … forward, backward in reverse."""
    per_round = _per_round("interleaved-1f1b", K, M)
    ranks = []
    for r in range(K):
        warm_up = min((v - 1) * per_round + 2 * (K - 1 - r), M * v)
        next_f, next_b = [0] * v, [0] * v
        ops = []
        for step in range(M * v + warm_up):
            if step < M * v:
                c = (step // per_round) % v
                ops.append(Action("F", next_f[c], c))
                next_f[c] += 1
            if step >= warm_up:
                c = v - 1 - ((step - warm_up) // per_round) % v
                ops.append(Action("B", next_b[c], c))
                next_b[c] += 1
        ranks.append(ops)
    return ranks


def interleaved_zb(K: int, M: int, v: int) -> list[list[Action]]:
    """torch.distributed.pipelining's ScheduleInterleavedZeroBubble, without its idle padding: interleaving's rounds
    with a warm-up of (v − 1)·M/rounds + K − 1 − r forwards, each backward split into I and W, rank r deferring its
    W's by r backwards into the cool-down (as "zb-h1" does with one chunk)."""
    per_round = _per_round("interleaved-zb", K, M)
    return [_interleaved_zb_rank(K, M, v, r, per_round) for r in range(K)]


def _interleaved_zb_rank(K: int, M: int, v: int, r: int, per_round: int) -> list[Action]:
    warm_up = min((v - 1) * per_round + K - 1 - r, M * v)
    index: dict[Kind, list[int]] = {"F": [0] * v, "I": [0] * v, "W": [0] * v}
    chunks: list[int] = []  # each I's chunk, in order: the W's follow them
    ops: list[Action] = []

    def act(kind: Kind, c: int) -> None:
        ops.append(Action(kind, index[kind][c], c))
        index[kind][c] += 1

    for op in range(M * v + warm_up):
        if op < M * v:
            act("F", (op // per_round) % v)
        if op >= warm_up:
            chunks.append(v - 1 - ((op - warm_up) // per_round) % v)
            act("I", chunks[-1])
            if op - warm_up >= r:
                act("W", chunks[sum(index["W"])])
    while sum(index["W"]) < len(chunks):
        act("W", chunks[sum(index["W"])])
    return ops


def zb_v(K: int, M: int, v: int) -> list[list[Action]]:
    """torch.distributed.pipelining's ScheduleZBVZeroBubble (Qi et al., "Zero Bubble Pipeline Parallelism", §6): two
    chunks per rank in a V (chunk 0 = stage r, chunk 1 = stage 2K − 1 − r). Rank r warms up with 2(K − r) − 1
    forwards of chunk 0, then r pairs of forwards on chunk 1 and 0, then K − r rounds of F, I, W on chunk 1; the
    steady state runs F, I, W on chunk 0 and on chunk 1 by turns; the cool-down runs the input gradients first and
    the deferred weight gradients last. Built for max(M, 2K − 1) micro-batches, as torch does, those beyond M left
    out."""
    n = max(M, 2 * K - 1)
    return [[a for a in _zb_v_rank(K, n, r) if a.m < M] for r in range(K)]


def _zb_v_rank(K: int, n: int, r: int) -> list[Action]:
    ops: list[Action] = []
    f, b = [0, 0], [0, 0]  # the next forward and input gradient, per chunk

    def forward(c: int) -> None:
        ops.append(Action("F", f[c], c))
        f[c] += 1

    def halves(c: int, weight: bool = True) -> None:
        ops.extend([Action("I", b[c], c), Action("W", b[c], c)] if weight else [Action("I", b[c], c)])
        b[c] += 1

    for _ in range(2 * (K - r) - 1):
        forward(0)
    for _ in range(r):
        forward(1)
        forward(0)
    for _ in range(K - r):
        forward(1)
        halves(1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            forward(0)
        halves(0)
        forward(1)
        halves(1)
    w = list(b)
    for _ in range(r):
        halves(0, weight=False)
        halves(1, weight=False)
    for _ in range(K - r):
        halves(0, weight=False)
        ops.append(Action("W", w[0], 0))
        w[0] += 1
    return ops + [Action("W", m, 1) for m in range(w[1], b[1])] + [Action("W", m, 0) for m in range(w[0], b[0])]


SCHEDULES: dict[ScheduleName, ScheduleSpec] = {
    s.name: s
    for s in (
        ScheduleSpec("gpipe", gpipe, "fill/drain: every forward, then every backward (M in flight)"),
        ScheduleSpec("fill-drain", fill_drain, "GPipe's order on the last stage too: every forward before any loss"),
        ScheduleSpec("1f1b", one_f_one_b, "one forward, one backward: at most K − k in flight on rank k"),
        ScheduleSpec(
            "interleaved-1f1b",
            interleaved_1f1b,
            "1F1B over v virtual stages per rank (stages r, r + K, …): the bubble divided by v",
            v_min=2,
            v_max=None,
            example=(2, 4, 2),
        ),
        ScheduleSpec(
            "zb-h1",
            zb_h1,
            "1F1B with backward split into I and W, W deferred into the cool-down",
            example=(3, 4, 1),
        ),
        ScheduleSpec(
            "interleaved-zb",
            interleaved_zb,
            "interleaving with each backward split into I and W, W deferred into the cool-down",
            v_min=2,
            v_max=None,
            example=(2, 4, 2),
        ),
        ScheduleSpec(
            "zb-v",
            zb_v,
            "zero bubble over two chunks per rank in a V: 1F1B's activation memory",
            v_min=2,
            v_max=2,
            example=(2, 4, 2),
            placement="v",
        ),
    )
}


def lookup(name: str) -> ScheduleSpec:
    """The registered schedule ``name``, or a ValueError naming the registered ones."""
    if isinstance(name, str) and name in SCHEDULES:
        return SCHEDULES[name]
    raise ValueError(f"schedule={name!r} is not one of {list(SCHEDULES)}")


def fuse_halves(actions: Sequence[Action], r: int) -> list[Action]:
    """Rank r's actions with each I m of stage 0 right before its W m run as one B m: split, they would send nothing
    earlier (nobody waits for stage 0's input gradient; rank 0 of "zb-h1" always) and pay for the split. Elsewhere the
    I sends its gradient before the W runs (the last stage of "zb-v", on rank 0 too, runs I m, W m by turns)."""
    out: list[Action] = []
    for a in actions:
        if r == 0 and a.c == 0 and a.kind == "W" and out and out[-1] == Action("I", a.m, a.c):
            out[-1] = Action("B", a.m, a.c)
        else:
            out.append(a)
    return out


def executed(schedule: str, K: int, M: int, v: int = 1) -> list[list[Action]]:
    """Every rank's actions of ``schedule`` as the runtime runs them (:func:`fuse_halves`)."""
    return [fuse_halves(ops, r) for r, ops in enumerate(lookup(schedule).actions(K, M, v))]


def keeps_graph(mode: Checkpoint, actions: Sequence[Action], m: int, c: int = 0) -> bool:
    """Whether micro-batch m keeps chunk c's inner activations from its forward to its backward (else: recomputed).

    ``except_last`` keeps them when the rank's next action after the forward is that backward (or its input half):
    recomputing would only delay it."""
    if mode != "except_last":
        return mode == "never"
    at = actions.index(Action("F", m, c))
    return at + 1 < len(actions) and actions[at + 1] in (Action("B", m, c), Action("I", m, c))


def inputs_ahead(
    actions: Sequence[Action], K: int, r: int, v: int = 1, placement: Placement = "loop"
) -> dict[int, int]:
    """Rank r's inputs received ahead: from the position of each F that receives its input, the position of the F
    whose input is the next receive from the same rank, where no output gradient from that rank comes between them
    (both transports match a peer's messages in order, so it is posted right after the first one was received)."""
    ahead: dict[int, int] = {}
    latest: dict[int, int] = {}  # source rank -> the position of its latest receive
    S = v * K
    for pos, a in enumerate(actions):
        s = stage_of(a.c, r, K, placement)
        if a.kind == "F" and s > 0:
            src = rank_of(s - 1, K, placement)
        elif a.kind in ("B", "I") and s < S - 1:
            src = rank_of(s + 1, K, placement)
        else:
            continue
        if src == r:  # a hand-off between the rank's own chunks
            continue
        before = latest.get(src)
        if a.kind == "F" and before is not None and actions[before].kind == "F":
            ahead[before] = pos
        latest[src] = pos
    return ahead
