"""One input pipeline per pipeline: stage 0 loads each batch; a thread broadcasts it to the other stages ahead of use.

    stage 0     loader thread: next(loader), pack ──▶ outbox ──▶ sender thread ──┐ header: sid + the batch pickled
                main thread:   step i  ◀── batch i (from the stream's queue)     │ with its tensors by reference;
    stage k>0   receiver thread ◀───────────────────────────────────────────────┘ then one flat buffer per dtype,
                main thread:   step i  ◀── batch i (from the stream's queue)       broadcast over the input group

The loader thread runs up to ``depth`` batches ahead of the training step, so batch i+1 is loaded and already on
every stage while step i runs (Jizhi's pipelined input). Every ``iter()`` of a wrapped loader opens a stream; the
streams are numbered in the order they open, the same on every stage (Lightning's loops run alike on each), and one
sender thread keeps the broadcasts of all streams (training, and validation inside it) in one order for the receivers.
A stream left unfinished (``limit_train_batches``) is dropped once its iterator is let go, or at the latest when the
same loader opens its next one.
"""

from __future__ import annotations

import io
import pickle
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_gpipe.pipe.errors import PipelineTimeout

_POLL_S = 0.05  # how often a loader thread waiting for room looks at its stop flag
_JOIN_S = 60.0  # a stopped loader thread finishes the batch it is loading; longer means a hung loader
_SHUTDOWN = -1
Metas = list[tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class _End:
    """The stream's loader is exhausted, or was stopped."""


@dataclass(frozen=True)
class _Failed:
    """The stream's loader raised on stage 0."""

    message: str


@dataclass(frozen=True)
class Packed:
    """A batch as it crosses: its structure, the shape and dtype of each tensor, one flat copy per dtype."""

    structure: bytes
    metas: Metas
    flats: dict[torch.dtype, torch.Tensor]


class _TensorPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and not obj.is_nested:
            self.tensors.append(obj.detach())
            return len(self.tensors) - 1
        return None


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self.tensors[pid]


def pack(batch: Any) -> Packed:
    """A copy of ``batch`` to send: the training step may change the original in place while it crosses."""
    file = io.BytesIO()
    pickler = _TensorPickler(file)
    pickler.dump(batch)
    tensors = pickler.tensors
    flats = {}
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        flats[dtype] = torch.cat([t.reshape(-1).to("cpu") for t in tensors if t.dtype == dtype])
    return Packed(file.getvalue(), [(tuple(t.shape), t.dtype) for t in tensors], flats)


def unpack(packed: Packed) -> Any:
    """The batch again, each tensor a view of its dtype's buffer (on the CPU, as a data loader gives it)."""
    offsets = dict.fromkeys(packed.flats, 0)
    tensors = []
    for shape, dtype in packed.metas:
        n = _numel(shape)
        tensors.append(packed.flats[dtype][offsets[dtype] : offsets[dtype] + n].view(shape))
        offsets[dtype] += n
    return _TensorUnpickler(io.BytesIO(packed.structure), tensors).load()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class BatchFeed:
    """The batches of every loader one pipeline iterates, loaded once on stage 0 and broadcast over ``group`` (gloo,
    the K stages of the pipeline). Each stage calls ``stream(loader)`` at the same point of its loop, and ``close()``
    at the end."""

    def __init__(self, group: dist.ProcessGroup, is_source: bool, timeout_s: float, depth: int = 2) -> None:
        self.group, self.is_source, self.timeout_s, self.depth = group, is_source, timeout_s, depth
        self._lock = threading.Lock()
        self._opened = -1  # the last stream id this rank opened
        self._queues: dict[int, queue.Queue[Any]] = {}
        self._pinned: set[int] = set()  # streams whose loader pins its batches: so are the received ones
        self._sources: dict[int, Any] = {}  # the open streams' keys
        self._loaders: dict[int, _Loader] = {}
        self._dropped: list[_Loader] = []  # stopped, maybe still finishing a batch
        self._outbox: queue.Queue[tuple[int, Any]] = queue.Queue()
        target = self._send_all if is_source else self._receive_all
        self._thread = threading.Thread(target=target, name="gpipe-batch-feed", daemon=True)
        self._thread.start()

    def stream(self, loader: Iterable[Any], key: Any = None) -> Iterator[Any]:
        """A new stream of ``loader``'s batches (on stage 0 it iterates ``loader``; elsewhere it receives them). An
        unfinished stream of the same ``key`` (default: the loader; an epoch cut short) is dropped; others (training
        around validation, even of the same loader under another key) stay open."""
        key = loader if key is None else key
        with self._lock:
            for old in [s for s, of in self._sources.items() if of is key]:
                self._drop(old)
            self._opened += 1
            sid = self._opened
            self._sources[sid] = key
            q = self._queues.setdefault(sid, queue.Queue())
            if getattr(loader, "pin_memory", False) and torch.cuda.is_available():
                self._pinned.add(sid)
        if self.is_source:
            self._loaders[sid] = _Loader(sid, loader, self._outbox, q, self.depth)
        return self._take(sid, q)

    def close(self) -> None:
        """Stop every stream; the receivers' thread ends with the source's last message."""
        with self._lock:
            for sid in list(self._sources):
                self._drop(sid)
        for loader in self._dropped:
            loader.thread.join(timeout=_JOIN_S)
        if self.is_source:
            self._outbox.put((_SHUTDOWN, None))
        self._thread.join(timeout=self.timeout_s)

    def _drop(self, sid: int) -> None:
        """Forget a stream: stage 0 stops loading it (and ends it for the others); elsewhere, its batches still
        arriving are let go. Either side may drop a stream at any time without the other."""
        self._sources.pop(sid, None)
        self._queues.pop(sid, None)
        loader = self._loaders.pop(sid, None)
        if loader is not None:
            loader.stopped.set()
            self._dropped = [d for d in self._dropped if d.thread.is_alive()] + [loader]

    def _take(self, sid: int, q: queue.Queue[Any]) -> Iterator[Any]:
        loader = self._loaders.get(sid)
        try:
            yield from self._items(sid, q, loader)
        finally:  # exhausted, or abandoned: CPython closes a generator once nothing refers to it
            with self._lock:
                self._drop(sid)

    def _items(self, sid: int, q: queue.Queue[Any], loader: _Loader | None) -> Iterator[Any]:
        while True:
            try:
                item = q.get(timeout=self.timeout_s)
            except queue.Empty:
                who = "this stage's data loader" if self.is_source else "stage 0 of this pipeline (which loads them)"
                raise PipelineTimeout(
                    f"no batch came for {self.timeout_s:.0f} s from {who}: it is slow, hung, or died",
                    stage=0,
                    phase="data loading",
                ) from None
            if loader is not None:
                loader.budget.release()
            if isinstance(item, _End):
                return
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, _Failed):
                raise RuntimeError(f"stage 0's data loader raised {item.message}")
            yield item

    def _send_all(self) -> None:
        while True:
            sid, item = self._outbox.get()
            header = (sid, (item.structure, item.metas, list(item.flats)) if isinstance(item, Packed) else item)
            dist.broadcast_object_list([header], group=self.group, group_src=0)
            if isinstance(item, Packed):
                for flat in item.flats.values():
                    dist.broadcast(flat, group=self.group, group_src=0)
            if sid == _SHUTDOWN:
                return

    def _receive_all(self) -> None:
        try:
            while True:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, group=self.group, group_src=0)
                sid, item = box[0]
                if sid == _SHUTDOWN:
                    return
                if isinstance(item, tuple):
                    structure, metas, dtypes = item
                    sizes = dict.fromkeys(dtypes, 0)
                    for shape, dtype in metas:
                        sizes[dtype] += _numel(shape)
                    pin = sid in self._pinned
                    flats = {dtype: torch.empty(n, dtype=dtype, pin_memory=pin) for dtype, n in sizes.items()}
                    for flat in flats.values():
                        dist.broadcast(flat, group=self.group, group_src=0)
                    item = unpack(Packed(structure, metas, flats))
                with self._lock:
                    if sid > self._opened:  # stage 0 opened it before this stage did
                        self._queues.setdefault(sid, queue.Queue())
                    q = self._queues.get(sid)  # None: a stream this stage dropped
                if q is not None:
                    q.put(item)
        except BaseException as error:  # stage 0 died or the group broke: every open stream raises it
            with self._lock:
                for q in self._queues.values():
                    q.put(error)


class _Loader:
    """Stage 0's loader thread for one stream: it iterates the loader at most ``depth`` batches ahead."""

    def __init__(self, sid: int, loader: Iterable[Any], outbox: queue.Queue[Any], local: queue.Queue[Any], depth: int):
        self.sid, self.loader, self.outbox, self.local = sid, loader, outbox, local
        self.budget = threading.Semaphore(depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._load, name=f"gpipe-loader-{sid}", daemon=True)
        self.thread.start()

    def _load(self) -> None:
        try:
            for batch in self.loader:
                while not self.budget.acquire(timeout=_POLL_S):
                    if self.stopped.is_set():
                        break
                if self.stopped.is_set():
                    break
                self.outbox.put((self.sid, pack(batch)))
                self.local.put(batch)
        except Exception as error:  # raised on stage 0's main thread; the other stages get its message
            self.outbox.put((self.sid, _Failed(f"{type(error).__name__}: {error}")))
            self.local.put(error)
            return
        self.outbox.put((self.sid, _End()))
        self.local.put(_End())
