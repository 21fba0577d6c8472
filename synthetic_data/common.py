"""Pieces shared by the synthetic generators."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

BOS = 9999


class TaskParamError(ValueError):
    """A task parameter that cannot work; ``key`` names it."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


@dataclass
class Sample:
    """One sequence: token ids, labels (1 marks tokens the loss is taken on) and facts for
    scoring."""

    tokens: list[int]
    labels: list[int]
    meta: dict = field(default_factory=dict)


def sample_rng(seed: int, rank: int, index: int) -> random.Random:
    """The generator for sample ``index`` of data-parallel ``rank``: independent streams per rank,
    and any sample can be regenerated on its own (resume = keep the index)."""
    return random.Random(f"{seed}/{rank}/{index}")


def sample_size(rng: random.Random, largest: int, smallest: int = 3) -> int:
    """Training sizes: n in [smallest, largest] with P(n) proportional to 1 / (n +
    sqrt(largest))."""
    sizes = list(range(smallest, largest + 1))
    return rng.choices(sizes, weights=[1 / (n + math.sqrt(largest)) for n in sizes])[0]


def multi_token_words(
    rng: random.Random, n: int, mini_vocab: int, min_len: int, max_len: int
) -> list[tuple[int, ...]]:
    """``n`` distinct words of ``min_len..max_len`` tokens in 1..mini_vocab; the last token of a
    word is shifted by ``mini_vocab`` (ids mini_vocab+1..2*mini_vocab mark word ends)."""
    words: set[tuple[int, ...]] = set()
    ordered = []
    capacity = sum(mini_vocab**length for length in range(min_len, max_len + 1))
    if n > capacity:
        raise ValueError(f"cannot make {n} distinct words from {capacity} possible ones")
    while len(ordered) < n:
        length = rng.randint(min_len, max_len)
        word = [rng.randint(1, mini_vocab) for _ in range(length)]
        word[-1] += mini_vocab
        word = tuple(word)
        if word not in words:
            words.add(word)
            ordered.append(word)
    return ordered


def split_words(tokens: list[int], mini_vocab: int) -> list[tuple[int, ...]]:
    """Cut a run of word tokens at the end-of-word marks (ids above ``mini_vocab``)."""
    words, current = [], []
    for token in tokens:
        current.append(token)
        if token > mini_vocab:
            words.append(tuple(current))
            current = []
    if current:
        raise ValueError(f"tokens end inside a word: {current}")
    return words
