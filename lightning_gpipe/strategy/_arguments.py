"""Input checks of GPipeStrategy: each raises one error that names the problem and the fix, before any work."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import torch
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe._torch_internals import BatchNormBase
from lightning_gpipe.pipe.run.compiled import check_backbone as check_compiled_backbone
from lightning_gpipe.pipe.run.compiled import compile_options, is_compiled, splits
from lightning_gpipe.pipe.run.loss_inside import check_schedule
from lightning_gpipe.pipe.schedule.registry import SCHEDULES, ScheduleName, lookup
from lightning_gpipe.pipe.split.rules import check_plain_sequential, sync_batch_norm_error, sync_batch_norms
from lightning_gpipe.pipe.state.rematerialize import CHECKPOINT_MODES

# The option types of GPipeStrategy's signature that the strategy owns (the engine's: Checkpoint, ScheduleName).
StrategyBalance = list[int] | Literal["auto", "flops", "time", "parameters"] | Callable[[int, nn.Module], float]
BALANCE_NAMES = ("auto", "flops", "time", "parameters")
# When the stages compare their batches' fingerprints.
CheckBatches = Literal["first", "always", "never"]
CHECK_BATCHES: tuple[CheckBatches, ...] = get_args(CheckBatches)
# Every stage loads its batches, or stage 0 loads them once for its pipeline.
DataLoading = Literal["every_stage", "first_stage"]
DATA_LOADINGS: tuple[DataLoading, ...] = get_args(DataLoading)
# The data-parallel gradient mean: one all-reduce per bucket, or Jizhi's hierarchy, or chosen by the layout.
DpReduction = Literal["auto", "flat", "hierarchical"]
DP_REDUCTIONS: tuple[DpReduction, ...] = get_args(DpReduction)
# How the replicas of a stage hold it: each a whole copy (gradients all-reduced), or a shard of each layer (FSDP2).
DataParallel = Literal["ddp", "fsdp"]
DATA_PARALLELS: tuple[DataParallel, ...] = get_args(DataParallel)
# Which ranks are neighbours: a pipeline's stages (d·K + k), or a stage's replicas (k·D + d); "auto" by data_parallel.
Layout = Literal["stages_together", "replicas_together"]
LAYOUTS: tuple[Layout | Literal["auto"], ...] = ("auto", *get_args(Layout))


def check_arguments(a: dict[str, Any]) -> tuple[int, ...]:
    """Every argument of GPipeStrategy (``a``: ``__init__``'s locals), at construction; returns the trace steps."""
    check_strategy_args(
        a["chunks"],
        a["pipeline_parallel_size"],
        a["activation_checkpointing"],
        a["output"],
        a["batch_dim"],
        a["check_batches"],
        a["balance"],
    )
    check_loss_path(a["pipeline_loss"], a["schedule"], a["virtual_stages"])
    try:
        compile_options(a["compile"])
    except (TypeError, ValueError) as e:
        raise type(e)(f"GPipeStrategy(compile=...): {e}") from e
    check_memory_budget(a["max_memory_per_stage"])
    if a["data_parallel_reduction"] not in DP_REDUCTIONS:
        raise ValueError(
            f"GPipeStrategy(data_parallel_reduction={a['data_parallel_reduction']!r}): choose one of "
            f"{list(DP_REDUCTIONS)}"
        )
    check_data_loading(a["data_loading"])
    check_sharding(a["data_parallel"], a["reshard_after_forward"])
    T = a["tensor_parallel_size"]
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(
            f"GPipeStrategy(tensor_parallel_size={T!r}): the ranks that split each stage's tensors, an int ≥ 1"
        )
    if a["layout"] not in LAYOUTS:
        raise ValueError(
            f"GPipeStrategy(layout={a['layout']!r}): choose 'stages_together' (a pipeline's stages on consecutive "
            "ranks), 'replicas_together' (a stage's replicas on consecutive ranks) or 'auto' (replicas together "
            "with data_parallel='fsdp', stages together with 'ddp')"
        )
    return check_trace_args(a["trace_dir"], a["trace_steps"])


def check_strategy_args(
    chunks: Any,
    pipeline_parallel_size: Any,
    activation_checkpointing: Any,
    output: Any,
    batch_dim: Any,
    check_batches: Any,
    balance: Any = "auto",
) -> None:
    """GPipeStrategy's own arguments, at construction."""
    if chunks != "auto" and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(f"GPipeStrategy(chunks={chunks!r}): chunks, M, must be an int ≥ 1 or 'auto'")
    if pipeline_parallel_size != "auto" and (not isinstance(pipeline_parallel_size, int) or pipeline_parallel_size < 1):
        raise ValueError(f"GPipeStrategy(pipeline_parallel_size={pipeline_parallel_size!r}): give an int ≥ 1 or 'auto'")
    if activation_checkpointing not in (*CHECKPOINT_MODES, "auto"):
        raise ValueError(
            f"GPipeStrategy(activation_checkpointing={activation_checkpointing!r}): choose one of "
            f"{[*CHECKPOINT_MODES, 'auto']}"
        )
    if output not in ("all", "placeholder"):
        raise ValueError(f"GPipeStrategy(output={output!r}): choose 'all' or 'placeholder'")
    if not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or batch_dim < 0:
        raise ValueError(
            f"GPipeStrategy(batch_dim={batch_dim!r}): the dimension that holds the samples, an int ≥ 0 (0 batch-first, "
            "1 for time-major (T, N, ...) tensors)"
        )
    if check_batches not in CHECK_BATCHES:
        raise ValueError(
            f"GPipeStrategy(check_batches={check_batches!r}): choose one of {list(CHECK_BATCHES)} (when the stages "
            "of a pipeline compare the batches they loaded: the first training step of each epoch, every one, or none)"
        )
    # Layer counts are checked against the backbone at setup, when its length and K are known.
    if isinstance(balance, str) and balance not in BALANCE_NAMES:
        raise ValueError(
            f"GPipeStrategy(balance={balance!r}): choose one of {list(BALANCE_NAMES)}, a list of layer counts per "
            "stage, or a cost function fn(index, layer) -> cost"
        )


def check_sharding(data_parallel: Any, reshard_after_forward: Any) -> None:
    """How the replicas of a stage hold its layers, and when a sharded layer lets go of its gathered weights."""
    if data_parallel not in DATA_PARALLELS:
        raise ValueError(
            f"GPipeStrategy(data_parallel={data_parallel!r}): choose 'ddp' (each replica holds its stage whole) or "
            "'fsdp' (each replica holds a shard of every layer of its stage)"
        )
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"GPipeStrategy(reshard_after_forward={reshard_after_forward!r}): give True or False")
    if reshard_after_forward and data_parallel != "fsdp":
        raise ValueError(
            "GPipeStrategy(reshard_after_forward=True) frees the gathered weights of sharded layers, and only "
            "data_parallel='fsdp' shards them; set data_parallel='fsdp' or leave reshard_after_forward=False"
        )


