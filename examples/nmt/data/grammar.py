"""Meanings of generated sentences and their rendering in en, de, fr and es by each language's word order and agreement.

The rules are simplified but systematic: German puts the finite verb second in main clauses and last in subordinate
ones (with participles and separable particles at the end), inflects articles and adjectives for case and gender and
says "vier und zwanzig"; French and Spanish put most adjectives after the noun, agree them in gender and number,
count "quatre-vingt-dix" and "veintiún"; Spanish marks animate objects with "a"; English needs "do" to negate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from examples.nmt.data.lexicon import MONTHS, SAY, Adjective, Noun, Phrase, Verb
from examples.nmt.data.numbers import (
    de_cardinal,
    de_ordinal,
    en_cardinal,
    en_ordinal,
    es_cardinal,
    es_day,
    fr_cardinal,
    fr_day,
)

Determiner = Literal["def", "indef", "num"]


@dataclass(frozen=True)
class NounPhrase:
    noun: Noun
    det: Determiner
    plural: bool
    count: int = 1  # how many, for det == "num"
    adj: Adjective | None = None


@dataclass(frozen=True)
class Clause:
    """One clause: subject verb object [place] (action), subject costs N euros (price), subject arrives on a date."""

    kind: Literal["action", "price", "travel"]
    subject: NounPhrase
    verb: Verb
    past: bool = False
    negated: bool = False
    obj: NounPhrase | None = None
    place: Phrase | None = None
    amount: int = 0
    day: int = 1
    month: int = 0


@dataclass(frozen=True)
class Sentence:
    """A clause, either fronted by an adverb or reported: "the man says that <clause>"."""

    clause: Clause
    adverb: Phrase | None = None
    speaker: NounPhrase | None = None
    speaker_past: bool = False


def _join(words: list[str]) -> str:
    return " ".join(words).replace(" ,", ",") + "."


# ------------------------------------------------------------------------------------------------------- English
def _en_np(np_: NounPhrase) -> list[str]:
    words = ([np_.adj.en] if np_.adj else []) + [np_.noun.en[np_.plural]]
    if np_.det == "def":
        return ["the", *words]
    if np_.det == "num":
        return [en_cardinal(np_.count), *words]
    return ["an" if words[0][0] in "aeiou" else "a", *words]


def _en_clause(c: Clause) -> list[str]:
    base, third, past = c.verb.en
    singular = not c.subject.plural
    if c.negated:
        verb = ["did" if c.past else "does" if singular else "do", "not", base]
    else:
        verb = [past if c.past else third if singular else base]
    if c.kind == "action":
        assert c.obj is not None
        rest = _en_np(c.obj) + (c.place.en.split() if c.place else [])
    elif c.kind == "price":
        rest = [en_cardinal(c.amount), "euro" if c.amount == 1 else "euros"]
    else:
        rest = ["on", "the", en_ordinal(c.day), "of", MONTHS["en"][c.month]]
    return _en_np(c.subject) + verb + rest


def render_en(s: Sentence) -> str:
    words = [s.adverb.en] if s.adverb else []
    if s.speaker:
        say = SAY.en[2] if s.speaker_past else SAY.en[0] if s.speaker.plural else SAY.en[1]
        words += [*_en_np(s.speaker), say, "that"]
    return _join(words + _en_clause(s.clause))


# -------------------------------------------------------------------------------------------------------- German
_DE_ARTICLES = {  # (determiner, case) -> m, f, n, plural
    ("def", "nom"): ("der", "die", "das", "die"),
    ("def", "acc"): ("den", "die", "das", "die"),
    ("indef", "nom"): ("ein", "eine", "ein", ""),
    ("indef", "acc"): ("einen", "eine", "ein", ""),
}
_DE_ENDINGS = {  # weak after der/die/das, mixed after ein, strong without an article
    ("def", "nom"): ("e", "e", "e", "en"),
    ("def", "acc"): ("en", "e", "e", "en"),
    ("indef", "nom"): ("er", "e", "es", "e"),
    ("indef", "acc"): ("en", "e", "es", "e"),
    ("num", "nom"): ("e", "e", "e", "e"),
    ("num", "acc"): ("e", "e", "e", "e"),
}


def _de_np(np_: NounPhrase, case: str) -> list[str]:
    singular, plural, gender = np_.noun.de
    slot = 3 if np_.plural else "mfn".index(gender)
    words = [f"{np_.adj.de}{_DE_ENDINGS[np_.det, case][slot]}"] if np_.adj else []
    words.append(plural if np_.plural else singular)
    if np_.det == "num":
        return [*de_cardinal(np_.count).split(), *words]
    return [_DE_ARTICLES[np_.det, case][slot], *words]


def _de_verb(verb: Verb, plural: bool, past: bool) -> tuple[str, list[str]]:
    """(finite verb, right bracket): the perfect's participle or the particle of a separable verb goes last."""
    sg, pl, particle, participle, aux = verb.de
    if past:
        return {"haben": ("hat", "haben"), "sein": ("ist", "sind")}[aux][plural], [participle]
    return (pl if plural else sg), ([particle] if particle else [])


