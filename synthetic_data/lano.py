"""Lano: sentences of layered context-free grammars (spec 6.5).

A grammar has ``depth`` levels of non-terminals below one root; every rule of a level-l symbol is
a sequence of 2-3 symbols of level l+1, and level ``depth`` holds the terminals (ids
1..sizes[depth]). Sentences expand the root top-down, each symbol picking one of its rules
uniformly. Grammars load from and save to the reference's JSON layout (``depth``, ``sizes``,
``idx``, ``all[level][j] = {name, id, children}``), and new ones are sampled from the same
parameters. ``accepts`` decides membership with a dynamic program over (level, symbol, start).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from synthetic_data.common import TaskParamError


@dataclass
class Grammar:
    depth: int
    sizes: list[int]
    rules: list[list[list[tuple[int, ...]]]]
    """rules[level][symbol] = the symbol's rules, each a tuple of indices into level + 1."""

    @property
    def num_terminals(self) -> int:
        return self.sizes[self.depth]

    # --- the reference JSON layout -------------------------------------------------------------
    @classmethod
    def from_json(cls, data: dict) -> Grammar:
        depth, sizes = data["depth"], list(data["sizes"])
        if len(sizes) != depth + 1 or sizes[0] != 1:
            raise ValueError(
                f"grammar: sizes {sizes} must have depth+1 = {depth + 1} levels and one root"
            )
        rules = []
        for level in range(depth):
            symbols = data["all"][level]
            if len(symbols) != sizes[level]:
                raise ValueError(
                    f"grammar: level {level} lists {len(symbols)} symbols, sizes says "
                    f"{sizes[level]}"
                )
            level_rules = []
            for symbol in symbols:
                children = [tuple(rule) for rule in symbol["children"]]
                for rule in children:
                    if not rule or any(not 0 <= c < sizes[level + 1] for c in rule):
                        raise ValueError(
                            f"grammar: rule {list(rule)} of {symbol.get('name')} points "
                            f"outside level {level + 1}"
                        )
                level_rules.append(children)
            rules.append(level_rules)
        return cls(depth, sizes, rules)

    def to_json(self) -> dict:
        # Terminals take ids 1..sizes[depth]; non-terminals follow, level by level from the bottom.
        level_ids = {self.depth: list(range(1, self.num_terminals + 1))}
        next_id = self.num_terminals + 1
        for level in range(self.depth - 1, -1, -1):
            level_ids[level] = list(range(next_id, next_id + self.sizes[level]))
            next_id += self.sizes[level]
        idx = [level_ids[level] for level in range(self.depth + 1)]
        all_levels = [
            [
                {
                    "name": f"L{level}S{j}",
                    "id": level_ids[level][j],
                    "children": [list(r) for r in self.rules[level][j]],
                }
                for j in range(self.sizes[level])
            ]
            for level in range(self.depth)
        ]
        all_levels.append(
            [{"name": f"T{t}", "id": t, "children": []} for t in level_ids[self.depth]]
        )
        return {"depth": self.depth, "sizes": self.sizes, "idx": idx, "all": all_levels}

    @classmethod
    def load(cls, path: str | Path) -> Grammar:
        return cls.from_json(json.loads(Path(path).read_text()))

    # --- sampling --------------------------------------------------------------------------------
    def generate(self, rng: random.Random) -> list[int]:
        """A sentence: terminal ids (no BOS/EOS)."""
        out: list[int] = []
        stack = [(0, 0)]
        while stack:
            level, symbol = stack.pop()
            if level == self.depth:
                out.append(symbol + 1)
                continue
            rule = rng.choice(self.rules[level][symbol])
            stack.extend((level + 1, child) for child in reversed(rule))
        return out

    def accepts(self, sentence: list[int]) -> bool:
        """Whether the root derives exactly ``sentence`` (terminal ids)."""
        n = len(sentence)
        if n == 0 or any(not 1 <= t <= self.num_terminals for t in sentence):
            return False

        @lru_cache(maxsize=None)
        def ends(level: int, symbol: int, start: int) -> frozenset[int]:
            if level == self.depth:
                return (
                    frozenset((start + 1,))
                    if start < n and sentence[start] == symbol + 1
                    else frozenset()
                )
            found: set[int] = set()
            for rule in self.rules[level][symbol]:
                positions = {start}
                for child in rule:
                    positions = {e for p in positions if p < n for e in ends(level + 1, child, p)}
                    if not positions:
                        break
                found |= positions
            return frozenset(found)

        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 10 * (self.depth + 10)))
        try:
            return n in ends(0, 0, 0)
        finally:
            sys.setrecursionlimit(limit)


