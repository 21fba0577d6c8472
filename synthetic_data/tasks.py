"""The playground tasks behind one interface: training samples, held-out test items and scorers.

``make_task(dataset, **overrides)`` returns a ``Task`` for ``depo1``, ``depo2``, ``brevo1``,
``brevo2``, ``mano``, ``lano`` or ``capo_bios``, starting from the reference preset of that
dataset. The dataloader packs ``train_sample`` outputs; evaluation feeds each ``TestItem.prompt``
to the model, generates greedily (stopping at ``stop_ids``, after ``stop_chars`` decoded
characters for text tasks, or after ``max_new`` tokens) and asks ``score`` whether the
continuation is right. Test items come from their own random streams, disjoint from training's.
"""

from __future__ import annotations

import dataclasses
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from synthetic_data import brevo, capo, depo, lano, mano
from synthetic_data.common import BOS, Sample, TaskParamError, sample_rng

VOCAB = 10000
"""Integer-token tasks use ids below this (BOS = 9999); models need at least this vocabulary."""
PAD = 0
"""Fills the end of a packed window; no generator emits it."""


def _word_params(params, largest_n: int) -> None:
    if params.min_word_len < 1:
        raise TaskParamError(
            "min_word_len", f"is {params.min_word_len}; words need at least 1 token"
        )
    if params.max_word_len < params.min_word_len:
        raise TaskParamError(
            "max_word_len", f"is {params.max_word_len}, below min_word_len = {params.min_word_len}"
        )
    if params.mini_vocab < 1:
        raise TaskParamError("mini_vocab", f"is {params.mini_vocab}; it must be >= 1")
    capacity = sum(
        params.mini_vocab**n for n in range(params.min_word_len, params.max_word_len + 1)
    )
    if capacity < largest_n:
        raise TaskParamError(
            "N",
            f"is {largest_n}, but mini_vocab = {params.mini_vocab} with words of "
            f"{params.min_word_len}-{params.max_word_len} tokens makes only {capacity} "
            "distinct words",
        )


@dataclass
class TestItem:
    prompt: list[int] | str
    group: str
    """Row of the accuracy table (a hop count, a depth, a length, an attribute)."""
    answer: Any
    """One correct continuation (token ids, or text for text tasks); scorers may accept others."""
    max_new: int
    stop_ids: frozenset[int] = frozenset()
    """Generation ends after one of these tokens."""
    stop_chars: int | None = None
    """Text tasks: generation may end once this many characters are decoded."""


def _test_rng(seed: int, group: str, index: int) -> random.Random:
    # Training windows use "seed/window/i" streams; tests never collide with them.
    return sample_rng(seed, f"test-{group}", index)


class Task(ABC):
    name: str
    params: Any
    text = False
    """Text tasks give strings (the run's tokenizer encodes them); the others give token ids."""

    @abstractmethod
    def train_sample(self, rng: random.Random) -> Sample | str: ...

    def max_length(self) -> int | None:
        """Longest training sample in tokens (None: not bounded, long samples are redrawn)."""
        return None

    def min_length(self) -> int | None:
        """Shortest training sample in tokens, where that can exceed a small window."""
        return None

    @abstractmethod
    def test_items(self, seed: int, count: int) -> list[TestItem]: ...

    @abstractmethod
    def test_set(self, count: int) -> str:
        """What ``test_items(seed, count)`` draws and how it groups it, in words."""

    @abstractmethod
    def score(self, item: TestItem, continuation) -> bool: ...


class DepoTask(Task):
    def __init__(self, name: str, params: depo.DepoParams):
        self.name, self.params = name, params
        if params.N < 3:
            raise TaskParamError("N", f"is {params.N}; cycles need at least 3 words")
        if not 1 <= params.K < depo.ANSWER - depo.HOP_BASE:
            raise TaskParamError("K", f"is {params.K}; hop tokens 9000+k need 1 <= K < 500")
        if params.queries < 1:
            raise TaskParamError("queries", f"is {params.queries}; it must be >= 1")
        if 2 * params.mini_vocab >= depo.HOP_BASE:
            raise TaskParamError(
                "mini_vocab", f"is {params.mini_vocab}; word tokens must stay below 9000"
            )
        _word_params(params, params.N)

    def train_sample(self, rng):
        return depo.generate(self.params, rng)

    def max_length(self) -> int:
        p, w = self.params, self.params.max_word_len
        return 1 + p.N * (int(p.separator) + 2 * w) + min(p.N, p.queries) * (2 + 2 * w)

    def test_items(self, seed, count):
        p, items = self.params, []
        for k in depo.test_hops(p.K):
            index = 0
            group = []
            while len(group) < count:
                sample = depo.generate(p, _test_rng(seed, f"depo-k{k}", index), test=True, hops=k)
                marks = [i for i, t in enumerate(sample.tokens) if t == depo.ANSWER]
                for at, query in zip(marks, sample.meta["queries"]):
                    group.append(
                        TestItem(
                            sample.tokens[: at + 1],
                            f"k={k}",
                            query["answer"],
                            p.max_word_len,
                            frozenset(range(p.mini_vocab + 1, 2 * p.mini_vocab + 1)),
                        )
                    )
                index += 1
            items += group[:count]
        return items

    def test_set(self, count):
        return f"{count} queries per hop count k, on cycles of {self.params.N} words"

    def score(self, item, continuation):
        return tuple(continuation) == tuple(item.answer)


