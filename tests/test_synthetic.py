"""Synthetic generators: every answer checked by re-deriving it from the sequence alone."""

import json
import random

import pytest

from synthetic_data import brevo, depo, mano
from synthetic_data.common import BOS, sample_rng, sample_size, split_words


@pytest.mark.parametrize("params", [depo.DEPO1, depo.DEPO2, depo.DepoParams(N=20, K=4, separator=False)])
def test_depo_answers_are_kth_successors(params):
    for index in range(30):
        sample = depo.generate(params, sample_rng(1, 0, index), test=index % 3 == 0)
        assert sample.tokens[0] == BOS and len(sample.tokens) == len(sample.labels)
        nxt = depo.successor_map(sample.tokens, params)
        assert len(nxt) == sample.meta["n"]
        # Read each query back from the tokens: [9000+k] source [9500] answer.
        rest = sample.tokens[sample.tokens.index(next(t for t in sample.tokens if depo.HOP_BASE <= t < depo.ANSWER)):]
        answered = 0
        while rest:
            k = rest[0] - depo.HOP_BASE
            answer_at = rest.index(depo.ANSWER)
            (source,) = split_words(rest[1:answer_at], params.mini_vocab)
            following = [i for i, t in enumerate(rest[answer_at + 1 :], answer_at + 1) if depo.HOP_BASE <= t < depo.ANSWER]
            end = following[0] if following else len(rest)
            (answer,) = split_words(rest[answer_at + 1 : end], params.mini_vocab)
            node = source
            for _ in range(k):
                node = nxt[node]
            assert answer == node
            answered += 1
            rest = rest[end:]
        assert answered == min(sample.meta["n"], params.queries)
        # Loss only on the answer marker and the answer words.
        assert sum(sample.labels) == sum(1 + len(q["answer"]) for q in sample.meta["queries"])


def test_depo_test_hops_and_sizes():
    assert depo.test_hops(8) == [1, 2, 4, 8] and depo.test_hops(32) == [1, 2, 4, 8, 16, 24, 32]
    assert depo.test_hops(12) == [1, 2, 4, 8, 12]
    rng = random.Random(0)
    sizes = [sample_size(rng, 100) for _ in range(5000)]
    assert min(sizes) >= 3 and max(sizes) <= 100 and sizes.count(3) > sizes.count(100) * 3  # favours small n
    sample = depo.generate(depo.DEPO1, sample_rng(0, 0, 0), test=True, hops=8)
    assert sample.meta["n"] == 300 and {q["hops"] for q in sample.meta["queries"]} == {8}


@pytest.mark.parametrize("params", [brevo.BREVO1, brevo.BREVO2, brevo.BrevoParams(N=12)])
def test_brevo_answers_are_ancestor_sets_in_valid_order(params):
    for index in range(40):
        sample = brevo.generate(params, sample_rng(2, 0, index), test=index % 4 == 0)
        assert sample.tokens[0] == BOS and sample.tokens[-1] == brevo.ANSWER
        assert brevo.is_correct(sample.tokens, params)
        parents, _, answer = brevo.parse(sample.tokens, params)
        assert all(len(ps) <= brevo.MAX_DEGREE for ps in parents.values())
        first_label = sample.labels.index(1)
        assert sample.tokens[first_label] == brevo.ANSWER and all(sample.labels[first_label:])


def test_brevo_scorer_rejects_wrong_answers():
    params = brevo.BREVO1
    rejected = 0
    for index in range(40):
        tokens = brevo.generate(params, sample_rng(3, 0, index)).tokens
        answer_at = tokens.index(brevo.ANSWER)
        answer = tokens[answer_at + 1 : -1]
        if len(answer) < 3:
            continue
        dropped = tokens[: answer_at + 1] + answer[1:] + [brevo.ANSWER]  # a missing ancestor
        swapped = tokens[: answer_at + 1] + answer[::-1][1:] + answer[-1:] + [brevo.ANSWER]
        assert not brevo.is_correct(dropped, params)
        rejected += not brevo.is_correct(swapped, params)
    assert rejected > 10  # reversing the order breaks parents-before-children in most graphs


