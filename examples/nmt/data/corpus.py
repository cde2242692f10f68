"""The generated multilingual parallel corpus: random meanings rendered in two languages, pairs mixed by temperature."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from examples.nmt.data.grammar import Clause, NounPhrase, Sentence, render
from examples.nmt.data.lexicon import (
    ADJECTIVES,
    ADVERBS,
    COST,
    LANGUAGES,
    NOUNS,
    PLACES,
    TRAVEL_VERBS,
    VERBS,
    Adjective,
    Noun,
)

# Deliberately unequal, as in multilingual NMT: temperature sampling decides how often the small pairs are seen.
PAIR_SIZES = {"en-de": 200_000, "de-en": 100_000, "en-fr": 50_000, "en-es": 10_000}
DEFAULT_PAIR_SIZE = 20_000
DAYS_IN_MONTH = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
# Streams of the per-example seeds: training and validation sentences are drawn apart.
TRAIN, VAL = 0, 1


def parse_pair(pair: str) -> tuple[str, str]:
    """``"en-de"`` -> ``("en", "de")``, with a clear error for a pair the generator cannot render."""
    source, _, target = pair.partition("-")
    if source not in LANGUAGES or target not in LANGUAGES or source == target:
        raise ValueError(
            f"language pair {pair!r}: write it as 'src-tgt' with two different languages of {list(LANGUAGES)}, "
            "e.g. 'en-de'"
        )
    return source, target


@cache
def _nouns_tagged(tags: frozenset[str]) -> tuple[Noun, ...]:
    return tuple(noun for noun in NOUNS if noun.tags & tags)


@cache
def _adjectives(person: bool) -> tuple[Adjective, ...]:
    return tuple(adj for adj in ADJECTIVES if adj.for_people or not person)


def _count(rng: random.Random) -> int:
    return rng.randint(2, 12) if rng.random() < 0.5 else rng.randint(13, 99)


def _amount(rng: random.Random) -> int:
    r = rng.random()
    return rng.randint(1, 20) if r < 0.3 else rng.randint(21, 99) if r < 0.6 else rng.randint(100, 999)


def _noun_phrase(rng: random.Random, tags: frozenset[str], det: str | None = None, adj: bool = True) -> NounPhrase:
    noun = rng.choice(_nouns_tagged(tags))
    adjective = rng.choice(_adjectives("person" in noun.tags)) if adj and rng.random() < 0.4 else None
    r = rng.random() if det is None else {"def": 0.0, "indef": 0.6}[det]
    if r < 0.5:
        return NounPhrase(noun, "def", rng.random() < 0.3, adj=adjective)
    if r < 0.75:
        return NounPhrase(noun, "indef", False, adj=adjective)
    return NounPhrase(noun, "num", True, _count(rng), adjective)


def _clause(rng: random.Random) -> Clause:
    past, r = rng.random() < 0.4, rng.random()
    animate = frozenset({"animate"})
    if r < 0.6:
        verb = rng.choice(VERBS)
        negated = rng.random() < 0.2
        # A negated object is a definite one: "does not see the car", not "does not see three cars".
        obj = _noun_phrase(rng, verb.objects, "def" if negated else None)
        place = rng.choice(PLACES) if rng.random() < 0.3 else None
        subject = _noun_phrase(rng, animate)
        return Clause("action", subject, verb, past, negated, obj=obj, place=place)
    if r < 0.8:
        subject = _noun_phrase(rng, frozenset({"thing"}), rng.choice(("def", "indef")))
        return Clause("price", subject, COST, past, amount=_amount(rng))
    month = rng.randrange(12)
    subject = _noun_phrase(rng, animate)
    verb = rng.choice(TRAVEL_VERBS)
    day = rng.randint(1, DAYS_IN_MONTH[month])
    return Clause("travel", subject, verb, past, rng.random() < 0.1, day=day, month=month)


def sample_sentence(rng: random.Random) -> Sentence:
    """A random meaning: a clause, perhaps fronted by an adverb of its tense or reported by a speaker."""
    clause = _clause(rng)
    if rng.random() < 0.25:
        speaker = _noun_phrase(rng, frozenset({"animate"}), rng.choice(("def", "indef")), adj=False)
        past = rng.random() < 0.4
        adverb = rng.choice([a for a in ADVERBS if a.past == past]) if rng.random() < 0.2 else None
        return Sentence(clause, adverb, speaker, past)
    adverb = rng.choice([a for a in ADVERBS if a.past == clause.past]) if rng.random() < 0.3 else None
    return Sentence(clause, adverb)


def generate_pair(seed: int, stream: int, pair: str, index: int) -> tuple[str, str]:
    """Example ``index`` of ``pair`` (e.g. ``"en-de"``): (source, target), a pure function of its arguments.

    Seeded from a string, which Python hashes with SHA-512 whatever PYTHONHASHSEED: every process renders the same.
    """
    source, target = parse_pair(pair)
    sentence = sample_sentence(random.Random(f"{seed}/{stream}/{pair}/{index}"))
    return render(sentence, source), render(sentence, target)


def pair_probabilities(sizes: Sequence[int], temperature: float) -> np.ndarray:
    """p_i ∝ n_i^(1/T) (GPipe/M4): T = 1 samples in proportion to the data, T -> ∞ uniformly."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (1 = proportional, larger = flatter, inf = uniform)")
    if not sizes or min(sizes) < 1:
        raise ValueError(f"pair sizes {list(sizes)}: every pair needs at least one example")
    if math.isinf(temperature):
        return np.full(len(sizes), 1 / len(sizes))
    logits = np.log(np.asarray(sizes, dtype=np.float64)) / temperature
    weights = np.exp(logits - logits.max())
    return weights / weights.sum()


@dataclass
class ParallelText:
    """Raw sentence pairs of one split, with each example's language pair (``"en-de"``: its ``<2de>`` token)."""

    sources: list[str]
    targets: list[str]
    pairs: list[str]

    def __len__(self) -> int:
        return len(self.sources)

    def subset(self, keep: Sequence[int]) -> ParallelText:
        return ParallelText(
            [self.sources[i] for i in keep], [self.targets[i] for i in keep], [self.pairs[i] for i in keep]
        )


def draw_train(seed: int, pairs: Sequence[str], sizes: Sequence[int], temperature: float, size: int) -> np.ndarray:
    """(pair id, index within the pair) of each of ``size`` training examples, [size, 2]: pair by temperature,
    index uniform over the pair's ``n_i`` examples (so a small pair's examples repeat when it is sampled up)."""
    rng = np.random.default_rng([seed, TRAIN])
    chosen = rng.choice(len(pairs), size=size, p=pair_probabilities(sizes, temperature))
    within = np.floor(rng.random(size) * np.asarray(sizes)[chosen]).astype(np.int64)
    return np.stack([chosen, within], axis=1)


def generated_text(seed: int, stream: int, pairs: Sequence[str], draws: np.ndarray) -> ParallelText:
    """Renders the examples ``draws`` ([n, 2] of pair id, index) of a stream."""
    text = ParallelText([], [], [])
    for pair_id, index in draws.tolist():
        source, target = generate_pair(seed, stream, pairs[pair_id], index)
        text.sources.append(source)
        text.targets.append(target)
        text.pairs.append(pairs[pair_id])
    return text


def generated_val(seed: int, pairs: Sequence[str], size: int) -> ParallelText:
    """``size`` validation examples, the pairs in turn so that each gets an equal share for its own BLEU."""
    draws = np.stack([np.arange(size) % len(pairs), np.arange(size) // len(pairs)], axis=1)
    return generated_text(seed, VAL, pairs, draws)
