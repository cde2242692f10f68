"""The word inventory of the generated translation corpus: nouns, verbs, adjectives and phrases in en, de, fr, es."""

from __future__ import annotations

import re
from typing import NamedTuple

LANGUAGES = ("en", "de", "fr", "es")


class Noun(NamedTuple):
    """One noun in every language, with the gender (m/f/n) that articles and adjectives agree with."""

    en: tuple[str, str]  # (singular, plural)
    de: tuple[str, str, str]  # (singular, plural, gender)
    fr: tuple[str, str, str]
    es: tuple[str, str, str]
    tags: frozenset[str]  # animate, food, readable, openable, thing: which verbs may take it


class Verb(NamedTuple):
    """Finite forms per language; ``de`` and ``fr`` carry the auxiliary of their perfect tense."""

    en: tuple[str, str, str]  # (base, 3rd singular, past)
    de: tuple[str, str, str, str, str]  # (3rd sg, 3rd pl, separable particle or "", participle, haben/sein)
    fr: tuple[str, str, str, str]  # (3rd sg, 3rd pl, participle, avoir/être)
    es: tuple[str, str, str, str]  # (3rd sg present, 3rd pl present, 3rd sg preterite, 3rd pl preterite)
    objects: frozenset[str]  # tags of the nouns it takes as object; empty for the verbs without one


class Adjective(NamedTuple):
    en: str
    de: str  # the stem the endings attach to
    fr: tuple[str, str, bool]  # (masculine, feminine, placed before the noun)
    es: tuple[str, str]  # (masculine, feminine)
    for_people: bool  # colours and weights describe animals and things only


class Phrase(NamedTuple):
    """A fixed phrase (a place, an adverb) per language; ``past`` says which tense an adverb goes with."""

    en: str
    de: str
    fr: str
    es: str
    past: bool = False


def _split(row: str) -> list[list[str]]:
    return [[word.strip() for word in cell.split(",")] for cell in row.split("|")]


def _rows(table: str) -> list[str]:
    """The table's rows; an indented line continues the row above it."""
    return re.sub(r"\n\s+\|", " |", table.strip()).splitlines()


def _nouns(table: str) -> tuple[Noun, ...]:
    rows = []
    for line in _rows(table):
        en, de, fr, es, tags = _split(line)
        noun = Noun(
            (en[0], en[1]), (de[0], de[1], de[2]), (fr[0], fr[1], fr[2]), (es[0], es[1], es[2]), frozenset(tags)
        )
        rows.append(noun)
    return tuple(rows)


def _verbs(table: str) -> tuple[Verb, ...]:
    rows = []
    for line in _rows(table):
        en, de, fr, es, objects = _split(line)
        rows.append(Verb(tuple(en), tuple(de), tuple(fr), tuple(es), frozenset(o for o in objects if o)))  # type: ignore[arg-type]
    return tuple(rows)


def _adjectives(table: str) -> tuple[Adjective, ...]:
    rows = []
    for line in _rows(table):
        en, de, fr, es, people = _split(line)
        rows.append(Adjective(en[0], de[0], (fr[0], fr[1], fr[2] == "pre"), (es[0], es[1]), people == ["people"]))
    return tuple(rows)


def _phrases(table: str) -> tuple[Phrase, ...]:
    rows = []
    for line in _rows(table):
        en, de, fr, es, *tense = (cell[0] for cell in _split(line))
        rows.append(Phrase(en, de, fr, es, tense == ["past"]))
    return tuple(rows)


