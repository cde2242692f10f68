"""Runs a schedule's action lists on a model of the runtime and of NCCL: validity, deadlocks, timing, peak memory.

What it assumes the runtime does (``forward_backward``, ``Executor.forward_micro``/``backward_micro``, ``Transport``):

* Rank r runs its actions in order. Chunk c of rank r is stage s = c·K + r of S = vK: micro-batch m's forward goes
  stage 0 → S − 1 and its backward back; the last stage's B (or I) begins with m's loss, so it needs no receive.
* F(m) on stage s > 0 receives m's activation from stage s − 1 when it starts (``Links.receive``: the header on the
  gloo group, then the tensors' receives) and waits for it; it computes, then posts the send of its output to stage
  s + 1 (none from the last stage). Where the next receive from that rank is an F's input too
  (``registry.inputs_ahead``), its receive is posted as the F computes (``ahead=True``, as the runtime does on NCCL:
  ``Links.receive_ahead``, its tensors posted at the first poll after their header came, taken here as the moment
  the send is posted), so that input's bytes move while the rank computes. A send never blocks the rank, only its
  communicator's queue; posting it takes the rank's host ``send_host`` (pickling the header, one isend per
  tensor), after which the message leaves.
* B(m) or I(m) on stage s < S − 1 posts the receive of m's output gradient from stage s + 1 when it starts, header
  and tensors at once (``backward_micro``: the shapes are known), then recomputes (cost R, when the graph was not
  kept: ``keeps_graph``), then waits, computes, and posts the send of the input gradient to stage s − 1 (none from
  stage 0). Posting that receive and reading it take the rank's host ``recv_host``, charged with the posting (when
  the wait is long, the reading hides in it). W needs nothing. After its last action a rank waits until its sends
  were received (``wait_sends``).
* Communication as NCCL runs it, as ``nccl_order`` checks it on CPU: per rank, one queue per communicator, run one
  operation at a time in posting order; a send completes only when the matching receive runs (a large send's
  rendezvous, the worst case the runtime must survive); the n-th send a → b on a communicator meets b's n-th receive
  from a, whatever either meant (a mismatch is an error: NCCL would hand over the wrong micro-batch's bytes). On
  NCCL the host does not wait for tensor data (the stream does), but each queue's order is the actions' order,
  which is all the model needs. ``nccl=False`` models gloo: buffered sends, matched in order, no queue. Headers
  travel on a gloo group and are not modelled.
* The communicator layout is the runtime's, ``layout="link"``: ``Transport._data_group`` sends each directed pair of
  ranks' tensors on a communicator of their own (``groups.link_groups``), so a rank's receive never waits behind its
  own send to another rank, and activations apart from input gradients (a group each where a direction carries both,
  at K = 2; on gloo, tags), since each end may post the two kinds in its own order. ``"rank-order"``: the layout
  before it, two communicators over the pipeline's ranks, one for sends to a higher rank and one for sends to a
  lower rank (a middle rank's receive from below then queues
  behind its send above: about 1.5× the makespan of gpipe with the loss inside at K = 4–8 once transfers cost,
  ``tests/engine/test_schedules.py``); ``"flow"``: activations on one, gradients on the other, whatever the ranks;
  ``"single"``: one for everything (the layout that hung, to show the check catches it). A transfer between two
  virtual stages of one rank is a local hand-off.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from lightning_gpipe.pipe.schedule.registry import (
    Action,
    Placement,
    chunk_of,
    inputs_ahead,
    keeps_graph,
    rank_of,
    stage_of,
)

if TYPE_CHECKING:
    from lightning_gpipe.pipe.state.rematerialize import Checkpoint

Layout = Literal["rank-order", "flow", "single", "link"]
Message = tuple[str, int, int]  # ("activation" | "gradient", micro-batch, the stage that sends it)


class ScheduleError(ValueError):
    """A schedule that is invalid, or that deadlocks or mixes up micro-batches under the modelled communication."""


@dataclass(frozen=True)
class Costs:
    """Time units of each action on one chunk; R: the recompute before a backward whose graph was not kept;
    F_kept: the forward of a micro-batch whose graph is kept (None: ``F``; on the CPU a dropped one runs without
    autograd, so the two differ); transfer: from a send and its receive both running to both completing;
    grad_transfer: the same for the chunk's input gradient, sent back (None: ``transfer``; the two differ where the
    stage's input and output do). send_host: the rank's own time to post the send of the chunk's output, which
    leaves after it; grad_send_host: the same for its input gradient (None: ``send_host``); recv_host: its own time
    to post the receive of the chunk's output gradient and read it (what the transfers do not hold: a message's
    host work is the rank's, not the link's)."""

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 (the zero-bubble paper's name)
    W: float = 1.0
    R: float = 0.0
    transfer: float = 0.0
    grad_transfer: float | None = None
    F_kept: float | None = None
    send_host: float = 0.0
    grad_send_host: float | None = None
    recv_host: float = 0.0


@dataclass
class SimulationResult:
    finish: list[float]  # per rank: its last action ended and every send it posted was received
    makespan: float
    peak: list[int]  # per rank: most (micro-batch, chunk) pairs live at once, from F to B (or W)
    bubble: float  # the idle fraction of the ranks' time, K × makespan
    timeline: list[list[tuple[Action, float, float]]] = field(repr=False)  # per rank: (action, start, end)


@dataclass
class _Op:
    """A posted send or receive on one rank's queue of one communicator."""

    send: bool
    rank: int
    peer: int
    message: Message
    comm: str
    posted: float

    def __str__(self) -> str:
        verb = f"send to rank {self.peer}" if self.send else f"receive from rank {self.peer}"
        return f"{verb} of {_describe(self.message)}"


