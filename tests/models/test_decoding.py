"""Greedy and beam decoding: EOS and padding, beam of one is greedy, beam search finds what greedy misses."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from lightning_gpipe.models import beam_decode, greedy_decode
from lightning_gpipe.models.transformer import next_token_logits
from tests.helpers.transformer import BOS, EOS, PAD, V, batch, tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Scripted:
    """A stand-in model: row n says token 3 + n until step eos_at[n], where it says EOS (or never, if None).

    Under beam search row n is the rows n·beam … n·beam + beam - 1; ``margin`` is the logit of the scripted token.
    """

    def __init__(self, eos_at: list[int | None], margin: float = 1.0) -> None:
        self.eos_at, self.margin, self.calls = eos_at, margin, 0

    def __call__(self, x: tuple[Tensor, Tensor]) -> Tensor:
        src, prefix = x
        self.calls += 1
        step, beam = prefix.shape[1] - 1, src.shape[0] // len(self.eos_at)
        logits = torch.zeros(src.shape[0], prefix.shape[1], V)
        for r in range(src.shape[0]):
            n = r // beam
            logits[r, -1, EOS if self.eos_at[n] == step else 3 + n] = self.margin
        return logits


def test_greedy_decode_stops_at_eos_and_pads() -> None:
    src = torch.ones(3, 4, dtype=torch.long)
    model = Scripted([1, 3, 0])
    out = greedy_decode(model, src, BOS, EOS, max_len=10)
    assert model.calls == 4 and out.shape == (3, 4)
    assert out.tolist() == [[3, EOS, PAD, PAD], [4, 4, 4, EOS], [EOS, PAD, PAD, PAD]]
    never = Scripted([None, 2, None])
    out = greedy_decode(never, src, BOS, EOS, max_len=6)
    assert never.calls == 6 and out.shape == (3, 6) and out[1].tolist() == [4, 4, EOS, PAD, PAD, PAD]


def test_greedy_decode_equals_step_by_step_reference() -> None:
    model = tiny(seed=3).eval()
    src, _, _ = batch(4, 7, 2, seed=4)
    with torch.no_grad():  # the most likely first token of row 0 plays EOS, so some rows end early
        eos = int(model((src, torch.full((4, 1), BOS)))[0, -1].argmax())
    out = greedy_decode(model, src, BOS, eos, max_len=8)
    assert out.shape[1] <= 8 and out[0, 0] == eos
    for n in range(4):  # each row alone, unpadded, one token at a time
        s = src[n : n + 1, : int((src[n] != PAD).sum())]
        gen: list[int] = []
        with torch.no_grad():
            while len(gen) < out.shape[1] and eos not in gen:
                gen.append(int(model((s, torch.tensor([[BOS, *gen]])))[0, -1].argmax()))
        assert out[n].tolist() == gen + [PAD] * (out.shape[1] - len(gen)), n
    assert out.shape[1] == 8 or (out == eos).any(dim=1).all()  # stopped early only when every row had ended


class Tree:
    """A stand-in model with hand-set next-token probabilities: ``probs(src_ids[n, 0], tokens after BOS)``.

    The rest of the probability mass is spread evenly over the other tokens of a vocabulary of 8.
    """

    def __init__(self, probs: Callable[[int, tuple[int, ...]], dict[int, float]]) -> None:
        self.probs, self.shapes = probs, []

    def __call__(self, x: tuple[Tensor, Tensor]) -> Tensor:
        src, prefix = x
        self.shapes.append((tuple(src.shape), tuple(prefix.shape)))
        logits = torch.zeros(*prefix.shape, 8)
        for r, row in enumerate(prefix.tolist()):
            p = self.probs(int(src[r, 0]), tuple(row[1:]))
            dist = torch.full((8,), (1 - sum(p.values())) / (8 - len(p)))
            dist[list(p)] = torch.tensor(list(p.values()))
            logits[r, -1] = dist.log()
        return logits


@pytest.mark.timeout(60)
def test_beam_of_one_is_greedy() -> None:
    model = tiny(seed=3).eval()
    src, _, _ = batch(4, 7, 2, seed=4)
    with torch.no_grad():  # as in the greedy test: some rows end early
        eos = int(model((src, torch.full((4, 1), BOS)))[0, -1].argmax())
    out = beam_decode(model, src, BOS, eos, max_len=8, beam_size=1)
    assert torch.equal(out, greedy_decode(model, src, BOS, eos, max_len=8))
    for eos_at, max_len in (([1, 3, 0], 10), ([None, 2, None], 6)):
        greedy, beam = Scripted(eos_at), Scripted(eos_at)
        ref = greedy_decode(greedy, src[:3], BOS, EOS, max_len=max_len)
        assert torch.equal(beam_decode(beam, src[:3], BOS, EOS, max_len=max_len, beam_size=1), ref)
        assert beam.calls == greedy.calls


@pytest.mark.timeout(60)
def test_beam_finds_the_path_greedy_misses() -> None:
    """Source 1: 3 (0.5) then EOS (0.35) is greedy's, 4 (0.4) then EOS (0.9) the better; source 2: greedy is right."""
    tables = {
        1: {(): {3: 0.5, 4: 0.4}, (3,): {EOS: 0.35, 5: 0.3}, (4,): {EOS: 0.9}},
        2: {(): {3: 0.6}, (3,): {EOS: 0.9}},
    }
    model = Tree(lambda s, prefix: tables[s].get(prefix, {EOS: 0.9}))
    src = torch.tensor([[1, 5, 6], [2, 5, 6]])
    assert greedy_decode(model, src, BOS, EOS, max_len=6).tolist() == [[3, EOS], [3, EOS]]
    model.shapes.clear()
    assert beam_decode(model, src, BOS, EOS, max_len=6, beam_size=2).tolist() == [[4, EOS], [3, EOS]]
    # Both beams of both rows finished after two steps; the model saw every beam of every sentence.
    assert model.shapes == [((4, 3), (4, 1)), ((4, 3), (4, 2))]


