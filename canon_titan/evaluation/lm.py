"""lm-eval on canon-titan models: ``canon-titan eval lm`` and the in-training evaluator.

A model is evaluated as a transformers model through lm-eval's ``HFLM`` (the harness the
reference's headline table used), never with a BOS token prepended. It comes from an HF export
(``convert to-hf``), from a DCP checkpoint converted in memory, or from live training weights.
Task definitions live in the repository's ``eval/`` folder (the reference suites, multi-hop,
Babilong) next to lm-eval's built-in tasks.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

from torchtitan.tools.logging import logger

from canon_titan.data.tokenizers import (
    LLAMA3_PATTERN,
    _find_file,
    build_tokenizer,
    tiktoken_special_tokens,
)
from canon_titan.evaluation.lm_tasks import MissingTestFile
from canon_titan.hf import DTYPES
from canon_titan.tools.fileio import write_atomic
from model_registry import register_with_transformers

EVAL_DIR = Path(__file__).resolve().parents[2] / "eval"
"""The repository's lm-eval task folder (an editable install keeps it next to the package)."""

DATA_DIR_ENV = "CANON_EVAL_DATA"
"""Where the ``eval/`` tasks that read local files (multi-hop, Babilong) find them."""


@dataclass(frozen=True)
class Column:
    label: str
    task: str
    metric: str


# The reference table's columns, in its order. Which of acc / acc_norm the reference reported is
# not recorded (spec §8); we take acc_norm where lm-eval offers a length-normalised score for a
# multiple-choice task with multi-token choices, acc elsewhere, and print the metric in the JSON.
COLUMNS = (
    Column("LMB", "lambada_openai", "acc"),
    Column("PIQA", "piqa", "acc_norm"),
    Column("Hella", "hellaswag", "acc_norm"),
    Column("Wino", "winogrande", "acc"),
    Column("ARC-e", "arc_easy", "acc_norm"),
    Column("ARC-c", "arc_challenge", "acc_norm"),
    Column("SIQA", "social_iqa", "acc"),
    Column("BoolQ", "boolq", "acc"),
    Column("COPA", "copa", "acc"),
    Column("OBQA", "openbookqa", "acc_norm"),
    Column("RACE", "race", "acc"),
    Column("CSQA", "commonsense_qa", "acc"),
    Column("MMLU", "mmlu", "acc"),
)
AVG10 = ("PIQA", "Hella", "Wino", "ARC-e", "ARC-c", "SIQA", "OBQA", "RACE", "CSQA", "MMLU")
SUITES = {"avg10": "canon_avg10", "all13": "canon_all13"}
"""Suite names on the command line -> the lm-eval groups defined in ``eval/suites/``."""


class LMEvalError(RuntimeError):
    pass


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise LMEvalError(
            "lm-eval is not installed: install canon-titan's eval extra "
            "(scripts/setup.sh dev,eval, or pip install -e '.[eval]')"
        ) from e


def task_manager(tasks: list[str], data_dir: str | None = None, include_paths: list[str] = ()):
    """An lm-eval TaskManager that knows ``eval/`` (and lm-eval's own tasks unless every
    requested name is one of ours: indexing lm-eval's ~15,000 task files takes seconds)."""
    from lm_eval.tasks import TaskManager

    if not EVAL_DIR.is_dir():
        raise LMEvalError(
            f"the task folder {EVAL_DIR} is missing: install canon-titan from its "
            "repository in editable mode (scripts/setup.sh)"
        )
    metadata = {"data_dir": data_dir or os.environ.get(DATA_DIR_ENV) or "eval_data"}
    paths = [str(EVAL_DIR), *map(str, include_paths)]
    ours = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    if all(t in ours.task_index for t in tasks) and not leaf_tasks(ours, tasks, missing=True):
        return ours
    manager = TaskManager(include_path=paths, metadata=metadata)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise LMEvalError(
            f"unknown lm-eval task or group {unknown[0]!r}; suites: {', '.join(SUITES)}; "
            f"tasks are lm-eval's (lm_eval ls tasks) and those in {EVAL_DIR}"
        )
    return manager


