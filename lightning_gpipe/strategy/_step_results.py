"""What steps leave behind: errors that abort every stage, the last stage's values, lazy outputs, predictions once."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn

from lightning_gpipe.pipe import GPipeStage, PipelineError
from lightning_gpipe.pipe._torch_internals import tree_flatten, tree_map
from lightning_gpipe.strategy._lightning_internals import broadcast_coalesced, forward_cache, logged_values

_BUCKET = 16 * 2**20


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _metric_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every torchmetrics state of ``module`` (tensors and the items of list states) and their last forward value."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return []
    out: list[torch.Tensor] = []
    for metric in module.modules():
        if isinstance(metric, Metric):
            leaves, _ = tree_flatten(list(metric.metric_state.values()))
            out.extend(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
            cache, _ = tree_flatten(forward_cache(metric))
            out.extend(leaf for leaf in cache if isinstance(leaf, torch.Tensor))
    return out


def _describe(keys: list[str], tensors: list[torch.Tensor]) -> list[Any]:
    return [keys, [(tuple(t.shape), str(t.dtype)) for t in tensors]]


def _check_same_structure(described: list[Any], group: Any, last: int, device: torch.device) -> None:
    """Every stage must log, return and update the same things: otherwise the broadcast would pair unrelated values
    (a wrong key on rank 0) or send different sizes (gloo aborts). One 8-byte all-gather per step says so first."""
    digest = hashlib.blake2b(repr(described).encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little") >> 1], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    differ = [k for k, g in enumerate(gathered) if not torch.equal(g, gathered[last])]
    if not differ:
        return
    everyone: list[Any] = [None] * len(gathered)
    dist.all_gather_object(everyone, described[0], group=group)
    raise RuntimeError(
        f"GPipeStrategy(output='placeholder'): stage(s) {differ} logged, returned or updated other values than the "
        f"last stage in this step (logged keys {everyone[differ[0]]} vs the last stage's {everyone[last]}). With "
        "output='placeholder' the other stages compute on zeros, so what a step logs (its keys and how many values), "
        "returns and feeds to metrics must not depend on the backbone's output values "
        "(e.g. `if acc > 0.5: self.log(...)`); "
        "log the same keys every step, or use GPipeStrategy(output='all')"
    )


@contextmanager
def abort_on_error(stage: GPipeStage) -> Iterator[None]:
    try:
        yield
    except PipelineError:
        raise
    except Exception as e:
        # An error on one stage only (in the loss, say) must not leave the other stages waiting for it.
        stage.abort(e)


def from_last_stage(
    step_output: Any, stage: GPipeStage, module: pl.LightningModule, group: dist.ProcessGroup, device: torch.device
) -> Any:
    """``output="placeholder"``: the other stages computed on zeros; the last stage's values replace theirs."""
    if stage.output_mode != "placeholder" or stage.num_stages == 1:
        return step_output
    return take_from_last_stage(step_output, module, group, stage.last_rank, device)


def take_from_last_stage(
    step_output: Any, module: pl.LightningModule, group: dist.ProcessGroup, last: int, device: torch.device
) -> Any:
    """Overwrite this rank's logged values and metric states with the last stage's, and return its step output.

    The other stages computed them from placeholder zeros. Every stage ran the same code on same-shaped values, so
    the tensors line up one to one (checked first); one coalesced broadcast per step (scalars, mostly) replaces them
    in place.
    """
    keys, logged = logged_values(module.trainer)
    source = dist.get_rank(group) == last
    # The last stage's own loss keeps its graph (it drives the backward phase); the others get detached copies.
    returned = step_output if source else tree_map(lambda t: t.detach().clone() if _is_tensor(t) else t, step_output)
    returned_tensors = [t for t in tree_flatten(returned)[0] if _is_tensor(t)]
    states = logged + _metric_tensors(module)
    # Several entries may share one tensor (a value logged on_step only is also its forward cache).
    unique = list({id(t): t for t in states}.values())
    tensors = returned_tensors + unique
    _check_same_structure(_describe(keys, tensors), group, last, device)
    if source:  # the broadcast writes into its tensors even on the source: those may share a graph's storage
        tensors = [t.detach().clone() for t in tensors]
    if tensors:
        broadcast_coalesced(group, tensors, _BUCKET, last)
    return returned


