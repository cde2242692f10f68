"""Record what ``configure_model()`` does to the tensors it creates on the meta device; replay it for one tensor.

On the meta device a model has shapes but no values: every initializer its constructors ran (a torchvision
ResNet's kaiming loop, timm's ``init_weights`` with its zeroed residual BatchNorms, ``nn.Linear``'s own
``reset_parameters``) was a no-op. Calling ``reset_parameters()`` afterwards gives each module *torch's* default,
not the model's. So while ``configure_model()`` runs, :func:`record_init` notes every torch call that creates or
writes a meta tensor, with its arguments; :meth:`InitRecord.replay` later re-runs, on the real device, exactly the
calls that made one tensor's storage what it is (its creation, the writes to it, and what those read), and nothing
of the other stages. Each call that draws random numbers is seeded from the run's seed and the call's index in the
record, which every rank and every layout shares: the same weights whatever the number of stages.

What the recorder cannot see it reports (:class:`Unreplayable`) instead of guessing.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_gpipe.pipe._torch_internals import storage_key, tree_flatten, tree_map, version

# Creations that leave the values undefined: a parameter made so and never written was initialized by something
# the recorder did not see (an initializer that skips meta tensors), or by nothing.
_EMPTY = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


# Tensor methods that set every element of their tensor whatever it held (torch.nn.init's functions all do too).
_FILLS = tuple(f".{n}" for n in ("normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_"))


class Unreplayable(Exception):
    """The recorded initialization of a tensor cannot be reproduced; the message says why."""


@dataclass(frozen=True)
class _Meta:
    """A meta tensor as a call saw it: its storage, and the view of that storage it was at that moment."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True, eq=False)  # compared by identity: the same tensor, not equal values
class _Real:
    """A tensor with data passed to a recorded call (e.g. a CPU tensor copied into the model), and its version."""

    tensor: Tensor
    version: int


@dataclass
class _Call:
    func: Callable[..., Any]
    args: Any  # (args, kwargs) with meta tensors as _Meta and real ones as _Real
    default_dtype: torch.dtype
    outputs: list[_Meta | None]  # each output leaf: the storage it created, or None


def _key(t: Tensor) -> int:
    return storage_key(t)


def _meta(t: Tensor) -> _Meta:
    nbytes = t.untyped_storage().nbytes()
    return _Meta(_key(t), tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype, nbytes)


def _layout(t: Tensor) -> tuple[Any, ...]:
    size, stride, offset = tuple(t.shape), tuple(t.stride()), int(t.storage_offset())
    return size, stride, offset, t.dtype, t.untyped_storage().nbytes(), t.device


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(f"init call {index}".encode())) % 2**63


