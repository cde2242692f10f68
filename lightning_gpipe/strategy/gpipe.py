"""GPipeStrategy: Lightning glue around the engine — mesh, launcher, setup, backward phase, reductions, clipping."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_gpipe.pipe import GPipeStage, PipelineError
from lightning_gpipe.pipe.batchnorm import sync_deferred_batch_norm
from lightning_gpipe.pipe.grads import BucketedAllReduce
from lightning_gpipe.strategy._arguments import (
    check_same_batch,
    check_strategy_args,
    find_backbone,
    reject_closure_replaying_optimizers,
    reject_unsupported,
)
from lightning_gpipe.strategy._audit import BackboneAudit, StepAudit
from lightning_gpipe.strategy._checkpoint_hooks import CheckpointHooks
from lightning_gpipe.strategy._clean_exit import destroy_at_exit, keep_at_exit
from lightning_gpipe.strategy._collectives import Collectives
from lightning_gpipe.strategy._materialize import has_meta_tensors, materialize, record_init
from lightning_gpipe.strategy._metric_groups import sync_metrics_over
from lightning_gpipe.strategy._precision import PrecisionHooks
from lightning_gpipe.strategy._predict import PredictHooks
from lightning_gpipe.strategy._step_results import take_from_last_stage
from lightning_gpipe.strategy._time_balance import agreed_time_balance
from lightning_gpipe.strategy._trace import TraceHooks, check_trace_args
from lightning_gpipe.strategy._weight_copies import WeightCopies

Checkpoint = Literal["always", "except_last", "never"]


class GPipeStrategy(TraceHooks, PredictHooks, CheckpointHooks, PrecisionHooks, Collectives, ParallelStrategy):
    """GPipe pipeline parallelism (× data parallelism) for an ``nn.Sequential`` backbone of a LightningModule.

    The backbone (``backbone``, a dotted attribute path) is split into K = ``pipeline_parallel_size`` stages, one
    process each; the remaining processes form data-parallel replicas of the whole pipeline. The user's
    ``training_step`` is unchanged: its call of the backbone runs the forward phase of M = ``chunks`` micro-batches
    and gives every stage the backbone's output, so the loss, logging and metrics are the same on every rank;
    ``backward`` drains the pipeline and reduces the gradients. With ``output="placeholder"`` (for large-vocabulary
    heads) the output stays on the last stage: the others compute on zeros of its shape, and the step's returned values,
    everything it logged and the module's torchmetrics states are then copied from the last stage.
    ``trace_dir`` writes the training steps ``trace_steps`` (optimizer-step indices) as a Chrome trace and a Gantt
    chart of every stage, with the measured bubble beside (K−1)/(M+K−1). ``balance="time"`` splits the backbone
    by each layer's measured forward + backward time on one micro-batch of ``example_input_array`` (rank 0 times
    it, layer by layer on its device; every rank gets the same split).
    """

    strategy_name = "gpipe"

    def __init__(
        self,
        chunks: int = 8,
        pipeline_parallel_size: int | Literal["auto"] = "auto",
        backbone: str = "backbone",
        balance: list[int] | Literal["parameters", "time"] | Callable[[int, nn.Module], float] = "parameters",
        checkpoint: Checkpoint = "except_last",
        batch_dim: int = 0,
        deferred_batch_norm: bool = True,
        output: Literal["all", "placeholder"] = "all",
        save_distributed_checkpoint: bool = True,
        bucket_size_mb: float = 25.0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        trace_dir: str | None = None,
        trace_steps: int | list[int] = 5,
    ) -> None:
        super().__init__()
        check_strategy_args(chunks, pipeline_parallel_size, checkpoint, output, batch_dim)
        self.trace_steps = check_trace_args(trace_dir, trace_steps)
        self.trace_dir = trace_dir
        self.chunks = chunks
        self.output = output
        self.backbone = backbone
        self.balance = balance
        self.checkpoint = checkpoint
        self.batch_dim = batch_dim
        self._step_audit: Callable[[GPipeStage, Any], None] = lambda stage, batch: None  # made in setup
        self.deferred_batch_norm = deferred_batch_norm
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self.bucket_size_mb = bucket_size_mb
        self._pipeline_parallel_size = pipeline_parallel_size
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._device_mesh: DeviceMesh | None = None
        self._pp_group: Any = None
        self._dp_group: Any = None
        self._header_group: Any = None
        self._stage: GPipeStage | None = None
        self._copies: WeightCopies | None = None
        self._dp_reduce: BucketedAllReduce | None = None
        self._sync_blocked = False
        self.num_nodes = 1

    # -------------------------------------------------------------------------------------------- process layout
    @property
    def is_distributed(self) -> bool:
        # The connector only knows built-in classes: without this no DistributedSampler is injected.
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def pipeline_parallel_size(self) -> int:
        auto = self._pipeline_parallel_size == "auto"
        return self.num_nodes * self.num_processes if auto else self._pipeline_parallel_size  # type: ignore[return-value]

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.pipeline_parallel_size

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("the device mesh exists once the processes have started (after setup_environment)")
        return self._device_mesh

    @property
    def stage(self) -> GPipeStage:
        if self._stage is None:
            raise RuntimeError("the pipeline stage exists after GPipeStrategy.setup()")
        return self._stage

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard over data parallelism only: every stage of one pipeline must see the same batch.
        dp = self.device_mesh["data_parallel"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        # Lightning's launcher sets cpus // devices threads in its own process only, after starting the others,
        # which keep torch's default (all cores): every stage gets the same share instead.
        _set_num_threads_if_needed(num_processes=max(1, self.num_processes))
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        K = self.pipeline_parallel_size
        if self.world_size % K:
            raise ValueError(
                f"GPipeStrategy(pipeline_parallel_size={K}) does not divide the world size {self.world_size} "
                f"({self.num_nodes} node(s) × {self.num_processes} process(es)); choose a K that divides it, or 'auto'"
            )
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        destroy_at_exit()
        # Stages of one pipeline are consecutive ranks, so on multi-GPU nodes neighbours share a node.
        self._device_mesh = init_device_mesh(
            self.root_device.type,
            (self.world_size // K, K),
            mesh_dim_names=("data_parallel", "pipeline_parallel"),
        )
        self._pp_group = self._device_mesh["pipeline_parallel"].get_group()
        self._dp_group = self._device_mesh["data_parallel"].get_group()
        self._header_group = self._cpu_pipeline_group()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    # ----------------------------------------------------------------------------------------------------- setup
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        sync_batchnorm = self._layer_sync is not None
        reject_unsupported(
            self.lightning_module,
            self.backbone,
            sync_batchnorm=sync_batchnorm,
            deferred_batch_norm=self.deferred_batch_norm,
        )
        _, _, backbone = find_backbone(self.lightning_module, self.backbone)
        if isinstance(backbone, GPipeStage):  # setup() runs again for validate/test after fit
            self._stage = backbone
        else:
            # A plain optimizer's state dict numbers parameters in this order (checkpoints convert by it).
            self._plain_parameter_names = [n for n, _ in self.lightning_module.named_parameters()]
            audit = BackboneAudit(self.lightning_module, backbone, self.backbone)
            on_meta = has_meta_tensors(self.lightning_module)
            whole = dict(self.lightning_module.named_modules()) if on_meta else {}
            balance = self.balance
            if balance == "time":
                balance = agreed_time_balance(
                    self.lightning_module,
                    backbone,
                    self.pipeline_parallel_size,
                    self.chunks,
                    self.root_device,
                    on_meta=on_meta,
                    rank=self.global_rank,
                    batch_dim=self.batch_dim,
                    broadcast=self.broadcast,
                )
            self._stage = GPipeStage(
                backbone,
                chunks=self.chunks,
                balance=balance,
                checkpoint=self.checkpoint,
                batch_dim=self.batch_dim,
                group=self._pp_group,
                header_group=self._header_group,
                deferred_batch_norm=self.deferred_batch_norm,
                output=self.output,
                device=self.root_device,
                timeout=self._timeout.total_seconds() if self._timeout else 1800.0,
            )
            audit.hand_over(self._stage, log=self.global_rank == 0)
            self._step_audit = StepAudit(self._stage, self.backbone, self.batch_dim, self._dp_group, self.global_rank)
            if on_meta:  # only now, with the other stages' layers dropped: memory ∝ this rank's partition
                seed = self.broadcast(torch.initial_seed())
                record, self._init_record = getattr(self, "_init_record", None), None  # its CPU sources freed after
                materialize(self.lightning_module, whole, self.root_device, seed, record)
            if sync_batchnorm:  # per-micro-batch statistics over the replicas of this stage
                sync_deferred_batch_norm(self._stage, self._dp_group)
        # Predictions need the real output (see on_predict_start for where they are kept).
        loss_only = self.output == "placeholder" and trainer.state.fn != TrainerFn.PREDICTING
        self._stage.output_mode = "placeholder" if loss_only else "all"
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._copies is None or self._copies.stage is not self._stage:
            self._copies = WeightCopies(
                self.lightning_module,
                self._stage,
                self.pipeline_parallel_size,
                self.global_rank,
                self._pp_group,
                self._dp_group,
            )
            self._copies.broadcast_initial_state()
        sync_metrics_over(self.lightning_module, self._dp_group)
        self._dp_reduce = BucketedAllReduce(
            list(self.lightning_module.parameters()), self._dp_group, int(self.bucket_size_mb * 2**20)
        )
        # Lightning clips with a local norm; a pipeline needs the norm of the whole model across stages.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        self._agree_on_loss_scaling()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            reject_closure_replaying_optimizers(self.optimizers)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device with its initialization recorded; setup materializes only
        this rank's stage with that initialization, the same whatever K (``lightning_gpipe.strategy._materialize``)."""
        with torch.device("meta"), record_init() as self._init_record:
            yield

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------------------------------- training step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.stage.reset()  # a step whose backward was skipped must not leave its forward phase behind
        self._trace_begin()
        batch = args[0] if args else kwargs.get("batch")
        with self._abort_on_error():
            check_same_batch(batch, self.pipeline_parallel_size, self._header_group)
            output = self._from_last_stage(super().training_step(*args, **kwargs))
        self._step_audit(self.stage, batch)
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._abort_on_error():
            return self._from_last_stage(super().validation_step(*args, **kwargs))

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._abort_on_error():
            return self._from_last_stage(super().test_step(*args, **kwargs))

    def _from_last_stage(self, step_output: Any) -> Any:
        """``output="placeholder"``: the other stages computed on zeros; the last stage's values replace theirs."""
        if self.stage.output_mode != "placeholder" or self.pipeline_parallel_size == 1:
            return step_output
        last = self.pipeline_parallel_size - 1
        return take_from_last_stage(step_output, self.lightning_module, self._pp_group, last, self.root_device)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._abort_on_error():
            return super().predict_step(*args, **kwargs)

    @contextmanager
    def _abort_on_error(self) -> Generator[None, None, None]:
        try:
            yield
        except PipelineError:
            raise
        except Exception as e:
            # An error on one stage only (in the loss, say) must not leave the other stages waiting for it.
            self.stage.abort(e)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        assert self.lightning_module is not None
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with self._abort_on_error():
            drain = self.stage.pending
            # A backbone called under no_grad (a frozen feature extractor) ran a forward-only pass: nothing to drain.
            if not drain and not self.stage.forward_only_calls:
                raise RuntimeError(
                    f"the training step did not call self.{self.backbone}: GPipeStrategy pipelines that call, so "
                    "every training step must call the backbone exactly once"
                )
            # Every stage computed the same loss on the same output; the last stage's gradient is the one that
            # drives the pipeline, and a head after the backbone must not collect K copies of its gradient.
            if self.stage.is_last:
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
            self._trace_loss()
            if drain:
                self.stage.backward()
        if not self._sync_blocked:
            with self.stage.timeline.record("reduce"):
                self._reduce_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _reduce_gradients(self) -> None:
        assert self._copies is not None
        self._copies.sum_gradients()
        assert self._dp_reduce is not None
        self._dp_reduce()

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Entered on gradient-accumulation micro-steps: reductions wait for the step that ends the window.
        self._sync_blocked = True
        try:
            yield
        finally:
            self._sync_blocked = False

    def on_exception(self, exception: BaseException) -> None:
        keep_at_exit()

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
