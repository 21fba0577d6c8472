"""What a run's config implies, filled in before its model is built and its checks run: the
absolute initial-load path, the synthetic task's full parameters (the other task sections leave
the config), the loss's reach (answer tokens only for the integer-token tasks, unless set), and the
vocabulary the tokenizer, the task or the weights being converted set."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from canon_titan.config.run import RunConfig
from canon_titan.config.sections import TASK_SECTIONS
from canon_titan.data.builtin import ASSET_DIR
from canon_titan.data.tokenizers import build_tokenizer
from synthetic_data.tasks import PRESETS, SECTION, VOCAB, TaskParamError, make_task


def derive(run: RunConfig, environment: bool) -> None:
    """Resolve ``run.sections`` in place (``[model]`` holds only the keys set so far)."""
    _initial_load_path(run)
    _task_parameters(run, environment)
    dataset = run["dataloader"]["dataset"]
    integer_task = dataset in PRESETS and not PRESETS[dataset][0].text
    if run["dataloader"]["answer_only_loss"] is None:
        run["dataloader"]["answer_only_loss"] = integer_task
    if integer_task:
        if ("model", "vocab_size") not in run.origins:
            run.sections["model"]["vocab_size"] = VOCAB  # integer tokens, no tokenizer
        return
    run.tokenizer_vocab = _tokenizer_vocab(run)
    vocab = run.weights_vocab or run.tokenizer_vocab
    if vocab is not None and ("model", "vocab_size") not in run.origins:
        run.sections["model"]["vocab_size"] = vocab


def _initial_load_path(run: RunConfig) -> None:
    """Absolute (TorchTitan needs that; the resolved config then works from any directory)."""
    ckpt = run["checkpoint"]
    path = ckpt["initial_load_path"]
    if path and "://" not in path:
        ckpt["initial_load_path"] = str(Path(path).expanduser().resolve())


def _task_parameters(run: RunConfig, environment: bool) -> None:
    """The chosen synthetic task with its full parameters in its section; task sections other than
    the chosen dataset's must stay unset and leave the config."""
    dataset = run["dataloader"]["dataset"]
    own = SECTION.get(dataset)
    for name in TASK_SECTIONS:
        if name == own:
            continue
        for key, value in run[name].items():
            if value is not None:
                reads = f"reads [{own}]" if own else "is not a synthetic task"
                raise run.error(
                    name, key, f"is set, but [dataloader] dataset = {dataset!r} {reads}"
                )
        del run.sections[name]
    if own is None:
        return
    overrides = {k: v for k, v in run[own].items() if v is not None}
    if not environment and any(overrides.get(k) for k in ("grammar", "bior_path")):
        return  # the task needs its file, which may be on another machine
    try:
        task = make_task(dataset, **overrides)
    except TaskParamError as e:
        raise run.error(own, e.key, str(e)) from None
    except OSError as e:
        raise run.error(
            own, "bior_path", f"cannot read {overrides.get('bior_path')}: {e.strerror or e}"
        ) from None
    except ValueError as e:  # a bad bioR file: its path and line are in the message
        raise run.error(own, "bior_path", str(e)) from None
    run[own].update(dataclasses.asdict(task.params))


def _tokenizer_vocab(run: RunConfig) -> int | None:
    """The tokenizer's vocabulary size, or None when its files are not there (or none is named)."""
    kind, path = run["tokenizer"]["kind"], run["tokenizer"]["path"]
    if path is None and kind != "hf":
        return None  # reported by the checks
    try:
        return build_tokenizer(kind, path or str(ASSET_DIR)).get_vocab_size()
    except (FileNotFoundError, OSError):
        return None
    except Exception as e:  # a corrupt or wrong-kind tokenizer file
        raise run.error(
            "tokenizer", "path", f"cannot load a {kind} tokenizer from {path}: {e}"
        ) from None
