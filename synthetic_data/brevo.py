"""Brevo: recursive dependencies (the ancestors of a node of a DAG, in a valid topological order).

Layout (spec 6.2): ``[BOS] (parent child)* [9997] query [9998] answer... [9998]`` with the edges
shuffled; the answer lists the query's ancestors and the query itself, parents before children
(any valid order is correct), query last. Labels are 1 from the answer marker through the final
EOS. Brevo1 uses single-token node ids (N in {110, 90, 70}); Brevo2 replaces every node by a
multi-token word (mini_vocab 4, 2-4 tokens; N in {50, 40, 30}).
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

from synthetic_data.common import BOS, Sample, multi_token_words, sample_size, split_words

QUERY = 9997
ANSWER = 9998  # also the end-of-sequence token
MAX_DEGREE = 4


@dataclass
class BrevoParams:
    N: int = 90
    """Node ids come from 1..N and graphs have up to N nodes (test sets use N)."""
    multi_token: bool = False
    mini_vocab: int = 4
    min_word_len: int = 2
    max_word_len: int = 4


BREVO1 = BrevoParams(N=90)
BREVO2 = BrevoParams(N=40, multi_token=True)


def random_dag(rng: random.Random, n: int) -> list[list[int]]:
    """Parents of nodes 0..n-1: the first L nodes are leaves (L uniform in 1..(n-1)//4+1); each
    later node takes 1..4 parents among earlier nodes that have fewer than 4 children."""
    leaves = rng.randint(1, (n - 1) // 4 + 1)
    parents: list[list[int]] = [[] for _ in range(n)]
    children = [0] * n
    for node in range(leaves, n):
        eligible = [p for p in range(node) if children[p] < MAX_DEGREE]
        for p in rng.sample(eligible, rng.randint(1, min(len(eligible), MAX_DEGREE))):
            parents[node].append(p)
            children[p] += 1
    return parents


def ancestors(parents: list[list[int]], node: int) -> set[int]:
    found, stack = set(), [node]
    while stack:
        for p in parents[stack.pop()]:
            if p not in found:
                found.add(p)
                stack.append(p)
    return found


def random_topological_order(
    rng: random.Random, parents: list[list[int]], nodes: set[int], last: int
) -> list[int]:
    """Kahn's algorithm over ``nodes`` with a random choice among ready nodes; ``last`` comes
    last."""
    waiting = {v: {p for p in parents[v] if p in nodes} for v in nodes}
    order = []
    while waiting:
        ready = sorted(
            v for v, ps in waiting.items() if not ps and (v != last or len(waiting) == 1)
        )
        chosen = rng.choice(ready)
        order.append(chosen)
        del waiting[chosen]
        for ps in waiting.values():
            ps.discard(chosen)
    return order


def generate(params: BrevoParams, rng: random.Random, *, test: bool = False) -> Sample:
    n = params.N if test else sample_size(rng, params.N)
    parents = random_dag(rng, n)
    ids = rng.sample(range(1, params.N + 1), n)
    names = (
        [
            list(w)
            for w in multi_token_words(
                rng, n, params.mini_vocab, params.min_word_len, params.max_word_len
            )
        ]
        if params.multi_token
        else [[i] for i in ids]
    )
    query = n - 1
    answer = random_topological_order(rng, parents, ancestors(parents, query) | {query}, query)
    edges = [(p, c) for c in range(n) for p in parents[c]]
    rng.shuffle(edges)
    tokens = [BOS]
    for p, c in edges:
        tokens += names[p] + names[c]
    tokens += [QUERY] + names[query]
    labels = [0] * len(tokens)
    answer_tokens = [ANSWER] + [t for v in answer for t in names[v]] + [ANSWER]
    tokens += answer_tokens
    labels += [1] * len(answer_tokens)
    return Sample(
        tokens, labels, {"n": n, "depth": depth(parents, query), "answer_nodes": len(answer)}
    )


def depth(parents: list[list[int]], node: int) -> int:
    """Shortest number of edges from ``node`` up to a node without parents (spec 6.2's depth)."""
    frontier, distance, seen = [node], 0, {node}
    while frontier:
        if any(not parents[v] for v in frontier):
            return distance
        frontier = [p for v in frontier for p in parents[v] if p not in seen]
        seen.update(frontier)
        distance += 1
    raise ValueError("the graph has a cycle")


def parse(tokens: list[int], params: BrevoParams):
    """(parents of each node, query node, answer nodes) read back from a sequence."""
    query_at, answer_at = tokens.index(QUERY), tokens.index(ANSWER)
    end = len(tokens) - 1 if tokens[-1] == ANSWER else len(tokens)

    def nodes(part):
        return split_words(part, params.mini_vocab) if params.multi_token else [(t,) for t in part]

    edge_nodes = nodes(tokens[1:query_at])
    parents = defaultdict(set)
    for p, c in zip(edge_nodes[0::2], edge_nodes[1::2]):
        parents[c].add(p)
    (query,) = nodes(tokens[query_at + 1 : answer_at])
    return parents, query, nodes(tokens[answer_at + 1 : end])


def is_correct(tokens: list[int], params: BrevoParams) -> bool:
    """The answer holds exactly the query and its ancestors, each after all of its parents."""
    parents, query, answer = parse(tokens, params)
    expected, stack = {query}, [query]
    while stack:
        for p in parents[stack.pop()]:
            if p not in expected:
                expected.add(p)
                stack.append(p)
    if set(answer) != expected or len(answer) != len(expected) or answer[-1] != query:
        return False
    seen = set()
    for node in answer:
        if not parents[node] <= seen:
            return False
        seen.add(node)
    return True