class InitRecord:
    """The calls of one ``configure_model()`` that created or wrote meta tensors, in order."""

    def __init__(self, known: Iterable[Tensor] = ()) -> None:
        self.calls: list[_Call] = []
        self.created: dict[int, tuple[int, int]] = {}  # storage → (call index, output leaf)
        self.writes: dict[int, list[int]] = {}  # storage → indices of the calls that wrote it
        # Storages whose writes are recorded: those made here, and ``known`` ones made before. Holding them keeps
        # every key unique (a freed storage's address could come back).
        self._alive: dict[int, torch.UntypedStorage] = {_key(t): t.untyped_storage() for t in known}
        self._unit_depth = 0

    # ------------------------------------------------------------------------------------------------ recording
    def call(self, func: Callable[..., Any], args: tuple, kwargs: dict, unit: bool = False) -> Any:
        """Run ``func`` and record it if it created or wrote a meta tensor. A ``unit`` (a torch.nn.init
        function) is recorded as one call, the calls inside it not at all, and always writes its first argument:
        some of them return early on meta tensors, leaving no trace but their arguments."""
        # A unit runs under the mode (it is called from user code), so its own bookkeeping must pass through too.
        self._unit_depth += unit
        try:
            leaves = tree_flatten((args, kwargs))[0]
            metas = [t for t in leaves if isinstance(t, Tensor) and t.is_meta]
            if not metas and unit:
                return func(*args, **kwargs)
            try:  # taken before the call: an in-place view (t_()) changes how its tensor sees the storage
                seen = {id(t): _meta(t) for t in metas}
            except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass): nothing to replay from
                return func(*args, **kwargs)
            versions = [version(t) for t in metas]
            out = func(*args, **kwargs)
            written = {seen[id(t)].key for t, v in zip(metas, versions, strict=True) if version(t) != v}
            if unit:
                first = args[0] if args else kwargs.get("tensor")
                if isinstance(first, Tensor) and first.is_meta:
                    written.add(seen[id(first)].key)
            outputs: list[_Meta | None] = []
            for leaf in tree_flatten(out)[0]:
                new = isinstance(leaf, Tensor) and leaf.is_meta and _key(leaf) not in self._alive
                outputs.append(_meta(leaf) if new else None)
                if new:
                    self._alive[_key(leaf)] = leaf.untyped_storage()
            written &= self._alive.keys()  # a storage made outside configure_model() has no history to replay
            if written or any(outputs):
                self._append(func, args, kwargs, seen, outputs, written)
            return out
        finally:
            self._unit_depth -= unit

    def _append(
        self, func: Callable[..., Any], args: tuple, kwargs: dict, seen: dict[int, _Meta], outputs: list, written: set
    ) -> None:
        index = len(self.calls)

        def spec(x: Any) -> Any:
            if isinstance(x, Tensor):
                return seen[id(x)] if x.is_meta else _Real(x, version(x))
            return x

        self.calls.append(_Call(func, tree_map(spec, (args, kwargs)), torch.get_default_dtype(), outputs))
        for leaf_index, o in enumerate(outputs):
            if o is not None:
                self.created[o.key] = (index, leaf_index)
        for key in written:
            self.writes.setdefault(key, []).append(index)

    # ------------------------------------------------------------------------------------------------ replaying
    def knows(self, t: Tensor) -> bool:
        return t.is_meta and _key(t) in self.created

    def write_calls(self, t: Tensor) -> list[tuple[Callable[..., Any], Any]]:
        """The calls that wrote ``t``'s storage, each as (function, (args, kwargs)) with tensors as seen."""
        return [(self.calls[i].func, self.calls[i].args) for i in self.writes.get(_key(t), [])]

    def overwritten_alone(self, t: Tensor) -> bool:
        """Whether the first write to ``t``'s storage replaced all of it, and no write read another meta storage:
        then its value depends on these writes only, not on its creation nor on any other tensor."""
        key = _key(t)
        index = self.writes.get(key, [None])[0]
        if index is None or key not in self.created:
            return False
        made = self.calls[self.created[key][0]].outputs[self.created[key][1]]
        first = self.calls[index]
        leaves = tree_flatten(first.args)[0]
        target = leaves[0] if leaves else None
        whole = isinstance(target, _Meta) and made is not None and target == made
        fills = getattr(first.func, "__module__", None) == "torch.nn.init" or _name(first.func).endswith(_FILLS)
        reads = {x.key for i in self.writes[key] for x in tree_flatten(self.calls[i].args)[0] if isinstance(x, _Meta)}
        return whole and fills and reads == {key}

    def replay(
        self, t: Tensor, device: torch.device, seed: int, into: Tensor | None = None
    ) -> tuple[Tensor, str | None]:
        """Meta tensor ``t`` on ``device``, as configure_model() left it, and a note when it was left
        uninitialized (created empty, never written). Raises :class:`Unreplayable` with the reason.

        ``into``: a tensor on ``device`` laid out as ``t``'s whole storage. When that storage was created empty, the
        writes run on ``into`` itself and the result is a view of it: no second copy of the tensor exists at any
        time (a model's embedding can be a third of a stage)."""
        key = _key(t)
        try:
            base = self._state(key, len(self.calls), device, seed, into)
        except Unreplayable:
            raise
        except Exception as e:  # an error of the replayed code itself, or RecursionError on a very long chain
            raise Unreplayable(f"replaying its initialization failed: {type(e).__name__}: {e}") from e
        if base.dtype != t.dtype:
            raise Unreplayable(f"it views its storage as {t.dtype}, the storage was made as {base.dtype}")
        index, _ = self.created[key]
        note = None
        if _name(self.calls[index].func).split(".")[-1] in _EMPTY and not self.writes.get(key):
            note = f"created by {_name(self.calls[index].func)} and never written in configure_model()"
        return base.as_strided(t.shape, t.stride(), t.storage_offset()), note

    def _state(self, key: int, upto: int, device: torch.device, seed: int, into: Tensor | None = None) -> Tensor:
        """Storage ``key`` on ``device`` as it was just before call ``upto``; made in ``into`` where it can be."""
        if key not in self.created or self.created[key][0] >= upto:
            raise Unreplayable("it depends on a meta tensor not created in configure_model()")
        index, leaf = self.created[key]
        made = self.calls[index].outputs[leaf]
        assert made is not None
        layout = (made.size, made.stride, made.offset, made.dtype, made.nbytes, device)
        if (
            into is not None
            and _name(self.calls[index].func).split(".")[-1] in _EMPTY  # its values were undefined: any memory will do
            and layout == _layout(into)
        ):
            base = into
        else:
            base = tree_flatten(self._run(index, None, device, seed))[0][leaf]
        got = (tuple(base.shape), tuple(base.stride()), base.storage_offset(), base.dtype)
        want = (made.size, made.stride, made.offset, made.dtype)
        if got != want or base.untyped_storage().nbytes() != made.nbytes:
            raise Unreplayable(f"{_name(self.calls[index].func)} made {got} on {device.type}, {want} on meta")
        for w in self.writes.get(key, []):
            if index < w < upto:
                self._run(w, (key, base), device, seed)
        return base

    def _run(self, index: int, target: tuple[int, Tensor] | None, device: torch.device, seed: int) -> Any:
        """Call ``index`` again on ``device``: ``target`` is the storage being rebuilt (its current tensor);
        any other meta storage it reads or writes is rebuilt as it was then, for this call only."""
        call = self.calls[index]
        bases: dict[int, Tensor] = {} if target is None else {target[0]: target[1]}

        def real(x: Any) -> Any:
            if isinstance(x, _Meta):
                if x.key not in bases:
                    bases[x.key] = self._state(x.key, index, device, seed)
                base = bases[x.key]
                if base.dtype != x.dtype:
                    raise Unreplayable(f"{_name(call.func)} saw its storage as {x.dtype}, not {base.dtype}")
                same = (x.size, x.stride, x.offset) == (tuple(base.shape), tuple(base.stride()), base.storage_offset())
                return base if same else base.as_strided(x.size, x.stride, x.offset)
            if isinstance(x, _Real):
                if version(x.tensor) != x.version:
                    raise Unreplayable(f"a tensor that {_name(call.func)} read was modified after configure_model()")
                return x.tensor
            if isinstance(x, torch.Generator):
                raise Unreplayable(f"{_name(call.func)} drew from an explicit torch.Generator (its state is gone)")
            if isinstance(x, torch.device) and x.type == "meta":
                return device
            return x

        args, kwargs = tree_map(real, call.args, is_leaf=lambda x: isinstance(x, _Meta | _Real))
        if kwargs.get("device") == "meta":
            kwargs["device"] = device
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(call.default_dtype)  # Lightning's true-precision init context sets it
        try:
            with torch.no_grad(), torch.device(device):
                torch.manual_seed(_seed(seed, index))  # per call: the same draw whichever tensor asks, any layout
                return call.func(*args, **kwargs)
        finally:
            torch.set_default_dtype(dtype)


