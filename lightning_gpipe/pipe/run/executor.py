"""The executor: one stage's (one chunk's) forward, recompute and backward of a micro-batch, and its halves.

``pipe/run/loss_outside.py`` runs it in GPipe's fill/drain phases (the loss outside the pipeline, drawn there), and
``pipe/run/loss_inside.py`` by a schedule's actions (the loss inside). What a micro-batch whose graph is dropped
keeps, and the re-materialization modes: ``pipe/state/rematerialize.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from lightning_gpipe.pipe.comm.framing import TensorMeta
from lightning_gpipe.pipe.comm.links import Links, check_header
from lightning_gpipe.pipe.comm.transport import GRAD_TAG
from lightning_gpipe.pipe.context import MicroBatchInfo, running
from lightning_gpipe.pipe.microbatch import (
    differentiable,
    tensors,
)
from lightning_gpipe.pipe.run.failures import FailureHandler
from lightning_gpipe.pipe.run.records import MicroBatch, Step
from lightning_gpipe.pipe.run.weight_grad import WeightGrads
from lightning_gpipe.pipe.schedule.registry import Placement, rank_of
from lightning_gpipe.pipe.skips import StageSkips
from lightning_gpipe.pipe.split.boundary import check_boundary
from lightning_gpipe.pipe.state.batchnorm import (
    deferred_statistics,
)
from lightning_gpipe.pipe.state.buffers import StatefulBuffers
from lightning_gpipe.pipe.state.rematerialize import Checkpoint, ForwardState, first_forward, recomputing
from lightning_gpipe.pipe.state.rng import StepSeeds, mix
from lightning_gpipe.pipe.trace.events import Timeline


class RunLayers(Protocol):
    """Runs a stage's layers on one micro-batch, their randomness seeded by ``seed``; ``copy``: on a copy of ``x``."""

    def __call__(self, x: Any, seed: int, copy: bool = True) -> Any: ...


def settle(first: Executor, where: list[Any], drained: Callable[[], None] | None = None, status: bool = True) -> None:
    """The end of a phase, inside its failure scope: no micro-batch in work any more, this rank's own work done
    (``drained``), then every stage learns how the phase ended on all of them (``status``: unless the shared output
    told already)."""
    where[:] = None, None
    if drained is not None:
        drained()
    if status and first.links is not None:
        with first.timeline.record("status"):
            first.links.check_status()


def wait_sends(first: Executor) -> None:
    """After a phase: its sends received, so that their buffers may be reused or freed."""
    if first.links is not None:
        first.links.transport.wait_sends()


Pairs = list[tuple[torch.Tensor, Any]]
# The last stage's roots of a micro-batch's backward: (tensor, its gradient or None for a scalar loss) pairs.
Roots = Callable[[Any, list[bool]], Pairs]


def marked_pairs(y: Any, marks: list[bool], grads: list[torch.Tensor]) -> Pairs:
    """The output tensors that the next stage differentiated, with the gradients it sent for them."""
    marked = [t for t, mark in zip(tensors(y), marks) if mark]
    return [(t, g) for t, g in zip(marked, grads) if t.requires_grad]


