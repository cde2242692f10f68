"""GPipeStrategy: the Lightning strategy around the engine — mesh, setup, steps, backward, collectives, checkpoints."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpipe.pipe import GPipeStage, ScheduleName
from lightning_gpipe.pipe.comm.batch_feed import BatchFeed
from lightning_gpipe.pipe.state.rematerialize import Checkpoint
from lightning_gpipe.strategy import _auto_plan as auto_plan
from lightning_gpipe.strategy import _checkpoint_files as checkpointing
from lightning_gpipe.strategy import _lightning_internals as internals
from lightning_gpipe.strategy._arguments import (
    CheckBatches,
    DataLoading,
    DataParallel,
    DpReduction,
    Layout,
    StrategyBalance,
    check_arguments,
    check_world_size,
    find_backbone,
    reject_closure_replaying_optimizers,
    reject_unsupported,
    resolve_layout,
)
from lightning_gpipe.strategy._batches import BatchCheck, FedLoader, open_feed
from lightning_gpipe.strategy._materialize import InitRecord, record_init
from lightning_gpipe.strategy._mesh import (
    PipelineMesh,
    default_backend,
    keep_at_exit,
    world_barrier,
    world_broadcast,
    world_vote,
)
from lightning_gpipe.strategy._partition_report import show_compilations, show_partition
from lightning_gpipe.strategy._pipeline_loss import PipelineLoss
from lightning_gpipe.strategy._rank_pipeline import RankPipeline, StageOptions
from lightning_gpipe.strategy._step_results import abort_on_error, from_last_stage, mute_prediction_output, unmute
from lightning_gpipe.strategy._trace import Closure, StepTracer
from lightning_gpipe.strategy._weight_copies import keeping_ties

_Model = pl.LightningModule | nn.Module | None


class GPipeStrategy(ParallelStrategy):
    """GPipe pipeline parallelism (× data parallelism) for an ``nn.Sequential`` backbone of a LightningModule.

    The backbone is split into K stages, one process each; the other processes are data-parallel replicas of the
    pipeline (global rank d·K + k is stage k of replica d, or k·D + d: ``layout``), each holding its stage whole or a
    shard of it (``data_parallel``). Each mini-batch runs as M micro-batches. A module that defines
    ``pipeline_loss(self, output, batch)`` and calls ``self.pipeline_loss(self.backbone(x), batch)`` gets its loss
    run per micro-batch on the last stage, inside the pipeline; an unchanged ``training_step`` still works
    (the loss then runs on the whole output between the phases). Guide: ``docs/guide.md``.

    Args:
        chunks: M, the micro-batches per mini-batch (M ≥ 4K keeps GPipe's bubble (K−1)/(M+K−1) small; fewer, with a
            warning, in a smaller batch). ``"auto"`` here, in ``schedule``, ``virtual_stages`` or
            ``activation_checkpointing``: chosen at setup by simulating each choice on costs measured on rank 0,
            within ``max_memory_per_stage`` (bytes, or a fraction of the device's); rank 0 logs the plan.
        pipeline_parallel_size: K, the pipeline stages; ``"auto"``: all processes in one pipeline (no data
            parallelism). The world size must be a multiple of K.
        backbone: dotted attribute path of the ``nn.Sequential`` to pipeline (``"backbone"``, ``"vit.blocks"``).
        balance: how layers are split over the stages: ``"auto"`` ("flops" with an ``example_input_array``, else
            "parameters"), ``"flops"``, ``"time"`` (measured on rank 0), ``"parameters"``, K layer counts, or
            ``fn(index, layer) -> cost``. Rank 0 logs the split as a table at setup.
        activation_checkpointing: ``"except_last"`` recomputes each micro-batch's inner activations in the backward
            except where its backward follows at once; ``"always"``; ``"never"`` keeps them all.
        batch_dim: the dimension of the backbone's input and output that holds the samples (1 for time-major).
        deferred_batch_norm: BatchNorm normalizes each micro-batch but updates its running statistics once per
            mini-batch, as on one device.
        output: with the loss outside the pipeline, ``"all"`` gives every stage the backbone's output;
            ``"placeholder"`` gives the other stages zeros of its shape and copies logs and metrics from the last.
            Predicting, only stage 0 gets it (the others zeros), as only stage 0 returns and writes predictions.
        save_distributed_checkpoint: save a torch.distributed.checkpoint folder (each rank its shard); ``False``
            writes one file with the plain module's keys, which ``load_from_checkpoint`` reads into a plain module
            (a folder consolidates into one with Lightning's tool). Either resumes in any layout.
        bucket_cap_mb: size of the buckets of the data-parallel gradient all-reduce (torch DDP's name and default).
        process_group_backend: ``"nccl"`` on CUDA, ``"gloo"`` on CPU by default.
        timeout: of every collective and peer-to-peer wait; a stage that fails or hangs raises on every rank.
        trace_dir: write the ``trace_steps`` as Chrome traces and Gantt charts of every stage here (matplotlib).
        trace_steps: the optimizer steps (``trainer.global_step`` at their start) to trace.
        check_batches: when the stages compare fingerprints of their batches, which must be equal: the
            ``"first"`` step of every epoch, ``"always"`` or ``"never"``.
        pipeline_loss: ``"auto"`` runs the module's ``pipeline_loss`` hook inside the pipeline where the module
            defines it; ``True`` requires it, ``False`` keeps the loss on the whole output. Training calls the hook
            per micro-batch; validation and test once, on the whole batch's output on the last stage.
        schedule: with the loss inside, ``"gpipe"`` (all forwards, then all backwards), ``"fill-drain"`` (so on
            the last stage too: a mixture of experts' load-balancing loss needs it), ``"1f1b"`` (at most K − k
            micro-batches held on stage k instead of M: less activation memory, the same bubble) or ``"zb-h1"``
            (1F1B with the weight gradients of linear, convolution and embedding layers deferred into the drain: a
            smaller bubble, the same gradients); measured in ``benchmarks/README.md``. With ``virtual_stages`` ≥ 2:
            ``"interleaved-1f1b"`` (the bubble divided by v), ``"interleaved-zb"`` (and each backward split) or, at
            v = 2, ``"zb-v"`` (zero bubble with rank k holding stages k and 2K − 1 − k: the loss on rank 0).
        virtual_stages: v, the stages of the backbone each rank holds: it is split into v·K stages (balance: v·K
            layer counts, or solved for v·K parts) and rank k holds stages k, k + K, … (in a V for "zb-v").
        data_parallel_reduction: the data-parallel gradient mean: ``"flat"`` (one all-reduce per bucket),
            ``"hierarchical"`` (Jizhi's: reduce within each node, all-reduce among one rank per node, broadcast back;
            the same means to fp32 rounding), or ``"auto"``: hierarchical where replicas of a stage share a node and
            span several.
        data_loading: ``"every_stage"`` iterates each stage's own loader; ``"first_stage"`` iterates it on stage 0
            only, in a thread up to two batches ahead, and broadcasts each batch to the other stages of its
            pipeline (one input pipeline per pipeline: 1/K of the loading work, no per-stage augmentation to match).
        data_parallel: ``"ddp"``: each replica of a stage holds it whole (gradients all-reduced in buckets);
            ``"fsdp"``: a shard of each of its layers (FSDP2; each layer gathered once a step, reduce-scattered once:
            between steps parameters, gradients and optimizer states ÷ dp, within one weights and gradients whole).
            Modules outside the backbone and layers with tied or shared weights stay whole.
        reshard_after_forward: with ``"fsdp"``, free a layer's gathered weights after each forward: less memory,
            M + 1 to 2M + 1 gathers a step instead of one.
        layout: which ranks share a node: ``"stages_together"`` (rank d·K + k), ``"replicas_together"`` (k·D + d:
            FSDP's gathers inside a node, the pipeline across nodes) or ``"auto"`` (the latter under ``"fsdp"``).
        tensor_parallel_size: T ranks per stage and replica (innermost), over which ``configure_model`` splits the
            layers with ``self.device_mesh["tensor_parallel"]`` and ``parallelize_module``, as under
            ``ModelParallelStrategy``; each layer's output must be whole on them. World size = K · D · T.
        max_memory_per_stage: the ``"auto"`` plan's budget (see ``chunks``); None: no limit.
        compile: compile each backbone layer on its stage: True, or torch.compile's options (pipe/run/compiled.py).
    """

    strategy_name = "gpipe"
    is_distributed = True  # Lightning's connector knows only its own classes: else it injects no DistributedSampler

    def __init__(
        self,
        chunks: int | Literal["auto"] = 8,
        pipeline_parallel_size: int | Literal["auto"] = "auto",
        backbone: str = "backbone",
        balance: StrategyBalance = "auto",
        activation_checkpointing: Checkpoint | Literal["auto"] = "except_last",
        batch_dim: int = 0,
        deferred_batch_norm: bool = True,
        output: Literal["all", "placeholder"] = "all",
        save_distributed_checkpoint: bool = True,
        bucket_cap_mb: float = 25.0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        trace_dir: str | None = None,
        trace_steps: int | list[int] = 5,
        check_batches: CheckBatches = "first",
        pipeline_loss: bool | Literal["auto"] = "auto",
        schedule: ScheduleName | Literal["auto"] = "gpipe",
        virtual_stages: int | Literal["auto"] = 1,
        data_parallel_reduction: DpReduction = "auto",
        data_loading: DataLoading = "every_stage",
        data_parallel: DataParallel = "ddp",
        reshard_after_forward: bool = False,
        layout: Layout | Literal["auto"] = "auto",
        tensor_parallel_size: int = 1,
        max_memory_per_stage: int | float | None = None,
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__()
        self.trace_steps: tuple[int, ...] = check_arguments(locals())  # raises on a bad value
        self.data_parallel_reduction, self.data_loading = data_parallel_reduction, data_loading
        self.data_parallel, self.reshard_after_forward = self._sharding = (data_parallel, reshard_after_forward)
        self.tensor_parallel_size, self.layout = tensor_parallel_size, resolve_layout(layout, data_parallel)
        self._feed: BatchFeed | None = None
        self.pipeline_loss, self.schedule, self.virtual_stages = pipeline_loss, schedule, virtual_stages
        self._loss_inside: PipelineLoss | None = None
        self.trace_dir, self.compile = trace_dir, compile
        self.chunks, self.backbone, self.balance = chunks, backbone, balance
        self.activation_checkpointing, self.max_memory_per_stage = activation_checkpointing, max_memory_per_stage
        self.output, self.batch_dim, self.deferred_batch_norm = output, batch_dim, deferred_batch_norm
        self.save_distributed_checkpoint, self.bucket_cap_mb = save_distributed_checkpoint, bucket_cap_mb
        self.check_batches, self._pipeline_parallel_size = check_batches, pipeline_parallel_size
        self._process_group_backend, self._timeout = process_group_backend, timeout
        self._tracer = StepTracer(trace_dir, self.trace_steps)
        self._batch_check = BatchCheck(check_batches)
        self._pipeline_mesh: PipelineMesh | None = None
        self._pipeline: RankPipeline | None = None
        self._init_record: InitRecord | None = None
        self._muted_writers: list[BasePredictionWriter] = []
        self._sync_blocked, self.num_nodes = False, 1
        self._plan_check, self._planned_costs = auto_plan.PlanCheck(), None  # "auto" arguments: planned at setup

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def pipeline_parallel_size(self) -> int:
        K = self._pipeline_parallel_size
        return self.num_nodes * self.num_processes // self.tensor_parallel_size if K == "auto" else K

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.pipeline_parallel_size * self.tensor_parallel_size)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._mesh.device_mesh

    @property
    def _mesh(self) -> PipelineMesh:
        if self._pipeline_mesh is None:
            raise RuntimeError("the device mesh exists once the processes have started (after setup_environment)")
        return self._pipeline_mesh

    @property
    def stage(self) -> GPipeStage:
        return self._rank_pipeline.stage

    @property
    def _trainer(self) -> pl.Trainer:
        assert self.lightning_module is not None
        return self.lightning_module.trainer

    @property
    def _rank_pipeline(self) -> RankPipeline:
        if self._pipeline is None:
            raise RuntimeError("the pipeline stage exists after GPipeStrategy.setup()")
        return self._pipeline

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard over data parallelism only: every stage of one pipeline must see the same batch.
        dp = self.device_mesh["data_parallel"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stage must exist: each rank restores only its own layers

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself

    # ---- processes: launcher, ranks, the mesh

    @override
    def _configure_launcher(self) -> None:
        env = self.cluster_environment
        if env is not None and not env.creates_processes_externally:
            self._launcher = internals.SubprocessScriptLauncher(env, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # set by Lightning, not in its stubs

    @override
    def setup_environment(self) -> None:
        # Lightning's launcher sets cpus // devices threads in its own process only, after starting the others,
        # which keep torch's default (all cores): every stage gets the same share instead.
        internals.set_num_threads_if_needed(num_processes=max(1, self.num_processes))
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        K, T, device = self.pipeline_parallel_size, self.tensor_parallel_size, self.root_device
        check_world_size(K, self.world_size, self.num_nodes, self.num_processes, T)
        backend = self._process_group_backend = self._process_group_backend or default_backend(device)
        assert self.cluster_environment is not None
        self._pipeline_mesh = PipelineMesh.join(
            self.cluster_environment, backend, self._timeout, device, K, max(1, self.num_processes),
            self.data_parallel_reduction, input_group=self.data_loading == "first_stage", layout=self.layout, T=T,
        )  # fmt: skip
        assert self.lightning_module is not None
        internals.set_device_mesh(self.lightning_module, self._pipeline_mesh.device_mesh)

    # ---- setup: every rank, in this order

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Every rank, in this order: the module checked; its backbone pipelined (``RankPipeline.build``: checked,
        read whole, balanced, split into this rank's stage, materialized); the split reported; the module converted,
        moved and connected to the pipeline's groups; the loss path chosen; the data feed opened; the optimizers."""
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        module, mesh = self.lightning_module, self._mesh
        self.accelerator.setup(trainer)
        sync_bn = internals.layer_sync_requested(self)
        reject_unsupported(module, self.backbone, sync_batchnorm=sync_bn, deferred_batch_norm=self.deferred_batch_norm)
        built = self._pipeline_backbone(module, sync_bn)
        if self._rank_pipeline.report is not None:
            show_partition(self._rank_pipeline.report, trainer, self, log=built)
        self._connect(trainer, module)
        args = (self.stage, self.schedule, self.batch_dim, mesh.header_group, self.precision_plugin)
        self._loss_inside = PipelineLoss.choose(module, self.pipeline_loss, *args)
        if self._feed is None:
            self._feed = open_feed(mesh, self.stage.is_first, log=built)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._batch_check.start_fit()
            self.setup_optimizers(trainer)
            reject_closure_replaying_optimizers(self.optimizers)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            internals.optimizers_to_device(self.optimizers, self.root_device)

    def _pipeline_backbone(self, module: pl.LightningModule, sync_batchnorm: bool) -> bool:
        """This rank's pipeline around the backbone's stage; whether the backbone was pipelined now (setup runs again
        after a fit, and a module may come pipelined by an earlier Trainer)."""
        _, _, backbone = find_backbone(module, self.backbone)
        if self._pipeline is not None and self._pipeline.stage is backbone:
            return False
        if isinstance(backbone, GPipeStage):
            self._pipeline = RankPipeline(backbone, self._mesh)
            return False
        record, self._init_record = self._init_record, None  # its CPU sources freed once materialized
        if auto_plan.wants_plan(self):
            self._plan_check = auto_plan.choose(self, module, backbone)
        args = (StageOptions.of(self), self._mesh, self.root_device, sync_batchnorm, record, self.broadcast)
        self._pipeline = RankPipeline.build(module, self.backbone, backbone, *args, self._sharding)
        return True

    def _connect(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """The stage's output mode for this run; the module converted by the precision plugin and moved, its ties
        kept; then the pipeline's collectives (copies, buckets, metrics, clipping and loss scaling) set up."""
        assert self.model is not None
        # Predictions are kept on stage 0 (see on_predict_start): only it gets the real output.
        predicting = trainer.state.fn == TrainerFn.PREDICTING
        self.stage.output_mode = "first" if predicting else self.output
        with keeping_ties(self.model):
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
        bucket_bytes = int(self.bucket_cap_mb * 2**20)
        self._rank_pipeline.connect(module, self.precision_plugin, self.root_device, bucket_bytes, *self._sharding)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device, its initialization recorded for setup (``_materialize``)."""
        with torch.device("meta"), record_init() as self._init_record:
            yield

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # configure_optimizers must not see the optimizers of an earlier fit (their parameters may be gone).
        self.optimizers, self.lr_scheduler_configs = [], []
        super().setup_optimizers(trainer)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return dataloader if self._feed is None else FedLoader(dataloader, self._feed)

    @override
    def teardown(self) -> None:
        if self._feed is not None:
            self._feed.close()
            self._feed = None
        with keeping_ties(self.lightning_module):  # Lightning moves it to the CPU
            super().teardown()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ---- steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        stage, trainer, mesh = self.stage, self._trainer, self._mesh
        stage.reset()  # a step whose backward was skipped must not leave its forward phase behind
        self._plan_check.begin()
        self._tracer.begin(stage, mesh, trainer.global_step)
        batch = args[0] if args else kwargs.get("batch")
        audit = self._rank_pipeline.step_audit
        self._rank_pipeline.begin_step(batch)
        with abort_on_error(stage):
            self._batch_check(batch, trainer.current_epoch, mesh.K, mesh.header_group)
            if self._loss_inside is None:
                output = self._from_last_stage(super().training_step(*args, **kwargs))
            else:
                with self._loss_inside.training_step(trainer, self._rank_pipeline, reduce=not self._sync_blocked):
                    output = super().training_step(*args, **kwargs)
            self._rank_pipeline.sync_held_buffers()
        if audit is not None:
            audit(stage, batch)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with abort_on_error(self.stage), self._evaluation_step(), self._rank_pipeline.evaluating():
            return self._from_last_stage(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with abort_on_error(self.stage), self._evaluation_step(), self._rank_pipeline.evaluating():
            return self._from_last_stage(super().test_step(*args, **kwargs))

    def _evaluation_step(self) -> AbstractContextManager[None]:
        # With the loss inside, an output given straight to pipeline_loss stays on the last stage.
        loss = self._loss_inside
        return nullcontext() if loss is None else loss.evaluation_step(self._trainer.lightning_module)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with abort_on_error(self.stage), self._rank_pipeline.evaluating():
            return super().predict_step(*args, **kwargs)

    def _from_last_stage(self, step_output: Any) -> Any:
        module, mesh = self._trainer.lightning_module, self._mesh
        return from_last_stage(step_output, self.stage, module, mesh.pp_group, self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        assert self.lightning_module is not None
        module, plugin, loss = self.lightning_module, self.precision_plugin, closure_loss
        self.pre_backward(closure_loss)
        closure_loss = plugin.pre_backward(closure_loss, module)
        inside = self._loss_inside
        if inside is not None and inside.ran:  # pipeline_loss ran: the step's gradients exist already
            inside.add_gradients(loss, self._trainer, None if self._sync_blocked else self._rank_pipeline.reduce)
        else:
            backprop = partial(plugin.backward, closure_loss, module, optimizer, *args, **kwargs)  # on the last stage
            pipeline = self._rank_pipeline
            pipeline.backward(self.backbone, closure_loss, backprop, self._tracer, reduce=not self._sync_blocked)
        closure_loss = plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        self._plan_check.end()
        return closure_loss

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Entered on gradient-accumulation micro-steps: reductions wait for the step that ends the window.
        self._sync_blocked = True
        try:
            yield
        finally:
            self._sync_blocked = False

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Closure, model: _Model = None, **kwargs: Any) -> Any:
        step = partial(super().optimizer_step, optimizer, model=model, **kwargs)
        return self._tracer.optimizer_step(self.stage, self._mesh, step, closure)

    # ---- collectives: sync_dist and all_gather over the replicas (as DDP); votes, barriers, broadcasts over the world

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        # Values are identical on the stages of a pipeline; sync_dist reduces over the data-parallel replicas.
        if isinstance(tensor, Tensor):
            return internals.sync_ddp_if_available(tensor, self._replicas(group), reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        # As DDP over the replicas: one entry per replica (the stages of a pipeline hold the same values).
        return internals.all_gather_ddp_if_available(tensor, group=self._replicas(group), sync_grads=sync_grads)

    def _replicas(self, group: Any | None) -> Any:
        """The group a DDP run over the replicas would use for ``group``: its world is the replicas of this stage
        (``LightningModule.all_gather`` passes ``WORLD`` itself); any other group as given."""
        return self._mesh.dp_group if group is None or group is dist.group.WORLD else group

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Not ParallelStrategy's vote over the replicas only: ModelCheckpoint and EarlyStopping need every rank's.
        return world_vote(decision, all, self.root_device, self.world_size)

    @override
    def barrier(self, name: str | None = None) -> None:
        world_barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return world_broadcast(obj, src)

    # ---- checkpoints: each rank saves and restores only its own stage's layers and optimizer state, as a
    # torch.distributed.checkpoint folder or one file of the plain module's keys, restored in any layout after setup

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}  # save_checkpoint collects every rank's states itself

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("GPipeStrategy.save_checkpoint does not take storage_options (it has no CheckpointIO)")
        path = Path(self.broadcast(str(filepath)))
        assert self.model is not None
        pipeline = self._rank_pipeline
        sharded, order = self.save_distributed_checkpoint, pipeline.plain_parameter_names
        args = (self.global_rank, sharded, order, pipeline.stage, pipeline.mesh.stage_ranks)
        checkpointing.save(checkpoint, path, self.model, self.optimizers, *args)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        return checkpointing.load(path, self.model, self.optimizers, strict, self._rank_pipeline.plain_parameter_names)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    # ---- hooks

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        # The other stages predicted from zeros (output mode "first"): nothing of theirs is returned or written.
        self._muted_writers = [] if self.stage.is_first else mute_prediction_output(self._trainer)

    @override
    def on_predict_end(self) -> None:
        unmute(self._muted_writers)
        self._muted_writers = []
        super().on_predict_end()

    @override
    def on_train_end(self) -> None:
        self._tracer.end_of_fit(self._mesh, self._trainer.global_step)
        show_compilations(self.stage.compilations, self._mesh.header_group)
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        keep_at_exit()