class _Recorder(TorchFunctionMode):
    def __init__(self, record: InitRecord, huggingface: HuggingFaceInit) -> None:
        super().__init__()
        self.record, self.huggingface = record, huggingface

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.huggingface.pending:  # transformers imported inside configure_model(): patched before its models
            self.huggingface.poll()
        # Property reads (shape, data, T) write nothing and make no storage; they are most of the calls.
        if self.record._unit_depth or getattr(func, "__name__", "") == "__get__":
            return func(*args, **kwargs)
        return self.record.call(func, args, kwargs)


def _unit(record: InitRecord, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        if record._unit_depth:  # one torch.nn.init function calling another
            return func(*args, **kwargs)
        return record.call(func, args, kwargs, unit=True)

    return recorded


@contextlib.contextmanager
def record_init(known: Iterable[Tensor] = ()) -> Iterator[InitRecord]:
    """Record the initialization of the meta tensors made inside. torch.nn.init's orthogonal_, dirac_, sparse_
    and trunc_normal_ return at once on a meta tensor, below any mode's sight, so every public torch.nn.init
    initializer is wrapped here to be recorded as one call (found by attribute: ``nn.init.orthogonal_(w)``, not a
    name imported from torch.nn.init before). A transformers model initializes as on a real device (see
    ``HuggingFaceInit``)."""
    record = InitRecord(known)
    init = torch.nn.init
    originals = {n: f for n, f in vars(init).items() if n.endswith("_") and not n.startswith("_") and callable(f)}
    wrapped = {}
    for n, f in originals.items():
        setattr(init, n, wrapper := _unit(record, f))
        wrapped[id(wrapper)] = f
    huggingface = HuggingFaceInit(functools.partial(_unit, record), wrapped)
    try:
        huggingface.poll()
        with _Recorder(record, huggingface):
            yield record
    finally:
        huggingface.restore()
        for n, f in originals.items():
            setattr(init, n, f)


# HuggingFace models built in configure_model(): transformers' own weight initialization, recorded like any other.


Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


class HuggingFaceInit:
    """While ``configure_model()`` is recorded, a transformers model initializes its weights as on a real device.

    transformers 5 skips a ``PreTrainedModel``'s weight initialization (``post_init()`` → ``init_weights()``) when
    its probe finds the meta device, leaving each layer's torch default: a GPT-2 with embeddings of std 1, not 0.02,
    and unscaled residual projections, silently another model. Here ``init_weights`` sees no meta device, so it runs
    at its usual point of construction (a change configure_model() makes afterwards still wins) by transformers' own
    rules (``_init_weights``, ``_is_hf_initialized``, tied weights), and the recorder notes its calls for the replay
    on each stage. transformers calls the torch.nn.init functions it saved at import, not the recorder's wrappers
    (some of them return at once on a meta tensor, unseen): those are wrapped too. (transformers 4 initialized on
    meta tensors, through their methods, which the recorder sees: there is nothing to patch.)

    transformers may be imported inside ``configure_model()``: :meth:`poll`, called on every recorded torch call
    while :attr:`pending`, patches once its ``PreTrainedModel`` exists, before any model of it is built.
    """

    def __init__(self, wrap: Wrap, wrapped: dict[int, Callable[..., Any]]) -> None:
        self._wrap = wrap
        # torch.nn.init's functions by the id of the recorder's wrapper on them: transformers imported inside
        # configure_model() saved the wrappers, which must not outlive the recording.
        self._wrapped = wrapped
        self._undo: list[tuple[Any, str, Any]] = []  # (dict or class, key, original), in patching order
        self.pending = True

    def poll(self) -> None:
        utils: Any = sys.modules.get("transformers.modeling_utils")
        model = getattr(utils, "PreTrainedModel", None)
        if model is None:  # not imported, or still being imported
            return
        self.pending = False
        saved: Any = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
        if isinstance(saved, dict):
            functions: dict[str, Callable[..., Any]] = saved
            for name, function in list(functions.items()):
                genuine = self._wrapped.get(id(function), function)
                self._undo.append((saved, name, genuine))
                saved[name] = self._wrap(genuine)
        probe = getattr(utils, "get_torch_context_manager_or_global_device", None)
        if probe is None or "init_weights" not in vars(model):
            return
        original = vars(model)["init_weights"]

        def init_weights(pretrained: Any, *args: Any, **kwargs: Any) -> Any:
            utils.get_torch_context_manager_or_global_device = lambda: None  # "no device context": initialize
            try:
                return original(pretrained, *args, **kwargs)
            finally:
                utils.get_torch_context_manager_or_global_device = probe

        self._undo.append((model, "init_weights", original))
        model.init_weights = init_weights

    def restore(self) -> None:
        for owner, key, original in reversed(self._undo):
            if isinstance(owner, dict):
                owner[key] = original
            else:
                setattr(owner, key, original)
        self._undo.clear()