class BrevoTask(Task):
    def __init__(self, name: str, params: brevo.BrevoParams):
        self.name, self.params = name, params
        if not 3 <= params.N < brevo.QUERY:
            raise TaskParamError("N", f"is {params.N}; graphs need 3 <= N < 9997 nodes")
        if params.multi_token:
            _word_params(params, params.N)
            if 2 * params.mini_vocab >= brevo.QUERY:
                raise TaskParamError(
                    "mini_vocab", f"is {params.mini_vocab}; word tokens must stay below 9997"
                )
        self.word = params.max_word_len if params.multi_token else 1

    def train_sample(self, rng):
        return brevo.generate(self.params, rng)

    def max_length(self) -> int:
        # Node i (after the first) has at most min(i, 4) parents.
        n, w = self.params.N, self.word
        edges = sum(min(i, brevo.MAX_DEGREE) for i in range(1, n))
        return 1 + edges * 2 * w + 1 + w + 1 + n * w + 1

    def test_items(self, seed, count):
        """``4 * count`` graphs of N nodes, grouped by the query's depth."""
        items = []
        for index in range(4 * count):
            sample = brevo.generate(self.params, _test_rng(seed, "brevo", index), test=True)
            at = sample.tokens.index(brevo.ANSWER)
            items.append(
                TestItem(
                    sample.tokens[: at + 1],
                    f"depth={sample.meta['depth']}",
                    sample.tokens[at + 1 :],
                    self.params.N * self.word + 1,
                    frozenset({brevo.ANSWER}),
                )
            )
        return sorted(items, key=lambda item: int(item.group.split("=")[1]))

    def test_set(self, count):
        return f"{4 * count} graphs of {self.params.N} nodes, grouped by the query's depth"

    def score(self, item, continuation):
        continuation = list(continuation)
        if not continuation or continuation[-1] != brevo.ANSWER:
            return False
        try:
            return brevo.is_correct(list(item.prompt) + continuation, self.params)
        except ValueError:  # not parseable: a word cut short, or several query nodes
            return False


