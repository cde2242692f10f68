"""A message's bytes: its header and, where they fit, its tensors' bytes in the same message; sizes both ends agree on.

A receive must be posted with its message's size, before the header that would tell it has come. Every message
therefore has a size that both of its ends compute alike from the messages before it on the same peer and tag
(``Sizes``): at least ``HEADER_BYTES``, and on gloo between CPU processes as large as the largest of the last few
messages there, so that a message of the shapes just seen carries its tensors' bytes beside its header (one message
a hop instead of two: on gloo every message is a rendezvous, and a second one doubles the hop's latency). A message
whose tensors do not fit sends its header alone, padded to the agreed size, and its tensors apart, as on NCCL
always (where the tensors live on the device and the header on the CPU).

    one message:   | length (8 B) | pickled header | pad | tensor 0 | pad | tensor 1 | ... | pad to the agreed size |
                   offsets aligned to 64 bytes, so that each tensor is a view of the received bytes in its dtype
"""

from __future__ import annotations

import math
import struct
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

HEADER_BYTES = 1024
LEN = struct.Struct("<q")
# Above this a message sends its tensors apart: a copy into the message costs more than the rendezvous it saves.
INLINE_MAX = 1 << 20
_ALIGN = 64
# Headers of the same shapes differ by a few bytes (the pickled ints of a seed, of m).
_SLACK = 256
# Messages remembered per peer and tag: interleaved chunks alternate shapes on one link.
_WINDOW = 4


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _nbytes(meta: TensorMeta) -> int:
    return math.prod(meta.shape) * meta.dtype.itemsize


def layout(n_header: int, metas: Sequence[TensorMeta]) -> tuple[list[int], int]:
    """Where each tensor's bytes start in a message whose pickled header has ``n_header`` bytes, and its end."""
    offsets, end = [], _up(LEN.size + n_header)
    for meta in metas:
        offsets.append(end)
        end = _up(end + _nbytes(meta))
    return offsets, end


class Sizes:
    """The size of the next message on each (peer, tag) of one direction, from the messages before it there."""

    def __init__(self, inline: bool) -> None:
        self.inline = inline
        self._needs: defaultdict[tuple[int, int], deque[int]] = defaultdict(lambda: deque(maxlen=_WINDOW))

    def size(self, key: tuple[int, int]) -> int:
        return max((HEADER_BYTES, *self._needs[key])) if self.inline else HEADER_BYTES

    def fits(self, size: int, metas: Sequence[TensorMeta], end: int) -> bool:
        """Whether a message of ``size`` bytes carries these tensors beside its header (``end``: ``layout``'s)."""
        return self.inline and bool(metas) and end <= size

    def record(self, key: tuple[int, int], end: int) -> None:
        """A message on ``key`` went (or came) whose header and tensors end at ``end`` (``layout``'s)."""
        if self.inline:
            need = end + _SLACK
            self._needs[key].append(need if need <= INLINE_MAX else 0)


def pack(payload: bytes, size: int, tensors: Sequence[torch.Tensor] = (), offsets: Sequence[int] = ()) -> torch.Tensor:
    """A message of ``size`` bytes: the header's length, the first ``size - 8`` of its bytes, and ``tensors`` at
    ``offsets``."""
    raw = bytearray(size)
    head = payload[: size - LEN.size]
    raw[: LEN.size] = LEN.pack(len(payload))
    raw[LEN.size : LEN.size + len(head)] = head
    buf = torch.frombuffer(raw, dtype=torch.uint8)  # keeps ``raw`` alive
    for t, start in zip(tensors, offsets):
        data = wire(t)
        buf[start : start + data.numel()] = data
    return buf


def unpack(buf: torch.Tensor, metas: Sequence[TensorMeta], offsets: Sequence[int]) -> list[torch.Tensor]:
    """The tensors a message carries beside its header: views of its bytes, one storage for all."""
    return [buf[start : start + _nbytes(meta)].view(meta.dtype).view(meta.shape) for start, meta in zip(offsets, metas)]


def wire(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, as they travel."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