def resolve_layout(layout: Layout | Literal["auto"], data_parallel: DataParallel) -> Layout:
    """``"auto"``: a stage's replicas together under fsdp (its gathers inside a node), a pipeline's stages under ddp."""
    if layout != "auto":
        return layout
    return "replicas_together" if data_parallel == "fsdp" else "stages_together"


def check_loss_path(pipeline_loss: Any, schedule: Any, virtual_stages: Any = 1) -> None:
    """Where the loss runs, and in which order the micro-batches go when it runs inside the pipeline, over how many
    virtual stages per rank."""
    if pipeline_loss not in (True, False, "auto"):
        raise ValueError(
            f"GPipeStrategy(pipeline_loss={pipeline_loss!r}): choose 'auto' (inside the pipeline when the module "
            "defines the pipeline_loss hook), True or False"
        )
    if schedule not in (*SCHEDULES, "auto"):
        raise ValueError(f"GPipeStrategy(schedule={schedule!r}): choose one of {[*SCHEDULES, 'auto']}")
    v = virtual_stages
    if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(
            f"GPipeStrategy(virtual_stages={v!r}): the stages of the backbone each rank holds, an int ≥ 1 (1: one "
            "stage per rank; ≥ 2 with schedule='interleaved-1f1b') or 'auto'"
        )
    if "auto" in (schedule, v):  # the plan chooses among what the other accepts (_auto_plan.py)
        return
    spec = lookup(schedule)
    if not spec.accepts(v):
        fix = "schedule='interleaved-1f1b'" if v > 1 else "virtual_stages=2 or more (or another schedule)"
        raise ValueError(
            f"GPipeStrategy(schedule={schedule!r}, virtual_stages={v}): {schedule!r} runs "
            + ("one stage per rank" if spec.v_max == 1 else f"v ≥ {spec.v_min} stages per rank")
            + f"; use {fix}"
        )


