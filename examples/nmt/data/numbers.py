"""Numbers 1..999 and days of the month spelled out by each language's own rules (en, de, fr, es)."""

from __future__ import annotations

EN_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
EN_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
EN_ORDINALS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth", "nine": "ninth"}

DE_ONES = [
    "null",
    "eins",
    "zwei",
    "drei",
    "vier",
    "fünf",
    "sechs",
    "sieben",
    "acht",
    "neun",
    "zehn",
    "elf",
    "zwölf",
    "dreizehn",
    "vierzehn",
    "fünfzehn",
    "sechzehn",
    "siebzehn",
    "achtzehn",
    "neunzehn",
]
DE_TENS = ("", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig")
DE_ORDINALS = {1: "ersten", 3: "dritten", 7: "siebten", 8: "achten"}

FR_ONES = [
    "zéro",
    "un",
    "deux",
    "trois",
    "quatre",
    "cinq",
    "six",
    "sept",
    "huit",
    "neuf",
    "dix",
    "onze",
    "douze",
    "treize",
    "quatorze",
    "quinze",
    "seize",
    "dix-sept",
    "dix-huit",
    "dix-neuf",
]
FR_TENS = ("", "", "vingt", "trente", "quarante", "cinquante", "soixante")

ES_ONES = [
    "cero",
    "uno",
    "dos",
    "tres",
    "cuatro",
    "cinco",
    "seis",
    "siete",
    "ocho",
    "nueve",
    "diez",
    "once",
    "doce",
    "trece",
    "catorce",
    "quince",
    "dieciséis",
    "diecisiete",
    "dieciocho",
    "diecinueve",
    "veinte",
    "veintiuno",
    "veintidós",
    "veintitrés",
    "veinticuatro",
    "veinticinco",
    "veintiséis",
    "veintisiete",
    "veintiocho",
    "veintinueve",
]
ES_TENS = ("", "", "", "treinta", "cuarenta", "cincuenta", "sesenta", "setenta", "ochenta", "noventa")
ES_HUNDREDS = (
    "",
    "ciento",
    "doscientos",
    "trescientos",
    "cuatrocientos",
    "quinientos",
    "seiscientos",
    "setecientos",
    "ochocientos",
    "novecientos",
)


def _check(n: int, high: int = 999) -> None:
    if not 1 <= n <= high:
        raise ValueError(f"only numbers 1..{high} are spelled out, got {n}")


def en_cardinal(n: int) -> str:
    """Twenty-four, three hundred and five."""
    _check(n)
    hundreds, rest = divmod(n, 100)
    if hundreds:
        return f"{EN_ONES[hundreds]} hundred" + (f" and {en_cardinal(rest)}" if rest else "")
    if n < 20:
        return EN_ONES[n]
    tens, ones = divmod(n, 10)
    return EN_TENS[tens] + (f"-{EN_ONES[ones]}" if ones else "")


def en_ordinal(n: int) -> str:
    """The day of a date: first, twelfth, twenty-third, thirtieth."""
    _check(n, 31)
    head, sep, last = en_cardinal(n).rpartition("-")
    if last in EN_ORDINALS:
        last = EN_ORDINALS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    elif last == "twelve":
        last = "twelfth"
    else:
        last += "th"
    return head + sep + last


def _de_below_100(n: int) -> str:
    if n < 20:
        return DE_ONES[n]
    tens, ones = divmod(n, 10)
    # Units first, joined by "und"; written apart here so that the reordering against English stays visible.
    return f"{'ein' if ones == 1 else DE_ONES[ones]} und {DE_TENS[tens]}" if ones else DE_TENS[tens]


def de_cardinal(n: int, before_noun: bool = True) -> str:
    """Vier und zwanzig, drei hundert fünf; a lone 1 before a noun is "ein"."""
    _check(n)
    if n == 1:
        return "ein" if before_noun else "eins"
    hundreds, rest = divmod(n, 100)
    if not hundreds:
        return _de_below_100(n)
    head = "hundert" if hundreds == 1 else f"{DE_ONES[hundreds]} hundert"
    return head + (f" {_de_below_100(rest)}" if rest else "")


def de_ordinal(n: int) -> str:
    """The day after "am" (dative): ersten, dritten, zwanzigsten, ein und zwanzigsten."""
    _check(n, 31)
    if n < 20:
        return DE_ORDINALS.get(n, DE_ONES[n] + "ten")
    return _de_below_100(n) + "sten"


def _fr_below_100(n: int, feminine: bool) -> str:
    one = "une" if feminine else "un"
    if n < 20:
        return one if n == 1 else FR_ONES[n]
    tens, ones = divmod(n, 10)
    if tens in (7, 9):  # counted on from sixty and from four-twenties: soixante-treize, quatre-vingt-dix
        base = "soixante" if tens == 7 else "quatre-vingt"
        return f"{base} et onze" if n == 71 else f"{base}-{FR_ONES[10 + ones]}"
    if tens == 8:
        return "quatre-vingts" if not ones else f"quatre-vingt-{one if ones == 1 else FR_ONES[ones]}"
    if not ones:
        return FR_TENS[tens]
    return f"{FR_TENS[tens]} et {one}" if ones == 1 else f"{FR_TENS[tens]}-{FR_ONES[ones]}"


def fr_cardinal(n: int, feminine: bool = False) -> str:
    """Vingt-quatre, soixante et onze, quatre-vingt-dix-sept, deux cents, deux cent un."""
    _check(n)
    hundreds, rest = divmod(n, 100)
    if not hundreds:
        return _fr_below_100(n, feminine)
    head = "cent" if hundreds == 1 else f"{FR_ONES[hundreds]} cent" + ("" if rest else "s")
    return head + (f" {_fr_below_100(rest, feminine)}" if rest else "")


def fr_day(n: int) -> str:
    """Days are cardinal, save the first: le premier mai, le deux mai."""
    _check(n, 31)
    return "premier" if n == 1 else fr_cardinal(n)


def _es_below_100(n: int) -> str:
    if n < 30:
        return ES_ONES[n]
    tens, ones = divmod(n, 10)
    return f"{ES_TENS[tens]} y {ES_ONES[ones]}" if ones else ES_TENS[tens]


def es_cardinal(n: int, feminine: bool = False, before_noun: bool = True) -> str:
    """Veinticuatro, treinta y un libros, veintiuna casas, doscientas mesas, cien, ciento cinco."""
    _check(n)
    hundreds, rest = divmod(n, 100)
    if n == 100:
        return "cien"
    words = ([ES_HUNDREDS[hundreds]] if hundreds else []) + (_es_below_100(rest).split() if rest else [])
    if feminine:
        words = [w.replace("ientos", "ientas") for w in words]
    if before_noun or feminine:  # a final "uno" agrees with the noun it counts
        last = words[-1]
        if last == "uno":
            words[-1] = "una" if feminine else "un"
        elif last == "veintiuno":
            words[-1] = "veintiuna" if feminine else "veintiún"
    return " ".join(words)


def es_day(n: int) -> str:
    """Days are cardinal, save the first: el primero de mayo, el veintiuno de mayo."""
    _check(n, 31)
    return "primero" if n == 1 else es_cardinal(n, before_noun=False)