class ManoTask(Task):
    def __init__(self, name: str, params: mano.ManoParams):
        self.name, self.params = name, params
        if not 1 <= params.L < 499:
            raise TaskParamError("L", f"is {params.L}; length tokens 10*L+5 need 1 <= L < 499")
        if not params.operators or set(params.operators) - set(mano.OPERATORS):
            raise TaskParamError(
                "operators", f"is {params.operators!r}; use a non-empty subset of '+-*/'"
            )

    def train_sample(self, rng):
        return mano.generate(self.params, rng)

    def max_length(self) -> int:
        return 2 + 2 * self.params.L + 1 + 2

    def test_lengths(self) -> list[int]:
        L = self.params.L
        return sorted({max(1, L * i // 4) for i in range(1, 5)})

    def test_items(self, seed, count):
        items = []
        for length in self.test_lengths():
            for index in range(count):
                sample = mano.generate(
                    dataclasses.replace(self.params, L=length),
                    _test_rng(seed, f"mano-l{length}", index),
                    test=True,
                )
                items.append(TestItem(sample.tokens[:-1], f"L={length}", sample.tokens[-1:], 1))
        return items

    def test_set(self, count):
        return f"{count} expressions per number of operators L"

    def score(self, item, continuation):
        return list(continuation)[:1] == list(item.answer)


class LanoTask(Task):
    def __init__(self, name: str, params: lano.LanoParams):
        self.name, self.params = name, params
        self.grammar = lano.build_grammar(params)
        self.eos = self.grammar.num_terminals + 1
        if self.eos >= BOS:
            raise TaskParamError(
                "grammar" if params.grammar else "sizes",
                f"{self.grammar.num_terminals} terminals: ids must stay below {BOS}",
            )
        self.shortest, self.longest = lano.length_range(self.grammar)

    def train_sample(self, rng):
        sentence = self.grammar.generate(rng)
        return Sample(
            [BOS] + sentence + [self.eos],
            [0] + [1] * (len(sentence) + 1),
            {"length": len(sentence)},
        )

    def min_length(self) -> int:
        return self.shortest + 2

    def test_items(self, seed, count):
        """Held-out sentences cut after 25% or 50% of their tokens; the model completes them."""
        items = []
        for percent in (25, 50):
            for index in range(count):
                sentence = self.grammar.generate(_test_rng(seed, "lano", index))
                cut = max(1, len(sentence) * percent // 100)
                items.append(
                    TestItem(
                        [BOS] + sentence[:cut],
                        f"cut={percent}%",
                        sentence[cut:] + [self.eos],
                        self.longest - cut + 1,
                        frozenset({self.eos}),
                    )
                )
        return items

    def test_set(self, count):
        return f"{count} held-out sentences, each cut after 25% and after 50% of its tokens"

    def score(self, item, continuation):
        continuation = list(continuation)
        if not continuation or continuation[-1] != self.eos:
            return False
        return self.grammar.accepts(list(item.prompt[1:]) + continuation[:-1])


class CapoTask(Task):
    text = True

    def __init__(self, name: str, params: capo.CapoParams):
        self.name, self.params = name, params
        if params.multiplicity < 0:
            raise TaskParamError("multiplicity", f"is {params.multiplicity}; it must be >= 0")
        if params.individuals < 1:
            raise TaskParamError("individuals", f"is {params.individuals}; it must be >= 1")
        self.people = capo.population(params)
        self.bior = capo.load_bior(params.bior_path, self.people) if params.bior_path else None

    def train_sample(self, rng):
        if self.bior is not None:
            pid, text = self.bior[rng.randrange(len(self.bior))]
            return capo.permute_text(text, self.people[pid], rng) if self.params.permute else text
        return capo.person_bio(self.params, self.people[rng.randrange(len(self.people))], rng)

    def test_items(self, seed, count):
        """Attribute recall for ``count`` people of the population (it is what was memorised)."""
        rng = _test_rng(seed, "capo", 0)
        people = rng.sample(self.people, min(count, len(self.people)))
        items = []
        for attribute in capo.ATTRIBUTES:
            for person in people:
                prompt, expected = capo.question(person, attribute, rng)
                items.append(TestItem(prompt, attribute, expected, 48, stop_chars=len(expected)))
        return items

    def test_set(self, count):
        people = min(count, len(self.people))
        return f"{people} people of the population, one question per attribute"

    def score(self, item, continuation):
        return str(continuation).startswith(item.answer)


PRESETS = {
    "depo1": (DepoTask, depo.DEPO1),
    "depo2": (DepoTask, depo.DEPO2),
    "brevo1": (BrevoTask, brevo.BREVO1),
    "brevo2": (BrevoTask, brevo.BREVO2),
    "mano": (ManoTask, mano.MANO),
    "lano": (LanoTask, lano.LANO),
    "capo_bios": (CapoTask, capo.CAPO),
}
SECTION = {
    "depo1": "depo",
    "depo2": "depo",
    "brevo1": "brevo",
    "brevo2": "brevo",
    "mano": "mano",
    "lano": "lano",
    "capo_bios": "capo",
}
"""The TOML section holding each dataset's parameters."""
PARAMS = {
    "depo": depo.DepoParams,
    "brevo": brevo.BrevoParams,
    "mano": mano.ManoParams,
    "lano": lano.LanoParams,
    "capo": capo.CapoParams,
}


def make_task(dataset: str, **overrides) -> Task:
    """The task of ``dataset``: its reference preset with ``overrides`` (keys of its params)."""
    if dataset not in PRESETS:
        raise KeyError(f"unknown synthetic dataset {dataset!r}; available: {', '.join(PRESETS)}")
    cls, preset = PRESETS[dataset]
    return cls(dataset, dataclasses.replace(preset, **overrides))


def changed_params(task: Task) -> dict[str, Any]:
    """The task's parameters that differ from its dataset's preset (what its label must say)."""
    preset = PRESETS[task.name][1]
    return {
        f.name: getattr(task.params, f.name)
        for f in dataclasses.fields(task.params)
        if getattr(task.params, f.name) != getattr(preset, f.name)
    }


def summarize(task: Task, items: list[TestItem], continuations: list) -> dict:
    """Accuracy per group (in the order of the items) and overall; ``scores`` lists each item's 1
    or 0, in order (a comparison of two models pairs them item by item)."""
    groups: dict[str, dict] = {}
    for item, continuation in zip(items, continuations, strict=True):
        group = groups.setdefault(item.group, {"correct": 0, "total": 0, "scores": []})
        right = int(bool(task.score(item, continuation)))
        group["total"] += 1
        group["correct"] += right
        group["scores"].append(right)
    correct, total = (
        sum(g["correct"] for g in groups.values()),
        sum(g["total"] for g in groups.values()),
    )
    for group in groups.values():
        group["accuracy"] = group["correct"] / group["total"]
    return {
        "groups": groups,
        "overall": {"correct": correct, "total": total, "accuracy": correct / max(total, 1)},
    }
