"""Long skip connections: a tensor stashed by one layer and popped by a later one, sent straight between their stages.

A U-Net's encoder keeps each resolution's features for the decoder's matching block. Threaded through the
``nn.Sequential`` as a tuple, such a skip crosses every stage between its producer and its consumer, and so does its
gradient. Declared, it goes straight from the stage that stashes it to the stage that pops it (K = 3, one skip from a
layer of stage 0 to a layer of stage 2):

    stage 0 --x--> stage 1 --x--> stage 2          forward: x along the chain, s1 from stage 0 to stage 2
       |                             ^
       +------------- s1 ------------+             backward: ds1 from stage 2 to stage 0; stage 1 sees neither

Declare the layers (or modules inside them) that stash or pop, then call :func:`stash` and :func:`pop` in their
forward; :class:`Stash` and :class:`Pop` are the two layers most models need::

    backbone = nn.Sequential(
        Block(3, 16), Stash("s1"), nn.MaxPool2d(2),
        Block(16, 32),
        nn.Upsample(scale_factor=2), Pop("s1"), Block(32 + 16, 16),  # Pop concatenates on the channels
    )

Every name is stashed by one layer and popped by one later layer (or the same one), once per forward. Outside a
pipeline the same module runs as written: stash keeps the tensor for this thread until pop takes it. In a pipeline
each stage runs its layers on a micro-batch with a tray holding what the micro-batch's earlier stages sent it, checks
each stash and pop against the layer's declaration, and the executor sends what is left to the stages that pop it.
Received skips are the micro-batch's boundary like its input: kept for the recompute, their gradients sent back.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from lightning_gpipe.pipe._torch_internals import tree_map

__all__ = ["Pop", "Stash", "pop", "skippable", "stash"]

_DECLARED = "_gpipe_skips"
GUIDE = 'docs/guide.md, "Long skip connections"'
M = TypeVar("M", bound=nn.Module)


def skippable(module: M, *, stash: Iterable[str] = (), pop: Iterable[str] = ()) -> M:
    """Declare that ``module``'s forward calls ``stash(name, …)`` for each name of ``stash`` and ``pop(name)`` for
    each of ``pop``, so that a pipeline knows, before it runs, which stage sends which skip to which; returns it."""
    stashed, popped = _names(stash, "stash"), _names(pop, "pop")
    old = getattr(module, _DECLARED, ((), ()))
    object.__setattr__(
        module, _DECLARED, (tuple(dict.fromkeys([*old[0], *stashed])), tuple(dict.fromkeys([*old[1], *popped])))
    )
    return module


def _names(names: Iterable[str], what: str) -> list[str]:
    names = [names] if isinstance(names, str) else list(names)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise TypeError(f"skippable({what}=...) takes skip names, non-empty strings; got {bad!r}")
    return names


class Stash(nn.Module):
    """A layer that stashes its input under ``name`` for a later :class:`Pop` (or :func:`pop`) and returns it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        skippable(self, stash=[name])

    def forward(self, x: Any) -> Any:
        stash(self.name, x)
        return x

    def extra_repr(self) -> str:
        return repr(self.name)


class Pop(nn.Module):
    """A layer that pops the skip ``name`` and merges it into its input: ``"cat"`` concatenates ``(x, skip)`` along
    ``dim`` (a U-Net's channels), ``"add"`` adds them (a long residual), a callable returns ``merge(x, skip)``."""

    def __init__(
        self, name: str, merge: Literal["cat", "add"] | Callable[[Any, Any], Any] = "cat", dim: int = 1
    ) -> None:
        super().__init__()
        if not callable(merge) and merge not in ("cat", "add"):
            raise ValueError(f"Pop(merge={merge!r}): merge is 'cat', 'add' or a callable merge(x, skip)")
        self.name, self.merge, self.dim = name, merge, dim
        skippable(self, pop=[name])

    def forward(self, x: Any) -> Any:
        skip = pop(self.name)
        if self.merge == "cat":
            return torch.cat([x, skip], dim=self.dim)
        if self.merge == "add":
            return x + skip
        assert callable(self.merge)
        return self.merge(x, skip)

    def extra_repr(self) -> str:
        merge = self.merge if isinstance(self.merge, str) else getattr(self.merge, "__name__", "callable")
        return f"{self.name!r}, merge={merge}" + (f", dim={self.dim}" if merge == "cat" else "")


# ---------------------------------------------------------------------------------------------------- the trays
class _Plain:
    """Outside a pipeline: what was stashed waits here, per thread, until it is popped."""

    def __init__(self) -> None:
        self.items: dict[str, Any] = {}

    def stash(self, name: str, value: Any) -> None:
        self.items[name] = value  # a forward that failed before its pop left the old one: replace it

    def pop(self, name: str) -> Any:
        if name not in self.items:
            raise RuntimeError(
                f"pop({name!r}) found nothing stashed under {name!r}: the layer that calls stash({name!r}, …) must "
                "run earlier in the same forward"
            )
        return self.items.pop(name)


