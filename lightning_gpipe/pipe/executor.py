"""The executor: one stage's forward, recompute and backward of a micro-batch, and the fill/drain phases drawn here.

K = 3 stages, M = 4 micro-batches, ``checkpoint="except_last"``; F m = forward of micro-batch m, R m = its
recompute, B m = its backward, L = the user's loss; time runs to the right, one column per unit of work:

            t  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    stage 0 | F0 F1 F2 F3 .  .  .  .  .  B3 R2 B2 R1 B1 R0 B0
    stage 1 |    F0 F1 F2 F3 .  .  .  B3 R2 B2 R1 B1 R0 B0
    stage 2 |       F0 F1 F2 F3 L  B3 R2 B2 R1 B1 R0 B0

Forward phase: stage k receives micro-batch m from stage k-1 (stage 0 splits the input), runs its layers and sends
the result to stage k+1 at once, without waiting for it to be received. A checkpointed micro-batch keeps only its
input (the stage boundary): on an accelerator it runs in the recompute's grad mode with nothing saved, so that both
choose the same kernels, on the CPU without autograd (``rematerialize.first_forward``); the others keep their graph.

Backward phase, in reverse order: stage k first posts the receive for m's output gradient, then re-runs ("R")
micro-batch m from its saved input -- before the gradient arrives, so recomputation fills time that would otherwise
be spent waiting (GPipe, section 2.3) -- then waits for the gradient, back-propagates ("B") and sends the input
gradient to stage k-1 at once: stage k's R m runs while stage k+1 runs B m (t = 9, 11, 13 above). The idle
triangles ('.') are the bubble, (K-1)/(M+K-1) of the time when every unit costs the same.

Re-materialization modes: ``always`` checkpoints every micro-batch; ``except_last`` (default) keeps the graph of the
last one, whose backward comes first, so recomputing it would only delay the drain (no R3 above);
``never`` keeps every graph (fastest, most memory).

With v chunks per rank (``virtual_stages``: rank r holds stages r, r + K, …) the phases run the rank's chunks one
after the other, each as above: a forward phase around the ring v times (rank K − 1 hands micro-batch m of chunk c to
rank 0's chunk c + 1), a backward phase back, the last chunk first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal, Protocol, get_args

import torch
from torch import nn

from lightning_gpipe.pipe.batchnorm import (
    check_replicas_run_the_same_m,
    commit_deferred_batch_norm,
    deferred_statistics,
)
from lightning_gpipe.pipe.boundary import check_boundary
from lightning_gpipe.pipe.buffers import StatefulBuffers
from lightning_gpipe.pipe.failures import FailureHandler
from lightning_gpipe.pipe.links import Links, check_header
from lightning_gpipe.pipe.microbatch import (
    differentiable,
    join,
    join_input_grads,
    plan_sizes,
    split_by_sizes,
    split_leaves,
    tensors,
)
from lightning_gpipe.pipe.outputs import join_outputs, output_grads, share_output
from lightning_gpipe.pipe.records import MicroBatch, OutputMode, Step
from lightning_gpipe.pipe.rematerialize import ForwardState, first_forward, recomputing
from lightning_gpipe.pipe.rng import StepSeeds, mix, restored_streams
from lightning_gpipe.pipe.skips import StageSkips
from lightning_gpipe.pipe.trace import Timeline
from lightning_gpipe.pipe.weight_grad import WeightGrads

Checkpoint = Literal["always", "except_last", "never"]
CHECKPOINT_MODES: tuple[Checkpoint, ...] = get_args(Checkpoint)


class RunLayers(Protocol):
    """Runs a stage's layers on one micro-batch, their randomness seeded by ``seed``; ``copy``: on a copy of ``x``."""

    def __call__(self, x: Any, seed: int, copy: bool = True) -> Any: ...


def validate_checkpoint(mode: str) -> Checkpoint:
    for valid in CHECKPOINT_MODES:
        if mode == valid:
            return valid
    raise ValueError(f"checkpoint={mode!r} is not one of {list(CHECKPOINT_MODES)}")


def is_checkpointed(mode: Checkpoint, m: int, M: int) -> bool:
    """Whether micro-batch m of M drops its inner activations in the forward phase and is recomputed later."""
    if mode == "always":
        return True
    if mode == "except_last":
        return m < M - 1
    return False


def backward_order(M: int) -> range:
    return range(M - 1, -1, -1)


Pairs = list[tuple[torch.Tensor, Any]]
# The last stage's roots of a micro-batch's backward: (tensor, its gradient or None for a scalar loss) pairs.
Roots = Callable[[Any, list[bool]], Pairs]


def _marked_pairs(y: Any, marks: list[bool], grads: list[torch.Tensor]) -> Pairs:
    """The output tensors that the next stage differentiated, with the gradients it sent for them."""
    marked = [t for t, mark in zip(tensors(y), marks) if mark]
    return [(t, g) for t, g in zip(marked, grads) if t.requires_grad]