def expand_suites(names: list[str]) -> list[str]:
    return [SUITES.get(name, name) for name in names]


def leaf_tasks(manager, names: list[str], missing: bool = False) -> list[str]:
    """The tasks that ``names`` (tasks, groups, tags) expand to, from lm-eval's index; with
    ``missing``, the names met along the way that the index does not know instead."""
    from lm_eval.tasks._index import Kind

    index, leaves, unknown, pending = manager.task_index, [], [], list(names)
    while pending:
        name = pending.pop(0)
        entry = index.get(name)
        if entry is None:
            unknown.append(name)
            continue
        if name in leaves:
            continue
        if entry.kind == Kind.GROUP:
            children = (entry.cfg or {}).get("task", [])
            pending += [c if isinstance(c, str) else c.get("task") for c in children]
        elif entry.kind == Kind.TAG:
            pending += [n for n, e in index.items() if name in e.tags and e.kind != Kind.TAG]
        else:
            leaves.append(name)
    return unknown if missing else leaves


def missing_datasets(manager, names: list[str]) -> tuple[list[str], list[str]]:
    """Test data the tasks cannot get: local test files of the eval/ tasks that do not exist (always
    checked), and, running offline (``HF_DATASETS_OFFLINE=1``), Hub datasets not in the HF cache,
    each as "what (its tasks)"."""
    import datasets

    offline = datasets.config.HF_DATASETS_OFFLINE
    hub: dict[str, list[str]] = {}
    local: dict[str, list[str]] = {}
    for name in leaf_tasks(manager, names):
        if not offline and not str(manager.task_index[name].yaml_path).startswith(str(EVAL_DIR)):
            continue  # online, Hub datasets download on first use
        try:
            manager.load(name)
        except MissingTestFile as e:
            local.setdefault(str(e), []).append(name)
        except Exception as e:  # datasets raises ConnectionError offline
            dataset = (manager.task_index[name].cfg or {}).get("dataset_path")
            hub.setdefault(dataset or str(e).splitlines()[0], []).append(name)

    def named(found: dict[str, list[str]]) -> list[str]:
        return [
            f"{what} (task{'s' if len(tasks) > 1 else ''} {', '.join(tasks[:3])}"
            f"{f' and {len(tasks) - 3} more' if len(tasks) > 3 else ''})"
            for what, tasks in found.items()
        ]

    return named(hub), named(local)


def check_datasets(manager, tasks: list[str]) -> None:
    hub, local = missing_datasets(manager, tasks)
    if local:
        raise LMEvalError(f"local test files are missing: {'; '.join(local)}")
    if hub:
        raise LMEvalError(
            "running offline (HF_DATASETS_OFFLINE=1), and the data of these tasks is not in the "
            f"local Hugging Face cache ({datasets_cache()}): {'; '.join(hub)}. "
            'Download them once with network access (e.g. python -c "import datasets; '
            "datasets.load_dataset('NAME', 'CONFIG')\") or drop those tasks."
        )


def datasets_cache() -> str:
    import datasets

    return str(datasets.config.HF_DATASETS_CACHE)


def hf_tokenizer(kind: str, path: str):
    """The run's tokenizer as a transformers fast tokenizer (what HFLM needs), adding nothing."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    ours = build_tokenizer(kind, path)
    specials = {}
    if kind == "hf":
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        if (folder / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(folder))
        else:
            tok = PreTrainedTokenizerFast(tokenizer_file=str(_find_file(path, ("tokenizer.json",))))
    elif kind == "sentencepiece":
        # transformers' converted (tokenizers-based) Llama tokenizer can split text differently
        # from sentencepiece's BPE; this backend calls sentencepiece itself.
        from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

        pieces = {
            name: ours.model.id_to_piece(i)
            for name, i in (
                ("bos_token", ours.bos_id),
                ("eos_token", ours.eos_id),
                ("unk_token", ours.model.unk_id()),
            )
            if i is not None and i >= 0
        }
        tok = SentencePieceBackend(vocab_file=str(_find_file(path, ("tokenizer.model",))), **pieces)
    else:
        from transformers.convert_slow_tokenizer import TikTokenConverter

        file = _find_file(path, ("tokenizer.model", "tokenizer.tiktoken"))
        from tiktoken.load import load_tiktoken_bpe

        names = list(tiktoken_special_tokens(len(load_tiktoken_bpe(str(file)))))
        converted = TikTokenConverter(
            vocab_file=str(file), pattern=LLAMA3_PATTERN, extra_special_tokens=names
        ).converted()
        tok = PreTrainedTokenizerFast(tokenizer_object=converted)
    for attr, token_id in (("bos_token", ours.bos_id), ("eos_token", ours.eos_id)):
        if token_id is not None and getattr(tok, attr) is None:
            specials[attr] = tok.convert_ids_to_tokens(token_id)
    if specials:
        tok.add_special_tokens(specials)
    return tok


def load_hf_folder(folder: Path, dtype: str):
    """(transformers model, tokenizer, training length) of an HF export."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register_with_transformers()
    hf = AutoModelForCausalLM.from_pretrained(
        str(folder), trust_remote_code=True, dtype=DTYPES[dtype]
    ).eval()
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    return hf, tok, hf.config.max_position_embeddings