def check_memory_budget(budget: Any) -> None:
    """``max_memory_per_stage``: None, bytes (an int ≥ 1) or a fraction of the device's memory (a float in (0, 1])."""
    if budget is None or (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1):
        return
    if isinstance(budget, float) and 0 < budget <= 1:
        return
    raise ValueError(
        f"GPipeStrategy(max_memory_per_stage={budget!r}): the memory each rank's stage may peak at, for the plan of "
        "schedule/chunks/virtual_stages/activation_checkpointing='auto': bytes (an int ≥ 1), a fraction of the "
        "device's memory (a float in (0, 1]), or None (no limit)"
    )


def check_interleaving(K: int, chunks: int, schedule: ScheduleName, virtual_stages: int) -> None:
    """At setup, on every rank, once K is known: v ≥ 2 needs a pipeline of several ranks, and M (``chunks``) the
    schedule's rule (torch's for interleaving: M a multiple of max(1, M // K))."""
    if virtual_stages == 1:
        return
    if K == 1:
        raise ValueError(
            f"GPipeStrategy(virtual_stages={virtual_stages}) interleaves stages over the ranks of a pipeline, but "
            "pipeline_parallel_size is 1: use virtual_stages=1, or a pipeline of several devices"
        )
    try:
        check_schedule(schedule, K, chunks, virtual_stages, lookup(schedule).placement)
    except ValueError as e:
        raise ValueError(f"GPipeStrategy(chunks={chunks}) on {K} pipeline stages: {e}") from e


def check_data_loading(data_loading: Any) -> None:
    if data_loading not in DATA_LOADINGS:
        raise ValueError(
            f"GPipeStrategy(data_loading={data_loading!r}): choose 'every_stage' (each stage iterates its own loader) "
            "or 'first_stage' (stage 0 loads each batch and sends it to the other stages of its pipeline)"
        )


def check_trace_args(trace_dir: str | None, trace_steps: int | Sequence[int]) -> tuple[int, ...]:
    """The steps to trace, as a tuple, or a clear error before any work is done."""
    steps = (trace_steps,) if isinstance(trace_steps, int) else tuple(trace_steps)
    if not steps or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in steps):
        raise ValueError(
            f"GPipeStrategy(trace_steps={trace_steps!r}): give one or more optimizer-step indices ≥ 0 "
            "(trainer.global_step when the step starts), e.g. trace_steps=[5, 100]"
        )
    if trace_dir is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "GPipeStrategy(trace_dir=...) draws each traced step as a PNG with matplotlib, which is not "
                "installed: pip install 'lightning-gpipe[timeline]' (or matplotlib), or leave trace_dir unset"
            ) from e
    return steps


def check_world_size(K: int, world_size: int, num_nodes: int, num_processes: int, T: int = 1) -> None:
    """K · T must divide the world, once the processes are known."""
    if K < 1 or world_size % (K * T):
        with_t = f" × tensor_parallel_size={T}" if T > 1 else ""
        raise ValueError(
            f"GPipeStrategy(pipeline_parallel_size={K}{with_t}) does not divide the world size {world_size} "
            f"({num_nodes} node(s) × {num_processes} process(es)); choose sizes whose product divides it"
            + (", or pipeline_parallel_size='auto'" if T == 1 else "")
        )


def find_backbone(module: nn.Module, path: str) -> tuple[nn.Module, str, nn.Sequential | GPipeStage]:
    """The module at the dotted ``path``, its parent and attribute name; it must be an nn.Sequential."""
    *parents, name = path.split(".")
    parent: nn.Module | None = module
    for attr in parents:
        parent = getattr(parent, attr, None)
        if parent is None:
            break
    found = getattr(parent, name, None) if parent is not None else None
    if found is None:
        sequential = [n for n, m in module.named_modules() if isinstance(m, nn.Sequential) and n]
        # Only the outermost ones: layers inside a Sequential are not candidates for a backbone.
        candidates = [n for n in sequential if not any(n.startswith(f"{o}.") for o in sequential)]
        raise AttributeError(
            f"GPipeStrategy(backbone={path!r}): {type(module).__name__} has no attribute {path!r}. "
            f"nn.Sequential attributes found: {candidates or 'none'}; pass one of them as GPipeStrategy(backbone=...)"
        )
    if isinstance(found, nn.Module):
        check_compiled_backbone(found, f"GPipeStrategy(backbone={path!r})")
    if not isinstance(found, nn.Sequential | GPipeStage):
        raise TypeError(_not_sequential(path, found))
    assert parent is not None
    return parent, name, found


