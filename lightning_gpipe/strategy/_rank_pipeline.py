"""This rank's part of a pipelined module: its stage, and what keeps the copies of every weight equal around it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_gpipe.pipe import GPipeStage, ScheduleName
from lightning_gpipe.pipe.dp.fsdp import ShardedLayers
from lightning_gpipe.pipe.dp.grads import OverlappedReduction, PendingReduction
from lightning_gpipe.pipe.dp.ready_buckets import ReadyBuckets
from lightning_gpipe.pipe.run.compiled import CompileOptions
from lightning_gpipe.pipe.schedule.registry import lookup
from lightning_gpipe.pipe.split.virtual_stages import solve_virtual_stages
from lightning_gpipe.pipe.state.batchnorm import sync_deferred_batch_norm
from lightning_gpipe.pipe.state.rematerialize import Checkpoint
from lightning_gpipe.strategy import _lightning_internals as internals
from lightning_gpipe.strategy._arguments import (
    DataParallel,
    StrategyBalance,
    check_backbone_layers,
    check_compiled_layers,
    check_interleaving,
)
from lightning_gpipe.strategy._audit import BackboneAudit, StepAudit, check_loss
from lightning_gpipe.strategy._averaged import WeightAverages
from lightning_gpipe.strategy._balance import Plan, plan_balance, shown_costs
from lightning_gpipe.strategy._materialize import InitRecord, has_meta_tensors, materialize
from lightning_gpipe.strategy._mesh import PipelineMesh
from lightning_gpipe.strategy._partition_report import PartitionReport, WholeModel
from lightning_gpipe.strategy._pipeline_loss_logs import sync_metrics_over
from lightning_gpipe.strategy._step_results import abort_on_error
from lightning_gpipe.strategy._trace import StepTracer
from lightning_gpipe.strategy._weight_copies import HeldBuffers, WeightCopies, fit_to_pipeline, outside_parameters


@dataclass(frozen=True)
class EarlyReduction:
    """``arm`` before the stage's last backward op, ``launch_rest`` after it, then ``finish`` what it returned."""

    arm: Callable[[], None]
    launch_rest: Callable[[], PendingReduction]
    finish: Callable[[PendingReduction | None], None]


@dataclass(frozen=True)
class StageOptions:
    """GPipeStrategy's arguments that shape the stage."""

    chunks: int
    balance: StrategyBalance
    checkpoint: Checkpoint
    batch_dim: int
    deferred_batch_norm: bool
    output: Literal["all", "placeholder"]
    pipeline_loss: bool = False  # the module's pipeline_loss hook will run inside the pipeline
    schedule: ScheduleName = "gpipe"
    virtual_stages: int = 1  # v virtual stages per rank: the backbone in vK stages
    planned_costs: list[float] | None = None  # the layers' costs on which "auto" planned ``balance``
    compile: CompileOptions = False  # torch.compile each layer on its stage (pipe/run/compiled.py)

    @classmethod
    def of(cls, strategy: Any) -> StageOptions:
        """GPipeStrategy's values of them."""
        s = strategy
        inside = s.pipeline_loss is not False and callable(getattr(s.lightning_module, "pipeline_loss", None))
        return cls(
            s.chunks,
            s.balance,
            s.activation_checkpointing,
            s.batch_dim,
            s.deferred_batch_norm,
            s.output,
            inside,
            s.schedule,
            s.virtual_stages,
            s._planned_costs,
            s.compile,
        )


