"""Synthetic generators: every answer checked by re-deriving it from the sequence alone."""

import json
import random

import pytest

from synthetic_data import brevo, depo, mano
from synthetic_data.common import BOS, sample_rng, sample_size, split_words


@pytest.mark.parametrize(
    "params", [depo.DEPO1, depo.DEPO2, depo.DepoParams(N=20, K=4, separator=False)]
)
def test_depo_answers_are_kth_successors(params):
    for index in range(30):
        sample = depo.generate(params, sample_rng(1, 0, index), test=index % 3 == 0)
        assert sample.tokens[0] == BOS and len(sample.tokens) == len(sample.labels)
        nxt = depo.successor_map(sample.tokens, params)
        assert len(nxt) == sample.meta["n"]
        # Read each query back from the tokens: [9000+k] source [9500] answer.
        rest = sample.tokens[
            sample.tokens.index(
                next(t for t in sample.tokens if depo.HOP_BASE <= t < depo.ANSWER)
            ) :
        ]
        answered = 0
        while rest:
            k = rest[0] - depo.HOP_BASE
            answer_at = rest.index(depo.ANSWER)
            (source,) = split_words(rest[1:answer_at], params.mini_vocab)
            following = [
                i
                for i, t in enumerate(rest[answer_at + 1 :], answer_at + 1)
                if depo.HOP_BASE <= t < depo.ANSWER
            ]
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
    assert (
        min(sizes) >= 3 and max(sizes) <= 100 and sizes.count(3) > sizes.count(100) * 3
    )  # favours small n
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


@pytest.mark.parametrize(
    "params", [mano.MANO, mano.ManoParams(L=6, operators="+-*/", knowledge_augment=False)]
)
def test_mano_answers_equal_the_expression_mod_23(params):
    lengths = set()
    for index in range(300):
        sample = mano.generate(params, sample_rng(4, 0, index), test=index % 10 == 0)
        tokens = sample.tokens
        length = (tokens[1] - tokens[1] % 10) // 10
        assert (
            tokens[0] in (9999, 9998) and tokens[-2] // 10 == length and tokens[-2] % 10 in (4, 5)
        )
        expression = tokens[2:-2]
        assert sum(1 for t in expression if t < mano.LEAF_BASE) == length  # l operators
        assert (
            mano.evaluate_prefix(expression) == tokens[-1] - mano.LEAF_BASE == sample.meta["answer"]
        )
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
TINY = {
    "depth": 2,
    "sizes": [1, 2, 3],
    "idx": [[6], [4, 5], [1, 2, 3]],
    "all": [
        [{"name": "S", "id": 6, "children": [[0, 1], [1, 0]]}],
        [
            {"name": "A", "id": 4, "children": [[0, 1], [1, 1, 1]]},
            {"name": "B", "id": 5, "children": [[2, 0]]},
        ],
        [
            {"name": "t1", "id": 1, "children": []},
            {"name": "t2", "id": 2, "children": []},
            {"name": "t3", "id": 3, "children": []},
        ],
    ],
}


def test_lano_membership_on_a_hand_grammar():
    g = lano.Grammar.from_json(TINY)
    for sentence in ([1, 2, 3, 1], [2, 2, 2, 3, 1], [3, 1, 1, 2], [3, 1, 2, 2, 2]):
        assert g.accepts(sentence), sentence
    for sentence in ([1, 2], [1, 2, 3, 1, 1], [3, 1, 3, 1], [2, 2, 3, 1], [], [1, 2, 3, 4]):
        assert not g.accepts(sentence), sentence
    assert lano.Grammar.from_json(g.to_json()) == g
    with pytest.raises(ValueError, match="points outside level 2"):
        lano.Grammar.from_json(
            {
                **TINY,
                "all": [
                    TINY["all"][0],
                    [{"name": "A", "children": [[0, 7]]}, TINY["all"][1][1]],
                    TINY["all"][2],
                ],
            }
        )