GUIDE = 'docs/guide.md, "Backbones that are not an nn.Sequential"'


def _not_sequential(path: str, found: Any) -> str:
    what = f"GPipeStrategy(backbone={path!r}) is a {type(found).__name__}, not an nn.Sequential"
    if isinstance(found, nn.ModuleList):
        return (
            f"{what}: a ModuleList has no forward, and the model's loop over it (for block in self.layers: "
            "hidden = block(hidden, mask)) passes each block more than one argument. Wrap each block in a layer "
            "that takes and returns one tuple, e.g. `forward(self, x): hidden, mask = x; return "
            "self.block(hidden, mask)[0], mask`, make self.backbone = nn.Sequential(*(Wrapped(b) for b in blocks)) "
            "(no other module may keep the ModuleList), and call self.backbone((hidden, mask)) in place of the loop; "
            f"see {GUIDE}"
        )
    if not isinstance(found, nn.Module):
        return f"{what}: point backbone= at the nn.Sequential of layers to pipeline"
    inner = [(n, m) for n, m in found.named_modules() if n and isinstance(m, nn.Sequential)]
    inner = [(n, m) for n, m in inner if not any(n.startswith(f"{o}.") for o, _ in inner)]
    hint = ""
    if inner:
        shown = ", ".join(f"{path}.{n} ({len(m)} layers)" for n, m in inner[:4])
        hint = f" The nn.Sequential modules inside it: {shown}; backbone= may name one of them."
    return (
        f"{what}: GPipeStrategy splits an nn.Sequential between its layers, one stage after the other.{hint} "
        "Else write the part to pipeline as an nn.Sequential; a skip connection that jumps over layers (a U-Net's) "
        "is declared: a Stash(name) layer (lightning_gpipe.pipe) where it starts and a Pop(name) layer where it is "
        f'used, which the pipeline sends straight between their stages; see {GUIDE} and "Long skip connections"'
    )


def check_backbone_layers(
    module: nn.Module, path: str, backbone: nn.Sequential, K: int, virtual_stages: int = 1
) -> None:
    """At setup, on every rank: K stages (of v virtual stages each) need vK layers, the backbone nothing but its layers,
    the module no nn.SyncBatchNorm, and no model around the backbone may run its layers one at a time itself (timm's or
    HuggingFace's own gradient checkpointing)."""
    check_plain_sequential(backbone, f"GPipeStrategy(backbone={path!r}): self.{path}")
    norms = sync_batch_norms(module)
    if norms:
        fix = (
            "pass Trainer(sync_batchnorm=True): GPipeStrategy then normalizes each micro-batch with the statistics "
            f"of all data-parallel replicas of its stage, in the BatchNorm layers of self.{path}"
        )
        raise TypeError(sync_batch_norm_error(norms, f"GPipeStrategy: {type(module).__name__}", fix))
    for name, owner in module.named_modules():
        timm = getattr(owner, "grad_checkpointing", False) is True
        hf = getattr(owner, "gradient_checkpointing", False) is True
        if not (timm or hf) or owner is backbone or not any(m is backbone for m in owner.modules()):
            continue
        where = f"self.{name}" if name else "self"
        if timm:
            flag, runner = f"{where}.grad_checkpointing is True (timm's set_grad_checkpointing)", "checkpoint_seq"
            off = f"{where}.set_grad_checkpointing(False)"
        else:
            flag = f"{where}.gradient_checkpointing is True (HuggingFace's gradient_checkpointing_enable)"
            runner, off = "its checkpoint function", "gradient_checkpointing_disable() on the HuggingFace model"
        raise ValueError(
            f"GPipeStrategy: {flag}: the model's forward then runs self.{path} one layer at a time through {runner}, "
            "but each rank holds only its stage's layers. The pipeline re-materializes already: GPipeStrategy("
            "activation_checkpointing='except_last') (the default) recomputes each micro-batch's activations in its "
            f"backward, 'always' keeps even fewer. Turn the model's own off: {off}"
        )
    S = K * virtual_stages
    if len(backbone) >= S:
        return
    nested = [(i, m) for i, m in enumerate(backbone) if isinstance(m, nn.Sequential) and len(m) >= S]
    layers = f"{len(backbone)} layer{'s' if len(backbone) != 1 else ''}"
    times_v = f" × virtual_stages={virtual_stages}" if virtual_stages > 1 else ""
    message = (
        f"GPipeStrategy: self.{path} has {layers}, fewer than the {S} stages (pipeline_parallel_size={K}{times_v}): "
        "every stage needs at least one layer"
    )
    if nested:
        i, inner = nested[0]
        name = list(backbone._modules)[i]
        message += (
            f". self.{path}[{i}] is an nn.Sequential of {len(inner)} layers (nn.Sequential(*model.children()) keeps "
            f"the model's own nn.Sequential, such as torchvision's `features`, as one layer): pipeline it instead, "
            f"with GPipeStrategy(backbone='{path}.{name}') or by holding it as self.{path}"
        )
    else:
        message += "; give the backbone more layers (unpack nested nn.Sequential ones), or use fewer stages"
    raise ValueError(message)


