"""Babilong qa1-qa5 in the reference's modified few-shot setting (spec 7.2).

Each prompt is an instruction, worked examples, then the (possibly long) context, the question
and ``Answer:``; the model is asked to answer in a fixed sentence format (qa1-qa3) or with one
word (qa4, qa5), and ``parse_answer`` reads the answer word back out of its continuation. The
layout follows the reference (``{instruction}\\n\\n{examples}\\n\\n<context>\\n...\\n</context>
\\n\\nQuestion: ...\\nAnswer:``, stripped); the instruction and example wording are this
project's own. Babilong samples (context with facts hidden in book text, question, target word)
are read from local files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Format:
    instruction: str
    examples: tuple[tuple[str, str, str], ...]
    """(context, question, answer) worked examples."""
    answer: re.Pattern | None
    """Reads the answer word from a sentence answer; None: the first word is the answer."""


FORMATS = {
    "qa1": Format(
        "The text below follows several people as they move between places. Answer the question "
        "about where a person is at the end, using the sentence: The most recent location of "
        "<person> is <place>.",
        (
            (
                "Anna went to the garden. Tom moved to the office. Anna travelled to the hallway.",
                "Where is Anna?",
                "The most recent location of Anna is hallway.",
            ),
            (
                "Tom journeyed to the kitchen. Lena went back to the bedroom.",
                "Where is Tom?",
                "The most recent location of Tom is kitchen.",
            ),
        ),
        re.compile(r"most recent location of \w+ is (?:the )?(\w+)", re.I),
    ),
    "qa2": Format(
        "The text below tells where people go and which objects they pick up or put down. An "
        "object is wherever the person holding it is. Answer with the sentence: The <object> is "
        "in <place>.",
        (
            (
                "Tom picked up the ball there. Tom went to the garden. Anna moved to the office.",
                "Where is the ball?",
                "The ball is in garden.",
            ),
            (
                "Lena took the cup. Lena journeyed to the kitchen. Lena left the cup. "
                "Lena went to the hallway.",
                "Where is the cup?",
                "The cup is in kitchen.",
            ),
        ),
        re.compile(r"The \w+ is in (?:the )?(\w+)", re.I),
    ),
    "qa3": Format(
        "The text below tells where people carry objects. Answer where the object was just before "
        "it reached the given place, with the sentence: Before the <place> the <object> was in "
        "the <earlier place>.",
        (
            (
                "Anna took the apple. Anna went to the office. Anna moved to the kitchen. "
                "Anna dropped the apple.",
                "Where was the apple before the kitchen?",
                "Before the kitchen the apple was in the office.",
            ),
            (
                "Tom grabbed the book in the garden. Tom went to the hallway. Tom "
                "travelled to the bedroom.",
                "Where was the book before the hallway?",
                "Before the hallway the book was in the garden.",
            ),
        ),
        re.compile(r"Before the \w+ the \w+ was in (?:the )?(\w+)", re.I),
    ),
    "qa4": Format(
        "The text below says how rooms are placed relative to each other. Answer the question "
        "with a single word: the name of a room.",
        (
            (
                "The kitchen is north of the office. The garden is west of the office.",
                "What is north of the office?",
                "kitchen",
            ),
            (
                "The bedroom is south of the hallway. The bathroom is east of the hallway.",
                "What is the hallway south of?",
                "bedroom",
            ),
        ),
        None,
    ),
    "qa5": Format(
        "The text below tells who gives objects to whom. Answer the question with a single word: "
        "a name or an object.",
        (
            (
                "Anna picked up the milk. Anna handed the milk to Tom. Tom passed the "
                "milk to Lena.",
                "Who gave the milk to Lena?",
                "Tom",
            ),
            (
                "Lena took the apple there. Lena gave the apple to Anna.",
                "What did Lena give to Anna?",
                "apple",
            ),
        ),
        None,
    ),
}


def format_example(context: str, question: str, answer: str) -> str:
    return (
        f"<example>\n<context>\n{context}\n</context>\n\nQuestion: {question}\nAnswer: "
        f"{answer}\n</example>"
    )


def format_prompt(task: str, context: str, question: str) -> str:
    """The full prompt for one Babilong sample (no BOS; the model continues after "Answer:")."""
    if task not in FORMATS:
        raise KeyError(f"unknown Babilong task {task!r}; available: {', '.join(FORMATS)}")
    spec = FORMATS[task]
    examples = "\n\n".join(format_example(*e) for e in spec.examples)
    return (
        f"{spec.instruction}\n\n{examples}\n\n"
        + f"<context>\n{context}\n</context>\n\nQuestion: {question}"
        + "\nAnswer: "
    ).strip()


def parse_answer(task: str, continuation: str) -> str | None:
    """The answer word of a model's continuation (lowercase), or None when it is not in the
    format."""
    text = continuation.strip().split("\n", 1)[0]
    spec = FORMATS[task]
    if spec.answer is None:
        words = re.findall(r"[A-Za-z]+", text)
        return words[0].lower() if words else None
    match = spec.answer.search(text)
    return match.group(1).lower() if match else None


def is_correct(task: str, continuation: str, target: str) -> bool:
    return parse_answer(task, continuation) == target.strip().lower()


def read_samples(path) -> list[dict]:
    """Babilong samples from JSON lines with "input" (the context), "question" and "target"."""
    samples = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            samples.append({k: str(record[k]) for k in ("input", "question", "target")})
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"{path}:{number}: expected a JSON object with input, question and target"
            ) from None
    return samples
