"""Greedy and beam-search decoding for any ``(src_ids, prefix) → logits`` model, the pipelined forward included.

Neither keeps a KV cache: ``model`` is re-run on the whole prefix each step, because it may be a pipelined forward that
runs on several processes, each of which must make the same calls with the same shapes. So the number of calls and the
shape of each depend only on the source and on what each step chose, which every process sees alike. On a pipeline
(a model with ``output_head``, as ``GPipeStage``) the choice's inputs are computed on the last stage and only they
travel to the others: the next ids for greedy, each beam's best ids and their log-probabilities for beam search, not
the logits over the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor

__all__ = ["beam_decode", "greedy_decode"]

Model = Callable[[tuple[Tensor, Tensor]], Tensor]


@contextmanager
def _stepping(model: Model, head: Callable[[Tensor], Any]) -> Iterator[Callable[[tuple[Tensor, Tensor]], Any]]:
    """``head(model(x))`` as one call; on a pipeline the last stage runs ``head`` and shares only its result."""
    output_head = getattr(model, "output_head", None)
    if output_head is None:
        yield lambda x: head(model(x))
        return
    with output_head(head):
        yield model


def _greedy_head(logits: Tensor) -> Tensor:
    """The next id of each row: the arg max of its last position's logits."""
    return logits[:, -1].argmax(dim=-1)


def _beam_head(logits: Tensor, beam_size: int) -> tuple[Tensor, Tensor]:
    """Each row's ``beam_size`` best next ids by the raw logits and their log-probabilities.

    Ties go to the lowest id, as argmax breaks them: log_softmax is monotonic but its rounding can tie distinct
    logits, and ``beam_size=1`` must pick what greedy picks."""
    logits = logits[:, -1]
    tok = logits.sort(dim=-1, descending=True, stable=True).indices[:, :beam_size]
    return tok, logits.float().log_softmax(dim=-1).gather(1, tok)


def greedy_decode(model: Model, src_ids: Tensor, bos_id: int, eos_id: int, max_len: int, pad_id: int = 0) -> Tensor:
    """Greedy translation, re-running ``model((src_ids, prefix))`` on the whole prefix each step (no KV cache).

    ``model`` is any callable from the pair ``(src_ids, prefix)`` to logits ``[N, t, vocab]`` (the Sequential, or a
    pipelined forward); put it in eval mode first. Returns the generated ids ``[N, ≤ max_len]`` without the BOS; it
    stops once every row has produced ``eos_id``, and rows that finished earlier are padded with ``pad_id`` after it.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be ≥ 1, got {max_len}")
    N = src_ids.shape[0]
    prefix = torch.full((N, 1), bos_id, dtype=torch.long, device=src_ids.device)
    done = torch.zeros(N, dtype=torch.bool, device=src_ids.device)
    with torch.no_grad(), _stepping(model, _greedy_head) as step:
        for _ in range(max_len):
            nxt = step((src_ids, prefix))
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            prefix = torch.cat([prefix, nxt[:, None]], dim=1)
            done |= nxt == eos_id
            if bool(done.all()):
                break
    return prefix[:, 1:]


def _length_penalty(length: Tensor, alpha: float) -> Tensor:
    """GNMT's lp(|Y|) = ((5 + |Y|) / 6)^α; a hypothesis is ranked by its log-probability / lp."""
    return ((5.0 + length.float()) / 6.0) ** alpha


def beam_decode(
    model: Model,
    src_ids: Tensor,
    bos_id: int,
    eos_id: int,
    max_len: int,
    pad_id: int = 0,
    beam_size: int = 4,
    length_penalty: float = 0.6,
) -> Tensor:
    """Beam-search translation; the same contract as :func:`greedy_decode`, with ``beam_size`` hypotheses per row.

    ``model`` sees a batch of ``N · beam_size`` rows (row ``n · beam_size + b`` is beam b of sentence n). A hypothesis
    that produced ``eos_id`` stays in its beam, competing by its log-probability / ``((5 + len) / 6) ** length_penalty``
    (len counts the EOS). A row stops once its best finished hypothesis beats what any live one could still reach; the
    decoding stops once every row has. Returns the best hypothesis per row, ``[N, ≤ max_len]`` without the BOS, padded
    with ``pad_id`` after its EOS. ``beam_size=1`` is :func:`greedy_decode`, call for call.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be ≥ 1, got {max_len}")
    if beam_size < 1:
        raise ValueError(f"beam_size must be ≥ 1, got {beam_size}")
    N, B, device = src_ids.shape[0], beam_size, src_ids.device
    src = src_ids.repeat_interleave(B, dim=0)
    prefix = torch.full((N * B, 1), bos_id, dtype=torch.long, device=device)
    # Only beam 0 starts live: B copies of the lone BOS would otherwise fill every beam with the same hypotheses.
    score = torch.full((N, B), -math.inf, device=device)
    score[:, 0] = 0.0
    length = torch.zeros(N, B, dtype=torch.long, device=device)
    done = torch.zeros(N, B, dtype=torch.bool, device=device)
    first = torch.arange(B, device=device) == 0
    base = torch.arange(N, device=device)[:, None] * B
    # A live hypothesis's log-probability only falls, so its key can at most reach score / the largest lp ahead.
    lp_end = _length_penalty(torch.tensor(max_len, device=device), length_penalty)
    with torch.no_grad(), _stepping(model, partial(_beam_head, beam_size=B)) as candidates:
        for _ in range(max_len):
            tok, logp = candidates((src, prefix))
            tok, logp = tok.view(N, B, B), logp.view(N, B, B)
            # A finished hypothesis offers one candidate, itself plus a pad at no cost, and keeps its length.
            fin = done[..., None]
            step = torch.where(first, 0.0, -math.inf).expand(N, B, B)
            cand = score[..., None] + torch.where(fin, step, logp)
            cand_tok = torch.where(fin, torch.full_like(tok, pad_id), tok)
            cand_len = (length + (~done).long())[..., None].expand(N, B, B)
            cand_done = fin | (cand_tok == eos_id)
            key = cand / _length_penalty(cand_len, length_penalty)
            # A stable sort for the same reason as above: among equal keys the earlier beam and token win.
            pick = key.view(N, B * B).sort(dim=-1, descending=True, stable=True).indices[:, :B]

            def take(t: Tensor, pick: Tensor = pick) -> Tensor:
                return t.reshape(N, B * B).gather(1, pick)

            score, length, done, nxt = take(cand), take(cand_len), take(cand_done), take(cand_tok)
            prefix = torch.cat([prefix[(base + pick // B).view(-1)], nxt.view(-1, 1)], dim=1)
            key = score / _length_penalty(length, length_penalty)
            best_done = torch.where(done, key, -math.inf).amax(dim=1)
            reach = score / torch.maximum(_length_penalty(length + 1, length_penalty), lp_end)
            best_live = torch.where(done, -math.inf, reach).amax(dim=1)
            # A decided row is frozen whole; its live hypotheses can no longer win, so they are dropped rather than
            # grown (-inf: with a negative length_penalty a cut-short hypothesis could otherwise outrank its reach).
            decided = (best_done > best_live)[:, None]
            score = torch.where(decided & ~done, -math.inf, score)
            done |= decided
            if bool(done.all()):
                break
    key = score / _length_penalty(length, length_penalty)
    best = key.argmax(dim=1)
    out = prefix[base[:, 0] + best, 1:]
    return out[:, : int(length.gather(1, best[:, None]).max())]