def _describe(message: Message) -> str:
    kind, m, s = message
    return f"micro-batch {m}'s {kind} from stage {s}"


def _validate(actions: Sequence[Sequence[Action]], K: int, v: int, placement: Placement = "loop") -> None:
    """Each rank runs each (micro-batch, chunk) once: F, then B, or I then W; M is the largest m + 1."""
    if len(actions) != K:
        raise ScheduleError(f"the schedule has action lists for {len(actions)} ranks, but K = {K}")
    M = 1 + max((a.m for ops in actions for a in ops), default=-1)
    for r, ops in enumerate(actions):
        seen: dict[tuple[int, int], str] = {}
        for a in ops:
            if a.kind not in ("F", "B", "I", "W") or not 0 <= a.c < v or a.m < 0:
                raise ScheduleError(f"rank {r}: {a!r} is not an action (kind F, B, I or W, m ≥ 0, c in 0 … {v - 1})")
            seen[a.m, a.c] = seen.get((a.m, a.c), "") + a.kind
        for c in range(v):
            for m in range(M):
                kinds = seen.get((m, c), "")
                if kinds in ("FB", "FIW"):
                    continue
                where = f"rank {r}, micro-batch {m} on chunk {c} (stage {stage_of(c, r, K, placement)})"
                if sorted(kinds) in (sorted("FB"), sorted("FIW")):
                    raise ScheduleError(f"{where}: runs {' '.join(kinds)}; it must run F, then B (or I, then W)")
                raise ScheduleError(f"{where}: has {' '.join(kinds) or 'no action'}; it needs F and B, or F, I and W")


