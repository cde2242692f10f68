"""Memory meters for benchmarks/memory.py: live tensors, the resident set's peak, CUDA's peak, model state."""

# Kept apart from the benchmark's driver so that what is measured, and how, reads in one place; METHOD in memory.py
# describes it for the report.

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# glibc reads these when a process starts (memory.py sets them before spawning workers): every block of 4 KiB or more
# gets its own mapping, unmapped when freed, so that the resident set follows the live memory.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "1"}


def storages(tensors: Any) -> set[int]:
    """The data pointers of the tensors' storages: what ``counting_saved`` is told to skip."""
    return {t.untyped_storage().data_ptr() for t in tensors}


@contextmanager
def counting_saved(skip: set[int], into: dict[int, int]) -> Iterator[None]:
    """Record the storages autograd saves for backward meanwhile (data pointer: bytes), except those in ``skip``."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            into[st.data_ptr()] = st.nbytes()
        return t.detach()  # not t: a saved output holding its own grad_fn would be a reference cycle

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


class LiveTensors(TorchDispatchMode):
    """Bytes of the storages that ops create while it is active and that are still alive, and their peak.

    New: a storage an op returns that none of its inputs has (so not an in-place result, a view or an ``out=``).
    torch keeps a storage's Python object as long as the storage lives, so a weak reference reports its release.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, weakref.ref] = {}

    def _freed(self, key: int, nbytes: int, _ref: weakref.ref) -> None:
        self.live -= nbytes
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in _tensors(out):
            st = t.untyped_storage()
            if (key := st._cdata) in self.refs:
                continue
            if inputs is None:
                inputs = {i.untyped_storage()._cdata for i in (*_tensors(args), *_tensors((kwargs or {}).values()))}
            if key not in inputs:
                self.refs[key] = weakref.ref(st, functools.partial(self._freed, key, st.nbytes()))
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
        return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results: a tensor, or a sequence of tensors and tensor lists."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    flat: list[torch.Tensor] = []
    for o in obj if isinstance(obj, (list, tuple)) or hasattr(obj, "__iter__") else ():
        if isinstance(o, torch.Tensor):
            flat.append(o)
        elif isinstance(o, (list, tuple)):
            flat += [t for t in o if isinstance(t, torch.Tensor)]
    return flat


class Meter:
    """Memory allocated since ``window()`` began, and its peak: ``LiveTensors`` on CPU (plus the resident set's growth:
    VmHWM, reset by writing 5 to /proc/self/clear_refs, minus VmRSS at the start), torch's allocator on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.base, self.mode = device.type == "cuda", 0, LiveTensors()

    @contextmanager
    def window(self) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = _status("VmRSS")
        with nullcontext() if self.cuda else self.mode:
            yield
        if self.cuda:
            torch.cuda.synchronize()

    def now(self) -> int:
        return torch.cuda.memory_allocated() - self.base if self.cuda else self.mode.live

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() - self.base if self.cuda else self.mode.peak

    def rss_peak(self) -> int | None:
        return None if self.cuda else _status("VmHWM") - self.base


def state_bytes(module: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters, buffers, gradients and optimizer state (distinct storages)."""
    ts = [*module.parameters(), *module.buffers(), *(p.grad for p in module.parameters() if p.grad is not None)]
    ts += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())