LENGTH_FACTOR = 2
"""The evaluation's ``max_length`` is this many times the training length unless set: the release
evaluates its models trained at 4096 tokens with a generator of ``max_tokens`` 8192 (every
recipe's ``eval.generator.max_tokens``), and its multi-hop 5k and 6k tasks measure how far a model
generalises past its training length (RoPE positions are computed, not looked up)."""


def default_max_length(training_length: int) -> int:
    return LENGTH_FACTOR * training_length


class _Drop(logging.Filter):
    """Drops the records whose message holds one of ``fragments``."""

    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


_NOISE = {
    # a model object is how canon-titan always hands lm-eval its model
    "lm_eval.models.huggingface": _Drop(
        "`pretrained` model kwarg is not of type `str`",
        "Passed an already-initialized model",
        # per batch and without the task: CountingHFLM counts them per task
        "Left truncation applied",
        "Combined length of context",
    ),
    # every eval/ task reads its files through a custom dataset, whose kwargs canon-titan passes
    "lm_eval.api.task": _Drop("Custom kwargs can be passed to `--metadata`"),
}


def quiet_lm_eval() -> None:
    """lm-eval logs every request batch at INFO, and repeats warnings that say nothing about this
    evaluation (``_NOISE``). huggingface_hub and datasets print their warnings (a Hub retry) with a
    handler of their own and again through the root logger's: once is enough."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    for name, noise in _NOISE.items():
        if noise not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(noise)
    for name in ("huggingface_hub", "datasets"):
        logging.getLogger(name).propagate = False


def evaluate(
    hf_model,
    tokenizer,
    tasks: list[str],
    *,
    max_length: int,
    limit: float | None = None,
    batch_size: int = 1,
    data_dir: str | None = None,
    include_paths: list[str] = (),
    manager=None,
) -> dict:
    """lm-eval results for ``tasks`` (names, suites expanded) on a transformers model, reading at
    most ``max_length`` tokens of each input. What lm-eval cut from the left of longer inputs is
    said once per task and returned under ``truncated``."""
    import lm_eval

    from canon_titan.evaluation.long_inputs import CountingHFLM

    quiet_lm_eval()
    tasks = expand_suites(tasks)
    if manager is None:  # a caller passing its manager has checked the datasets already
        manager = task_manager(tasks, data_dir, include_paths)
        check_datasets(manager, tasks)
    # transformers warns of any input past the tokenizer's model_max_length (an export's training
    # length, or a fixed 4096) as if the model could not read it; the limit here is max_length
    tokenizer.model_max_length = max_length
    lm = CountingHFLM(
        pretrained=hf_model,
        tokenizer=tokenizer,
        backend="causal",
        add_bos_token=False,
        max_length=max_length,
        batch_size=batch_size,
        device=str(next(hf_model.parameters()).device),
    )
    try:
        # lm-eval records "your repo's" commit (`git describe` in the current directory) in results
        # this function drops; outside a checkout git prints "fatal: not a git repository"
        # (tests/test_upstream.py pins the name)
        with patch("lm_eval.evaluator.get_git_commit_hash", lambda: None):
            out = lm_eval.simple_evaluate(
                model=lm,
                tasks=tasks,
                limit=limit,
                task_manager=manager,
                log_samples=False,
                bootstrap_iters=BOOTSTRAP_ITERS,
                verbosity="WARNING",
            )
    except ConnectionError as e:
        raise LMEvalError(f"a dataset could not be downloaded: {e}") from e
    truncated = {
        task: {
            "inputs": cut.inputs,
            "of": lm.inputs[task],
            "longest_tokens": cut.longest,
            "limit_tokens": cut.limit,
        }
        for task, cut in sorted(lm.cut.items())
    }
    for task, cut in truncated.items():
        logger.warning(
            f"[eval] {task}: {cut['inputs']:,} of {cut['of']:,} inputs are longer than the "
            f"{cut['limit_tokens']:,} tokens the model reads (max_length {max_length:,}"
            f"{', less the tokens to generate' if cut['limit_tokens'] < max_length else ''}); the "
            f"longest has {cut['longest_tokens']:,}; lm-eval kept the last {cut['limit_tokens']:,} "
            "tokens of each"
        )
    # What lm-eval's own table (lm_eval.utils.make_table) reads, without the run's full configs.
    return {
        "results": out["results"],
        "groups": out.get("groups", {}),
        "n-samples": out.get("n-samples", {}),
        "versions": out.get("versions", {}),
        "n-shot": out.get("n-shot", {}),
        "higher_is_better": out.get("higher_is_better", {}),
        "group_subtasks": out.get("group_subtasks", {}),
        "configs": {
            k: {"num_fewshot": v.get("num_fewshot")} for k, v in out.get("configs", {}).items()
        },
        "max_length": max_length,
        "truncated": truncated,
    }


BOOTSTRAP_ITERS = 1000
"""Resamples for the standard error of metrics without a closed form (accuracy's is exact)."""


def lm_eval_tables(result: dict) -> str:
    """lm-eval's own tables (tasks, then groups), with its standard-error column."""
    from lm_eval.utils import make_table

    tables = [make_table(result)]
    if result.get("groups"):
        tables.append(make_table(result, "groups"))
    return "\n".join(tables)


def metric_values(result: dict) -> dict[str, float]:
    """Flat ``task/metric`` -> value for every numeric score (stderr and aliases dropped)."""
    flat = {}
    for task, metrics in result["results"].items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            name = f"{task}/{metric}" if filt == "none" else f"{task}/{metric}[{filt}]"
            flat[name] = float(value)
    return flat


def table(result: dict) -> tuple[dict[str, float | None], str]:
    """The reference columns found in the results (%), Avg10 when all ten are there, and those
    printed in the reference table's order ("" when none is there; lm-eval's table has the rest)."""
    values: dict[str, float | None] = {}
    for col in COLUMNS:
        score = result["results"].get(col.task, {}).get(f"{col.metric},none")
        values[col.label] = None if score is None else 100 * float(score)
    avg = [values[label] for label in AVG10]
    values["Avg10"] = sum(avg) / len(avg) if all(v is not None for v in avg) else None
    shown = [label for label, v in values.items() if v is not None]
    if not shown:
        return values, ""
    return values, "\n".join(
        [
            "  ".join(f"{label:>6}" for label in shown),
            "  ".join(f"{values[label]:6.1f}" for label in shown),
        ]
    )


def evaluation_record(
    result: dict, *, model: str, dtype: str, limit, tasks: list[str], training_length: int
) -> dict:
    values, _ = table(result)
    return {
        "model": str(model),
        "dtype": dtype,
        "limit": limit,
        "tasks": tasks,
        "training_length": training_length,
        "columns": values,
        "metrics": {c.label: c.metric for c in COLUMNS},
        **result,
    }


def write_json(record: dict, path: str | Path) -> None:
    write_atomic(Path(path), json.dumps(record, indent=2, default=str) + "\n")


def default_output(model: str | Path) -> Path:
    """``eval_lm_<model folder>.json`` beside the model folder: one file per model scored."""
    model = Path(model).resolve()
    return model.parent / f"eval_lm_{model.name}.json"