def test_lano_generated_sentences_are_accepted_and_edits_mostly_rejected():
    rng = random.Random(0)
    grammar = lano.sample_grammar(
        rng, [1, 3, 3, 3, 3, 3]
    )  # depth 5, 3 symbols per level (like cfg3)
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


# ------------------------------------------------------------------------------------- Capo
from synthetic_data import capo  # noqa: E402
from synthetic_data.tasks import PRESETS, make_task, summarize  # noqa: E402


def test_capo_lists_meet_the_spec_sizes():
    sizes = {
        "first_names": 400,
        "middle_names": 400,
        "last_names": 1000,
        "cities": 200,
        "companies": 263,
        "fields": 100,
        "universities": 300,
    }
    for name, minimum in sizes.items():
        entries = capo.word_list(name)
        assert len(entries) >= minimum and len(set(entries)) == len(entries), name
    assert all(len(c.split(";")) == 2 for c in capo.word_list("companies"))
    for attribute in capo.ATTRIBUTES:
        lines = capo.templates(attribute)
        assert len(lines) >= 46 and all(
            t.startswith("{subject} ") and t.count("{value}") == 1 for t in lines
        )


def test_capo_names_unique_and_each_bio_states_each_attribute_once():
    params = capo.CapoParams(individuals=3000, population_seed=3)
    people = capo.population(params)
    assert len({p.name for p in people}) == len(people) == 3000
    assert (
        capo.population(params) == people
        and capo.population(capo.CapoParams(individuals=3000)) != people
    )
    rng = random.Random(0)
    orders = set()
    for person in people[:200]:
        bio = capo.bio_s(person, rng, permute=True)
        values = {a: getattr(person, a) for a in capo.ATTRIBUTES}
        assert set(bio.spans) == set(capo.ATTRIBUTES)
        for attribute, (start, end) in bio.spans.items():
            assert bio.text[start:end] == values[attribute]
        spans = sorted(bio.spans.values())
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))  # one sentence each, no overlap
        assert bio.text.count(".") == 6 and bio.text.count(person.name) == 1
        first = min(bio.spans, key=lambda a: bio.spans[a][0])
        assert bio.text.startswith(person.name)
        for attribute, value in values.items():
            if any(value in other and value != other for other in values.values()):
                continue  # e.g. a field name inside another value: counted below through that one
            assert bio.text.count(value) == sum(v == value for v in values.values()), (
                attribute,
                bio.text,
            )
        orders.add(tuple(sorted(bio.spans, key=lambda a: bio.spans[a][0])))
        assert (
            "." not in bio.text[: bio.spans[first][0]]
        )  # the full-name sentence states the first attribute
    assert len(orders) > 50  # permutation augmentation
    fixed = {
        tuple(sorted(b.spans, key=lambda a: b.spans[a][0]))
        for b in (capo.bio_s(p, rng, permute=False) for p in people[:20])
    }
    assert fixed == {capo.ATTRIBUTES}


def test_capo_multiplicity_and_permuted_free_text(tmp_path):
    params = capo.CapoParams(individuals=10, multiplicity=2)
    person = capo.population(params)[4]
    bios = {capo.person_bio(params, person, random.Random(i)) for i in range(40)}
    assert len(bios) == 2
    fresh = capo.CapoParams(individuals=10, multiplicity=0)
    assert len({capo.person_bio(fresh, person, random.Random(i)) for i in range(40)}) > 30
    text = (
        f"{person.name} was born in Ohio. {person.pronoun} liked maps. {person.pronoun} moved West."
    )
    for seed in range(10):
        out = capo.permute_text(text, person, random.Random(seed))
        assert (
            out.startswith(person.name + " ")
            and out.count(person.name) == 1
            and len(out.split(". ")) == 3
        )
    path = tmp_path / "bior.jsonl"
    path.write_text('{"id": 3, "text": "x"}\n{"id": 99, "text": "y"}\n')
    with pytest.raises(ValueError, match=r"bior.jsonl:2: id 99 outside"):
        capo.load_bior(path, capo.population(params))


