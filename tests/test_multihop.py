"""Multi-hop birth-year test files: derivable answers, valid chains, token budget, determinism."""

import random

import pytest

from canon_titan.data.builtin import ASSET_DIR, generate_corpus
from canon_titan.data.tokenizers import build_tokenizer
from canon_titan.evaluation import multihop


@pytest.fixture(scope="module")
def background(tmp_path_factory):
    path = tmp_path_factory.mktemp("bg") / "wiki.txt"
    path.write_text("\n".join(generate_corpus(200, seed=3)))
    return multihop.read_background(path)


@pytest.fixture(scope="module")
def count_tokens():
    tokenizer = build_tokenizer("hf", str(ASSET_DIR))
    return lambda text: len(tokenizer.encode(text, add_bos=False, add_eos=False))


@pytest.mark.parametrize("n,k", [(5, 1), (3, 2), (4, 3)])
@pytest.mark.parametrize("budget", [0, 500, 2000])
def test_answers_are_derivable_and_budget_respected(n, k, budget, background, count_tokens):
    records = multihop.generate(
        n, k, budget, 8, seed=1, background=background, count_tokens=count_tokens
    )
    for record in records:
        prompt = record["prompt"]
        assert multihop.solve(prompt) == record["answer"] and 1950 <= int(record["answer"]) <= 2009
        assert prompt.endswith(" was born in the year of ") and prompt.count("Answer me: ") == 1
        assert record["background_tokens"] < max(budget, 1)
        if budget >= 500:
            assert record["background_tokens"] > budget * 0.8  # filled up to the budget
        assert ("<context>" in prompt) == (k > 1)
        stated = len(multihop._STATED.findall(prompt))
        linked = len(multihop._LINKED.findall(prompt))
        assert (stated, linked) == (n, n * (k - 1))


def test_chains_are_bijections_with_distinct_years():
    problem = multihop.make_problem(random.Random(0), 6, 3)
    stated = dict(multihop._STATED.findall(" ".join(problem.sentences)))
    linked = dict(multihop._LINKED.findall(" ".join(problem.sentences)))
    assert len(set(stated.values())) == 6  # years without replacement
    names = list(stated) + list(linked)
    assert len(set(names)) == 18  # unique people
    group2 = [x for x in linked if linked[x] in stated]
    group3 = [x for x in linked if linked[x] in group2]
    assert sorted(linked[x] for x in group2) == sorted(stated) and sorted(
        linked[x] for x in group3
    ) == sorted(group2)
    assert problem.query in group3


def test_same_seed_same_file_and_hand_example(background, count_tokens):
    a = multihop.generate(3, 2, 300, 4, seed=9, background=background, count_tokens=count_tokens)
    assert a == multihop.generate(
        3, 2, 300, 4, seed=9, background=background, count_tokens=count_tokens
    )
    assert a != multihop.generate(
        3, 2, 300, 4, seed=10, background=background, count_tokens=count_tokens
    )
    prompt = (
        "Ann Bee Cole was born in the year of 1970. Sky is blue. Dan Eve Fox was born in "
        "the same year as "
        "Ann Bee Cole.\n\nAnswer me: Dan Eve Fox was born in the year of "
    )
    assert multihop.solve(prompt) == "1970"
    assert multihop.solve(prompt.replace("Ann Bee Cole was born in the year of 1970. ", "")) is None


def test_generator_command_writes_the_file_and_reports_bad_input(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import REPO

    background = tmp_path / "bg.jsonl"
    background.write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in generate_corpus(50, seed=1))
    )
    out = tmp_path / "2hop.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "canon_titan.cli",
        "data",
        "multihop",
        "--background",
        str(background),
        "--out",
        str(out),
        "--hops",
        "2",
        "--context-tokens",
        "400",
        "--count",
        "5",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 5 and all(multihop.solve(r["prompt"]) == r["answer"] for r in records)
    assert all(r["n"] == 3 and r["k"] == 2 and r["background_tokens"] < 400 for r in records)
    background.write_text('{"txt": 1}\n')
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert (
        proc.returncode == 2
        and "bg.jsonl:1: the 'text' text field is missing; the record's fields: 'txt'\n"
        in proc.stderr
    )