def reject_unsupported(module: nn.Module, backbone: str, *, sync_batchnorm: bool, deferred_batch_norm: bool) -> None:
    if type(module).__name__ == "OptimizedModule":
        raise TypeError(
            "GPipeStrategy cannot pipeline a torch.compile'd LightningModule: compile inside configure_model() instead"
        )
    if not sync_batchnorm:
        return
    # Refused rather than ignored: replicas would silently normalize with their own statistics.
    if not deferred_batch_norm:
        raise ValueError(
            "Trainer(sync_batchnorm=True) with GPipeStrategy synchronizes its deferred BatchNorm layers; "
            "set GPipeStrategy(deferred_batch_norm=True) or drop sync_batchnorm"
        )
    outside = [
        name
        for name, m in module.named_modules()
        if isinstance(m, BatchNormBase) and not name.startswith(f"{backbone}.")
    ]
    if outside:
        raise ValueError(
            f"Trainer(sync_batchnorm=True): GPipeStrategy synchronizes the BatchNorm layers of self.{backbone} over "
            f"the data-parallel replicas, but these are outside it: {outside}; move them into the backbone or drop "
            "sync_batchnorm"
        )


def reject_closure_replaying_optimizers(optimizers: list[Any]) -> None:
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "GPipeStrategy cannot run LBFGS: it re-evaluates the closure a data-dependent number of times, and "
                "every evaluation is a pipeline step all stages must take together; use a first-order optimizer"
            )


def check_compiled_layers(
    backbone: nn.Sequential, compile: Any, schedule: Any, inside: bool, sync_batchnorm: bool
) -> None:
    """At setup, on every rank: a schedule that splits each backward op by op runs no compiled layer, and no compiled
    layer synchronizes its BatchNorm."""
    compiled = [str(i) for i, layer in enumerate(backbone) if is_compiled(layer)]
    norms = [str(i) for i, layer in enumerate(backbone) if any(isinstance(m, BatchNormBase) for m in layer.modules())]
    bad = norms if compile else [n for n in norms if n in compiled]
    if sync_batchnorm and bad:
        raise ValueError(
            "Trainer(sync_batchnorm=True) synchronizes each micro-batch's BatchNorm statistics over the replicas "
            f"with collectives inside the layer's forward, which the compiled layers ({', '.join(bad[:3])}"
            f"{', …' if len(bad) > 3 else ''}) cannot issue. Drop sync_batchnorm, or compile only the layers "
            "without BatchNorm (layer.compile() on each, without GPipeStrategy(compile=...))"
        )
    if not inside or schedule == "auto" or not splits(schedule) or not (compiled or compile):
        return
    what = "compile=" + repr(compile) if compile else f"the backbone's compiled layers ({', '.join(compiled[:3])})"
    raise ValueError(
        f"GPipeStrategy(schedule={schedule!r}) splits each backward op by op (the weight gradients of linear, "
        f"convolution and embedding ops wait for W), which {what} cannot do: a compiled layer's backward is one "
        "graph. Use schedule='1f1b' or 'interleaved-1f1b' (the same order without the deferred weight gradients), or "
        "run the layers eagerly"
    )