class _Run:
    """One simulation; see :func:`simulate`."""

    def __init__(
        self,
        actions: Sequence[Sequence[Action]],
        K: int,
        v: int,
        costs: Costs | Mapping[tuple[int, int], Costs] | None,
        layout: Layout,
        nccl: bool,
        checkpoint: Checkpoint,
        ahead: bool = True,
        placement: Placement = "loop",
    ) -> None:
        self.actions, self.K, self.S, self.placement = actions, K, v * K, placement
        self.ahead = [inputs_ahead(ops, K, r, v, placement) if ahead else {} for r, ops in enumerate(actions)]
        self.posted_ahead: set[tuple[int, int]] = set()  # (rank, position): an F whose input receive is posted
        self.layout, self.nccl, self.checkpoint = layout, nccl, checkpoint
        self.table = costs if isinstance(costs, Mapping) else {}
        self.default = costs if isinstance(costs, Costs) else Costs()
        self.queues: dict[tuple[int, str], deque[_Op]] = defaultdict(deque)  # NCCL: per rank and communicator
        self.free: dict[tuple[int, str], float] = defaultdict(float)  # when a queue's last operation completed
        self.unmatched: dict[tuple[str, int, int], deque[_Op]] = defaultdict(deque)  # gloo: per (comm, src, dst)
        self.arrived: dict[Message, float] = {}  # when a message is there for its receiver
        self.pc, self.clock, self.ready = [0] * K, [0.0] * K, [0.0] * K
        self.need: list[Message | None] = [None] * K  # what the current action waits for, once started
        self.started = [False] * K
        self.sent = [0.0] * K  # when the rank's last send completed
        self.live, self.peak = [0] * K, [0] * K
        self.timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(K)]

    def cost(self, r: int, c: int) -> Costs:
        return self.table.get((r, c), self.default)

    def comm(self, src: int, dst: int, message: Message) -> str:
        if self.layout == "single":
            return "pipeline"
        if self.layout == "link":  # activations and gradients apart, as the runtime's tags and groups keep them
            return f"{src} → {dst} ({message[0]}s)"
        if self.layout == "flow":
            return "downstream" if message[0] == "activation" else "upstream"
        return "downstream" if dst > src else "upstream"

    def post(self, send: bool, r: int, peer: int, message: Message, at: float) -> None:
        src, dst = (r, peer) if send else (peer, r)
        op = _Op(send, r, peer, message, self.comm(src, dst, message), at)
        if self.nccl:
            self.queues[r, op.comm].append(op)
            return
        pending = self.unmatched[op.comm, src, dst]
        if pending and pending[0].send != send:  # gloo matches one tag's messages in order, and buffers sends
            other = pending.popleft()
            self.meet(op if send else other, other if send else op, max(op.posted, other.posted))
        else:
            pending.append(op)
            if send:
                self.sent[r] = max(self.sent[r], at)

    def meet(self, send: _Op, recv: _Op, start: float) -> float:
        if send.message != recv.message:
            raise ScheduleError(
                f"rank {recv.rank}'s receive of {_describe(recv.message)} would meet rank {send.rank}'s send of "
                f"{_describe(send.message)} on the {send.comm} communicator: a rank's n-th send to a peer meets the "
                "peer's n-th receive from it, so both ends must post their transfers in the same order"
            )
        cost = self.cost(send.rank, chunk_of(send.message[2], self.K, self.placement))
        back = cost.grad_transfer if send.message[0] == "gradient" else None
        end = start + (cost.transfer if back is None else back)
        self.arrived[recv.message] = end
        self.sent[send.rank] = max(self.sent[send.rank], end)
        return end

    def advance(self, r: int) -> bool:
        """Run rank r's actions until one waits for a message; whether anything happened."""
        ops, K, moved = self.actions[r], self.K, False
        while self.pc[r] < len(ops):
            a = ops[self.pc[r]]
            s, cost = stage_of(a.c, r, K, self.placement), self.cost(r, a.c)
            if not self.started[r]:
                self.started[r], self.ready[r], moved = True, self.clock[r], True
                src = s - 1 if a.kind == "F" else s + 1 if a.kind in ("B", "I") else -1
                if 0 <= src < self.S:
                    message: Message = ("activation" if a.kind == "F" else "gradient", a.m, src)
                    self.need[r] = message
                    peer = rank_of(src, K, self.placement)
                    if peer != r and (r, self.pc[r]) not in self.posted_ahead:  # B: before the recompute
                        self.post(False, r, peer, message, self.clock[r])
                        if a.kind != "F":
                            self.ready[r] += cost.recv_host
                if a.kind in ("B", "I") and not keeps_graph(self.checkpoint, ops, a.m, a.c):
                    self.ready[r] += cost.R
            need = self.need[r]
            if need is not None and need not in self.arrived:
                return moved
            start = max(self.ready[r], self.arrived[need] if need is not None else 0.0)
            if (later := self.ahead[r].get(self.pc[r])) is not None:
                b = ops[later]
                before = stage_of(b.c, r, K, self.placement) - 1
                self.post(False, r, rank_of(before, K, self.placement), ("activation", b.m, before), start)
                self.posted_ahead.add((r, later))
            took = getattr(cost, a.kind)
            if a.kind == "F" and cost.F_kept is not None and keeps_graph(self.checkpoint, ops, a.m, a.c):
                took = cost.F_kept
            end = start + took
            self.timeline[r].append((a, start, end))
            self.clock[r], self.need[r], self.started[r] = end, None, False
            self.live[r] += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
            self.peak[r] = max(self.peak[r], self.live[r])
            dst = s + 1 if a.kind == "F" else s - 1 if a.kind in ("B", "I") else -1
            if 0 <= dst < self.S:
                message = ("activation" if a.kind == "F" else "gradient", a.m, s)
                if rank_of(dst, K, self.placement) == r:
                    self.arrived[message] = end
                else:
                    host = cost.send_host if a.kind == "F" or cost.grad_send_host is None else cost.grad_send_host
                    self.clock[r] = end + host
                    self.post(True, r, rank_of(dst, K, self.placement), message, self.clock[r])
            self.pc[r] += 1
            moved = True
        return moved

    def transfer(self) -> bool:
        """Run every transfer whose send and receive are both at the head of their queues; whether any ran."""
        moved = False
        for (r, comm), queue in list(self.queues.items()):
            while queue and queue[0].send:
                send = queue[0]
                theirs = self.queues[send.peer, comm]
                if not theirs or theirs[0].send or theirs[0].peer != r:
                    break
                recv = theirs[0]
                start = max(send.posted, recv.posted, self.free[r, comm], self.free[recv.rank, comm])
                end = self.meet(send, recv, start)
                queue.popleft(), theirs.popleft()
                self.free[r, comm] = self.free[recv.rank, comm] = end
                moved = True
        return moved

    def run(self) -> SimulationResult:
        K = self.K
        while any([self.advance(r) for r in range(K)]) | self.transfer():
            pass
        if any(self.pc[r] < len(self.actions[r]) for r in range(K)) or any(self.queues.values()):
            raise ScheduleError(self.deadlock())
        finish = [max(self.clock[r], self.sent[r]) for r in range(K)]
        makespan = max(finish)
        busy = sum(end - start for row in self.timeline for _, start, end in row)
        bubble = 1 - busy / (K * makespan) if makespan else 0.0
        return SimulationResult(finish, makespan, self.peak, bubble, self.timeline)

    def where(self, r: int) -> str:
        ops = self.actions[r]
        if self.pc[r] == len(ops):
            return f"rank {r} ran all its actions"
        a = ops[self.pc[r]]
        step = f"action {self.pc[r] + 1} of {len(ops)}, stage {stage_of(a.c, r, self.K, self.placement)}"
        return f"rank {r} is in {a.label(self.S // self.K)} ({step})"

    def blocked(self, op: _Op) -> str:
        """Why ``op`` (posted, not completed) does not run."""
        queue = self.queues[op.rank, op.comm]
        if queue[0] is not op:
            return f"it is queued behind rank {op.rank}'s {queue[0]} on the {op.comm} communicator"
        theirs = self.queues[op.peer, op.comm]
        match = next((o for o in theirs if o.send != op.send and (o.peer == op.rank)), None)
        if match is None:
            return (
                f"rank {op.peer} has not posted the matching {'receive' if op.send else 'send'} ({self.where(op.peer)})"
            )
        return (
            f"rank {op.peer}'s matching {'receive' if op.send else 'send'} is queued behind its {theirs[0]} on the "
            f"{op.comm} communicator (a rank's operations on a communicator run one at a time, in posting order)"
        )

    def deadlock(self) -> str:
        lines = []
        for r in range(self.K):
            need = self.need[r]
            if self.pc[r] < len(self.actions[r]):
                assert need is not None, "a rank stops only in a wait"
                text = f"{self.where(r)} and waits for {_describe(need)}"
                src = rank_of(need[2], self.K, self.placement)
                if src == r:
                    text += ", which this rank computes in a later action"
                elif self.nccl:
                    op = next(o for o in self.queues[r, self.comm(src, r, need)] if o.message == need and not o.send)
                    text += f": {self.blocked(op)}"
                else:
                    text += f", which rank {src} has not sent ({self.where(src)})"
                lines.append(text)
            heads = [q[0] for (q_r, _), q in self.queues.items() if q_r == r and q and q[0].send]
            lines += [f"rank {r}'s {op} waits for its receive: {self.blocked(op)}" for op in heads]
        text = "the schedule deadlocks under NCCL's rules" if self.nccl else "the schedule deadlocks"
        text += f" ({self.layout} communicator layout): " + "; ".join(lines)
        if self.nccl:
            try:
                v, buffered = self.S // self.K, False
                _Run(
                    self.actions, self.K, v, self.default, self.layout, buffered, self.checkpoint, True, self.placement
                ).run()
                text += (
                    ". With buffered sends (gloo) it would run: the cycle comes from NCCL's in-order, rendezvous "
                    "transfers; post in an order both ends of each communicator agree on"
                )
            except ScheduleError as e:
                if not str(e).startswith("the schedule deadlocks"):
                    return f"{text}. With buffered sends: {e}"
                text += ". It deadlocks with buffered sends too: the action order contradicts the data dependencies"
        return text


