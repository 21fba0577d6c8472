"""Evaluation while training (TOML ``[eval]``): every ``every`` steps and at the last step, the
current weights are scored on lm-eval tasks and/or the run's synthetic test set, and the scores go
to the log, TensorBoard and wandb at that step.

The full weights are gathered from whatever FSDP/TP/PP layout trains them (a collective on every
rank) into a separate copy, so training state is never touched. The first rank then evaluates
(``ranks = "first"``); with ``ranks = "all"`` the synthetic test items are split over all ranks.
lm-eval tasks always run on the first rank, one task at a time. ``max_seconds`` bounds the whole
evaluation: synthetic items stop when it is spent (the items scored are reported) and lm-eval tasks
not yet started are skipped. The other ranks wait on a separate process group whose timeout
covers the evaluation, not the training collectives' timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchtitan.tools.logging import logger

from canon_titan.convert.hf import hf_model_in_memory
from canon_titan.data.tokenizers import build_tokenizer
from canon_titan.evaluation import lm
from canon_titan.evaluation.synthetic import greedy_continuation
from canon_titan.hf import DTYPES
from canon_titan.tools.collectives import from_rank0
from synthetic_data.tasks import make_task, summarize


@dataclass(kw_only=True)
class EvalSettings:
    """The ``[eval]`` section plus what the evaluator needs to know about the run."""

    every: int
    tasks: list[str]
    synthetic: bool
    synthetic_count: int
    limit: int | None
    ranks: str
    max_seconds: float
    dtype: str
    batch_size: int
    data_dir: str | None
    include_path: list[str]
    adapter: Any = None
    """The run's ``CanonStateDictAdapter``: its model config and Hugging Face format."""
    tokenizer_kind: str = "hf"
    tokenizer_path: str = ""
    seq_len: int = 0
    dataset: str = ""
    task_params: dict = field(default_factory=dict)
    test_seed: int = 0


def _interleave_groups(items: list) -> list:
    """Items in round-robin order over their groups, so a time limit cuts every group evenly."""
    by_group: dict[str, list] = {}
    for item in items:
        by_group.setdefault(item.group, []).append(item)
    out, lists = [], list(by_group.values())
    for i in range(max(map(len, lists), default=0)):
        out += [group[i] for group in lists if i < len(group)]
    return out


