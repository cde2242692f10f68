"""The loss inside the pipeline: the module's ``pipeline_loss`` run per micro-batch on the last stage (1F1B or GPipe).

A training step on this path (``docs/design/micro-batch-loss.md``)::

    training_step(batch)                       every rank, the user's code
      out = self.backbone(x)                   -> a PipelineOutput marker; x kept, nothing runs yet
      loss = self.pipeline_loss(out, batch)    -> stage.forward_backward: forward and backward of every micro-batch;
                                                  on the last stage pipeline_loss(y_m, batch_m) · w_m per micro-batch,
                                                  its self.log calls and metric updates recorded;
                                                  one broadcast: the loss, the combined logs, the metric increments;
                                                  every rank logs once per key; the loss comes back as a fresh leaf
    backward(loss)                             the step's gradients (kept aside during training_step, which Lightning
                                                  follows with zero_grad) are added into .grad, then reduced

Weights: w_m = c(B_m) / c(B) with c = ``pipeline_loss_denominator(*args)`` if the module defines it, else the number of
samples; the whole batch's loss is then Σ_m w_m · loss_m exactly, for a loss that is a mean over what c counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_gpipe.pipe import GPipeStage, ScheduleName
from lightning_gpipe.pipe._torch_internals import tree_map
from lightning_gpipe.pipe.context import weighted_loss
from lightning_gpipe.pipe.dp.grads import PendingReduction
from lightning_gpipe.pipe.microbatch import batch_size, micro_batch_sizes, split_by_sizes, tensors
from lightning_gpipe.pipe.run.loss_inside import check_scalar_loss
from lightning_gpipe.strategy._pipeline_loss_logs import (
    LogRecorder,
    absorb,
    check_split_invariance,
    host_floats,
    replay,
    step_only_metrics,
)
from lightning_gpipe.strategy._rank_pipeline import EarlyReduction
from lightning_gpipe.strategy._step_results import LazyOutput, real_leaves

HOOK, DENOMINATOR = "pipeline_loss", "pipeline_loss_denominator"


@contextmanager
def _standing_in(
    stage: GPipeStage, forward: Callable[..., Any], module: Any, loss: Callable[..., Tensor]
) -> Iterator[None]:
    """``forward`` stands in for the stage's and ``loss`` for the module's ``pipeline_loss`` while the step runs."""
    stage.forward = forward  # type: ignore[method-assign]
    module.pipeline_loss = loss
    try:
        yield
    finally:
        del stage.forward
        del module.pipeline_loss


def _misuse(what: str) -> TypeError:
    return TypeError(
        f"GPipeStrategy(pipeline_loss=...): the backbone's output was {what}. On this path it exists per micro-batch "
        "on the last stage only: pass it straight to self.pipeline_loss(output, batch), which computes the loss (and "
        "logs and updates metrics) per micro-batch; or set GPipeStrategy(pipeline_loss=False)"
    )


@dataclass(frozen=True)
class _Call:
    """One call of ``pipeline_loss`` on the backbone's output: what the pipeline runs it with."""

    module: Any
    hook: Callable[..., Tensor]
    input: Any  # the backbone's input
    args: tuple
    kwargs: dict
    accumulate: int  # Lightning divides the step's loss by it
    scale: Callable[[Tensor], Tensor]  # the loss scaler's, or the identity


class PipelineOutput:
    """What the backbone returns in a training step on this path: a stand-in for ``pipeline_loss``'s first argument."""

    def __init__(self, input: Any) -> None:
        self.input = input

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise _misuse(f"given to {getattr(func, '__name__', func)}")

    def __getattr__(self, name: str) -> Any:
        raise _misuse(f"asked for .{name}")

    def __getitem__(self, key: Any) -> Any:
        raise _misuse("indexed")

    def __iter__(self) -> Any:
        raise _misuse("iterated")

    def __bool__(self) -> bool:
        raise _misuse("tested for truth")