@pytest.mark.timeout(60)
def test_beam_length_penalty_decides_between_short_and_long() -> None:
    """EOS at once (0.5) against 3 3 3 3 EOS (0.45 · 0.9⁴ ≈ 0.30): the raw and GNMT's α = 0.6 prefer the short one,
    α = 2 divides the long one's log-probability by (10/6)² and prefers it."""

    def probs(_: int, prefix: tuple[int, ...]) -> dict[int, float]:
        if not prefix:
            return {EOS: 0.5, 3: 0.45}
        return {EOS: 0.9} if prefix == (3, 3, 3, 3) else {3: 0.9, EOS: 0.05}

    src = torch.ones(1, 2, dtype=torch.long)
    for alpha, want in ((0.0, [EOS]), (0.6, [EOS]), (2.0, [3, 3, 3, 3, EOS])):
        out = beam_decode(Tree(probs), src, BOS, EOS, max_len=8, beam_size=2, length_penalty=alpha)
        assert out.tolist() == [want], alpha


@pytest.mark.timeout(60)
def test_beam_decode_stops_at_eos_and_pads() -> None:
    """A confident model: every row stops at its EOS as greedy does, the rest padded, or runs to max_len."""
    src = torch.ones(3, 4, dtype=torch.long)
    model = Scripted([1, 3, 0], margin=20.0)
    out = beam_decode(model, src, BOS, EOS, max_len=10, beam_size=3)
    assert model.calls == 4 and out.tolist() == [[3, EOS, PAD, PAD], [4, 4, 4, EOS], [EOS, PAD, PAD, PAD]]
    never = Scripted([None, 2, None], margin=20.0)
    out = beam_decode(never, src, BOS, EOS, max_len=6, beam_size=3, pad_id=7)
    assert never.calls == 6 and out.tolist() == [[3] * 6, [4, 4, EOS, 7, 7, 7], [5] * 6]
    with pytest.raises(ValueError, match="beam_size"):
        beam_decode(never, src, BOS, EOS, max_len=6, beam_size=0)


@pytest.mark.timeout(60)
def test_next_token_logits_decode_the_same_from_one_position() -> None:
    """Under next_token_logits the model returns [N, 1, vocab] (what a pipeline's last stage then sends to the
    others per token), and greedy and beam decoding give the same translations as from the full [N, t, vocab]."""
    model = tiny(seed=3).eval()
    src, _, _ = batch(4, 7, 2, seed=4)
    with torch.no_grad():
        eos = int(model((src, torch.full((4, 1), BOS)))[0, -1].argmax())
    shapes = []
    full = (greedy_decode(model, src, BOS, eos, max_len=8), beam_decode(model, src, BOS, eos, max_len=8))

    def recorded(x: tuple[Tensor, Tensor]) -> Tensor:
        out = model(x)
        shapes.append(tuple(out.shape))
        return out

    with next_token_logits(model):
        one = (greedy_decode(recorded, src, BOS, eos, max_len=8), beam_decode(recorded, src, BOS, eos, max_len=8))
    assert torch.equal(full[0], one[0]) and torch.equal(full[1], one[1])
    assert shapes and all(shape[1] == 1 for shape in shapes), shapes
    assert model((src, torch.full((4, 3), BOS))).shape[1] == 3  # back to every position afterwards
