"""One rank's cell of a GPipe pipeline: its layers under their original names, and the phases that run them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe._torch_internals import tree_map
from lightning_gpipe.pipe.comm.groups import link_groups, process_groups, skip_groups
from lightning_gpipe.pipe.comm.links import Links
from lightning_gpipe.pipe.comm.status import StatusCheck
from lightning_gpipe.pipe.comm.transport import DEFAULT_TIMEOUT_S, Transport
from lightning_gpipe.pipe.errors import one_of
from lightning_gpipe.pipe.microbatch import plan_sizes
from lightning_gpipe.pipe.run.compiled import (
    Compilations,
    CompileOptions,
    check_backbone,
    compile_layers,
    compile_options,
)
from lightning_gpipe.pipe.run.compiled import check_schedule as check_compiled_schedule
from lightning_gpipe.pipe.run.executor import Executor
from lightning_gpipe.pipe.run.failures import FailureHandler, skip_notices
from lightning_gpipe.pipe.run.loss_inside import LossFn, check_schedule, forward_backward
from lightning_gpipe.pipe.run.loss_outside import backward_phase, evaluate, forward_phase
from lightning_gpipe.pipe.run.records import OUTPUT_MODES, OutputMode, Step
from lightning_gpipe.pipe.schedule.registry import Placement, ScheduleName, lookup, rank_of
from lightning_gpipe.pipe.skips import current_tray, plan_skips, skip_layers, skip_pairs
from lightning_gpipe.pipe.split.balance import Balance, stage_layers
from lightning_gpipe.pipe.split.indexing import LayerIndex, RemoteLayer
from lightning_gpipe.pipe.split.rules import check_plain_sequential, sync_batch_norm_error, sync_batch_norms
from lightning_gpipe.pipe.split.virtual_stages import (
    ChunkLayers,
    agree_on_virtual_stages,
    check_virtual_stages,
    checked_placement,
    held_stages,
    homes,
    shared_over_ranks,
)
from lightning_gpipe.pipe.state.batchnorm import convert_deferred_batch_norm
from lightning_gpipe.pipe.state.buffers import StatefulBuffers
from lightning_gpipe.pipe.state.rematerialize import CHECKPOINT_MODES, Checkpoint
from lightning_gpipe.pipe.state.rng import mix, name_key, reseed
from lightning_gpipe.pipe.trace.events import Timeline


class GPipeStage(nn.Module):
    """Stage k of K: owns a contiguous slice of an ``nn.Sequential`` and runs it as GPipe does.

    Every rank of the pipeline group builds it from the same ``nn.Sequential`` and keeps only its own layers, named as
    in the original module so that state-dict keys stay global. Calling it with grad enabled runs the forward phase
    of a training step (stage 0 splits the input into M micro-batches; the last stage returns the joined output as a
    leaf that collects the caller's gradient); :meth:`backward` then drains the micro-batches in reverse. Calling it
    without grad runs a forward-only pipeline. Every stage must make the same calls: they are collective.
    Indexing it (``stage[i]``, ``len(stage)``) goes by the layers of the whole backbone (see ``indexing``); the
    phases run as ``schedule`` draws them.

    Args:
        module: the L layers; built alike on every rank (same seed), only this stage's layers are kept, so the
            nn.Sequential may add nothing of its own (forward, weights, hooks) and hold no nn.SyncBatchNorm.
        chunks: M, micro-batches per mini-batch (fewer, with a warning, when the batch has fewer samples).
        balance: layers per stage, or how to find them: ``"parameters"``, ``"time"`` (profiles ``sample``),
            ``"flops"`` (counts each layer's forward FLOPs on ``sample``), or a per-layer cost ``fn(i, layer) -> c_i``;
            solved exactly on stage 0 and broadcast.
        checkpoint: re-materialization, ``"always"``, ``"except_last"`` or ``"never"`` (see ``schedule``).
        batch_dim: the dimension that holds the samples in every tensor that is split or crosses a stage boundary:
            0, or 1 for time-major ``(T, N, ...)`` tensors (nn.GRU, nn.LSTM, nn.Transformer without batch_first).
        group: the pipeline's process group, stage k = group rank k (default: the world). Where it runs transfers in
            posting order (NCCL) the tensors travel on groups of their own, one per link and direction, which every
            rank of the world makes at once (``comm.groups.link_groups``; see ``comm.transport``).
        header_group: a gloo group over the same ranks for headers and status checks (made for you if needed).
        deferred_batch_norm: defer the running statistics of every BatchNorm layer, in place (subclasses keep their
            forward; see :func:`~lightning_gpipe.pipe.state.batchnorm.convert_deferred_batch_norm`).
        output: ``"last"`` returns the output on the last stage only; ``"all"`` on every stage; ``"placeholder"``
            gives the other stages zeros of the same structure, shapes and dtypes (no tensor data crosses);
            ``"first"`` gives stage 0 the output and the others such zeros (where predictions are kept). Settable
            later as :attr:`output_mode`; :meth:`output_head` shares a function of it instead.
        device: where received tensors go (default: the current CUDA device with NCCL, else the CPU).
        timeout: seconds to wait for a peer before raising :class:`PipelineTimeout`; the timeout of the groups the
            stage makes.
        timeline: record per-micro-batch events in ``self.timeline``.
        virtual_stages: v, the virtual stages of layers each rank holds: the backbone is split into vK stages
            (``balance`` gives vK counts, or is solved for vK parts) and rank r holds the non-adjacent stages r, r + K,
            …, for ``forward_backward(schedule="interleaved-1f1b")``, whose bubble is 1F1B's divided by v. The phases of
            ``stage(x)`` and ``backward()`` run the virtual stages one after the other. Default 1: one stage per rank.
        placement: where a rank's virtual stages sit: ``"loop"`` (interleaved, as above) or ``"v"`` (v = 2, rank r
            holds stages r and 2K − 1 − r, for ``schedule="zb-v"``: rank K − 1 holds the middle two, rank 0 the first
            and the last, so the loss and the output are on rank 0; see ``pipe/schedule/registry.py``).
        compile: compile each of this stage's layers in place (``nn.Module.compile``), True or a dict of
            ``torch.compile``'s options; layers compiled already run as they are (see ``pipe/run/compiled.py``).
    """

    def __init__(
        self,
        module: nn.Sequential,
        *,
        chunks: int = 8,
        balance: Balance = "parameters",
        checkpoint: Checkpoint = "except_last",
        batch_dim: int = 0,
        group: dist.ProcessGroup | None = None,
        header_group: dist.ProcessGroup | None = None,
        deferred_batch_norm: bool = True,
        sample: Any = None,
        output: OutputMode = "last",
        device: torch.device | str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        timeline: bool = False,
        virtual_stages: int = 1,
        placement: Placement = "loop",
        compile: CompileOptions = False,
    ) -> None:
        super().__init__()
        check_backbone(module, "GPipeStage(module)")
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"a pipeline is built from an nn.Sequential, got {type(module).__name__}")
        compile_with = compile_options(compile)
        check_plain_sequential(module, "GPipeStage(module)")
        # Without torch.distributed it normalizes as BatchNorm does; with it, it syncs over the other stages too.
        if dist.is_available() and dist.is_initialized() and (norms := sync_batch_norms(module)):
            fix = "call lightning_gpipe.pipe.state.batchnorm.sync_deferred_batch_norm(stage, group) with the group of "
            raise TypeError(
                sync_batch_norm_error(norms, "GPipeStage(module)", fix + "this stage's data-parallel replicas")
            )
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks (M, the number of micro-batches) must be an int ≥ 1, got {chunks!r}")
        output = one_of(output, OUTPUT_MODES, "output")
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"batch_dim must be an int ≥ 0 (0: batch-first, 1: time-major), got {batch_dim!r}")
        wait = timedelta(seconds=timeout)
        groups = process_groups(group, header_group, wait)
        self._index = dist.get_rank(groups[0]) if groups else 0
        self._num_stages = dist.get_world_size(groups[0]) if groups else 1
        self._chunks = chunks
        self._batch_dim = batch_dim
        self._output_mode = output
        self._head: Callable[[Any], Any] | None = None  # output_head's
        checkpoint = one_of(checkpoint, CHECKPOINT_MODES, "checkpoint")
        if device is None:
            backend = dist.get_backend(groups[0]) if groups else "gloo"
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self._device = torch.device(device)
        K, r = self._num_stages, self._index
        self._placement = placement = checked_placement(placement, virtual_stages)
        v = self._virtual_stages = check_virtual_stages(virtual_stages, K)
        solved_for = "zb-v" if placement == "v" else "interleaved-1f1b"
        self._balance = agree_on_virtual_stages(
            module, K, v, balance, sample, groups[1] if groups else None, chunks, checkpoint, solved_for
        )
        stages = held_stages(r, K, v, placement)
        skips = plan_skips(module, self._balance, homes(K, v, placement))
        chunk_layers = [stage_layers(module, self._balance, s) for s in stages]
        layers = [pair for chunk in chunk_layers for pair in chunk]
        self._layer_index = LayerIndex(module, self._balance, r, stages, homes(K, v, placement))
        self._shared_names = shared_over_ranks(module, self._balance, K, r, layers, placement)
        for name, layer in layers:
            self.add_module(name, convert_deferred_batch_norm(layer) if deferred_batch_norm else layer)
        names = list(module._modules)
        holders = {names[i] for pair in skip_layers(module).values() for i in pair}
        compile_layers(dict(self._modules.items()), compile_with, holders)  # type: ignore[arg-type]
        self._compilations = Compilations(dict(self._modules.items()), batch_dim)  # type: ignore[arg-type]
        self._name_keys = {name: name_key(name) for name, _ in layers}
        # Interleaved: each chunk runs, normalizes and watches its own layers; otherwise the stage is its one chunk.
        self._chunk_layers = [ChunkLayers([name for name, _ in chunk]) for chunk in chunk_layers] if v > 1 else []
        self._refresh_chunks()
        owners: list[nn.Module] = [*self._chunk_layers] or [self]
        self._stateful_buffers = [StatefulBuffers(owner) for owner in owners]
        self._forward_only_calls = 0
        self._steps: list[Step] | None = None
        self._timeline = Timeline(self._index, enabled=timeline, device=self._device)
        links = None
        if groups:
            links_ = link_groups(groups[0], r, K, wait, placement)
            transport = Transport(groups[0], device=self._device, timeout=wait, header_group=groups[1], links=links_)
            links = Links(transport, StatusCheck(groups[1], self._index, wait), self._index, self._timeline)
            if skips is not None:
                pairs = skip_pairs(skips)
                transport.add_skip_groups(skip_groups(groups[0], r, pairs, homes(K, v, placement), wait))
        self._last_rank = rank_of(v * K - 1, K, placement)
        ring = v > 1 and placement == "loop"
        notices = skip_notices(skips, r)
        self._failures = FailureHandler(
            self._index, K, links, self._timeline, ring=ring, skip_notices=notices, last=self._last_rank
        )
        self._executors = [
            Executor(
                owner,
                self._run if owner is self else partial(self._run, names=self._chunk_layers[c].names),
                index=stages[c],
                num_stages=K * v,
                checkpoint=checkpoint,
                batch_dim=batch_dim,
                device=self._device,
                producer=self._layer_index.label(self._layer_index.layer_ranges[c][-1]),
                stateful_buffers=self._stateful_buffers[c],
                failures=self._failures,
                links=links,
                timeline=self._timeline,
                ranks=K,
                chunk=c if v > 1 else -1,
                skips=None if skips is None else skips[stages[c]],
                placement=placement,
                compiled=bool(self._compilations.names),
            )
            for c, owner in enumerate(owners)
        ]
        self._executor = self._executors[0]

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def timeline(self) -> Timeline:
        """The per-micro-batch events this stage records while ``timeline.enabled`` (see ``trace``)."""
        return self._timeline

    @property
    def shared(self) -> list[tuple[str, tuple[int, ...], nn.Parameter | None]]:
        """Weights tied across stages, whose gradients must be summed over the stages that hold them: (name in the
        whole model, the stages (ranks) holding it, this stage's copy or None); a weight tied across virtual stages of
        one rank only is one parameter there, not listed. Looked up now, as materializing a model built on
        the meta device replaces its parameters."""
        return [
            (name, stages, None if local is None else self.get_parameter(local))
            for name, stages, local in self._shared_names
        ]

    @property
    def index(self) -> int:
        """k: this stage's place in the pipeline, 0 … K−1."""
        return self._index

    @property
    def num_stages(self) -> int:
        return self._num_stages

    @property
    def is_first(self) -> bool:
        return self._index == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (rank K − 1; rank 0 in a V): the loss, the output."""
        return self._index == self._last_rank

    @property
    def last_rank(self) -> int:
        """The pipeline rank that holds the last stage: K − 1, or 0 in a V."""
        return self._last_rank

    @property
    def placement(self) -> Placement:
        """Where this rank's virtual stages sit (``registry.Placement``)."""
        return self._placement

    @property
    def balance(self) -> list[int]:
        """Layers per stage: K counts, or with interleaving vK, one per chunk (stage c·K + r is rank r's chunk c)."""
        return list(self._balance)

    @property
    def output_mode(self) -> OutputMode:
        """Where the output goes (see the class docstring); change it on every stage alike, between steps."""
        return self._output_mode

    @output_mode.setter
    def output_mode(self, mode: OutputMode) -> None:
        self._output_mode = one_of(mode, OUTPUT_MODES, "output_mode")

    @contextmanager
    def output_head(self, head: Callable[[Any], Any]) -> Iterator[None]:
        """Within it, a forward-only call returns ``head(output)`` on every stage: the last stage runs ``head`` and
        sends only what it returns (a decoder's next tokens, not the logits over the vocabulary). Enter it on every
        stage alike."""
        if not callable(head):
            raise TypeError(f"output_head(head): head must be callable, got {type(head).__name__}")
        self._head, before = head, self._head
        try:
            yield
        finally:
            self._head = before

    @property
    def chunks(self) -> int:
        return self._chunks

    @property
    def batch_dim(self) -> int:
        return self._batch_dim

    @property
    def buffers_changed_in_forward(self) -> list[str]:
        """Buffers (global names) that this stage's layers changed in a training forward phase so far: they are
        snapshotted for each recompute and restored after it, so re-materialization never changes them twice."""
        if len(self._stateful_buffers) == 1:
            return self._stateful_buffers[0].changed
        changed = {name for buffers in self._stateful_buffers for name in buffers.changed}
        return [name for name, _ in self.named_buffers(remove_duplicate=False) if name in changed]

    @property
    def compilations(self) -> dict[str, int]:
        """The graphs dynamo compiled so far for each compiled layer of this stage (global names; see
        ``pipe/run/compiled.py``); empty without any."""
        return {name: self._compilations.graphs[name] for name in self._compilations.names}

    @property
    def forward_only_calls(self) -> int:
        """Forward-only (no grad) calls since the last :meth:`reset`: a training step that called the backbone
        under ``torch.no_grad()`` has nothing to back-propagate through the pipeline."""
        return self._forward_only_calls

    @property
    def pending(self) -> bool:
        """True between a training forward phase and its backward()."""
        return self._steps is not None

    # --------------------------------------------------------------------------- indexing by global layer index
    def __len__(self) -> int:
        """L, the number of layers of the whole backbone."""
        return len(self._layer_index)

    def __iter__(self) -> Iterator[nn.Module]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, index: int | slice) -> nn.Module:
        """Layer ``index`` of the whole backbone, or a :class:`RemoteLayer` standing for it on another stage; a
        slice gives an nn.Sequential of the layers of that range that this stage holds (see ``indexing``)."""
        return self._layer_index.get(index, self._modules)

    def holds(self, index: int) -> bool:
        """Whether this stage holds layer ``index`` (global, negative too)."""
        return not isinstance(self[index], RemoteLayer)

    @property
    def layer_range(self) -> range:
        """The global indices of the layers this stage holds (with one chunk per rank)."""
        return self._layer_index.layer_range

    @property
    def layer_ranges(self) -> list[range]:
        """The global indices of the layers of each chunk this rank holds (one range unless interleaved)."""
        return self._layer_index.layer_ranges

    @property
    def virtual_stages(self) -> int:
        """v, the virtual stages each rank holds: rank r holds stages r, r + K, …, r + (v−1)K of the vK."""
        return self._virtual_stages

    def _refresh_chunks(self) -> None:
        for chunk in self._chunk_layers:
            chunk.refresh(self._modules)

    # ----------------------------------------------------------------------------------------------------- phases
    def _run(self, x: Any, seed: int, copy: bool = True, names: list[str] | None = None) -> Any:
        """This stage's layers on one micro-batch; each layer's randomness seeded by ``seed`` (see ``rng``)."""
        # A training boundary input is kept for the recompute and may be a leaf that requires grad: an in-place
        # first layer (ReLU(inplace=True)) must neither corrupt it nor trip autograd's leaf check, so layers get a copy.
        if copy:
            x = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)
        tray = current_tray()  # long skips: each stash and pop is checked against its layer's declaration
        for name, layer in self._modules.items() if names is None else ((n, self._modules[n]) for n in names):
            assert layer is not None, f"layer {name} was set to None"
            reseed(mix(seed, self._name_keys[name]), self._device)
            if tray is not None:
                tray.layer, tray.layer_class = name, type(layer).__name__
            x = layer(x) if name not in self._compilations else self._compilations.call(name, layer, x)
        return x

    def reset(self) -> None:
        """Forget a forward phase whose backward will not run (e.g. a skipped step); zero forward_only_calls."""
        self._steps = None
        self._forward_only_calls = 0

    def forward(self, input: Any = None) -> Any:
        """Forward phase (grad enabled) or forward-only pipeline (no grad); ``input`` is used on stage 0 only."""
        self._refresh_chunks()
        if torch.is_grad_enabled():
            if self._steps is not None:
                raise RuntimeError(
                    "the pipelined module was called again, with grad, before backward() drained its previous call: "
                    "each call's forward phase must be drained by backward() before the next call (batch several "
                    "inputs into one call); reset() drops a forward phase whose backward will not run"
                )
            if self._head is not None:
                raise RuntimeError(
                    "the pipelined module was called with grad inside output_head(): a head applies to forward-only "
                    "calls (wrap the call in torch.no_grad()), as its output has no gradient path back to the stages"
                )
            self._steps, output = forward_phase(self._executors, input, self._chunks, self._output_mode)
            return output
        self._forward_only_calls += 1
        try:
            return evaluate(self._executors, input, self._chunks, self._output_mode, self._head)
        except Exception:
            if self._failures.broken is not None:
                self._steps = None  # a failed pipeline drains no forward phase
            raise

    def backward(self, grad_output: Any = None, drained: Callable[[], None] | None = None) -> None:
        """Backward phase: drain the micro-batches in reverse, recomputing checkpointed ones before their gradient.

        On the last stage the gradient of the joined output is taken from its leaves' ``.grad`` (filled by the
        caller's ``loss.backward()``), unless ``grad_output`` gives it. Stage 0 finally back-propagates into the
        caller's input if it required grad. ``drained`` then runs, before the check that every stage finished the
        phase (which waits for the slowest): work that needs only this stage's gradients (their reduction over
        data-parallel replicas) overlaps the other stages' drain.
        """
        self._failures.check_usable()
        steps, self._steps = self._steps, None
        if steps is None:
            raise RuntimeError("backward() was called without a forward phase to drain: call the module first")
        self._refresh_chunks()
        backward_phase(self._executors, steps, grad_output, self._output_mode, drained)

    def forward_backward(
        self,
        input: Any,
        loss_fn: LossFn,
        *,
        schedule: ScheduleName = "gpipe",
        drained: Callable[[], None] | None = None,
        before_last_backward: Callable[[], None] | None = None,
    ) -> list[torch.Tensor]:
        """A whole training step with the loss inside the pipeline, forward and backward, no optimizer step (see
        ``pipe/run/loss_inside.py``).

        ``input`` is used on stage 0 only. The last stage calls ``loss_fn(output_m, m)`` on each micro-batch's
        output as soon as it exists and back-propagates the scalar it returns at once (weight it: ``n_m / N`` for a
        mean over samples, see :meth:`micro_batch_sizes`); it returns those scalars, detached, the other stages [].
        ``schedule`` is ``"gpipe"`` (all M micro-batches in flight before the first backward on stages before the
        last; ``"fill-drain"`` on the last too), ``"1f1b"`` (at most K − k on stage k: less activation memory, the
        same bubble) or ``"zb-h1"`` (1F1B with each backward split: the weight gradients of linear, convolution and
        embedding ops wait, as ``pipe/run/weight_grad.py`` keeps them, to fill the drain); their times:
        ``benchmarks/README.md``.
        ``"interleaved-1f1b"`` needs ``virtual_stages`` ≥ 2 (the others 1): 1F1B over the rank's v virtual stages, the
        bubble divided by v, for more activations in flight; ``chunks`` must suit it (see
        ``pipe/schedule/registry.py``). ``drained`` runs once this stage's gradients are complete, before waiting for
        the other stages; ``before_last_backward`` right before the stage's last backward op (e.g. to reduce
        gradients as they end).
        """
        self._failures.check_usable()
        if self._steps is not None:
            raise RuntimeError(
                "forward_backward() was called while a forward phase awaits its backward(): drain it first"
            )
        name = lookup(schedule).name
        try:  # on every rank before any transfer: each raises the same error
            check_schedule(name, self._num_stages, self._chunks, self._virtual_stages, self._placement)
        except ValueError as e:
            raise ValueError(f"GPipeStage(virtual_stages={self._virtual_stages}, chunks={self._chunks}): {e}") from e
        check_compiled_schedule(name, self._compilations.names)
        self._refresh_chunks()
        return forward_backward(self._executors, input, self._chunks, loss_fn, name, drained, before_last_backward)

    def micro_batch_sizes(self, input: Any) -> list[int]:
        """n_m of each micro-batch this stage's pipeline splits ``input`` into (the same on every stage)."""
        return plan_sizes(input, self._chunks, self._batch_dim)

    def abort(self, exc: BaseException) -> None:
        """Report a failure outside the pipelined module (e.g. in the loss) to every stage, then raise it."""
        phase = "backward" if self._steps is not None else "forward"
        self._steps = None
        self._failures.abort(exc, phase, self._output_mode)