def _de_parts(c: Clause) -> tuple[list[str], str, list[str], list[str]]:
    """(subject, finite verb, middle field, right bracket): the fields that main and subordinate clauses order."""
    finite, right = _de_verb(c.verb, c.subject.plural, c.past)
    if c.kind == "action":
        assert c.obj is not None
        middle = _de_np(c.obj, "acc") + (c.place.de.split() if c.place else [])
    elif c.kind == "price":
        middle = [*de_cardinal(c.amount).split(), "Euro"]
    else:
        middle = ["am", *de_ordinal(c.day).split(), MONTHS["de"][c.month]]
    if c.negated:
        middle.append("nicht")
    return _de_np(c.subject, "nom"), finite, middle, right


def _de_main(c: Clause, adverb: Phrase | None) -> list[str]:
    subject, finite, middle, right = _de_parts(c)
    if adverb:  # verb second: the adverb takes the first place and the subject moves behind the verb
        return [adverb.de, finite, *subject, *middle, *right]
    return [*subject, finite, *middle, *right]


def _de_subordinate(c: Clause) -> list[str]:
    subject, finite, middle, right = _de_parts(c)
    if right and not c.past:  # the separable particle joins its verb again at the end: ... ankommt
        return [*subject, *middle, right[0] + finite]
    return [*subject, *middle, *right, finite]


def render_de(s: Sentence) -> str:
    if not s.speaker:
        return _join(_de_main(s.clause, s.adverb))
    subject = _de_np(s.speaker, "nom")
    finite, right = _de_verb(SAY, s.speaker.plural, s.speaker_past)
    head = [s.adverb.de, finite, *subject] if s.adverb else [*subject, finite]
    return _join([*head, *right, ",", "dass", *_de_subordinate(s.clause)])


# -------------------------------------------------------------------------------------------------------- French
_FR_VOWELS = tuple("aeiouyéèêœh")
_FR_NO_ELISION = ("huit", "onze")  # le huit juin, le onze mai


def _fr_elide(words: list[str]) -> list[str]:
    """le, la, ne, que before a vowel: l'oiseau, n'a, qu'un."""
    out: list[str] = []
    for word in words:
        if out and out[-1] in ("le", "la", "ne", "que") and word.startswith(_FR_VOWELS) and word not in _FR_NO_ELISION:
            out[-1] = out[-1][:-1] + "'" + word
        else:
            out.append(word)
    return out