def sample_grammar(
    rng: random.Random,
    sizes: list[int],
    rules_per_symbol: tuple[int, int] = (2, 3),
    rule_lengths: tuple[int, int] = (2, 3),
) -> Grammar:
    """A new grammar with the given level sizes (sizes[0] = 1 root, sizes[-1] = terminals), each
    non-terminal having ``rules_per_symbol`` distinct rules of ``rule_lengths`` symbols."""
    depth = len(sizes) - 1
    rules = []
    for level in range(depth):
        level_rules = []
        for _ in range(sizes[level]):
            count = rng.randint(*rules_per_symbol)
            chosen: list[tuple[int, ...]] = []
            while len(chosen) < count:
                rule = tuple(
                    rng.randrange(sizes[level + 1]) for _ in range(rng.randint(*rule_lengths))
                )
                if rule not in chosen:
                    chosen.append(rule)
            level_rules.append(chosen)
        rules.append(level_rules)
    return Grammar(depth, list(sizes), rules)


@dataclass
class LanoParams:
    grammar: str | None = None
    """A grammar JSON file in the reference layout (e.g. cfg3f.json); None samples one."""
    sizes: list[int] = field(default_factory=lambda: [1, 3, 3, 3, 3, 3, 3])
    """Sampled grammar: symbols per level, root (1) to terminals (like cfg3f: depth 6, 3 per
    level)."""
    rules_per_symbol: list[int] = field(default_factory=lambda: [3, 4])
    """Sampled grammar: [min, max] rules per non-terminal."""
    rule_lengths: list[int] = field(default_factory=lambda: [2, 3])
    grammar_seed: int = 0


LANO = LanoParams()


def build_grammar(params: LanoParams) -> Grammar:
    if params.grammar:
        try:
            return Grammar.load(params.grammar)
        except OSError as e:
            raise TaskParamError(
                "grammar", f"cannot read {params.grammar}: {e.strerror or e}"
            ) from None
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise TaskParamError(
                "grammar",
                f"{params.grammar} is not a grammar in the reference JSON layout "
                f"(depth, sizes, idx, all): {type(e).__name__}: {e}",
            ) from None
    if len(params.sizes) < 2 or params.sizes[0] != 1 or min(params.sizes) < 1:
        raise TaskParamError(
            "sizes", f"is {params.sizes}; need a root level of 1 symbol and at least one more level"
        )
    for name in ("rules_per_symbol", "rule_lengths"):
        low_high = getattr(params, name)
        if len(low_high) != 2 or not 1 <= low_high[0] <= low_high[1]:
            raise TaskParamError(name, f"is {low_high}; expected [min, max] with 1 <= min <= max")
    narrowest = min(params.sizes[1:])
    possible = sum(narrowest**n for n in range(params.rule_lengths[0], params.rule_lengths[1] + 1))
    if params.rules_per_symbol[1] > possible:
        raise TaskParamError(
            "rules_per_symbol",
            f"is {params.rules_per_symbol}, but a level of {narrowest} "
            f"symbols allows only {possible} distinct rules of {params.rule_lengths} symbols",
        )
    return sample_grammar(
        random.Random(f"lano-grammar/{params.grammar_seed}"),
        params.sizes,
        tuple(params.rules_per_symbol),
        tuple(params.rule_lengths),
    )


def length_range(grammar: Grammar) -> tuple[int, int]:
    """Shortest and longest sentence the grammar can generate."""
    low = [1] * grammar.sizes[grammar.depth]
    high = list(low)
    for level in range(grammar.depth - 1, -1, -1):
        low = [min(sum(low[c] for c in rule) for rule in rules) for rules in grammar.rules[level]]
        high = [max(sum(high[c] for c in rule) for rule in rules) for rules in grammar.rules[level]]
    return low[0], high[0]
