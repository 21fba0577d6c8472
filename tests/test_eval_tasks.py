"""The multi-hop and Babilong tasks of eval/ run through lm-eval: the prompts lm-eval builds are
ours, and answers are scored by the year / the fixed answer format (oracle models, no network)."""

import json

import pytest

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402

from canon_titan.cli import main  # noqa: E402
from canon_titan.evaluation import babilong, lm, multihop  # noqa: E402
from canon_titan.evaluation.lm_tasks import MULTIHOP_CONTEXTS  # noqa: E402
from conftest import REPO  # noqa: E402

BACKGROUND = REPO / "canon_titan" / "assets" / "builtin" / "corpus.jsonl"


class Oracle(LM):
    """Answers every generation request with ``answer(prompt)``; records the prompts."""

    def __init__(self, answer):
        super().__init__()
        self.answer, self.prompts = answer, []

    def generate_until(self, requests, disable_tqdm=False):
        self.prompts += [r.args[0] for r in requests]
        return [self.answer(r.args[0]) for r in requests]

    def loglikelihood(self, requests, disable_tqdm=False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError


def score(oracle, tasks, data_dir):
    manager = lm.task_manager(tasks, str(data_dir))
    out = simple_evaluate(model=oracle, tasks=tasks, task_manager=manager, bootstrap_iters=0)
    return lm.metric_values({"results": out["results"]})


@pytest.fixture(scope="module")
def multihop_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_data")
    assert (
        main(
            [
                "data",
                "multihop",
                "--background",
                str(BACKGROUND),
                "--out-dir",
                str(out),
                "--count",
                "4",
            ]
        )
        == 0
    )
    return out


def test_generator_writes_the_reference_grid(multihop_dir):
    files = sorted(p.name for p in (multihop_dir / "multihop").iterdir())
    assert files == sorted(f"{h}_{c}.jsonl" for h in ("1hop", "2hop") for c in MULTIHOP_CONTEXTS)
    two_hop = [
        json.loads(line)
        for line in (multihop_dir / "multihop" / "2hop_1k.jsonl").read_text().splitlines()
    ]
    assert all(r["n"] == 3 and r["k"] == 2 and r["background_tokens"] < 1024 for r in two_hop)


def test_multihop_tasks_score_the_year(multihop_dir):
    tasks = ["multihop_1hop", "multihop_2hop_2k"]
    right = Oracle(lambda prompt: f" {multihop.solve(prompt)}. She was")
    scores = score(right, tasks, multihop_dir)
    assert len(scores) == len(MULTIHOP_CONTEXTS) + 2  # the 1-hop group's average too
    assert all(v == 1.0 for k, v in scores.items() if k.endswith("/exact_match")), scores
    # lm-eval hands the model exactly the generated prompts: the prompt ends after "year of ".
    rows = [
        json.loads(line)
        for line in (multihop_dir / "multihop" / "2hop_2k.jsonl").read_text().splitlines()
    ]
    assert all(r["prompt"] in right.prompts for r in rows)
    assert all(p.endswith("was born in the year of ") for p in right.prompts)

    wrong = Oracle(lambda prompt: f"{int(multihop.solve(prompt)) + 1}.")
    assert set(score(wrong, tasks, multihop_dir).values()) == {0.0}
    late = Oracle(lambda prompt: f"the year {multihop.solve(prompt)}.")  # the year must come first
    assert set(score(late, ["multihop_1hop_0k"], multihop_dir).values()) == {0.0}


SAMPLES = {
    "qa1": (
        {
            "input": "Mary went to the kitchen. John moved to the garden. Mary travelled to the "
            "office.",
            "question": "Where is Mary?",
            "target": "office",
        },
        " The most recent location of Mary is office.",
        " The most recent location of Mary is kitchen.",
    ),
    "qa4": (
        {
            "input": "The garden is south of the bedroom. The office is east of the garden.",
            "question": "What is the garden south of?",
            "target": "bedroom",
        },
        " bedroom\nQuestion:",
        " office",
    ),
}


def test_multihop_groups_report_the_mean_over_context_lengths(multihop_dir):
    """Right on about half the prompts (by a hash of the prompt): the group's exact match is the
    plain mean of its eight tasks'."""
    import zlib

    half = Oracle(
        lambda prompt: (
            f" {multihop.solve(prompt)}." if zlib.crc32(prompt.encode()) % 2 else " 1066."
        )
    )
    scores = score(half, ["multihop_2hop"], multihop_dir)
    leaves = [v for k, v in scores.items() if k.startswith("multihop_2hop_")]
    assert len(leaves) == len(MULTIHOP_CONTEXTS) and 0 < sum(leaves) < len(leaves)
    assert scores["multihop_2hop/exact_match"] == pytest.approx(sum(leaves) / len(leaves))


def test_babilong_tasks_use_our_prompt_and_answer_format(tmp_path):
    (tmp_path / "babilong").mkdir()
    for qa, (sample, _, _) in SAMPLES.items():
        (tmp_path / "babilong" / f"{qa}_1k.jsonl").write_text(json.dumps(sample) + "\n")
    prompts = {
        babilong.format_prompt(qa, s["input"], s["question"]): (right, wrong)
        for qa, (s, right, wrong) in SAMPLES.items()
    }
    tasks = ["babilong_qa1_1k", "babilong_qa4_1k"]
    right = Oracle(lambda prompt: prompts[prompt][0])  # a KeyError if lm-eval's prompt is not ours
    assert score(right, tasks, tmp_path) == {"babilong_qa1_1k/acc": 1.0, "babilong_qa4_1k/acc": 1.0}
    wrong = Oracle(lambda prompt: prompts[prompt][1])
    assert score(wrong, tasks, tmp_path) == {"babilong_qa1_1k/acc": 0.0, "babilong_qa4_1k/acc": 0.0}


def test_missing_test_file_names_the_path_and_the_command(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"multihop/1hop_0k.jsonl does not exist.*data multihop --out-dir"
    ):
        score(Oracle(str), ["multihop_1hop_0k"], tmp_path)


def test_every_task_file_is_indexed():
    names = {
        p.stem for p in (REPO / "eval" / "tasks").glob("*.yaml") if not p.stem.startswith("group_")
    }
    manager = lm.task_manager(sorted(names))
    assert names <= set(manager.all_tasks)
    assert len(lm.leaf_tasks(manager, ["babilong_avg20"])) == 20