# The backbone's output in an evaluation step with the loss inside: computed where first needed, never shipped idly.


_LATE = (
    "GPipeStrategy: the backbone's output was used after this evaluation step ended, but self.pipeline_loss had "
    "taken it, so it exists on the last stage only. Use it inside the step (before or after pipeline_loss), or "
    "return what you computed from it"
)


class LazyOutput:
    """Stands for the backbone's output until something needs it: ``make()`` computes it (on every rank alike).

    Given straight to ``self.pipeline_loss``, the output stays on the last stage (the loss runs there; only the loss,
    logs and metric increments reach the other stages). Used any other way, it becomes the real output first -- the
    pipeline runs as it would have -- and every use after that is the real output's: its attributes, operators, torch
    functions, and ``isinstance`` (through ``__class__``).
    """

    __slots__ = ("_make", "_ready", "_value", "input", "sealed", "taken")

    def __init__(self, make: Callable[[], Any], input: Any) -> None:
        self._make, self._value, self._ready = make, None, False
        self.input = input  # the backbone's input: what pipeline_loss runs the pipeline with
        self.taken = False  # pipeline_loss ran the pipeline on it, with the loss on the last stage
        self.sealed = False  # its step ended

    @property
    def ready(self) -> bool:
        return self._ready

    def real(self) -> Any:
        """The output itself, computed now if it was not (after ``taken``: by running the pipeline again)."""
        if not self._ready:
            if self.sealed and self.taken:
                raise RuntimeError(_LATE)
            self._value, self._ready = self._make(), True
        return self._value

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(out, torch.Tensor) answers as for the real output
        return type(self.real())

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*real_leaves(args), **real_leaves(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.real()[key] = value

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return repr(self.real())


def real_leaves(tree: Any) -> Any:
    """``tree`` with every LazyOutput in it replaced by the real output."""
    return tree_map(lambda x: x.real() if isinstance(x, LazyOutput) else x, tree)


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: LazyOutput, *args: Any) -> Any:
        return getattr(self.real(), name)(*real_leaves(args))

    method.__name__ = name
    return method


# Python looks these up on the type, not through __getattr__.
for _name in (
    *(f"__{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor")),
    *(f"__r{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor")),
    "__lshift__", "__rshift__", "__neg__", "__pos__", "__abs__", "__invert__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__getitem__", "__len__", "__iter__", "__contains__", "__bool__", "__float__", "__int__", "__index__",
    "__format__", "__array__", "__reversed__", "__str__",
):  # fmt: skip
    setattr(LazyOutput, _name, _delegate(_name))


# Prediction under a pipeline: predictions are returned and written once per replica, by its stage 0.


def mute_prediction_output(trainer: pl.Trainer) -> list[BasePredictionWriter]:
    """On a stage other than the first: its predictions were made from zeros of the output's shape (only stage 0
    gets the real output), and must be neither returned nor written. Returns the writers muted, for :func:`unmute`."""
    trainer.predict_loop.return_predictions = False
    muted = []
    for writer in trainer.callbacks:  # type: ignore[attr-defined]  # set by its callback connector, not declared
        if isinstance(writer, BasePredictionWriter):
            writer.write_on_batch_end = writer.write_on_epoch_end = _skip  # type: ignore[method-assign]
            muted.append(writer)
    return muted


def unmute(writers: list[BasePredictionWriter]) -> None:
    for writer in writers:
        del writer.write_on_batch_end, writer.write_on_epoch_end  # back to the class's methods


def _skip(*args: Any, **kwargs: Any) -> None:
    pass
