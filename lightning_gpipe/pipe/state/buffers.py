"""Buffers that layers change in forward: learned by watching, and replayed so that a recompute changes no state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lightning_gpipe.pipe._torch_internals import version
from lightning_gpipe.pipe.state.batchnorm import is_deferred

Marks = dict[str, tuple[torch.Tensor, int]]
Snapshot = dict[str, torch.Tensor]


def _version(t: torch.Tensor) -> int:
    try:
        return version(t)
    except RuntimeError:  # an inference tensor (made under torch.inference_mode) has no version counter
        return -1


class StatefulBuffers:
    """The buffers of ``module`` that its forward changes in place or reassigns (a sample counter, an EMA, the
    running statistics of a BatchNorm that is not deferred).

    A recompute re-runs a micro-batch's forward: left alone, such a layer would update its state once more per
    recompute and would recompute with the state of the end of the phase, not the one its forward saw. So the stage
    takes a :meth:`snapshot` before each checkpointed micro-batch, and runs its recompute under :meth:`replay`.
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._changed: set[str] = set()
        self._watched = False
        self._owners: list[tuple[str, nn.Module]] = []
        self._writes_unseen: set[str] = set()

    def begin(self) -> None:
        """Find the modules that hold buffers, once per forward phase: watching only those keeps :meth:`mark` and
        :meth:`learn` cheap enough to run on every micro-batch (most layers hold none)."""
        self._owners = [
            (f"{prefix}." if prefix else "", m)
            for prefix, m in self._module.named_modules(remove_duplicate=False)
            if m._buffers
        ]
        # BatchNorm's and InstanceNorm's kernels write their running statistics in place without bumping the version
        # counter (a compiled graph's copy-back does bump it): a training one that tracks them, not deferred, always
        # changes them.
        self._writes_unseen = {
            prefix + name
            for prefix, m in self._owners
            if getattr(m, "track_running_stats", False) is True and m.training and not is_deferred(m)
            for name in ("running_mean", "running_var")
            if m._buffers.get(name) is not None
        }

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for prefix, m in self._owners:
            for leaf, b in m._buffers.items():
                if b is not None:
                    yield prefix + leaf, b

    @property
    def changed(self) -> list[str]:
        """Their names in the module, in its order."""
        if not self._changed:  # read after every training step: no walk over the buffers in the usual case
            return []
        return [name for name, _ in self._module.named_buffers(remove_duplicate=False) if name in self._changed]

    def mark(self) -> Marks:
        # References rather than ids: an id can be reused by the tensor that replaces a freed buffer.
        return {name: (b, _version(b)) for name, b in self._items()}

    def learn(self, marks: Marks) -> None:
        """Note the buffers changed since :meth:`mark`; once noted, a buffer is replayed from then on."""
        for name, b in self._items():
            before = marks.get(name)
            if before is None or before[0] is not b or before[1] != _version(b):
                self._changed.add(name)
        self._changed |= self._writes_unseen
        self._watched = True

    def snapshot(self) -> Snapshot | None:
        """Copies of the buffers a recompute must start from; before anything was watched, of all of them (which
        ones change is only known afterwards). None when there are none."""
        if self._watched and not self._changed:
            return None
        copies: dict[int, torch.Tensor] = {}  # one copy per tensor, so that tied buffers stay tied
        snap = {}
        for name, b in self._items():
            if name in self._changed or not self._watched:
                if id(b) not in copies:
                    copies[id(b)] = b.detach().clone()
                snap[name] = copies[id(b)]
        return snap or None

    @contextlib.contextmanager
    def replay(self, snapshot: Snapshot | None) -> Iterator[None]:
        """Run a recompute on the snapshot's copies of the changed buffers (on fresh copies of the current ones for
        a buffer that began to change after its snapshot), then put the module's own buffers back: whatever the
        recompute did to them, in place or by reassigning, is dropped."""
        if not self._changed:
            yield
            return
        names = self.changed
        slots: list[tuple[nn.Module, str, torch.Tensor]] = []
        for name in names:
            owner_name, _, leaf = name.rpartition(".")
            owner = self._module.get_submodule(owner_name)
            original = owner._buffers[leaf]
            assert original is not None, f"{name} is one of named_buffers(), which are tensors"
            slots.append((owner, leaf, original))
        copies: dict[int, torch.Tensor] = {}
        for (owner, leaf, original), name in zip(slots, names):
            stand_in = snapshot.get(name) if snapshot is not None else None
            if stand_in is None:
                stand_in = copies.get(id(original))
                if stand_in is None:
                    stand_in = copies[id(original)] = original.detach().clone()
            # Swapped in, not copied into the buffer: a copy would bump the version of a tensor autograd may have
            # saved, and the recompute's graph keeps the stand-ins it used.
            owner._buffers[leaf] = stand_in
        try:
            yield
        finally:
            for owner, leaf, original in slots:
                owner._buffers[leaf] = original