class Executor:
    """Runs stage ``index``'s micro-batches: its part of each phase drawn above (:func:`forward_phase`,
    :func:`backward_phase`, :func:`evaluate`, the loss between the phases) and its actions for ``forward_backward``
    (the loss inside the pipeline), given the parts of the stage it works with.

    ``layers`` is the stage's module (its parameters, its BatchNorm layers); ``run`` runs them on a micro-batch;
    ``producer`` names its last layer in boundary errors. ``links`` is None on a stage without peers. With several
    chunks per rank (interleaving, ``virtual_stages``) each chunk has its executor: stage ``index`` of
    ``num_stages`` = vK is chunk ``chunk`` of rank ``index % ranks``, its neighbours on ranks ``index ± 1`` mod K.
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
    ) -> None:
        self.layers = layers
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
        self.prev_rank, self.next_rank = (index - 1) % K, (index + 1) % K
        self.chunk = chunk  # -1: the rank's only chunk (events and messages name no chunk)
        self.skips = skips  # the long skips its layers stash and pop (skips.py); None: the backbone declares none
        self.seeds = StepSeeds()

    def peers(self) -> Links:
        assert self.links is not None, "a stage with a neighbour has links"
        return self.links

    def receive(self, m: int, training: bool) -> tuple[Any, dict[str, Any]]:
        """Micro-batch m's input from the previous stage, with its header's fields."""
        return self.peers().receive(m, training, self.prev_rank, self.index, self.chunk)

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
        graph = first_forward(self.device) if ckpt else torch.enable_grad()
        # The split only matters where a graph is recorded: a recomputed micro-batch's CPU forward records none.
        defer = not (ckpt and self.device.type == "cpu")
        split = weights.deferring(m) if weights is not None and defer else contextlib.nullcontext()
        skips_in = self.peers().receive_skips(m, self.skips, self.chunk) if self.skips and self.skips.receives else {}
        with self.timeline.record("forward", m, chunk=self.chunk), deferred_statistics(), graph, split:
            y, skips_out = self.run_with_skips(x, mix(step.seed, m), skips_in)
        stateful.learn(before)
        check_boundary(y, n, self.batch_dim, self.producer, self.is_last)
        needs = could_require or any(t.requires_grad for t in tensors((x, skips_in)))
        marks = [differentiable(t) and (t.requires_grad or (ckpt and needs)) for t in tensors(y)]
        mb = MicroBatch(x, y, state, marks, buffers=buffers, skips_in=skips_in, skips_out=skips_out)
        step.sizes.append(n)
        fields: dict[str, Any] = {"m": m, "M": M, "n": n, "training": True, "seed": step.seed, "stage": self.index}
        if not self.is_last:
            mb.metas = self.peers().send(self.next_rank, y, m, self.chunk, requires_grad=marks, **fields)
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
        if not self.is_last:
            expect = [meta for meta, mark in zip(mb.metas, mb.marks) if mark]
            what = f"micro-batch {m}'s output gradient"
            pending = self.peers().transport.post_recv(self.next_rank, what, expect=expect)
        skip_grads = {
            dst: self.peers().post_skip_grads(dst, m, expect, self.routes())
            for dst, metas in mb.skip_metas.items()
            if (expect := [meta for meta, mark in zip(metas, mb.skip_marks[dst]) if mark])
        }
        y, skips_out = mb.output, mb.skips_out
        if mb.state is not None:
            with (
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
            pairs = _marked_pairs(y, mb.marks, grads)
        else:
            pairs = roots(y, mb.marks)
        for dst, skip_pending in skip_grads.items():
            with self.timeline.record("recv-wait", m, label="skip gradient", chunk=c):
                grads, fields = skip_pending.wait()
            check_header(fields, m, dst, self.index, "skip gradients")
            pairs = [*pairs, *_marked_pairs(skips_out[dst], mb.skip_marks[dst], grads)]
        with self.timeline.record("backward" if weights is None else "backward-input", m, chunk=c):
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        leaves = [t for t in tensors(mb.input) if t.requires_grad]
        grads_in = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        skips_in = mb.skips_in
        step.micro[m] = MicroBatch(None, None, None, [])  # free this micro-batch's memory now
        if not self.is_first:
            marks = [False] * len(grads_in)
            self.peers().send(
                self.prev_rank, grads_in, m, c, label="gradient", requires_grad=marks, m=m, stage=self.index
            )
        else:
            input_grads[m] = grads_in
        for src, values in skips_in.items():
            if skip_leaves := [t for t in tensors(values) if t.requires_grad]:
                skip_grads_in = [t.grad if t.grad is not None else torch.zeros_like(t) for t in skip_leaves]
                self.peers().send_skip_grads(src, skip_grads_in, m, c, self.routes())

    def weight_micro(self, m: int, weights: WeightGrads) -> None:
        """W m: micro-batch m's deferred weight gradients into ``.grad``."""
        with self.timeline.record("backward-weight", m, chunk=self.chunk):
            weights.run(m)


