"""Mano: modular arithmetic over expressions in prefix (Polish) notation, mod 23 (spec 6.4).

A random binary expression tree with l operators (l uniform in 1..L, or L for test sets):
operators ``+ - x (/)`` as tokens 1/5, 2/6, 3/7, 4/8 (either id of a pair, picked at random, when
``knowledge_augment``), leaves ``5000 + v`` with v in 0..22. Sequence:
``[9999|9998] [10*l + 0|1] expression [10*l + 4 + 0|1] [5000 + answer]``; the label is on the
answer token. Division uses the modular inverse; a division by zero redraws the expression.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from synthetic_data.common import BOS, Sample

MOD = 23
LEAF_BASE = 5000
OPERATORS = {"+": (1, 5), "-": (2, 6), "*": (3, 7), "/": (4, 8)}
TOKEN_TO_OPERATOR = {t: op for op, ids in OPERATORS.items() for t in ids}


@dataclass
class ManoParams:
    L: int = 10
    operators: str = "+-*"
    """'+-*' (the reference's 'asm'), or '+-*/' to add division."""
    knowledge_augment: bool = True


MANO = ManoParams()


class _DivisionByZero(Exception):
    pass


def apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return (a + b) % MOD
    if op == "-":
        return (a - b) % MOD
    if op == "*":
        return (a * b) % MOD
    if b == 0:
        raise _DivisionByZero
    return a * pow(b, -1, MOD) % MOD


def _expression(rng: random.Random, operators: int, params: ManoParams) -> tuple[list[int], int]:
    if operators == 0:
        value = rng.randint(0, MOD - 1)
        return [LEAF_BASE + value], value
    left = rng.randint(0, operators - 1)
    op = rng.choice(params.operators)
    token = OPERATORS[op][rng.randint(0, 1) if params.knowledge_augment else 0]
    left_tokens, left_value = _expression(rng, left, params)
    right_tokens, right_value = _expression(rng, operators - 1 - left, params)
    return [token] + left_tokens + right_tokens, apply(op, left_value, right_value)


def generate(params: ManoParams, rng: random.Random, *, test: bool = False) -> Sample:
    length = params.L if test else rng.randint(1, params.L)
    while True:
        try:
            expression, answer = _expression(rng, length, params)
            break
        except _DivisionByZero:
            continue
    jitter = (lambda: rng.randint(0, 1)) if params.knowledge_augment else (lambda: 0)
    bos = BOS - jitter()
    tokens = (
        [bos, 10 * length + jitter()]
        + expression
        + [10 * length + 4 + jitter(), LEAF_BASE + answer]
    )
    labels = [0] * (len(tokens) - 1) + [1]
    return Sample(tokens, labels, {"length": length, "answer": answer})


def evaluate_prefix(tokens: list[int]) -> int:
    """Value mod 23 of a prefix expression, read from its tokens alone."""

    def walk(i: int) -> tuple[int, int]:
        token = tokens[i]
        if token >= LEAF_BASE:
            return token - LEAF_BASE, i + 1
        left, j = walk(i + 1)
        right, k = walk(j)
        return apply(TOKEN_TO_OPERATOR[token], left, right), k

    value, end = walk(0)
    if end != len(tokens):
        raise ValueError(f"{len(tokens) - end} tokens left after a complete expression")
    return value
