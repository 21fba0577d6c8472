"""Depo: multi-hop reasoning in context (k-th successor on a hidden cycle).

n distinct words form a directed cycle; the context lists every edge ``word -> next word`` in a
random order; each query asks for the k-th successor of a word. Layout (spec 6.1):
``[BOS] ([9700] a b)*n`` then per query ``[9000+k] source [9500] answer``, labels 1 on ``[9500]``
and the answer word. Depo1: N in {375, 300, 225}, K = 8, mini_vocab 50, words of 1-2 tokens;
Depo2: N in {125, 100, 75}, K = 16, mini_vocab 3, words of 5-7 tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from synthetic_data.common import BOS, Sample, multi_token_words, sample_size, split_words

SEPARATOR = 9700
HOP_BASE = 9000
ANSWER = 9500


@dataclass
class DepoParams:
    N: int = 300
    """Largest cycle (training draws n in 3..N; test sets use n = N)."""
    K: int = 8
    """Largest hop count."""
    mini_vocab: int = 50
    min_word_len: int = 1
    max_word_len: int = 2
    queries: int = 10
    separator: bool = False
    """Token 9700 before every edge (the release's depo_data defaults it off)."""


DEPO1 = DepoParams(N=300, K=8, mini_vocab=50, min_word_len=1, max_word_len=2)
DEPO2 = DepoParams(N=100, K=16, mini_vocab=3, min_word_len=5, max_word_len=7)


def test_hops(K: int) -> list[int]:
    """Hop counts of the test sets: powers of two up to K, 24 when K = 32, and K."""
    hops = {2**i for i in range(K.bit_length()) if 2**i <= K} | {K}
    if K == 32:
        hops.add(24)
    return sorted(hops)


def generate(
    params: DepoParams, rng: random.Random, *, test: bool = False, hops: int | None = None
) -> Sample:
    n = params.N if test else sample_size(rng, params.N)
    words = multi_token_words(rng, n, params.mini_vocab, params.min_word_len, params.max_word_len)
    tokens, labels = [BOS], [0]
    for i in rng.sample(range(n), n):
        edge = ([SEPARATOR] if params.separator else []) + list(words[i]) + list(words[(i + 1) % n])
        tokens += edge
        labels += [0] * len(edge)
    queries = []
    for source in rng.sample(range(n), min(n, params.queries)):
        k = (
            hops
            if hops is not None
            else (rng.choice(test_hops(params.K)) if test else rng.randint(1, params.K))
        )
        answer = words[(source + k) % n]
        prompt = [HOP_BASE + k] + list(words[source])
        tokens += prompt + [ANSWER] + list(answer)
        labels += [0] * len(prompt) + [1] * (1 + len(answer))
        queries.append({"source": words[source], "hops": k, "answer": answer})
    return Sample(tokens, labels, {"n": n, "queries": queries})


def successor_map(tokens: list[int], params: DepoParams) -> dict[tuple[int, ...], tuple[int, ...]]:
    """The cycle as written in a sequence's context (independent of how it was generated)."""
    context = []
    for token in tokens[1:]:
        if HOP_BASE <= token < ANSWER:
            break
        context.append(token)
    edges = {}
    pieces = [context] if not params.separator else _split_on(context, SEPARATOR)
    for piece in pieces:
        words = split_words(piece, params.mini_vocab)
        for a, b in zip(words[0::2], words[1::2]):
            edges[a] = b
    return edges


def _split_on(tokens: list[int], mark: int) -> list[list[int]]:
    out, current = [], None
    for token in tokens:
        if token == mark:
            if current is not None:
                out.append(current)
            current = []
        else:
            current.append(token)
    return out + ([current] if current is not None else [])
