"""One rank's cell of a GPipe pipeline: its layers under their original names, and the phases that run them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from lightning_gpipe.pipe.batchnorm import (
    check_replicas_run_the_same_m,
    commit_deferred_batch_norm,
    convert_deferred_batch_norm,
    deferred_statistics,
)
from lightning_gpipe.pipe.boundary import check_boundary
from lightning_gpipe.pipe.buffers import StatefulBuffers
from lightning_gpipe.pipe.errors import PipelineError
from lightning_gpipe.pipe.failures import FailureHandling
from lightning_gpipe.pipe.indexing import LayerIndexing
from lightning_gpipe.pipe.microbatch import (
    differentiable,
    join,
    join_input_grads,
    plan_sizes,
    split_by_sizes,
    split_leaves,
    tensors,
)
from lightning_gpipe.pipe.outputs import OutputHandling
from lightning_gpipe.pipe.partition import Balance, agree_on_balance, local_name, shared_parameters, stage_layers
from lightning_gpipe.pipe.records import OUTPUT_MODES, MicroBatch, OutputMode, Step
from lightning_gpipe.pipe.rematerialize import ForwardState, recomputing
from lightning_gpipe.pipe.rng import draw_step_seed, mix, name_key, reseed, restored_streams
from lightning_gpipe.pipe.schedule import Checkpoint, backward_order, is_checkpointed, validate_checkpoint
from lightning_gpipe.pipe.status import StatusCheck
from lightning_gpipe.pipe.trace import Timeline
from lightning_gpipe.pipe.transport import TensorMeta, Transport, cpu_group


class GPipeStage(FailureHandling, OutputHandling, LayerIndexing, nn.Module):
    """Stage k of K: owns a contiguous slice of an ``nn.Sequential`` and runs it as GPipe does.

    Every rank of the pipeline group builds it from the same ``nn.Sequential`` and keeps only its own layers, named as
    in the original module so that state-dict keys stay global. Calling it with grad enabled runs the forward phase
    of a training step (stage 0 splits the input into M micro-batches; the last stage returns the joined output as a
    leaf that collects the caller's gradient); :meth:`backward` then drains the micro-batches in reverse. Calling it
    without grad runs a forward-only pipeline. Every stage must make the same calls: they are collective.
    Indexing it (``stage[i]``, ``len(stage)``) goes by the layers of the whole backbone (see ``indexing``).

    Args:
        module: the L layers; built alike on every rank (same seed), only this stage's layers are kept.
        chunks: M, micro-batches per mini-batch (fewer, with a warning, when the batch has fewer samples).
        balance: layers per stage, or how to find them: ``"parameters"``, ``"time"`` (profiles ``sample``), or a
            per-layer cost ``fn(i, layer) -> c_i``; solved exactly on stage 0 and broadcast.
        checkpoint: re-materialization, ``"always"``, ``"except_last"`` or ``"never"`` (see ``schedule``).
        batch_dim: the dimension that holds the samples in every tensor that is split or crosses a stage boundary:
            0, or 1 for time-major ``(T, N, ...)`` tensors (nn.GRU, nn.LSTM, nn.Transformer without batch_first).
        group: the pipeline's process group, stage k = group rank k (default: the world).
        header_group: a gloo group over the same ranks for headers and status checks (made for you if needed).
        deferred_batch_norm: turn BatchNorm layers into :class:`DeferredBatchNorm`.
        output: ``"last"`` returns the output on the last stage only; ``"all"`` on every stage; ``"placeholder"``
            gives the other stages zeros of the same structure, shapes and dtypes (no tensor data crosses).
            Settable later as :attr:`output_mode`.
        device: where received tensors go (default: the current CUDA device with NCCL, else the CPU).
        timeout: seconds to wait for a peer before raising :class:`PipelineTimeout`.
        timeline: record per-micro-batch events in ``self.timeline``.
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
        timeout: float = 1800.0,
        timeline: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"a pipeline is built from an nn.Sequential, got {type(module).__name__}")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks (M, the number of micro-batches) must be an int ≥ 1, got {chunks!r}")
        if output not in OUTPUT_MODES:
            raise ValueError(f"output={output!r} is not one of {list(OUTPUT_MODES)}")
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"batch_dim must be an int ≥ 0 (0: batch-first, 1: time-major), got {batch_dim!r}")
        distributed = dist.is_available() and dist.is_initialized()
        group = group if group is not None or not distributed else dist.group.WORLD
        self._k = dist.get_rank(group) if distributed else 0
        self._K = dist.get_world_size(group) if distributed else 1
        if distributed and header_group is None:
            header_group = cpu_group(group)
        self._chunks = chunks
        self._checkpoint = validate_checkpoint(checkpoint)
        self._batch_dim = batch_dim
        self._output_mode = output
        if device is None:
            backend = dist.get_backend(group) if distributed else "gloo"
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self._device = torch.device(device)
        self._balance = agree_on_balance(
            module, self._K, balance, sample=sample, group=header_group if distributed else None
        )
        layers = stage_layers(module, self._balance, self._k)
        self._index_layers(module)
        # Tied weights used on several stages: (first name, stages, the name of one of its uses on this stage).
        self._shared: list[tuple[str, tuple[int, ...], str | None]] = [
            (name, stages, local_name(layers, module.get_parameter(name)) if self._k in stages else None)
            for name, stages in shared_parameters(module, self._balance)
        ]
        for name, layer in layers:
            self.add_module(name, convert_deferred_batch_norm(layer) if deferred_batch_norm else layer)
        self._name_keys = {name: name_key(name) for name, _ in layers}
        self._stateful = StatefulBuffers(self)
        self._forward_only_calls = 0
        self._transport = (
            Transport(group, device=self._device, timeout=timedelta(seconds=timeout), header_group=header_group)
            if distributed
            else None
        )
        self._status = StatusCheck(header_group, self._k, timedelta(seconds=timeout)) if distributed else None
        self.timeline = Timeline(self._k, enabled=timeline, device=self._device)
        self._step: Step | None = None
        self._broken: PipelineError | None = None

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def shared(self) -> list[tuple[str, tuple[int, ...], nn.Parameter | None]]:
        """Weights tied across stages, whose gradients must be summed over the stages that hold them: (name in the
        whole model, stages holding it, this stage's copy or None). Looked up now, as materializing a model built on
        the meta device replaces its parameters."""
        return [
            (name, stages, None if local is None else self.get_parameter(local)) for name, stages, local in self._shared
        ]

    @property
    def index(self) -> int:
        """k: this stage's place in the pipeline, 0 … K−1."""
        return self._k

    @property
    def num_stages(self) -> int:
        return self._K

    @property
    def is_first(self) -> bool:
        return self._k == 0

    @property
    def is_last(self) -> bool:
        return self._k == self._K - 1

    @property
    def balance(self) -> list[int]:
        return list(self._balance)

    @property
    def output_mode(self) -> OutputMode:
        """Where the output goes (see the class docstring); change it on every stage alike, between steps."""
        return self._output_mode

    @output_mode.setter
    def output_mode(self, mode: OutputMode) -> None:
        if mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode={mode!r} is not one of {list(OUTPUT_MODES)}")
        self._output_mode = mode

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
        return self._stateful.changed

    @property
    def forward_only_calls(self) -> int:
        """Forward-only (no grad) calls since the last :meth:`reset`: a training step that called the backbone
        under ``torch.no_grad()`` has nothing to back-propagate through the pipeline."""
        return self._forward_only_calls

    @property
    def pending(self) -> bool:
        """True between a training forward phase and its backward()."""
        return self._step is not None

    # -------------------------------------------------------------------------------------------- running layers
    def _run(self, x: Any, seed: int, copy: bool = True) -> Any:
        """This stage's layers on one micro-batch; each layer's randomness seeded by ``seed`` (see ``rng``)."""
        # A training boundary input is kept for the recompute and may be a leaf that requires grad: an in-place
        # first layer (ReLU(inplace=True)) must neither corrupt it nor trip autograd's leaf check, so layers get a copy.
        if copy:
            x = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)
        for name, layer in self._modules.items():
            reseed(mix(seed, self._name_keys[name]), self._device)
            x = layer(x)
        return x

    def _receive(self, m: int, training: bool) -> tuple[Any, dict[str, Any]]:
        """Micro-batch m's input from the previous stage, with its header fields: M, its size n, the step seed."""
        assert self._transport is not None
        with self.timeline.record("recv-wait", m):
            x, fields = self._transport.recv(self._k - 1, f"micro-batch {m}'s input")
        if fields["training"] != training:
            modes = {True: "a training forward phase (grad enabled)", False: "a forward-only pass (no grad)"}
            raise RuntimeError(
                f"stage {self._k - 1} ran {modes[fields['training']]} while stage {self._k} ran {modes[training]}; "
                "every stage must call the pipelined module in the same grad mode"
            )
        return x, fields

    def _send(self, dst: int, obj: Any, micro_batch: int, **kwargs: Any) -> list[TensorMeta]:
        assert self._transport is not None
        with self.timeline.record("send", micro_batch):
            metas = self._transport.send(dst, obj, **kwargs)
            self._transport.retire_sends()
        return metas

    def reset(self) -> None:
        """Forget a forward phase whose backward will not run (e.g. a skipped step); zero forward_only_calls."""
        self._step = None
        self._forward_only_calls = 0

    # ----------------------------------------------------------------------------------------------------- phases
    def forward(self, input: Any = None) -> Any:
        """Forward phase (grad enabled) or forward-only pipeline (no grad); ``input`` is used on stage 0 only."""
        if torch.is_grad_enabled():
            return self._forward_phase(input)
        self._forward_only_calls += 1
        return self._evaluate(input)

    def _forward_phase(self, input: Any) -> Any:
        if self._step is not None:
            raise RuntimeError(
                "the pipelined module was called twice before backward() drained the first call: call it exactly once "
                "per training step (or call reset() if a step's backward is skipped)"
            )
        seed = draw_step_seed()  # outside the restored streams: the next step draws the next seed
        with self._phase("forward") as where, restored_streams(self._device):
            sizes = plan_sizes(input, self._chunks, self._batch_dim) if self.is_first else []
            micro_inputs, input_leaves = split_leaves(input, sizes, self._batch_dim) if self.is_first else ([], [])
            could_require = any(p.requires_grad for p in self.parameters())
            step = Step([], input_leaves=input_leaves, seed=seed)
            self._stateful.begin()
            m, M = 0, len(micro_inputs)
            while m < M or (m == 0 and not self.is_first):
                where[0] = m
                if self.is_first:
                    x, n = micro_inputs[m], sizes[m]
                else:
                    x, got = self._receive(m, training=True)
                    M, n, step.seed = got["M"], got["n"], got["seed"]
                if m == 0:
                    check_replicas_run_the_same_m(self, M, self._device)
                ckpt = is_checkpointed(self._checkpoint, m, M)
                state = ForwardState.capture([self._device]) if ckpt else None
                buffers, before = self._stateful.snapshot() if ckpt else None, self._stateful.mark()
                with self.timeline.record("forward", m), deferred_statistics(), torch.set_grad_enabled(not ckpt):
                    y = self._run(x, mix(step.seed, m))
                self._stateful.learn(before)
                check_boundary(y, n, self._batch_dim, self._producer, self.is_last)
                needs = could_require or any(t.requires_grad for t in tensors(x))
                marks = [differentiable(t) and (t.requires_grad or (ckpt and needs)) for t in tensors(y)]
                mb = MicroBatch(x, y, state, marks, buffers=buffers)
                step.sizes.append(n)
                if not self.is_last:
                    fields = {"m": m, "M": M, "n": n, "training": True, "seed": step.seed}
                    mb.metas = self._send(self._k + 1, y, m, requires_grad=marks, **fields)
                    if ckpt:
                        mb.output = None
                step.micro.append(mb)
                m += 1
            commit_deferred_batch_norm(self)
            where[0] = None
            output = self._join_outputs(step) if self.is_last else None
            output = self._share_output(output)
            if self._status_checked("forward"):
                with self.timeline.record("status"):
                    self._status.check(None, self._transport.unreceived)
        self._step = step
        return output

    def backward(self, grad_output: Any = None) -> None:
        """Backward phase: drain the micro-batches in reverse, recomputing checkpointed ones before their gradient.

        On the last stage the gradient of the joined output is taken from its leaves' ``.grad`` (filled by the
        caller's ``loss.backward()``), unless ``grad_output`` gives it. Stage 0 finally back-propagates into the
        caller's input if it required grad.
        """
        self._check_usable()
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("backward() was called without a forward phase to drain: call the module first")
        tr = self._transport
        with self._phase("backward") as where:
            grads_m = self._output_grads(step, grad_output) if self.is_last else None
            input_grads: list[list[torch.Tensor]] = [[] for _ in step.micro]
            for m in backward_order(len(step.micro)):
                where[0] = m
                mb = step.micro[m]
                pending = None
                if not self.is_last:
                    expect = [meta for meta, mark in zip(mb.metas, mb.marks) if mark]
                    pending = tr.post_recv(self._k + 1, f"micro-batch {m}'s output gradient", expect=expect)
                y = mb.output
                if mb.state is not None:
                    with (
                        self.timeline.record("recompute", m),
                        mb.state.restore(),
                        self._stateful.replay(mb.buffers),
                        recomputing(),
                        torch.enable_grad(),
                    ):
                        y = self._run(mb.input, mix(step.seed, m))
                if pending is not None:
                    with self.timeline.record("recv-wait", m):
                        grads, _ = pending.wait()
                else:
                    grads = grads_m[m]
                with self.timeline.record("backward", m):
                    marked = [t for t, mark in zip(tensors(y), mb.marks) if mark]
                    pairs = [(t, g) for t, g in zip(marked, grads) if t.requires_grad]
                    if pairs:
                        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                leaves = [t for t in tensors(mb.input) if t.requires_grad]
                g_in = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
                step.micro[m] = MicroBatch(None, None, None, [])  # free this micro-batch's memory now
                if not self.is_first:
                    self._send(self._k - 1, g_in, m, requires_grad=[False] * len(g_in))
                else:
                    input_grads[m] = g_in
            where[0] = None
            if self.is_first and step.input_leaves:
                torch.autograd.backward(step.input_leaves, join_input_grads(input_grads, self._batch_dim))
            if self._status is not None:
                with self.timeline.record("status"):
                    self._status.check(None, tr.unreceived)
        if tr is not None:
            tr.wait_sends()

    def _evaluate(self, input: Any) -> Any:
        seed = draw_step_seed()
        with self._phase("evaluation") as where, deferred_statistics(), restored_streams(self._device):
            planned = plan_sizes(input, self._chunks, self._batch_dim) if self.is_first else []
            micro_inputs = split_by_sizes(input, planned, self._batch_dim) if self.is_first else []
            outs, sizes = [], []
            m, M = 0, len(micro_inputs)
            while m < M or (m == 0 and not self.is_first):
                where[0] = m
                if self.is_first:
                    x, n = micro_inputs[m], planned[m]
                else:
                    x, got = self._receive(m, training=False)
                    M, n, seed = got["M"], got["n"], got["seed"]
                with self.timeline.record("forward", m):
                    y = self._run(x, mix(seed, m), copy=False)
                check_boundary(y, n, self._batch_dim, self._producer, self.is_last)
                sizes.append(n)
                if self.is_last:
                    outs.append(y)
                else:
                    self._send(self._k + 1, y, m, m=m, M=M, n=n, training=False, seed=seed)
                m += 1
            commit_deferred_batch_norm(self)
            where[0] = None
            output = self._share_output(join(outs, self._batch_dim, sizes) if self.is_last else None)
            if self._status_checked("evaluation"):
                self._status.check(None, self._transport.unreceived)
        if self._transport is not None:
            self._transport.wait_sends()
        return output