class Executor:
    """Runs stage ``index``'s micro-batches: its part of each phase (``pipe/run/loss_outside.py``, the loss between the
    phases) and its actions for ``forward_backward`` (the loss inside the pipeline), given the parts of the stage it
    works with.

    ``layers`` is the stage's module (its parameters, its BatchNorm layers); ``run`` runs them on a micro-batch;
    ``producer`` names its last layer in boundary errors. ``links`` is None on a stage without peers. With several
    virtual stages per rank (``virtual_stages``) each chunk has its executor: stage ``index`` of ``num_stages`` = vK
    is chunk ``chunk`` of rank ``rank_of(index)`` under ``placement`` (interleaved: ``index % ranks``), its neighbours
    the stages ``index ± 1``; one on this rank too (a V's middle) is handed over, not sent.
    """

    def __init__(
        self,
        layers: nn.Module,
        run: RunLayers,
        *,
        index: int,
        num_stages: int,
        checkpoint: Checkpoint,
        batch_dim: int,
        device: torch.device,
        producer: str,
        stateful_buffers: StatefulBuffers,
        failures: FailureHandler,
        links: Links | None,
        timeline: Timeline,
        ranks: int | None = None,
        chunk: int = -1,
        skips: StageSkips | None = None,
        placement: Placement = "loop",
        compiled: bool = False,
    ) -> None:
        self.layers = layers
        self.compiled = compiled  # whether a layer runs compiled: dropped graphs' forwards in the recompute's grad mode
        self.run = run
        self.index = index
        self.num_stages = num_stages
        self.checkpoint = checkpoint
        self.batch_dim = batch_dim
        self.device = device
        self.producer = producer
        self.stateful_buffers = stateful_buffers
        self.failures = failures
        self.links = links
        self.timeline = timeline
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.ranks = K = num_stages if ranks is None else ranks
        self.placement = placement
        self.rank, self.last_rank = rank_of(index, K, placement), rank_of(num_stages - 1, K, placement)
        self.prev_rank = rank_of(index - 1, K, placement) if index > 0 else -1
        self.next_rank = rank_of(index + 1, K, placement) if index < num_stages - 1 else -1
        # The stage before (after) on this rank too: activations and gradients handed over in the process.
        self.hands_back, self.hands_on = self.prev_rank == self.rank, self.next_rank == self.rank
        self.chunk = chunk  # -1: the rank's only chunk (events and messages name no chunk)
        self.skips = skips  # the long skips its layers stash and pop (skips.py); None: the backbone declares none
        self.seeds = StepSeeds()

    @property
    def place(self) -> str | None:
        """Which of the rank's virtual stages this is, as an error names it (None: the rank's only chunk)."""
        if self.chunk < 0:
            return None
        backbone = "interleaved backbone" if self.placement == "loop" else "backbone in a V"
        return f"its chunk {chr(ord('a') + self.chunk)}, the {backbone}'s stage {self.index}"

    def peers(self) -> Links:
        assert self.links is not None, "a stage with a neighbour has links"
        return self.links

    def receive(self, m: int, training: bool) -> tuple[Any, dict[str, Any]]:
        """Micro-batch m's input from the previous stage, with its header's fields."""
        return self.peers().receive(m, training, self.prev_rank, self.index, self.chunk, local=self.hands_back)

    def receive_ahead(self, m: int) -> None:
        """Post micro-batch m's input receive now (``Links.receive_ahead``): the runner knows it is the next receive
        from the previous stage's rank. Nothing where that stage is on this rank."""
        if not self.hands_back:
            self.peers().receive_ahead(m, self.prev_rank)

    def send_on(self, y: Any, micro_batch: int, marks: list[bool] | None = None, **fields: Any) -> list[TensorMeta]:
        """A micro-batch's output to the next stage (``marks``: the tensors it differentiates; default: those that
        require grad), sent or handed over; ``fields`` go in its header."""
        marks = [t.requires_grad for t in tensors(y)] if marks is None else marks
        if self.hands_on:
            return self.peers().hand(self.index, self.index + 1, micro_batch, y, marks, **fields)
        return self.peers().send(self.next_rank, y, micro_batch, self.chunk, requires_grad=marks, **fields)

    def poll(self) -> None:
        """Before queuing compute: the tensors of the receives posted ahead whose headers came, posted."""
        if self.links is not None:
            self.links.poll()

    def routes(self) -> StageSkips:
        assert self.skips is not None, "only a stage whose layers declare long skips sends or receives them"
        return self.skips

    def run_with_skips(
        self, x: Any, seed: int, skips_in: dict[int, list[Any]], copy: bool = True
    ) -> tuple[Any, dict[int, list[Any]]]:
        """The stage's layers on a micro-batch given the skips it received; also the skips to send, by stage."""
        if self.skips is None:
            return self.run(x, seed, copy), {}
        with self.skips.tray(skips_in, copy).active() as tray:
            y = self.run(x, seed, copy)
        return y, tray.outgoing()

    def forward_micro(
        self,
        step: Step,
        x: Any,
        m: int,
        M: int,
        n: int,
        ckpt: bool,
        could_require: bool,
        weights: WeightGrads | None = None,
    ) -> None:
        """Micro-batch m of M (n samples) through this stage's layers, sent on at once; appended to ``step``.
        With ``weights`` (a split schedule), the weight gradients of its linear, convolution and embedding ops will
        wait there for W m."""
        stateful = self.stateful_buffers
        state = ForwardState.capture([self.device]) if ckpt else None
        buffers, before = stateful.snapshot() if ckpt else None, stateful.mark()
        graph = first_forward(self.device, self.compiled) if ckpt else torch.enable_grad()
        # The split only matters where a graph is recorded: a recomputed micro-batch's CPU forward records none.
        defer = not (ckpt and self.device.type == "cpu")
        split = weights.deferring(m) if weights is not None and defer else contextlib.nullcontext()
        skips_in = self.peers().receive_skips(m, self.skips, self.chunk) if self.skips and self.skips.receives else {}
        self.poll()
        step.M = M
        info = MicroBatchInfo(step.key, m, M)
        with self.timeline.record("forward", m, chunk=self.chunk), deferred_statistics(), graph, split, running(info):
            y, skips_out = self.run_with_skips(x, mix(step.seed, m), skips_in)
        self.poll()  # a header that came during the compute: its tensors' receives before this wait for them
        stateful.learn(before)
        check_boundary(y, n, self.batch_dim, self.producer, self.is_last)
        needs = could_require or any(t.requires_grad for t in tensors((x, skips_in)))
        marks = [differentiable(t) and (t.requires_grad or (ckpt and needs)) for t in tensors(y)]
        mb = MicroBatch(x, y, state, marks, buffers=buffers, skips_in=skips_in, skips_out=skips_out)
        step.sizes.append(n)
        fields: dict[str, Any] = {"m": m, "M": M, "n": n, "training": True, "seed": step.seed, "stage": self.index}
        if not self.is_last:
            mb.metas = self.send_on(y, m, marks, **fields)
            if ckpt:
                mb.output = None
        for dst, values in skips_out.items():
            mb.skip_marks[dst] = [differentiable(t) and (t.requires_grad or (ckpt and needs)) for t in tensors(values)]
            mb.skip_metas[dst] = self.peers().send_skips(
                dst, values, mb.skip_marks[dst], self.chunk, fields, self.routes()
            )
        if ckpt:
            mb.skips_out = {}
        step.micro.append(mb)

    def backward_micro(
        self,
        step: Step,
        m: int,
        input_grads: list[list[torch.Tensor]],
        roots: Roots,
        weights: WeightGrads | None = None,
    ) -> None:
        """Micro-batch m's backward: its recompute first (if checkpointed), then autograd from its output gradient
        (received from the next stage, or ``roots(output, marks)`` on the last stage); the input gradient goes to the
        previous stage, or into ``input_grads`` on stage 0. Frees the micro-batch. With ``weights``, this is I m:
        the deferred weight gradients wait for :meth:`weight_micro`."""
        mb = step.micro[m]
        pending = None
        c = self.chunk
        if self.hands_on:
            pending = self.peers().post_take(self.index + 1, self.index, m)
        elif not self.is_last:
            expect = [meta for meta, mark in zip(mb.metas, mb.marks) if mark]
            what = f"micro-batch {m}'s output gradient"
            pending = self.peers().transport.post_recv(self.next_rank, what, expect=expect, tag=GRAD_TAG)
        skip_grads = {
            dst: self.peers().post_skip_grads(dst, m, expect, self.routes())
            for dst, metas in mb.skip_metas.items()
            if (expect := [meta for meta, mark in zip(metas, mb.skip_marks[dst]) if mark])
        }
        y, skips_out = mb.output, mb.skips_out
        self.poll()
        info = MicroBatchInfo(step.key, m, step.M)
        if mb.state is not None:
            with (
                running(info),
                self.timeline.record("recompute", m, chunk=c),
                mb.state.restore(),
                self.stateful_buffers.replay(mb.buffers),
                recomputing(),
                torch.enable_grad(),
                weights.deferring(m) if weights is not None else contextlib.nullcontext(),
            ):
                y, skips_out = self.run_with_skips(mb.input, mix(step.seed, m), mb.skips_in)
        if pending is not None:
            with self.timeline.record("recv-wait", m, label="gradient", chunk=c):
                grads, fields = pending.wait()
            check_header(fields, m, self.index + 1, self.index, "output gradient")
            pairs = marked_pairs(y, mb.marks, grads)
        else:
            with running(info):
                pairs = roots(y, mb.marks)
        for dst, skip_pending in skip_grads.items():
            with self.timeline.record("recv-wait", m, label="skip gradient", chunk=c):
                grads, fields = skip_pending.wait()
            check_header(fields, m, dst, self.index, "skip gradients")
            pairs = [*pairs, *marked_pairs(skips_out[dst], mb.skip_marks[dst], grads)]
        with self.timeline.record("backward" if weights is None else "backward-input", m, chunk=c):
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        leaves = [t for t in tensors(mb.input) if t.requires_grad]
        grads_in = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        skips_in = mb.skips_in
        step.micro[m] = MicroBatch(None, None, None, [])  # free this micro-batch's memory now
        if self.hands_back:
            self.peers().hand(
                self.index, self.index - 1, m, grads_in, [False] * len(grads_in), True, m=m, stage=self.index
            )
        elif not self.is_first:
            marks = [False] * len(grads_in)
            self.peers().send(
                self.prev_rank,
                grads_in,
                m,
                c,
                label="gradient",
                tag=GRAD_TAG,
                requires_grad=marks,
                m=m,
                stage=self.index,
            )
        else:
            input_grads[m] = grads_in
        for src, values in skips_in.items():
            if skip_leaves := [t for t in tensors(values) if t.requires_grad]:
                skip_grads_in = [t.grad if t.grad is not None else torch.zeros_like(t) for t in skip_leaves]
                self.peers().send_skip_grads(src, skip_grads_in, m, c, self.routes())

    def weight_micro(self, m: int, weights: WeightGrads) -> None:
        """W m: micro-batch m's deferred weight gradients into ``.grad``."""
        self.poll()
        with self.timeline.record("backward-weight", m, chunk=self.chunk):
            weights.run(m)
