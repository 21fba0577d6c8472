"""Capo: knowledge capacity with synthetic biographies (bioS), or user-supplied ones (bioR).

A population of ``individuals`` people with unique full names (first, middle, last) and six
attributes: birthday, birth city, university, field of study, employer and the employer's city
(spec 6.3). A bioS biography states each attribute in exactly one sentence, each drawn from
about 60 templates per attribute (``capo_fields/templates_*.txt``, written for this project). The
first sentence names the person in full, later ones use He/She (He for even ids, as in the
reference). ``permute`` shuffles the sentence order per biography (knowledge augmentation);
``multiplicity`` fixes how many distinct biographies each person has (0: a fresh one every time).

bioR: a JSON-lines file of biographies written elsewhere (e.g. by an LLM from ``bior_prompt``),
``{"id": person_id, "text": ...}`` per line, for people of the same population.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from synthetic_data.common import TaskParamError

FIELDS_DIR = Path(__file__).parent / "capo_fields"
ATTRIBUTES = ("birthday", "birth_city", "university", "field", "company", "company_city")
MONTHS = (
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
)


@dataclass
class CapoParams:
    individuals: int = 1000
    """Size of the population (every training sample is about one of them)."""
    population_seed: int = 0
    """Seed of the population itself: the same for every rank and every run that shares it."""
    min_year: int = 1900
    max_year: int = 2099
    permute: bool = True
    """Shuffle the sentence order of each biography (the full name moves to the first sentence)."""
    multiplicity: int = 5
    """Distinct biographies per person; 0 draws fresh templates for every training sample."""
    bior_path: str | None = None
    """JSON lines of biographies ({"id": person id, "text": ...}) to train on instead of bioS."""


CAPO = CapoParams()


@dataclass(frozen=True)
class Person:
    id: int
    first: str
    middle: str
    last: str
    birthday: str
    birth_city: str
    university: str
    field: str
    company: str
    company_city: str

    @property
    def name(self) -> str:
        return f"{self.first} {self.middle} {self.last}"

    @property
    def pronoun(self) -> str:
        return "He" if self.id % 2 == 0 else "She"

    @property
    def possessive(self) -> str:
        return "his" if self.id % 2 == 0 else "her"


@lru_cache(maxsize=None)
def word_list(name: str) -> tuple[str, ...]:
    lines = (FIELDS_DIR / f"{name}.txt").read_text(encoding="utf-8").splitlines()
    return tuple(line.strip() for line in lines if line.strip())


@lru_cache(maxsize=None)
def templates(attribute: str) -> tuple[str, ...]:
    return word_list(f"templates_{attribute}")


def unique_names(rng: random.Random, count: int) -> list[tuple[str, str, str]]:
    """``count`` distinct (first, middle, last) names drawn from the lists."""
    first, middle, last = (
        word_list("first_names"),
        word_list("middle_names"),
        word_list("last_names"),
    )
    if count > len(first) * len(middle) * len(last) // 2:
        raise ValueError(f"{count} people are too many for the name lists")
    names: dict[tuple[str, str, str], None] = {}
    while len(names) < count:
        names.setdefault((rng.choice(first), rng.choice(middle), rng.choice(last)))
    return list(names)


def population(params: CapoParams) -> list[Person]:
    """The people, deterministic from ``population_seed``; full names are unique."""
    if params.min_year > params.max_year:
        raise TaskParamError(
            "max_year", f"is {params.max_year}, below min_year = {params.min_year}"
        )
    rng = random.Random(f"capo-population/{params.population_seed}")
    try:
        names = unique_names(rng, params.individuals)
    except ValueError as e:
        raise TaskParamError("individuals", str(e)) from None
    cities, companies = word_list("cities"), word_list("companies")
    universities, fields = word_list("universities"), word_list("fields")
    people = []
    for name in names:
        company, company_city = (part.strip() for part in rng.choice(companies).split(";"))
        birthday = (
            f"{rng.choice(MONTHS)} {rng.randint(1, 28)}, "
            f"{rng.randint(params.min_year, params.max_year)}"
        )
        people.append(
            Person(
                len(people),
                *name,
                birthday=birthday,
                birth_city=rng.choice(cities),
                university=rng.choice(universities),
                field=rng.choice(fields),
                company=company,
                company_city=company_city,
            )
        )
    return people


def render(template: str, person: Person, subject: str) -> str:
    return template.replace("{subject}", subject).replace("{his}", person.possessive)


def sentence(template: str, person: Person, attribute: str, subject: str) -> tuple[str, int]:
    """The sentence and where the attribute's value starts in it."""
    before, after = template.split("{value}")
    value = getattr(person, attribute)
    head = render(before, person, subject)
    return head + value + render(after, person, subject), len(head)


