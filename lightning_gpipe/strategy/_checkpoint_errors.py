"""Checkpoint steps that fail alike on every rank: one rank's error must not leave the others at a collective."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def agreed(action: Callable[[], T], message: Callable[[str], str]) -> T:
    """``action()`` on this rank, then one collective: if it raised on any rank, every rank raises RuntimeError.

    The message is ``message(causes)``, where ``causes`` names each rank that failed and its error. Ranks that did
    not fail raise too, so none goes on to a collective the failed rank never reaches (gloo would report a closed
    connection there, NCCL would wait for its timeout).
    """
    result: Any = None
    error: Exception | None = None
    try:
        result = action()
    except Exception as e:
        error = e
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if dist.is_available() and dist.is_initialized():
        causes: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(causes, mine)
    else:
        causes = [mine]
    failed = [(rank, cause) for rank, cause in enumerate(causes) if cause is not None]
    if failed:
        raise RuntimeError(message(_describe(failed, len(causes)))) from error
    return result


def _describe(failed: list[tuple[int, str]], world_size: int) -> str:
    texts = {cause for _, cause in failed}
    if len(failed) == world_size and len(texts) == 1:
        return f"every rank: {texts.pop()}"
    by_text: dict[str, list[int]] = {}
    for rank, cause in failed:
        by_text.setdefault(cause, []).append(rank)
    return "; ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {text}"
        for text, ranks in by_text.items()
    )