class InTrainingEval:
    def __init__(self, settings: EvalSettings, parallel_dims, device: torch.device, total_steps: int):
        self.settings, self.parallel_dims, self.device, self.total_steps = settings, parallel_dims, device, total_steps
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.group = None
        if self.distributed:
            # gloo: results and weights travel as Python objects on CPU, whatever the training backend.
            self.group = dist.new_group(backend="gloo",
                                        timeout=timedelta(seconds=max(3600.0, 4 * settings.max_seconds)))
        self._task_manager = None
        self._task = None
        self._tokenizer = None
        self._hf_tokenizer = None
        if settings.tasks and self.rank == 0:
            # Unknown task names and, offline, uncached datasets fail here, before training starts,
            # not at the first evaluation hours later.
            tasks = lm.expand_suites(settings.tasks)
            self._task_manager = lm.task_manager(tasks, settings.data_dir, settings.include_path)
            lm.check_datasets(self._task_manager, tasks)

    def due(self, step: int) -> bool:
        every = self.settings.every
        return every > 0 and (step % every == 0 or step == self.total_steps)

    # ------------------------------------------------------------------ weights

    def _full_state(self, model_parts) -> dict[str, torch.Tensor]:
        """Every model tensor, full and on CPU, on the first rank (and on all with ranks = "all")."""
        pp = self.parallel_dims.pp_enabled
        state: dict[str, torch.Tensor] = {}
        for part in model_parts:
            # With PP each stage's first rank holds that stage's full tensors; without it rank 0 does.
            options = StateDictOptions(full_state_dict=True, cpu_offload=not pp)
            state.update({k: v.detach().cpu() for k, v in get_model_state_dict(part, options=options).items()})
        if pp:
            stage_size = self.world // self.parallel_dims.pp
            mine = state if self.rank % stage_size == 0 else {}
            gathered = [None] * self.world if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0, group=self.group)
            state = {k: v for part in (gathered or []) for k, v in part.items()}
        if self.settings.ranks == "all" and self.distributed:
            state = from_rank0(state if self.rank == 0 else None, self.group)
        return state

    def _titan_model(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        with torch.device("meta"):
            model = self.settings.adapter.model_config.build()
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_states(buffer_device=self.device)
        model.load_state_dict(state)
        return model.to(DTYPES[self.settings.dtype]).eval()

    # ------------------------------------------------------------------ scorers

    def _synthetic(self, state, deadline: float) -> dict[str, float]:
        s = self.settings
        if self._task is None:
            self._task = make_task(s.dataset, **s.task_params)
        items = _interleave_groups(self._task.test_items(s.test_seed, s.synthetic_count))
        workers = self.world if s.ranks == "all" else 1
        done = []
        if self.rank < workers:
            model = self._titan_model(state)
            tokenizer = self._text_tokenizer() if self._task.text else None
            for index in range(self.rank, len(items), workers):
                if time.monotonic() > deadline:
                    break
                done.append((index, greedy_continuation(model, items[index], tokenizer, s.seq_len)))
            del model
        if workers > 1:
            parts = [None] * self.world
            dist.all_gather_object(parts, done, group=self.group)
            done = sorted(pair for part in parts for pair in part)
        if self.rank != 0:
            return {}
        result = summarize(self._task, [items[i] for i, _ in done], [c for _, c in done])
        name = self._task.name
        metrics = {f"eval/{name}/accuracy": result["overall"]["accuracy"], f"eval/{name}/items": len(done)}
        metrics.update({f"eval/{name}/{group}": g["accuracy"] for group, g in result["groups"].items()})
        if len(done) < len(items):
            logger.warning(f"[eval] {name}: time limit reached after {len(done)}/{len(items)} test items")
        return metrics

    def _text_tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = build_tokenizer(self.settings.tokenizer_kind, self.settings.tokenizer_path)
        return self._tokenizer

    def _lm_eval(self, state, deadline: float) -> dict[str, float]:
        s = self.settings
        if self._hf_tokenizer is None:
            self._hf_tokenizer = lm.hf_tokenizer(s.tokenizer_kind, s.tokenizer_path)
        tokenizer = self._hf_tokenizer
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        model = hf_model_in_memory(s.adapter, state.__getitem__, dtype=s.dtype, max_seq_len=s.seq_len,
                                   tokenizer_ids=ids).to(self.device)
        metrics = {}
        for task in s.tasks:
            if time.monotonic() > deadline:
                logger.warning(f"[eval] time limit reached: lm-eval task {task} skipped")
                continue
            result = lm.evaluate(model, tokenizer, [task], max_length=lm.default_max_length(s.seq_len),
                                 limit=s.limit, batch_size=s.batch_size, manager=self._task_manager)
            metrics.update({f"eval/{k}": v for k, v in lm.metric_values(result).items()})
        return metrics

    # ------------------------------------------------------------------ entry point

    def run(self, model_parts, step: int) -> dict[str, float]:
        """Evaluate the current weights (call on every rank); returns the metrics on every rank."""
        s = self.settings
        start = time.monotonic()
        deadline = start + s.max_seconds
        state = self._full_state(model_parts)
        metrics: dict[str, float] = {}
        if s.synthetic:
            metrics.update(self._synthetic(state, deadline))
        if s.tasks and self.rank == 0:
            metrics.update(self._lm_eval(state, deadline))
        del state
        if self.rank == 0:
            metrics["eval/seconds"] = time.monotonic() - start
        if self.distributed:
            metrics = from_rank0(metrics, self.group)
        if self.rank == 0:
            shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in metrics.items())
            logger.info(f"[eval] step {step}: {shown}")
        return metrics

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