def test_same_seed_same_samples_and_ranks_differ():
    a = depo.generate(depo.DEPO2, sample_rng(5, 0, 7)).tokens
    assert a == depo.generate(depo.DEPO2, sample_rng(5, 0, 7)).tokens
    assert a != depo.generate(depo.DEPO2, sample_rng(5, 1, 7)).tokens
    b = brevo.generate(brevo.BREVO2, sample_rng(5, 0, 7)).tokens
    assert b == brevo.generate(brevo.BREVO2, sample_rng(5, 0, 7)).tokens
    assert b != brevo.generate(brevo.BREVO2, sample_rng(5, 1, 7)).tokens


@pytest.mark.parametrize("params", [mano.MANO, mano.ManoParams(L=6, operators="+-*/", knowledge_augment=False)])
def test_mano_answers_equal_the_expression_mod_23(params):
    lengths = set()
    for index in range(300):
        sample = mano.generate(params, sample_rng(4, 0, index), test=index % 10 == 0)
        tokens = sample.tokens
        length = (tokens[1] - tokens[1] % 10) // 10
        assert tokens[0] in (9999, 9998) and tokens[-2] // 10 == length and tokens[-2] % 10 in (4, 5)
        expression = tokens[2:-2]
        assert sum(1 for t in expression if t < mano.LEAF_BASE) == length  # l operators
        assert mano.evaluate_prefix(expression) == tokens[-1] - mano.LEAF_BASE == sample.meta["answer"]
        assert sample.labels == [0] * (len(tokens) - 1) + [1]
        lengths.add(length)
    assert lengths == set(range(1, params.L + 1))
    if not params.knowledge_augment:
        assert all(t <= 4 for t in expression if t < mano.LEAF_BASE)


def test_mano_hand_example():
    # (3 + 5) x 4 = 32 = 9 mod 23 ; 7 / 2 = 7 x 12 = 84 = 15 mod 23
    assert mano.evaluate_prefix([3, 1, 5003, 5005, 5004]) == 9
    assert mano.evaluate_prefix([4, 5007, 5002]) == 15


from synthetic_data import lano  # noqa: E402

# A hand-written grammar in the reference layout: root -> A B | B A ; A -> 1 2 | 2 2 2 ; B -> 3 1
TINY = {"depth": 2, "sizes": [1, 2, 3], "idx": [[6], [4, 5], [1, 2, 3]], "all": [
    [{"name": "S", "id": 6, "children": [[0, 1], [1, 0]]}],
    [{"name": "A", "id": 4, "children": [[0, 1], [1, 1, 1]]}, {"name": "B", "id": 5, "children": [[2, 0]]}],
    [{"name": "t1", "id": 1, "children": []}, {"name": "t2", "id": 2, "children": []},
     {"name": "t3", "id": 3, "children": []}],
]}


def test_lano_membership_on_a_hand_grammar():
    g = lano.Grammar.from_json(TINY)
    for sentence in ([1, 2, 3, 1], [2, 2, 2, 3, 1], [3, 1, 1, 2], [3, 1, 2, 2, 2]):
        assert g.accepts(sentence), sentence
    for sentence in ([1, 2], [1, 2, 3, 1, 1], [3, 1, 3, 1], [2, 2, 3, 1], [], [1, 2, 3, 4]):
        assert not g.accepts(sentence), sentence
    assert lano.Grammar.from_json(g.to_json()) == g
    with pytest.raises(ValueError, match="points outside level 2"):
        lano.Grammar.from_json({**TINY, "all": [TINY["all"][0], [{"name": "A", "children": [[0, 7]]}, TINY["all"][1][1]],
                                               TINY["all"][2]]})


def test_lano_generated_sentences_are_accepted_and_edits_mostly_rejected():
    rng = random.Random(0)
    grammar = lano.sample_grammar(rng, [1, 3, 3, 3, 3, 3])  # depth 5, 3 symbols per level (like cfg3)
    rejected = total = 0
    for index in range(40):
        sentence = grammar.generate(sample_rng(6, 0, index))
        assert 2**5 <= len(sentence) <= 3**5 and grammar.accepts(sentence)
        edited = list(sentence)
        position = rng.randrange(len(edited))
        edited[position] = rng.choice([t for t in (1, 2, 3) if t != edited[position]])
        total += 1
        rejected += not grammar.accepts(edited)
    assert rejected / total > 0.6, (rejected, total)  # a random edit rarely stays in the language


def test_lano_grammar_round_trips_through_a_file(tmp_path):
    grammar = lano.sample_grammar(random.Random(1), [1, 3, 3, 3, 3])
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(grammar.to_json()))
    assert lano.Grammar.load(path) == grammar
