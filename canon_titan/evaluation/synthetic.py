"""Score a trained model on a synthetic task's held-out test set with greedy generation.

``evaluate(run, checkpoint)`` builds the run's task (the ``[dataloader]`` dataset and its task
section), loads the checkpoint's weights, completes every test prompt greedily (one sequence at a
time, no padding, so a batch never changes a result) and returns per-group accuracies, e.g. per
hop count for Depo. ``canon-titan eval synthetic`` prints the table and writes JSON.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torchtitan.tools.logging import logger

from canon_titan.convert.dcp_io import find_step_dir, load_model
from canon_titan.data.builtin import ASSET_DIR
from canon_titan.data.tokenizers import build_tokenizer
from canon_titan.tools.fileio import write_atomic
from synthetic_data.tasks import SECTION, TestItem, summarize

DEFAULT_TEST_SEED = 20251121
"""Test sets come from their own streams ("test-..."), never from training windows."""


class EvalError(ValueError):
    pass


def task_of(run):
    dataset = run["dataloader"]["dataset"]
    if dataset not in SECTION:
        raise EvalError(
            f"{run.source}: [dataloader] dataset = {dataset!r} is not a synthetic task; "
            f"available: {', '.join(SECTION)}"
        )
    return run.task


@torch.inference_mode()
def greedy_continuation(
    model, item: TestItem, tokenizer=None, max_len: int | None = None
) -> list[int] | str:
    """Greedy tokens after ``item.prompt`` until a stop token, ``max_new`` tokens, ``stop_chars``
    decoded characters (text tasks) or the model's context ``max_len`` (the longest input it
    was trained on). Text is decoded together with the prompt and cut after it, so tokenizers
    that drop a leading space when decoding a fragment (SentencePiece) score correctly."""
    text = isinstance(item.prompt, str)
    ids = tokenizer.encode(item.prompt, add_bos=True, add_eos=False) if text else list(item.prompt)
    prompt_text = tokenizer.decode(ids) if text else ""
    new: list[int] = []
    decoded = ""
    while len(new) < item.max_new and (max_len is None or len(ids) <= max_len):
        logits = model(torch.tensor([ids]))
        token = int(logits[0, -1].argmax())
        ids.append(token)
        new.append(token)
        if token in item.stop_ids:
            break
        if text:
            decoded = tokenizer.decode(ids)[len(prompt_text) :]
            if item.stop_chars is not None and len(decoded) >= item.stop_chars:
                break
    return decoded if text else new


def evaluate(run, checkpoint: str | Path, count: int = 100, seed: int = DEFAULT_TEST_SEED) -> dict:
    task = task_of(run)
    step_dir = find_step_dir(checkpoint)
    model = load_model(run, step_dir)
    tokenizer = None
    if task.text:
        tokenizer = build_tokenizer(
            run["tokenizer"]["kind"], run["tokenizer"]["path"] or str(ASSET_DIR)
        )
    items = task.test_items(seed, count)
    max_len = run["training"]["seq_len"]
    too_long = [i for i in items if not isinstance(i.prompt, str) and len(i.prompt) > max_len]
    if too_long:
        raise EvalError(
            f"{len(too_long)} test prompts are longer than the model's context "
            f"([training] seq_len = {max_len})"
        )
    continuations, started = [], time.monotonic()
    for n, item in enumerate(items, 1):
        continuations.append(greedy_continuation(model, item, tokenizer, max_len))
        if n % max(1, len(items) // 10) == 0 or n == len(items):
            elapsed = time.monotonic() - started
            logger.info(
                f"eval {task.name}: {n}/{len(items)} items, {elapsed:.0f}s, "
                f"ETA {elapsed / n * (len(items) - n):.0f}s"
            )
    result = summarize(task, items, continuations)
    result.update(
        {
            "dataset": task.name,
            "params": vars(task.params),
            "model": run["model"]["name"],
            "checkpoint": str(step_dir),
            "count": count,
            "seed": seed,
            "test_set": task.test_set(count),
        }
    )
    return result


def format_table(result: dict) -> str:
    rows = [(name, g["correct"], g["total"], g["accuracy"]) for name, g in result["groups"].items()]
    overall = result["overall"]
    rows.append(("all", overall["correct"], overall["total"], overall["accuracy"]))
    width = max(len(r[0]) for r in rows)
    lines = [
        f"{result['dataset']} ({result['model']}): greedy accuracy on held-out items "
        f"({result['test_set']})",
        f"{'group':<{width}}  correct  total  accuracy",
    ]
    lines += [f"{name:<{width}}  {c:>7}  {t:>5}  {100 * a:7.1f}%" for name, c, t, a in rows]
    return "\n".join(lines)


def write_result(result: dict, path: str | Path) -> None:
    write_atomic(Path(path), json.dumps(result, indent=2) + "\n")