# en singular, plural | de singular, plural, gender | fr ... | es ... | tags
NOUNS = _nouns("""
dog, dogs | Hund, Hunde, m | chien, chiens, m | perro, perros, m | animate
cat, cats | Katze, Katzen, f | chat, chats, m | gato, gatos, m | animate
bird, birds | Vogel, Vögel, m | oiseau, oiseaux, m | pájaro, pájaros, m | animate
horse, horses | Pferd, Pferde, n | cheval, chevaux, m | caballo, caballos, m | animate
child, children | Kind, Kinder, n | enfant, enfants, m | niño, niños, m | animate, person
woman, women | Frau, Frauen, f | femme, femmes, f | mujer, mujeres, f | animate, person
man, men | Mann, Männer, m | homme, hommes, m | hombre, hombres, m | animate, person
teacher, teachers | Lehrer, Lehrer, m | professeur, professeurs, m | profesor, profesores, m | animate, person
doctor, doctors | Ärztin, Ärztinnen, f | médecin, médecins, m | médica, médicas, f | animate, person
friend, friends | Freund, Freunde, m | ami, amis, m | amigo, amigos, m | animate, person
car, cars | Auto, Autos, n | voiture, voitures, f | coche, coches, m | thing
book, books | Buch, Bücher, n | livre, livres, m | libro, libros, m | thing, readable, openable
letter, letters | Brief, Briefe, m | lettre, lettres, f | carta, cartas, f | thing, readable, openable
newspaper, newspapers | Zeitung, Zeitungen, f | journal, journaux, m | periódico, periódicos, m | thing, readable
apple, apples | Apfel, Äpfel, m | pomme, pommes, f | manzana, manzanas, f | thing, food
egg, eggs | Ei, Eier, n | œuf, œufs, m | huevo, huevos, m | thing, food
bread, breads | Brot, Brote, n | pain, pains, m | pan, panes, m | thing, food
cake, cakes | Kuchen, Kuchen, m | gâteau, gâteaux, m | pastel, pasteles, m | thing, food
house, houses | Haus, Häuser, n | maison, maisons, f | casa, casas, f | thing
table, tables | Tisch, Tische, m | table, tables, f | mesa, mesas, f | thing
key, keys | Schlüssel, Schlüssel, m | clé, clés, f | llave, llaves, f | thing
bag, bags | Tasche, Taschen, f | sac, sacs, m | bolsa, bolsas, f | thing, openable
cup, cups | Tasse, Tassen, f | tasse, tasses, f | taza, tazas, f | thing
flower, flowers | Blume, Blumen, f | fleur, fleurs, f | flor, flores, f | thing
ball, balls | Ball, Bälle, m | balle, balles, f | pelota, pelotas, f | thing
bicycle, bicycles | Fahrrad, Fahrräder, n | vélo, vélos, m | bicicleta, bicicletas, f | thing
picture, pictures | Bild, Bilder, n | tableau, tableaux, m | cuadro, cuadros, m | thing
shoe, shoes | Schuh, Schuhe, m | chaussure, chaussures, f | zapato, zapatos, m | thing
hat, hats | Hut, Hüte, m | chapeau, chapeaux, m | sombrero, sombreros, m | thing
window, windows | Fenster, Fenster, n | fenêtre, fenêtres, f | ventana, ventanas, f | thing, openable
""")

# en base, 3sg, past | de 3sg, 3pl, particle, participle, aux | fr 3sg, 3pl, participle, aux | es ... | object tags
VERBS = _verbs("""
see, sees, saw | sieht, sehen, , gesehen, haben | voit, voient, vu, avoir
    | ve, ven, vio, vieron | animate, thing
buy, buys, bought | kauft, kaufen, , gekauft, haben | achète, achètent, acheté, avoir
    | compra, compran, compró, compraron | thing
find, finds, found | findet, finden, , gefunden, haben | trouve, trouvent, trouvé, avoir
    | encuentra, encuentran, encontró, encontraron | animate, thing
carry, carries, carried | trägt, tragen, , getragen, haben | porte, portent, porté, avoir
    | lleva, llevan, llevó, llevaron | thing
eat, eats, ate | isst, essen, , gegessen, haben | mange, mangent, mangé, avoir
    | come, comen, comió, comieron | food
wash, washes, washed | wäscht, waschen, , gewaschen, haben | lave, lavent, lavé, avoir
    | lava, lavan, lavó, lavaron | animate, thing
look for, looks for, looked for | sucht, suchen, , gesucht, haben | cherche, cherchent, cherché, avoir
    | busca, buscan, buscó, buscaron | animate, thing
love, loves, loved | liebt, lieben, , geliebt, haben | aime, aiment, aimé, avoir
    | ama, aman, amó, amaron | animate, thing
paint, paints, painted | malt, malen, , gemalt, haben | peint, peignent, peint, avoir
    | pinta, pintan, pintó, pintaron | animate, thing
bring, brings, brought | bringt, bringen, , gebracht, haben | apporte, apportent, apporté, avoir
    | trae, traen, trajo, trajeron | thing
open, opens, opened | öffnet, öffnen, , geöffnet, haben | ouvre, ouvrent, ouvert, avoir
    | abre, abren, abrió, abrieron | openable
read, reads, read | liest, lesen, , gelesen, haben | lit, lisent, lu, avoir
    | lee, leen, leyó, leyeron | readable
sell, sells, sold | verkauft, verkaufen, , verkauft, haben | vend, vendent, vendu, avoir
    | vende, venden, vendió, vendieron | thing
""")