def _fr_np(np_: NounPhrase) -> list[str]:
    singular, plural, gender = np_.noun.fr
    feminine = gender == "f"
    words = [plural if np_.plural else singular]
    if np_.adj:
        masculine, female, before = np_.adj.fr
        adj = female if feminine else masculine
        adj += "s" if np_.plural and not adj.endswith(("s", "x")) else ""
        words = [adj, *words] if before else [*words, adj]
    if np_.det == "num":
        return [*fr_cardinal(np_.count, feminine).split(), *words]
    if np_.det == "indef":
        return ["une" if feminine else "un", *words]
    return ["les" if np_.plural else "la" if feminine else "le", *words]


def _fr_clause(c: Clause) -> list[str]:
    sg, pl, participle, aux = c.verb.fr
    if c.past:
        if aux == "être":  # the participle agrees with the subject: elle est arrivée, ils sont partis
            participle += ("e" if c.subject.noun.fr[2] == "f" else "") + ("s" if c.subject.plural else "")
            verb = ["sont" if c.subject.plural else "est", participle]
        else:
            verb = ["ont" if c.subject.plural else "a", participle]
    else:
        verb = [pl if c.subject.plural else sg]
    if c.negated:
        verb = ["ne", verb[0], "pas", *verb[1:]]
    if c.kind == "action":
        assert c.obj is not None
        rest = _fr_np(c.obj) + (c.place.fr.split() if c.place else [])
    elif c.kind == "price":
        rest = [*fr_cardinal(c.amount).split(), "euro" if c.amount == 1 else "euros"]
    else:
        rest = ["le", *fr_day(c.day).split(), MONTHS["fr"][c.month]]
    return _fr_np(c.subject) + verb + rest


def render_fr(s: Sentence) -> str:
    words = [s.adverb.fr] if s.adverb else []
    if s.speaker:
        if s.speaker_past:
            say = ["ont" if s.speaker.plural else "a", SAY.fr[2]]
        else:
            say = [SAY.fr[1] if s.speaker.plural else SAY.fr[0]]
        words += [*_fr_np(s.speaker), *say, "que"]
    return _join(_fr_elide(words + _fr_clause(s.clause)))


# ------------------------------------------------------------------------------------------------------- Spanish
def _es_np(np_: NounPhrase) -> list[str]:
    singular, plural, gender = np_.noun.es
    feminine = gender == "f"
    words = [plural if np_.plural else singular]
    if np_.adj:
        adj = np_.adj.es[feminine]
        if np_.plural:
            adj += "s" if adj[-1] in "aeiou" else "es"
        words.append(adj)
    if np_.det == "num":
        return [*es_cardinal(np_.count, feminine).split(), *words]
    if np_.det == "indef":
        return ["una" if feminine else "un", *words]
    article = ("las" if feminine else "los") if np_.plural else ("la" if feminine else "el")
    return [article, *words]


def _es_clause(c: Clause) -> list[str]:
    forms = c.verb.es
    verb = [forms[2 * c.past + c.subject.plural]]
    if c.negated:
        verb = ["no", *verb]
    if c.kind == "action":
        assert c.obj is not None
        obj = _es_np(c.obj)
        if "animate" in c.obj.noun.tags:  # the personal "a" before people and animals; a + el contracts to al
            obj = ["al", *obj[1:]] if obj[0] == "el" else ["a", *obj]
        rest = obj + (c.place.es.split() if c.place else [])
    elif c.kind == "price":
        rest = [*es_cardinal(c.amount).split(), "euro" if c.amount == 1 else "euros"]
    else:
        rest = ["el", *es_day(c.day).split(), "de", MONTHS["es"][c.month]]
    return _es_np(c.subject) + verb + rest


def render_es(s: Sentence) -> str:
    words = [s.adverb.es] if s.adverb else []
    if s.speaker:
        words += [*_es_np(s.speaker), SAY.es[2 * s.speaker_past + s.speaker.plural], "que"]
    return _join(words + _es_clause(s.clause))


RENDER = {"en": render_en, "de": render_de, "fr": render_fr, "es": render_es}


def render(sentence: Sentence, language: str) -> str:
    """``sentence`` in ``language`` (one of en, de, fr, es)."""
    return RENDER[language](sentence)