def simulate(
    actions: Sequence[Sequence[Action]],
    K: int,
    v: int = 1,
    costs: Costs | Mapping[tuple[int, int], Costs] | None = None,
    *,
    layout: Layout = "link",
    nccl: bool = True,
    checkpoint: Checkpoint = "never",
    ahead: bool | None = None,
    placement: Placement = "loop",
) -> SimulationResult:
    """Run ``actions`` (per rank) on the model in the module docstring; ScheduleError if invalid or stuck.

    ``costs``: one Costs for every chunk, or per (rank, chunk) (the others: ``Costs()``); ``checkpoint``: which
    backwards recompute first (cost R), as the runtime decides with ``keeps_graph``; ``ahead``: inputs received
    ahead where the schedule allows (False: each posted when its F starts); by default where the runtime does it,
    under NCCL's rules (``nccl``), not on gloo; ``placement``: where the rank's chunks sit (``registry.Placement``)."""
    _validate(actions, K, v, placement)
    ahead = nccl if ahead is None else ahead
    return _Run(actions, K, v, costs, layout, nccl, checkpoint, ahead, placement).run()


def draw(
    actions: Sequence[Sequence[Action]], K: int, v: int = 1, nccl: bool = False, placement: Placement = "loop"
) -> list[str]:
    """The schedule's timeline with every action one unit long, one row per rank ('.' = idle), as drawn in
    ``pipe.schedule.registry``: with buffered sends unless ``nccl``."""
    unit = Costs(F=1, B=1, I=1, W=1)
    timeline = simulate(actions, K, v, unit, nccl=nccl, placement=placement).timeline
    width = max(len(a.label(v)) for row in timeline for a, _, _ in row)
    T = int(max(end for row in timeline for _, _, end in row))
    lines = [" t |" + "".join(f" {t:>{width}}" for t in range(T))]
    for r, row in enumerate(timeline):
        cells = ["."] * T
        for a, start, _ in row:
            cells[int(start)] = a.label(v)
        lines.append(f"r{r} |" + "".join(f" {c:>{width}}" for c in cells).rstrip(" ."))
    return lines
