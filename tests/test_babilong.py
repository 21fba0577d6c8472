"""Babilong qa1-qa5 prompts and answer parsing against hand-written strings."""

import pytest

from canon_titan.evaluation import babilong

QA1_EXPECTED = """The text below follows several people as they move between places. Answer the question about where a person is at the end, using the sentence: The most recent location of <person> is <place>.

<example>
<context>
Anna went to the garden. Tom moved to the office. Anna travelled to the hallway.
</context>

Question: Where is Anna?
Answer: The most recent location of Anna is hallway.
</example>

<example>
<context>
Tom journeyed to the kitchen. Lena went back to the bedroom.
</context>

Question: Where is Tom?
Answer: The most recent location of Tom is kitchen.
</example>

<context>
Mary moved to the bathroom. John went to the hallway.
</context>

Question: Where is Mary?
Answer:"""  # noqa: E501 (the prompt as the model sees it)


def test_qa1_prompt_is_exactly_the_reference_layout():
    prompt = babilong.format_prompt(
        "qa1", "Mary moved to the bathroom. John went to the hallway.", "Where is Mary?"
    )
    assert prompt == QA1_EXPECTED


@pytest.mark.parametrize(
    "task,question,tail_answer",
    [
        ("qa2", "Where is the football?", "Answer: The cup is in kitchen.\n</example>"),
        (
            "qa3",
            "Where was the apple before the kitchen?",
            "Answer: Before the hallway the book was in the garden.\n</example>",
        ),
        ("qa4", "What is the kitchen east of?", "Answer: bedroom\n</example>"),
        ("qa5", "What did Fred give to Bill?", "Answer: apple\n</example>"),
    ],
)
def test_other_prompts_end_with_context_question_and_bare_answer(task, question, tail_answer):
    prompt = babilong.format_prompt(task, "Some facts.", question)
    assert prompt.endswith(
        f"{tail_answer}\n\n<context>\nSome facts.\n</context>\n\nQuestion: {question}\nAnswer:"
    )
    assert prompt.count("<example>") == 2 and not prompt.endswith(" ")


@pytest.mark.parametrize(
    "task,continuation,target,right",
    [
        ("qa1", " The most recent location of Mary is bathroom.\nQuestion: ...", "bathroom", True),
        ("qa1", " The most recent location of Mary is the bathroom.", "bathroom", True),
        ("qa1", " The most recent location of Mary is hallway.", "bathroom", False),
        ("qa1", " bathroom", "bathroom", False),  # not in the required format
        ("qa2", " The football is in garden.", "garden", True),
        ("qa2", " The football is in the office.", "garden", False),
        ("qa3", " Before the kitchen the apple was in the office.", "office", True),
        ("qa3", " Before the kitchen the apple was in office.", "office", True),
        ("qa3", " The apple was in the office.", "office", False),
        ("qa4", " bedroom\n", "bedroom", True),
        ("qa4", " Bedroom.", "bedroom", True),
        ("qa4", " kitchen", "bedroom", False),
        ("qa5", " Fred", "fred", True),
        ("qa5", "", "fred", False),
    ],
)
def test_answer_parsing(task, continuation, target, right):
    assert babilong.is_correct(task, continuation, target) is right


def test_unknown_task_and_bad_sample_files(tmp_path):
    with pytest.raises(KeyError, match="available: qa1, qa2, qa3, qa4, qa5"):
        babilong.format_prompt("qa6", "", "")
    path = tmp_path / "qa1.jsonl"
    path.write_text(
        '{"input": "Mary went home.", "question": "Where is Mary?", "target": '
        '"home"}\n{"input": 1}\n'
    )
    with pytest.raises(
        ValueError, match="qa1.jsonl:2: expected a JSON object with input, question and target"
    ):
        babilong.read_samples(path)