# Verbs of motion, dated: German splits off their particle and takes "sein", French takes "être" and agrees.
TRAVEL_VERBS = _verbs("""
arrive, arrives, arrived | kommt, kommen, an, angekommen, sein | arrive, arrivent, arrivé, être
    | llega, llegan, llegó, llegaron |
leave, leaves, left | fährt, fahren, ab, abgefahren, sein | part, partent, parti, être
    | sale, salen, salió, salieron |
come back, comes back, came back | kommt, kommen, zurück, zurückgekommen, sein | revient, reviennent, revenu, être
    | vuelve, vuelven, volvió, volvieron |
""")

COST, SAY = _verbs("""
cost, costs, cost | kostet, kosten, , gekostet, haben | coûte, coûtent, coûté, avoir
    | cuesta, cuestan, costó, costaron |
say, says, said | sagt, sagen, , gesagt, haben | dit, disent, dit, avoir
    | dice, dicen, dijo, dijeron |
""")

# en | de stem | fr masculine, feminine, pre/post | es masculine, feminine | people or things
ADJECTIVES = _adjectives("""
big | groß | grand, grande, pre | grande, grande | people
small | klein | petit, petite, pre | pequeño, pequeña | people
beautiful | schön | joli, jolie, pre | bonito, bonita | people
red | rot | rouge, rouge, post | rojo, roja | things
green | grün | vert, verte, post | verde, verde | things
blue | blau | bleu, bleue, post | azul, azul | things
black | schwarz | noir, noire, post | negro, negra | things
white | weiß | blanc, blanche, post | blanco, blanca | things
yellow | gelb | jaune, jaune, post | amarillo, amarilla | things
fast | schnell | rapide, rapide, post | rápido, rápida | people
heavy | schwer | lourd, lourde, post | pesado, pesada | things
""")

PLACES = _phrases("""
in the garden | im Garten | dans le jardin | en el jardín
in the kitchen | in der Küche | dans la cuisine | en la cocina
in the city | in der Stadt | dans la ville | en la ciudad
in the park | im Park | dans le parc | en el parque
at the station | am Bahnhof | à la gare | en la estación
""")

ADVERBS = _phrases("""
today | heute | aujourd'hui | hoy
now | jetzt | maintenant | ahora
yesterday | gestern | hier | ayer | past
""")

MONTHS = {
    "en": [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ],
    "de": [
        "Januar",
        "Februar",
        "März",
        "April",
        "Mai",
        "Juni",
        "Juli",
        "August",
        "September",
        "Oktober",
        "November",
        "Dezember",
    ],
    "fr": [
        "janvier",
        "février",
        "mars",
        "avril",
        "mai",
        "juin",
        "juillet",
        "août",
        "septembre",
        "octobre",
        "novembre",
        "décembre",
    ],
    "es": [
        "enero",
        "febrero",
        "marzo",
        "abril",
        "mayo",
        "junio",
        "julio",
        "agosto",
        "septiembre",
        "octubre",
        "noviembre",
        "diciembre",
    ],
}
