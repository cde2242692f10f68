"""The GPipe engine, torch only: split, schedule, run, comm, state, dp, trace; micro-batches, skips and the stage."""

from lightning_gpipe.pipe.errors import PipelineError, PipelineTimeout
from lightning_gpipe.pipe.microbatch import join, micro_batch_sizes, micro_batch_weights, split
from lightning_gpipe.pipe.schedule.registry import ScheduleName
from lightning_gpipe.pipe.skips import Pop, Stash, pop, skippable, stash
from lightning_gpipe.pipe.split.balance import Balance, resolve_balance, solve
from lightning_gpipe.pipe.stage import GPipeStage
from lightning_gpipe.pipe.state.batchnorm import (
    DeferredBatchNorm,
    convert_deferred_batch_norm,
    revert_deferred_batch_norm,
)
from lightning_gpipe.pipe.state.rematerialize import Checkpoint, is_recomputing
from lightning_gpipe.pipe.trace.events import Timeline, gather_events, read_chrome_trace, write_chrome_trace
from lightning_gpipe.pipe.trace.stats import breakdown, theoretical_bubble

__all__ = [
    "Balance",
    "Checkpoint",
    "DeferredBatchNorm",
    "GPipeStage",
    "PipelineError",
    "PipelineTimeout",
    "Pop",
    "ScheduleName",
    "Stash",
    "Timeline",
    "breakdown",
    "convert_deferred_batch_norm",
    "gather_events",
    "is_recomputing",
    "join",
    "micro_batch_sizes",
    "micro_batch_weights",
    "pop",
    "read_chrome_trace",
    "resolve_balance",
    "revert_deferred_batch_norm",
    "skippable",
    "solve",
    "split",
    "stash",
    "theoretical_bubble",
    "write_chrome_trace",
]