class PipelineLoss:
    """Runs one training step's ``pipeline_loss`` inside the pipeline and keeps its gradients for ``backward``."""

    def __init__(
        self, stage: GPipeStage, schedule: ScheduleName, batch_dim: int, group: dist.ProcessGroup, plugin: Any
    ) -> None:
        self.stage, self.schedule, self.batch_dim, self.group = stage, schedule, batch_dim, group
        self.plugin = plugin  # its GradScaler, if any, scales each micro-batch's loss (read at each step)
        self.last = dist.get_global_rank(group, stage.last_rank) if stage.num_stages > 1 else None
        self.loss: float | None = None  # the step's loss, once pipeline_loss ran
        self.checked_epoch: int | None = None  # the split-invariance check runs at each epoch's first step
        self.grads: dict[nn.Parameter, Tensor] = {}
        self.reduced = False  # this step's gradients were reduced during the step
        self._output: PipelineOutput | None = None

    @property
    def ran(self) -> bool:
        """Whether this training step ran pipeline_loss inside the pipeline, whose gradients wait for backward."""
        return self.loss is not None

    @contextmanager
    def training_step(self, trainer: Any, pipeline: Any, reduce: bool) -> Iterator[None]:
        """While the user's training_step runs: the backbone gives a marker, ``pipeline_loss`` runs the pipeline.

        ``pipeline`` (a RankPipeline) reduces the gradients. With one micro-step per optimizer step (automatic
        optimization) the gradients kept aside were reduced already, so the step's are reduced as soon as this
        stage's drain ends, overlapping the other stages' (else in :meth:`add_gradients`)."""
        module, accumulate = trainer.lightning_module, trainer.accumulate_grad_batches
        early = reduce and accumulate == 1 and module.automatic_optimization
        reduction: EarlyReduction | None = pipeline.early_reduction() if early else None
        stage, self.loss, self._output, self.grads = self.stage, None, None, {}
        consumed: list[bool] = []
        self.reduced = early
        scaler = getattr(self.plugin, "scaler", None)
        scale: Callable[[Tensor], Tensor] = scaler.scale if scaler is not None else (lambda t: t)
        real_forward = stage.forward

        def capture(input: Any = None) -> Any:
            if not torch.is_grad_enabled():
                return real_forward(input)  # a frozen backbone under no_grad runs as usual
            if self._output is not None:
                raise RuntimeError("the training step called the backbone twice: call it exactly once per step")
            self._output = PipelineOutput(input)
            return self._output

        hook = getattr(module, HOOK)

        def pipeline_loss(output: Any, *args: Any, **kwargs: Any) -> Tensor:
            if not isinstance(output, PipelineOutput) or output is not self._output:
                return hook(output, *args, **kwargs)  # a whole output (validation, or computed outside the backbone)
            if consumed:
                raise RuntimeError("self.pipeline_loss ran twice on the backbone's output in one training step")
            consumed.append(True)
            return self._run(_Call(module, hook, output.input, args, kwargs, accumulate, scale), reduction)

        with _standing_in(stage, capture, module, pipeline_loss):
            yield
            if self._output is not None and not consumed:
                raise _misuse("never passed to self.pipeline_loss")

    @contextmanager
    def evaluation_step(self, module: Any) -> Iterator[None]:
        """While the user's validation or test step runs: the backbone gives a :class:`LazyOutput`; given straight to
        ``pipeline_loss``, the pipeline runs with the loss on the whole output on the last stage, and only the loss,
        logs and metric increments reach the other stages (else the output is computed and shared as usual)."""
        stage, real_forward, hook = self.stage, self.stage.forward, getattr(module, HOOK)
        made: list[LazyOutput] = []

        def capture(input: Any = None) -> Any:
            if torch.is_grad_enabled():
                return real_forward(input)

            def compute() -> Any:
                if lazy.taken:
                    warn_second_forward()
                return real_forward(input)

            lazy = LazyOutput(compute, input)
            made.append(lazy)
            return lazy

        def pipeline_loss(output: Any, *args: Any, **kwargs: Any) -> Tensor:
            if isinstance(output, LazyOutput) and not output.ready and not output.taken:
                output.taken = True
                mode, stage.output_mode = stage.output_mode, "last"
                try:
                    whole = real_forward(output.input)  # on the last stage; None on the others
                finally:
                    stage.output_mode = mode
                return self._evaluate(module, hook, whole, args, kwargs)
            output, args, kwargs = real_leaves((output, args, kwargs))
            return hook(output, *args, **kwargs)

        with _standing_in(stage, capture, module, pipeline_loss):
            try:
                yield
            finally:
                for lazy in made:
                    lazy.sealed = True
        for lazy in made:  # unused, or returned: computed now on every rank, as before, not later on one rank only
            if not lazy.taken:
                lazy.real()

    def _evaluate(self, module: Any, hook: Callable[..., Tensor], output: Any, args: tuple, kwargs: dict) -> Tensor:
        """``hook`` on the whole ``output`` on the last stage (None elsewhere); its loss, logs and metric increments
        given to every stage."""
        stage, device = self.stage, _device_of(self.stage)
        payload: dict[str, Any] = {}
        if stage.is_last:
            recorder, increments = LogRecorder(module), {}  # type: ignore[var-annotated]
            try:
                with recorder.recording(), step_only_metrics(module, increments):
                    loss = check_scalar_loss(hook(output, *args, **kwargs), "pipeline_loss")
                payload = {"loss": loss.detach().cpu(), "logs": recorder.logs(1), "metrics": increments}
            except Exception as e:  # the other stages wait for this broadcast: they must learn why it failed
                payload = {"error": f"{type(e).__name__}: {e}"}
        return self._share(module, payload, device, "in pipeline_loss")["loss"].to(device)

    def _share(self, module: Any, payload: dict[str, Any], device: torch.device, when: str) -> dict[str, Any]:
        """The last stage's ``payload`` on every rank, its metric increments and logs applied alike; its error
        raised on every rank."""
        if self.last is not None:
            box = [payload]
            dist.broadcast_object_list(box, src=self.last, group=self.group)
            payload = box[0]
        if "error" in payload:
            raise RuntimeError(f"on the last stage, {when}: {payload['error']}")
        absorb(module, payload["metrics"], device)
        replay(module, payload["logs"], device)
        return payload

    def _run(self, call: _Call, reduction: EarlyReduction | None) -> Tensor:
        stage, module = self.stage, call.module
        device = _device_of(stage)
        params = [p for p in module.parameters() if p.requires_grad]
        parked = [p.grad for p in params]  # Lightning zeroes .grad after training_step: the step's go aside
        for p in params:
            p.grad = None
        payload: dict[str, Any] = {}
        started: list[PendingReduction] = []
        hooks: dict[str, Any] = {}
        if reduction is not None:
            hooks = {"before_last_backward": reduction.arm, "drained": lambda: started.append(reduction.launch_rest())}
        try:
            if stage.is_last:
                payload = self._last_stage(call, hooks)
            else:
                stage.forward_backward(call.input, _never_called, schedule=self.schedule, **hooks)
            if reduction is not None:  # while the step's gradients are the only ones in .grad
                reduction.finish(started[0] if started else None)
        finally:
            self.grads = {p: p.grad for p in params if p.grad is not None}
            for p, g in zip(params, parked):
                p.grad = g
        payload = self._share(module, payload, device, "after the pipeline")
        self.loss = payload["loss"]
        # In the dtype pipeline_loss returned, as the plain run's loss is (float64 under "64-true").
        return torch.tensor(payload["loss"], dtype=payload["dtype"], device=device, requires_grad=True)

    def _last_stage(self, call: _Call, hooks: dict[str, Any]) -> dict[str, Any]:
        module, hook, input, args, kwargs = call.module, call.hook, call.input, call.args, call.kwargs
        sizes = micro_batch_sizes(batch_size(input, self.batch_dim), self.stage.chunks)
        pieces = split_by_sizes((args, kwargs), sizes, self.batch_dim)
        count = getattr(module, DENOMINATOR, None)
        if count is not None:
            total, *counts = host_floats([count(*args, **kwargs), *(count(*a, **k) for a, k in pieces)])
            weights = [c / total if total else 0.0 for c in counts]
        else:
            weights = [n / sum(sizes) for n in sizes]
        recorder, losses, increments = LogRecorder(module), [], {}  # type: ignore[var-annotated]
        dtypes: list[torch.dtype] = []
        epoch = module.trainer.current_epoch
        check, kept = len(sizes) >= 2 and epoch != self.checked_epoch, []
        self.checked_epoch = epoch

        def loss_fn(y: Any, m: int) -> Tensor:
            a, k = pieces[m]
            if check and m < 2:
                kept.append(tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, y))
            recorder.weight = weights[m]
            with recorder.recording(), weighted_loss(weights[m]):
                loss = check_scalar_loss(hook(y, *a, **k), "pipeline_loss")
            dtypes.append(loss.dtype)
            if weights[m] == 0.0:  # nothing of the loss in this micro-batch (all padding): 0/0 must not reach .grad
                return torch.zeros((), device=loss.device)
            losses.append(loss.detach().double() * weights[m])
            return call.scale(loss * (weights[m] / call.accumulate))

        with step_only_metrics(module, increments):
            self.stage.forward_backward(input, loss_fn, schedule=self.schedule, **hooks)
        try:
            logs = recorder.logs(len(sizes))
            if check:
                precise = not torch.is_autocast_enabled(tensors(kept[0])[0].device.type) and all(
                    t.dtype in (torch.float32, torch.float64) for t in tensors(kept[0]) if t.is_floating_point()
                )
                arguments = (args, kwargs)
                with weighted_loss(None):
                    check_split_invariance(module, hook, count, kept, arguments, sum(sizes), self.batch_dim, precise)
            return {"loss": math.fsum(host_floats(losses)), "dtype": dtypes[0], "logs": logs, "metrics": increments}
        except Exception as e:  # the other stages wait for this broadcast: they must learn why it failed
            return {"error": f"{type(e).__name__}: {e}"}

    @classmethod
    def choose(cls, module: Any, setting: Any, *args: Any) -> PipelineLoss | None:
        """This path (``args`` as for the constructor) when ``setting`` is True, or "auto" and the module defines
        ``pipeline_loss``; else None."""
        defined = callable(getattr(module, HOOK, None))
        if setting is True and not defined:
            raise TypeError(
                f"GPipeStrategy(pipeline_loss=True) needs {type(module).__name__}.pipeline_loss(self, output, "
                "batch), called in training_step as self.pipeline_loss(self.backbone(x), batch); define it, or "
                "pipeline_loss='auto'"
            )
        inside = defined and setting is not False
        schedule = args[1]
        if not inside and schedule != "gpipe":
            why = "pipeline_loss=False" if defined else f"{type(module).__name__} defines no pipeline_loss"
            raise ValueError(
                f"GPipeStrategy(schedule={schedule!r}) orders the micro-batches of a step with the loss inside the "
                f"pipeline, but {why}: the loss runs outside, after every micro-batch's forward (GPipe's order). "
                "Define pipeline_loss(self, output, batch) and call self.pipeline_loss(self.backbone(x), batch) in "
                "training_step to use it, or leave schedule='gpipe'"
            )
        return cls(*args) if inside else None

    def _check_closure_loss(self, closure_loss: Tensor, accumulate: int) -> None:
        """The loss Lightning back-propagates must be pipeline_loss's (÷ ``accumulate`` in automatic optimization):
        a term added outside it would reach no gradient."""
        assert self.loss is not None
        got = float(closure_loss.detach())
        # A bf16 or fp16 loss holds the step's loss rounded to its dtype (and divided by ``accumulate`` in it).
        tol = max(1e-5, torch.finfo(closure_loss.dtype).eps) if closure_loss.is_floating_point() else 1e-5
        if not any(abs(got - self.loss / a) <= tol * max(1.0, abs(got)) for a in (1, accumulate)):
            raise RuntimeError(
                f"GPipeStrategy(pipeline_loss=...): the training step returned {got:.6g}, not the value of "
                f"self.pipeline_loss ({self.loss:.6g}); only pipeline_loss is back-propagated through the pipeline, "
                "so move every term of the loss into it, or set pipeline_loss=False"
            )

    def add_gradients(self, closure_loss: Tensor, trainer: Any, reduce: Callable[[], None] | None) -> None:
        """In ``backward`` of ``closure_loss`` (checked to be pipeline_loss's): the step's gradients into ``.grad``
        (after Lightning's zero_grad, if it ran), then ``reduce`` them (None while an accumulation window goes on),
        unless that happened in the step already."""
        self._check_closure_loss(closure_loss, trainer.accumulate_grad_batches)
        for p, g in self.grads.items():
            p.grad = g if p.grad is None else p.grad + g
        self.grads, self.loss = {}, None
        if reduce is not None and not self.reduced:
            reduce()


def warn_second_forward() -> None:
    rank_zero_warn(
        "GPipeStrategy: an evaluation step used the backbone's output after self.pipeline_loss had taken it (which "
        "keeps the output on the last stage), so the pipeline ran a second time to compute it. Use the output "
        "before calling self.pipeline_loss on it to run the pipeline once",
        category=PossibleUserWarning,
    )


def _never_called(y: Any, m: int) -> Tensor:
    raise AssertionError("only the last stage computes the loss")


def _device_of(stage: GPipeStage) -> torch.device:
    return next((t.device for t in [*stage.parameters(), *stage.buffers()]), torch.device("cpu"))