def forward_phase(chunks: Sequence[Executor], input: Any, M: int, output_mode: OutputMode) -> tuple[list[Step], Any]:
    """The forward phase: every micro-batch through this rank's stages (``chunks``, in order), each in order; returns
    the step of each chunk and the output."""
    first = chunks[0]
    seed = first.seeds.draw()
    batch_dim = first.batch_dim
    steps = []
    with first.failures.phase("forward", output_mode) as where, restored_streams(first.device):
        sizes = plan_sizes(input, M, batch_dim) if first.is_first else []
        micro_inputs, input_leaves = split_leaves(input, sizes, batch_dim) if first.is_first else ([], [])
        M = len(micro_inputs)
        for s in chunks:
            could_require = any(p.requires_grad for p in s.layers.parameters())
            step = Step([], input_leaves=input_leaves if s.is_first else [], seed=seed)
            s.stateful_buffers.begin()
            m = 0
            while m < M or (m == 0 and not s.is_first):
                where[0] = m
                if s.is_first:
                    x, n = micro_inputs[m], sizes[m]
                else:
                    x, got = s.receive(m, training=True)
                    M, n, step.seed = got["M"], got["n"], got["seed"]
                if m == 0:
                    check_replicas_run_the_same_m(s.layers, M, s.device)
                s.forward_micro(step, x, m, M, n, is_checkpointed(s.checkpoint, m, M), could_require)
                m += 1
            commit_deferred_batch_norm(s.layers)
            steps.append(step)
        where[0] = None
        last = chunks[-1]
        output = join_outputs(steps[-1], batch_dim) if last.is_last else None
        output = share_output(output, output_mode, first.links, first.ranks, first.device)
        if first.links is not None and output_mode == "last":  # else the shared output told how the phase ended
            with first.timeline.record("status"):
                first.links.check_status()
    return steps, output


def backward_phase(
    chunks: Sequence[Executor],
    steps: Sequence[Step],
    grad_output: Any,
    output_mode: OutputMode,
    drained: Callable[[], None] | None = None,
) -> None:
    """The backward phase: the micro-batches of each chunk's step in reverse, the last chunk first, each recomputed
    first if checkpointed; ``drained`` runs once this rank's gradients are complete, before the status check waits
    for the others."""
    first = chunks[0]
    links = first.links
    with first.failures.phase("backward", output_mode) as where:
        for s, step in reversed(list(zip(chunks, steps))):
            last_grads = output_grads(step, grad_output, s.batch_dim) if s.is_last else None
            input_grads: list[list[torch.Tensor]] = [[] for _ in step.micro]
            for m in backward_order(len(step.micro)):
                where[0] = m
                grads = last_grads[m] if last_grads is not None else []
                s.backward_micro(step, m, input_grads, partial(_marked_pairs, grads=grads))
            if s.is_first and step.input_leaves:
                torch.autograd.backward(step.input_leaves, join_input_grads(input_grads, s.batch_dim))
        where[0] = None
        if drained is not None:
            drained()
        if links is not None:
            with first.timeline.record("status"):
                links.check_status()
    if links is not None:
        links.transport.wait_sends()


def evaluate(chunks: Sequence[Executor], input: Any, M: int, output_mode: OutputMode) -> Any:
    """A forward-only pipeline (no grad) through this rank's stages in order: nothing is kept for a backward phase."""
    first = chunks[0]
    seed = first.seeds.draw()
    batch_dim = first.batch_dim
    with (
        first.failures.phase("evaluation", output_mode) as where,
        deferred_statistics(),
        restored_streams(first.device),
    ):
        planned = plan_sizes(input, M, batch_dim) if first.is_first else []
        inputs = split_by_sizes(input, planned, batch_dim) if first.is_first else []
        M = len(inputs)
        for s in chunks:
            outs, sizes = [], []
            m = 0
            while m < M or (m == 0 and not s.is_first):
                where[0] = m
                if s.is_first:
                    x, n = inputs[m], planned[m]
                else:
                    x, got = s.receive(m, training=False)
                    M, n, seed = got["M"], got["n"], got["seed"]
                skips_in = s.peers().receive_skips(m, s.skips, s.chunk) if s.skips and s.skips.receives else {}
                with s.timeline.record("forward", m, chunk=s.chunk):
                    y, skips_out = s.run_with_skips(x, mix(seed, m), skips_in, copy=False)
                check_boundary(y, n, batch_dim, s.producer, s.is_last)
                sizes.append(n)
                fields: dict[str, Any] = {"m": m, "M": M, "n": n, "training": False, "seed": seed, "stage": s.index}
                if s.is_last:
                    outs.append(y)
                else:
                    s.peers().send(s.next_rank, y, m, s.chunk, **fields)
                for dst, values in skips_out.items():
                    s.peers().send_skips(dst, values, [False] * len(tensors(values)), s.chunk, fields, s.routes())
                m += 1
            commit_deferred_batch_norm(s.layers)
        where[0] = None
        output = join(outs, batch_dim, sizes) if chunks[-1].is_last else None
        output = share_output(output, output_mode, first.links, first.ranks, first.device)
        if first.links is not None and output_mode == "last":  # else the shared output told how the phase ended
            first.links.check_status()
    if first.links is not None:
        first.links.transport.wait_sends()
    return output
