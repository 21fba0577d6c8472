"""Multi-hop birth-year retrieval hidden in background text (spec 7.1), as test files.

A problem has ``n * k`` people with unique full names (from the Capo name lists). Group 1 states
``"{name} was born in the year of {year}."`` with distinct years from 1950-2009; each later group
states ``"{name} was born in the same year as {other}."`` through a random bijection onto the
previous group. The question asks for the first person of the last group, so answering needs
``k`` hops. Problem sentences are scattered among a contiguous run of background sentences
(a random start in a user-supplied text) holding fewer than ``context_tokens`` tokens. Everything
is deterministic from the seed; prompts carry no BOS and are scored by exact match of the year.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from canon_titan.data.documents import DataError, file_kind, iter_documents
from synthetic_data import capo

YEARS = range(1950, 2010)
QUESTION = "\n\nAnswer me: {name} was born in the year of "
INSTRUCTION = (
    "Below, some sentences about when people were born are mixed into unrelated text. A birth "
    "year is either stated outright or given by saying that one person was born in the same year "
    "as another. Use them to answer the question that follows.\n\n"
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_STATED = re.compile(
    r"([A-Z][A-Za-z]+ [A-Z][A-Za-z]+ [A-Z][A-Za-z]+) was born in the year of (\d{4})\."
)
_LINKED = re.compile(
    r"([A-Z][A-Za-z]+ [A-Z][A-Za-z]+ [A-Z][A-Za-z]+) was born in the same year as "
    r"([A-Z][A-Za-z]+ [A-Z][A-Za-z]+ [A-Z][A-Za-z]+)\."
)


@dataclass
class Problem:
    sentences: list[str]
    query: str
    answer: str


def make_problem(rng: random.Random, n: int, k: int) -> Problem:
    if n < 1 or k < 1 or n > len(YEARS):
        raise ValueError(f"need 1 <= n <= {len(YEARS)} and k >= 1, got n={n}, k={k}")
    names = [" ".join(name) for name in capo.unique_names(rng, n * k)]
    groups = [names[i * n : (i + 1) * n] for i in range(k)]
    years = rng.sample(list(YEARS), n)
    sentences = [f"{name} was born in the year of {year}." for name, year in zip(groups[0], years)]
    year_of = dict(zip(groups[0], years))
    for previous, group in zip(groups, groups[1:]):
        partners = rng.sample(previous, n)
        for name, partner in zip(group, partners):
            sentences.append(f"{name} was born in the same year as {partner}.")
            year_of[name] = year_of[partner]
    query = groups[-1][0]
    return Problem(sentences, query, str(year_of[query]))


def read_background(path: str | Path, text_key: str = "text") -> list[str]:
    """Sentences of a plain-text file, or of a document file (JSON lines, .zst, Parquet) with a
    ``text_key`` field (the reference's Wikipedia file uses "plaintext")."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"background text {path} does not exist")
    try:
        file_kind(str(path))
    except DataError:  # not a document format: plain text
        texts = [path.read_text(encoding="utf-8").replace("\n", " ")]
    else:
        try:
            texts = list(iter_documents(str(path), text_key))
        except DataError as e:  # without the dataloader's on_error hint, which does not apply here
            raise ValueError(str(e).split(" (set [dataloader]")[0]) from None
    sentences = [s.strip() for text in texts for s in _SENTENCE_END.split(text) if s.strip()]
    if not sentences:
        raise ValueError(f"{path}: no sentences")
    return sentences


def make_prompt(
    rng: random.Random,
    problem: Problem,
    background: list[str],
    context_tokens: int,
    count_tokens: Callable[[str], int],
    hops: int,
) -> tuple[str, int]:
    """The prompt and the number of background tokens in it (< context_tokens, or 0)."""
    chosen, used = [], 0
    if context_tokens > 0 and background:
        start = rng.randrange(len(background))
        for offset in range(len(background)):
            sentence = background[(start + offset) % len(background)]
            cost = count_tokens(" " + sentence)
            if used + cost >= context_tokens:
                break
            chosen.append(sentence)
            used += cost
    text = list(chosen)
    for sentence in problem.sentences:  # scattered, in random order, among the background
        text.insert(rng.randint(0, len(text)), sentence)
    body = " ".join(text)
    question = QUESTION.format(name=problem.query)
    if hops == 1:
        return body + " " + question, used
    return INSTRUCTION + "<context>" + body + "</context>" + question, used


def generate(
    n: int,
    k: int,
    context_tokens: int,
    count: int,
    seed: int,
    background: list[str],
    count_tokens: Callable[[str], int],
) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        problem = make_problem(rng, n, k)
        prompt, used = make_prompt(rng, problem, background, context_tokens, count_tokens, k)
        records.append(
            {
                "prompt": prompt,
                "answer": problem.answer,
                "n": n,
                "k": k,
                "context_tokens": context_tokens,
                "background_tokens": used,
            }
        )
    return records


def solve(prompt: str) -> str | None:
    """The year asked for, derived from the prompt's text alone (None when it cannot be)."""
    question = prompt.rsplit("Answer me: ", 1)
    if len(question) != 2:
        return None
    query = question[1].removesuffix(" was born in the year of ").strip()
    stated = dict(_STATED.findall(prompt))
    linked = dict(_LINKED.findall(prompt))
    seen = set()
    while query not in stated:
        if query in seen or query not in linked:
            return None
        seen.add(query)
        query = linked[query]
    return stated[query]