class RankPipeline:
    """This rank's stage of the pipelined backbone (``stage``), the module's weights with copies on other ranks
    (``copies``), and the reduction of the gradients over the data-parallel replicas.

    Made by :meth:`build` when this strategy pipelines the backbone, or around a ``stage`` an earlier Trainer made;
    :meth:`connect` runs at every setup, once the module is converted and on its device.
    """

    def __init__(
        self,
        stage: GPipeStage,
        mesh: PipelineMesh,
        step_audit: StepAudit | None = None,
        plain_parameter_names: list[str] | None = None,
        report: PartitionReport | None = None,
    ) -> None:
        self.stage, self.mesh = stage, mesh
        self.report = report  # the split, known only when the backbone was pipelined here
        self.step_audit = step_audit
        # The plain module's parameter names in order (a plain optimizer's state dict numbers parameters so); known
        # only when the backbone was pipelined here.
        self.plain_parameter_names = plain_parameter_names
        self.copies: WeightCopies | None = None
        self.held_buffers: HeldBuffers | None = None
        self._dp_reduce: OverlappedReduction | None = None
        self._ready: ReadyBuckets | None = None
        self.sharded: ShardedLayers | None = None  # data_parallel="fsdp": the stage's layers, sharded over dp
        self._shards_pending = False  # this step's sharded gradients wait for their reduce-scatter

    @classmethod
    def build(
        cls,
        module: nn.Module,
        path: str,
        backbone: nn.Sequential,
        options: StageOptions,
        mesh: PipelineMesh,
        device: torch.device,
        sync_batchnorm: bool,
        init_record: InitRecord | None,
        broadcast: Callable[[Any], Any],
        sharding: tuple[DataParallel, bool] = ("ddp", False),
    ) -> RankPipeline:
        """Replace ``backbone`` (at ``path``, and every other reference to it in ``module``) with this rank's stage.

        Collective: every rank calls it. In order: the backbone checked; what only the whole module shows read
        (its aliases, shared weights and weight averages, parameter names and counts, whether it is on the meta
        device); the split balanced; this rank's stage made; every reference handed over to it; a module built on the
        meta device (configure_model under the strategy) materialized, only this rank's share of it, as
        ``init_record`` says it was initialized -- with ``sharding`` ("fsdp", reshard_after_forward) one layer at a
        time, each sharded over the replicas before the next is made; BatchNorm synchronized over the replicas.
        """
        K, rank, v = mesh.K, mesh.rank, options.virtual_stages
        check_interleaving(K, options.chunks, options.schedule, v)  # on every rank, before any collective
        check_backbone_layers(module, path, backbone, K, v)
        check_compiled_layers(backbone, options.compile, options.schedule, options.pipeline_loss, sync_batchnorm)
        # Read now: the stage keeps only this rank's layers.
        names = [n for n, _ in module.named_parameters()]
        audit = BackboneAudit(module, backbone, path)
        averages = WeightAverages(module, backbone, path, audit.references, internals.averaged_copies(module))
        audit.findings += averages.findings
        split = any(isinstance(p, DTensor) for p in backbone.parameters())  # tensor-parallel parts
        if (sharding[0] == "fsdp" or split) and averages.copies:  # on every rank alike: each found the same copies
            what = "data_parallel='fsdp'" if sharding[0] == "fsdp" else "tensor_parallel_size > 1"
            raise ValueError(
                f"GPipeStrategy({what}) cannot keep a weight average of the backbone (an AveragedModel, a timm EMA, "
                "or Lightning's WeightAveraging / StochasticWeightAveraging): its copy would hold whole layers beside "
                "their shards or parts, and averaging pairs each copy tensor with a live one. Use data_parallel='ddp' "
                "without tensor parallelism for weight averaging, or drop the average"
            )
        whole_model = WholeModel.read(module, path, backbone)
        on_meta = has_meta_tensors(module)
        whole = dict(module.named_modules()) if on_meta else {}
        plan = _plan(module, backbone, options, mesh, device, on_meta, broadcast)
        costs = shown_costs(plan, backbone) if rank == 0 else plan.costs
        stage = _stage(backbone, plan, options, mesh, device)
        audit.hand_over(stage, log=rank == 0)
        averages.follow(stage)
        report = PartitionReport(whole_model, plan, stage.balance, costs, ranks=K, placement=stage.placement)
        step_audit = StepAudit(stage, path, options.batch_dim, mesh.dp_group, rank)
        sharded = None
        if on_meta:  # only now, with the other stages' layers dropped: memory ∝ this rank's partition
            seed = broadcast(torch.initial_seed())
            if sharding[0] == "fsdp":  # memory ∝ this rank's shard, and one whole layer

                def made(layers: Iterable[nn.Module]) -> Iterator[nn.Module]:
                    for layer in layers:
                        materialize(layer, whole, device, seed, init_record)
                        yield layer

                copied = [*outside_parameters(module, stage), *(p for _, _, p in stage.shared if p is not None)]
                sharded = _shard(stage, copied, mesh, sharding[1], made)
            materialize(module, whole, device, seed, init_record)  # the rest: modules outside, layers left whole
        if sync_batchnorm:  # per-micro-batch statistics over the replicas of this stage
            sync_deferred_batch_norm(stage, mesh.dp_group)
        pipeline = cls(stage, mesh, step_audit, names, report)
        pipeline.sharded = sharded
        return pipeline

    def connect(
        self,
        module: nn.Module,
        plugin: Precision,
        device: torch.device,
        bucket_bytes: int,
        data_parallel: DataParallel = "ddp",
        reshard_after_forward: bool = False,
    ) -> None:
        """Collective: the copies made equal and, with ``data_parallel="fsdp"``, the stage's layers sharded (the
        first time); metrics, gradient reduction and precision plugin pointed at the pipeline's groups. Runs after
        the precision plugin converted the module: a layer is sharded in the dtype it trains in."""
        mesh = self.mesh
        if self.copies is None:
            self.copies = WeightCopies(
                module, self.stage, mesh.stage_ranks, mesh.rank, mesh.pp_group, mesh.dp_group, mesh.header_group
            )
            self.copies.broadcast_initial_state()
            self.held_buffers = HeldBuffers(module, self.stage, mesh.pp_group, mesh.header_group)
            if data_parallel == "fsdp" and self.sharded is None:  # after the broadcast: replica 0's values
                self.sharded = _shard(self.stage, self.copies.copied, mesh, reshard_after_forward)
        sync_metrics_over(module, mesh.dp_group)
        # The stage's own parameters are reduced over the replicas while the pipeline still drains elsewhere (a
        # tensor-parallel part as a whole tensor: each replica holds the same part); the sharded layers' are
        # reduce-scattered by FSDP.
        units = self.sharded.units if self.sharded is not None else []
        fsdp = {id(p) for unit in units for p in unit.parameters()}  # type: ignore[attr-defined]
        params = [p for p in module.parameters() if id(p) not in fsdp]
        copied = self.copies.copied
        hierarchy, votes = mesh.dp_hierarchy, mesh.dp_cpu_group  # the votes on gloo: no wait for the GPU per step
        self._dp_reduce = OverlappedReduction(params, copied, mesh.dp_group, bucket_bytes, hierarchy, votes)
        self._ready = ReadyBuckets(self._dp_reduce.own.params, mesh.dp_group, bucket_bytes, hierarchy, vote_group=votes)
        fit_to_pipeline(plugin, self.copies, mesh.pp_group, device)

    def begin_step(self, batch: Any) -> None:
        """Before a training step: the step audit sees its ``batch``; the sharded layers' gradients accumulate whole
        until :meth:`reduce`."""
        if self.step_audit is not None:
            self.step_audit.start_step(batch)
        if self.sharded is not None:
            self.sharded.begin()
            self._shards_pending = True

    def _reduce_shards(self) -> None:
        if self.sharded is not None and self._shards_pending:
            self._shards_pending = False
            with self.stage.timeline.record("reduce"):
                self.sharded.reduce()

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Around a validation, test or predict step: after it the sharded layers let go of their gathered weights
        (gathered once for the step's micro-batches; a local free, no collective)."""
        try:
            yield
        finally:
            if self.sharded is not None:
                self.sharded.reshard()

    def sync_held_buffers(self) -> None:
        """After a training step: the buffers its layers changed, copied to their holders on the other stages."""
        if self.held_buffers is not None:
            self.held_buffers.sync()

    def backward(
        self, path: str, loss: Tensor, last_stage_backward: Callable[[], None], tracer: StepTracer, reduce: bool
    ) -> None:
        """The backward phase of a training step whose ``loss`` every stage computed; ``reduce`` the gradients then,
        unless an accumulation window goes on (``path``: the backbone's, for the errors)."""
        stage = self.stage
        with abort_on_error(stage):
            if self.mesh.K > 1:  # only the last stage back-propagates the loss: it must reach no layer directly
                assert self.copies is not None, "connect() first"
                check_loss(loss, stage, self.copies.replicated, path, stage.index)
            drain = stage.pending
            # A backbone called under no_grad (a frozen feature extractor) ran a forward-only pass: nothing to drain.
            if not drain and not stage.forward_only_calls:
                raise RuntimeError(
                    f"the training step did not call self.{path}: GPipeStrategy pipelines that call, so "
                    "every training step must call the backbone exactly once"
                )
            # Every stage computed the same loss on the same output; the last stage's gradient is the one that
            # drives the pipeline, and a head after the backbone must not collect K copies of its gradient.
            if stage.is_last:
                last_stage_backward()
            tracer.loss(stage)
            dp_reduce, copies = self._dp_reduce, self.copies
            assert dp_reduce is not None and copies is not None, "connect() first"
            own: list[PendingReduction] = []
            if drain:
                # The own gradients' buckets leave before the drain's status check waits for the slowest stage.
                def drained() -> None:
                    self._reduce_shards()
                    own.append(dp_reduce.start())

                stage.backward(drained=drained if reduce else None)
        if reduce:
            self.reduce(own[0] if own else None)

    def early_reduction(self) -> EarlyReduction:
        """The reduction of a step whose gradients are the only ones in ``.grad``, overlapped with its backward:
        this stage's own buckets leave during its last backward op, as their gradients end (see ``ready_buckets``)."""
        ready = self._ready
        assert ready is not None, "connect() first"

        def launch_rest() -> PendingReduction:
            self._reduce_shards()
            return ready.launch_rest()

        return EarlyReduction(ready.arm, launch_rest, self.reduce)

    def reduce(self, started: PendingReduction | None = None) -> None:
        """Sum the gradients of weights with copies on other stages, average every gradient over the replicas
        (``started``: the own buckets already on their way)."""
        dp_reduce, copies = self._dp_reduce, self.copies
        assert dp_reduce is not None and copies is not None, "connect() first"
        self._reduce_shards()
        with self.stage.timeline.record("reduce"):
            dp_reduce.finish(started if started is not None else dp_reduce.start(), copies.sum_gradients)


def _shard(
    stage: GPipeStage,
    copied: Sequence[nn.Parameter],
    mesh: PipelineMesh,
    reshard: bool,
    made: Callable[[Iterable[nn.Module]], Iterable[nn.Module]] = iter,
) -> ShardedLayers:
    """The stage's layers sharded over the replicas, except those holding a weight with a copy on another stage (tied
    across stages, or shared with a module outside the backbone: summed over the pipeline) or shared with another
    layer of the stage (one FSDP unit per weight): they stay whole. ``made`` yields each layer ready to shard
    (materialized), in order."""
    holders: dict[int, int] = {}
    for layer in stage.children():
        for p in layer.parameters():
            holders[id(p)] = holders.get(id(p), 0) + 1
    ids = {id(p) for p in copied} | {i for i, n in holders.items() if n > 1}
    layers = [layer for layer in stage.children() if not any(id(p) in ids for p in layer.parameters())]
    dp = mesh.device_mesh["data_parallel"]
    return ShardedLayers(made(layers), dp, reshard_after_forward=reshard, vote_group=mesh.dp_cpu_group)


def _plan(
    module: nn.Module,
    backbone: nn.Sequential,
    options: StageOptions,
    mesh: PipelineMesh,
    device: torch.device,
    on_meta: bool,
    broadcast: Callable[[Any], Any],
) -> Plan:
    """How many layers each stage holds (``GPipeStrategy(balance=...)``), resolved on rank 0 and broadcast."""
    K, v = mesh.K, options.virtual_stages
    if options.planned_costs is not None:
        assert isinstance(options.balance, list), "the plan gave layer counts"
        return Plan(options.balance, "planned", options.planned_costs)

    def simulated(costs: Sequence[float], S: int) -> list[int]:
        return solve_virtual_stages(costs, K, v, options.chunks, options.checkpoint, options.schedule)

    # With the loss inside, the last stage runs each micro-batch's F and B together and never recomputes, and which
    # stage is the heavier changes the step: the cut that the schedule, simulated, runs fastest. (With the loss
    # outside every stage runs the same phases: the cheapest costliest stage.)
    together = " (each rank's virtual stages together)" if v > 1 else ""
    how = f"split for the shortest simulated {options.schedule} step{together}"

    return plan_balance(
        module,
        backbone,
        options.balance,
        mesh.K * options.virtual_stages,
        options.chunks,
        device,
        on_meta=on_meta,
        rank=mesh.rank,
        batch_dim=options.batch_dim,
        broadcast=broadcast,
        # With the loss inside, the last stage runs F + B per micro-batch, the others F + R + B: about 3 : 4 (its
        # costs weighed so in the log, and by solve_virtual_stages where the simulation cannot tell two cuts apart).
        last_stage_scale=0.75 if options.pipeline_loss and options.checkpoint == "except_last" and v == 1 else 1.0,
        solver=(simulated, how) if v > 1 or options.pipeline_loss else None,
    )


def _stage(
    backbone: nn.Sequential, plan: Plan, options: StageOptions, mesh: PipelineMesh, device: torch.device
) -> GPipeStage:
    """This rank's stage of ``backbone``: its layers of the split ``plan``, on the pipeline's groups."""
    return GPipeStage(
        backbone,
        chunks=options.chunks,
        balance=plan.balance,
        checkpoint=options.checkpoint,
        batch_dim=options.batch_dim,
        group=mesh.pp_group,
        header_group=mesh.header_group,
        deferred_batch_norm=options.deferred_batch_norm,
        output=options.output,
        device=device,
        timeout=mesh.timeout_s,
        virtual_stages=options.virtual_stages,
        placement=lookup(options.schedule).placement,
        compile=options.compile,
    )