class _Profiling(_Plain):
    """While a balance is measured layer by layer (each maybe several times): a pop leaves the skip for the next
    run and gets a fresh autograd leaf of it, as each measured layer's input is."""

    def __init__(self, fresh: Callable[[Any], Any]) -> None:
        super().__init__()
        self.fresh = fresh

    def pop(self, name: str) -> Any:
        if name not in self.items:
            return super().pop(name)
        return tree_map(self.fresh, self.items[name])


_local = threading.local()
_active: ContextVar[_Plain | Tray | None] = ContextVar("gpipe_skip_tray", default=None)


def _tray() -> _Plain | Tray:
    tray = _active.get()
    if tray is not None:
        return tray
    if not hasattr(_local, "plain"):
        _local.plain = _Plain()
    return _local.plain


def stash(name: str, value: Any) -> None:
    """Keep ``value`` (a tensor, or a structure of them) for the layer that pops ``name``; the calling module must
    declare it (:func:`skippable`, or the :class:`Stash` layer)."""
    _tray().stash(name, value)


def pop(name: str) -> Any:
    """What the layer declared to stash ``name`` stashed in this forward; the calling module must declare it."""
    return _tray().pop(name)


def current_tray() -> Tray | None:
    """The tray of the micro-batch a stage is running, if any."""
    tray = _active.get()
    return tray if isinstance(tray, Tray) else None


@contextlib.contextmanager
def profiling(fresh: Callable[[Any], Any]) -> Iterator[None]:
    """Run layers one by one, each possibly more than once (balance by time or FLOPs): see :class:`_Profiling`."""
    token = _active.set(_Profiling(fresh))
    try:
        yield
    finally:
        _active.reset(token)


# ---------------------------------------------------------------------------------------------- the routes
@dataclass
class StageSkips:
    """The skips of stage ``index``: what its layers declare, what it receives from and sends to which stage."""

    index: int
    homes: tuple[int, ...] = ()  # the rank of each stage (with virtual stages a rank holds several); (): stage s's s
    stashes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # layer name -> skip names it stashes
    pops: dict[str, tuple[str, ...]] = field(default_factory=dict)  # layer name -> skip names it pops
    receives: dict[int, tuple[str, ...]] = field(default_factory=dict)  # source stage -> skip names, in order
    sends: dict[int, tuple[str, ...]] = field(default_factory=dict)  # destination stage -> skip names, in order
    pairs: dict[int, int] = field(default_factory=dict)  # the other stage -> the pair's index in skip_pairs

    def rank_of(self, stage: int) -> int:
        return self.homes[stage] if self.homes else stage

    def local(self, stage: int) -> bool:
        """Whether ``stage`` runs on this stage's rank (another chunk of it): skips are handed over, not sent."""
        return self.rank_of(stage) == self.rank_of(self.index)

    def tray(self, incoming: dict[int, Any], copy: bool) -> Tray:
        """The tray for one micro-batch's run, holding the skips received from earlier stages."""
        items: dict[str, Any] = {}
        for src, values in incoming.items():
            for name, value in zip(self.receives[src], values):
                # A kept boundary (for the recompute) must not be changed in place by the layer that pops it.
                items[name] = (
                    tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value) if copy else value
                )
        return Tray(self, items)


class Tray:
    """One micro-batch's skips on one stage while its layers run (see the module); ``layer`` is the running one."""

    def __init__(self, skips: StageSkips, items: dict[str, Any]) -> None:
        self.skips = skips
        self.items = items
        self.layer = ""
        self.layer_class = ""

    @property
    def where(self) -> str:
        """The running layer as errors name it: its index in the nn.Sequential and its class."""
        return f"layer {self.layer} ({self.layer_class})" if self.layer_class else f"layer {self.layer}"

    def _check(self, name: str, declared: dict[str, tuple[str, ...]], verb: str) -> None:
        if name not in declared.get(self.layer, ()):
            raise RuntimeError(
                f"{self.where} of the pipelined nn.Sequential calls {verb}({name!r}) without declaring it, so "
                f"the pipeline cannot route skip {name!r} between stages; declare it on the module that calls it: "
                f"skippable(module, {verb}=[{name!r}]) (see {GUIDE})"
            )

    def stash(self, name: str, value: Any) -> None:
        self._check(name, self.skips.stashes, "stash")
        if name in self.items:
            raise RuntimeError(f"{self.where} stashes skip {name!r} twice in one forward; each skip is stashed once")
        self.items[name] = value

    def pop(self, name: str) -> Any:
        self._check(name, self.skips.pops, "pop")
        if name not in self.items:
            raise RuntimeError(
                f"{self.where} pops skip {name!r}, which is not there: the layer declared to stash it did not "
                "call stash in this forward, or the skip was popped already; each skip is stashed and popped once "
                "per forward"
            )
        return self.items.pop(name)

    @contextlib.contextmanager
    def active(self) -> Iterator[Tray]:
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)

    def outgoing(self) -> dict[int, list[Any]]:
        """After the stage's layers ran: per destination stage, the skips to send, in its order; anything else
        still in the tray is a declared stash or pop that did not happen."""
        out = {dst: [self.items.pop(n, _MISSING) for n in names] for dst, names in self.skips.sends.items()}
        missing = [n for dst, names in self.skips.sends.items() for n, v in zip(names, out[dst]) if v is _MISSING]
        if missing or self.items:
            declared = {n for names in self.skips.stashes.values() for n in names}
            unpopped = sorted(self.items)
            raise RuntimeError(
                f"stage {self.skips.index}'s layers ran without "
                + "; ".join(
                    part
                    for part in (
                        f"stashing {missing} as declared" if missing else "",
                        f"popping {[n for n in unpopped if n not in declared]} as declared"
                        if any(n not in declared for n in unpopped)
                        else "",
                        f"popping {[n for n in unpopped if n in declared]}, which they stashed"
                        if any(n in declared for n in unpopped)
                        else "",
                    )
                    if part
                )
                + ": every declared skip must be stashed and popped once in each forward"
            )
        return out