@dataclass
class Bio:
    text: str
    spans: dict[str, tuple[int, int]]
    """attribute -> (start, end) of its value in ``text``."""


def bio_s(person: Person, rng: random.Random, permute: bool) -> Bio:
    order = list(ATTRIBUTES)
    if permute:
        rng.shuffle(order)
    parts, spans, offset = [], {}, 0
    for i, attribute in enumerate(order):
        subject = person.name if i == 0 else person.pronoun
        text, start = sentence(rng.choice(templates(attribute)), person, attribute, subject)
        value = getattr(person, attribute)
        spans[attribute] = (offset + start, offset + start + len(value))
        parts.append(text)
        offset += len(text) + 1
    return Bio(" ".join(parts), spans)


def person_bio(params: CapoParams, person: Person, rng: random.Random) -> str:
    """A training biography: one of the person's ``multiplicity`` fixed ones, or a fresh one."""
    if params.multiplicity > 0:
        variant = rng.randrange(params.multiplicity)
        rng = random.Random(f"capo-bio/{params.population_seed}/{person.id}/{variant}")
    return bio_s(person, rng, params.permute).text


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def permute_text(text: str, person: Person, rng: random.Random) -> str:
    """A free-text biography with its sentences shuffled; the first sentence names the person in
    full and later ones use the pronoun in place of the full name."""
    sentences = _SENTENCE_END.split(text.strip())
    rng.shuffle(sentences)
    out = []
    for i, s in enumerate(sentences):
        if i == 0 and s.startswith(person.pronoun + " "):
            s = person.name + s[len(person.pronoun) :]
        elif i > 0 and s.startswith(person.name + " "):
            s = person.pronoun + s[len(person.name) :]
        out.append(s)
    return " ".join(out)


def load_bior(path: str | Path, people: list[Person]) -> list[tuple[int, str]]:
    """(person id, text) records of a bioR file; ids must belong to the population."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                pid, text = int(record["id"]), str(record["text"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f'{path}:{number}: expected {{"id": int, "text": str}}: {e}'
                ) from None
            if not 0 <= pid < len(people):
                raise ValueError(
                    f"{path}:{number}: id {pid} outside the population (0..{len(people) - 1})"
                )
            records.append((pid, text))
    if not records:
        raise ValueError(f"{path}: no biographies")
    return records


def bior_prompt(person: Person, rng: random.Random) -> str:
    """A prompt asking a language model for a bioR biography of ``person`` (facts in random
    order)."""
    facts = [
        f"was born on {person.birthday}",
        f"was born in {person.birth_city}",
        f"studied at {person.university}",
        f"majored in {person.field}",
        f"worked for {person.company}",
        f"worked in {person.company_city}",
    ]
    rng.shuffle(facts)
    return (
        f"Write a 50-200 word biography of a fictional person named {person.name} "
        f"({person.pronoun.lower()}/{person.possessive}) who "
        + ", ".join(facts[:-1])
        + f" and {facts[-1]}. "
        "Mention every one of these facts exactly once, and nothing else that could "
        "contradict them."
    )


def question(person: Person, attribute: str, rng: random.Random) -> tuple[str, str]:
    """An attribute-recall prompt (the full name and a template's words up to the value, from a
    template that ends with the value) and the expected continuation."""
    endings = [t for t in templates(attribute) if t.endswith("{value}.")]
    before = rng.choice(endings).split("{value}")[0]
    return render(before, person, person.name).rstrip(), f" {getattr(person, attribute)}."
