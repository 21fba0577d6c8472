"""The Python behind the lm-eval tasks in ``eval/tasks/`` (multi-hop birth years, Babilong).

Both read test files from a local data folder (lm-eval metadata ``data_dir``, set by
``canon-titan eval lm --data-dir`` or ``$CANON_EVAL_DATA``):

- ``multihop/{1hop,2hop}_{0k,0.5k,1k,...,6k}.jsonl`` from ``canon-titan data multihop --out-dir``;
- ``babilong/qa{1..5}_{0k,1k,2k,4k}.jsonl`` with "input", "question", "target" per line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from canon_titan.evaluation import babilong

MULTIHOP_CONTEXTS = {
    "0k": 0,
    "0.5k": 512,
    "1k": 1024,
    "2k": 2048,
    "3k": 3072,
    "4k": 4096,
    "5k": 5120,
    "6k": 6144,
}
"""The reference's multi-hop context columns, in tokens (k = 1024)."""
MULTIHOP_HOPS = {"1hop": (5, 1), "2hop": (3, 2)}
"""(people per group N, hops k) of the two reference settings."""
BABILONG_CONTEXTS = ("0k", "1k", "2k", "4k")
_YEAR = re.compile(r"\s*(\d{4})(?!\d)")


class MissingTestFile(FileNotFoundError):
    """A local task's test file is not in its data folder."""


def local_jsonl(data_dir: str = "eval_data", file: str = "", qa: str | None = None, **_):
    """``custom_dataset`` of the local tasks: ``{data_dir}/{file}`` as a one-split DatasetDict."""
    import datasets

    path = Path(data_dir) / file
    if not path.is_file():
        hint = (
            "canon-titan data multihop --out-dir"
            if file.startswith("multihop")
            else "export the public Babilong release as JSON lines of input, question and target; "
            "docs/evaluation.md, section Babilong"
        )
        raise MissingTestFile(
            f"test file {path} does not exist (data dir {data_dir!r}: pass "
            f"--data-dir or set CANON_EVAL_DATA; to make it: {hint})"
        )
    if qa is not None:
        rows = [{**row, "task": qa} for row in babilong.read_samples(path)]
    else:
        rows = [
            json.loads(line)
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def multihop_results(doc: dict, results: list[str]) -> dict[str, float]:
    """Exact match: the continuation starts with the four-digit year asked for."""
    found = _YEAR.match(results[0])
    return {"exact_match": float(found is not None and found.group(1) == doc["answer"])}


def babilong_prompt(doc: dict) -> str:
    return babilong.format_prompt(doc["task"], doc["input"], doc["question"])


def babilong_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"acc": float(babilong.is_correct(doc["task"], results[0], doc["target"]))}