_MISSING = object()


def skip_layers(module: nn.Sequential) -> dict[str, tuple[int, int]]:
    """Each declared skip of ``module``'s layers (their submodules' too): (the layer that stashes it, the layer that
    pops it), in stashing order; empty when none is declared. Raises on declarations that cannot run, naming them."""
    where: dict[str, dict[str, list[tuple[int, str]]]] = {"stash": {}, "pop": {}}
    for i, (layer_name, layer) in enumerate(module._modules.items()):
        assert layer is not None, f"layer {layer_name} was set to None"
        for sub_name, sub in layer.named_modules():
            stashed, popped = getattr(sub, _DECLARED, ((), ()))
            for verb, names in (("stash", stashed), ("pop", popped)):
                for name in names:
                    at = where[verb].setdefault(name, [])
                    if not at or at[-1][0] != i:
                        named = f"{layer_name}.{sub_name}" if sub_name else layer_name
                        at.append((i, f"layer {named} ({type(sub).__name__})"))
    problems = []
    for name in sorted({*where["stash"], *where["pop"]}):
        stashed, popped = where["stash"].get(name, []), where["pop"].get(name, [])
        if len(stashed) != 1 or len(popped) != 1:
            problems.append(
                f"skip {name!r} is stashed by {_modules(stashed)} and popped by {_modules(popped)}, "
                "but needs exactly one layer that stashes it and one that pops it"
            )
        elif popped[0][0] < stashed[0][0]:
            problems.append(f"skip {name!r} is popped by {popped[0][1]} before {stashed[0][1]} stashes it")
    if problems:
        raise ValueError(
            "the skip declarations of the nn.Sequential cannot run: " + "; ".join(problems) + f" (see {GUIDE})"
        )
    order = sorted(where["stash"], key=lambda n: (where["stash"][n][0][0], n))
    return {name: (where["stash"][name][0][0], where["pop"][name][0][0]) for name in order}


def plan_skips(module: nn.Sequential, balance: Sequence[int], homes: Sequence[int] = ()) -> list[StageSkips] | None:
    """Each stage's skips for ``module`` split by ``balance`` (layers per stage), stage s on rank ``homes[s]``
    (default: a rank per stage), from the layers' declarations (:func:`skip_layers`); None when no layer declares
    one."""
    skips = skip_layers(module)
    if not skips:
        return None
    names = list(module._modules)
    stage_of = [k for k, count in enumerate(balance) for _ in range(count)]
    plans = [StageSkips(k, tuple(homes)) for k in range(len(balance))]
    for name, (i, j) in skips.items():
        s, p = stage_of[i], stage_of[j]
        plans[s].stashes[names[i]] = (*plans[s].stashes.get(names[i], ()), name)
        plans[p].pops[names[j]] = (*plans[p].pops.get(names[j], ()), name)
        if s != p:
            plans[s].sends[p] = (*plans[s].sends.get(p, ()), name)
            plans[p].receives[s] = (*plans[p].receives.get(s, ()), name)
    for plan in plans:
        plan.sends = dict(sorted(plan.sends.items()))
        plan.receives = dict(sorted(plan.receives.items()))
    for i, (s, p) in enumerate(skip_pairs(plans)):
        plans[s].pairs[p] = plans[p].pairs[s] = i
    return plans


def _modules(at: list[tuple[int, str]]) -> str:
    return " and ".join(name for _, name in at) or "no layer"


def skip_pairs(plans: Sequence[StageSkips]) -> list[tuple[int, int]]:
    """The (stashing stage, popping stage) pairs that skips cross, in one order on every rank."""
    return sorted((plan.index, dst) for plan in plans for dst in plan.sends)