# ------------------------------------------------------------------------------- scorers
SMALL = {
    "depo1": {"N": 12, "K": 4},
    "depo2": {"N": 8, "K": 4},
    "brevo1": {"N": 12},
    "brevo2": {"N": 8},
    "mano": {"L": 4},
    "lano": {"sizes": [1, 3, 3, 3, 3]},
    "capo_bios": {"individuals": 50},
}


def _corrupt(task, item, answer):
    """A wrong continuation built from the right one."""
    if task.text:
        return " Nowhere Special."
    answer = list(answer)
    if task.name.startswith("depo"):
        v = task.params.mini_vocab  # another end-of-word token: a different word
        return answer[:-1] + [v + (answer[-1] - v) % v + 1]
    if task.name == "mano":
        return [5000 + (answer[0] - 5000 + 1) % 23]
    if task.name.startswith("brevo"):
        word = task.word
        return answer[word:]  # drops the first (a parent-less) node of the ancestor set
    position = random.Random(len(answer)).randrange(len(answer) - 1)
    return (
        answer[:position]
        + [answer[position] % task.grammar.num_terminals + 1]
        + answer[position + 1 :]
    )


@pytest.mark.parametrize("dataset", list(PRESETS))
def test_scorers_accept_ground_truth_and_reject_corruptions(dataset):
    task = make_task(dataset, **SMALL[dataset])
    items = task.test_items(11, 12)
    assert items == task.test_items(11, 12) and items != task.test_items(12, 12)
    truth = summarize(task, items, [item.answer for item in items])
    assert truth["overall"]["accuracy"] == 1.0 and len(truth["groups"]) >= 2
    wrong = summarize(task, items, [_corrupt(task, item, item.answer) for item in items])
    assert wrong["overall"]["accuracy"] < 0.5, wrong
    assert (
        summarize(task, items, [[] if not task.text else "" for _ in items])["overall"]["correct"]
        == 0
    )


def test_brevo_scorer_accepts_any_valid_order():
    task = make_task("brevo1", N=14)
    other_orders = 0
    for item in task.test_items(5, 10):
        parents, query, _ = brevo.parse(item.prompt + item.answer, task.params)
        answer = list(item.answer[:-1])
        for seed in range(
            5
        ):  # shuffle within "ready" sets: Kahn's algorithm again with other choices
            rng = random.Random(seed)
            waiting = {v: {p[0] for p in parents[(v,)] if p[0] in answer} for v in answer}
            order = []
            while waiting:
                ready = sorted(
                    v
                    for v, ps in waiting.items()
                    if not ps and (v != query[0] or len(waiting) == 1)
                )
                chosen = rng.choice(ready)
                order.append(chosen)
                del waiting[chosen]
                for ps in waiting.values():
                    ps.discard(chosen)
            other_orders += order != answer
            assert task.score(item, order + [brevo.ANSWER])
    assert other_orders > 0


def test_depo_test_items_have_fixed_hops_and_full_cycles():
    task = make_task("depo2", N=10, K=8)
    items = task.test_items(1, 7)
    assert [i.group for i in items] == [f"k={k}" for k in (1, 2, 4, 8) for _ in range(7)]
    for item in items:
        k = int(item.group[2:])
        nxt = depo.successor_map(item.prompt, task.params)
        assert len(nxt) == 10 and item.prompt[-1] == depo.ANSWER
        hop_at = max(i for i, t in enumerate(item.prompt) if depo.HOP_BASE <= t < depo.ANSWER)
        assert item.prompt[hop_at] == depo.HOP_BASE + k
        node = tuple(item.prompt[hop_at + 1 : -1])
        for _ in range(k):
            node = nxt[node]
        assert node == tuple(item.answer)


@pytest.mark.parametrize("dataset", [d for d in PRESETS if d not in ("lano", "capo_bios")])
def test_max_length_bounds_every_training_sample(dataset):
    task = make_task(dataset, **SMALL[dataset])
    lengths = [len(task.train_sample(sample_rng(8, 0, i)).tokens) for i in range(2000)]
    assert max(lengths) <= task.max_length() < 2 * max(lengths)
