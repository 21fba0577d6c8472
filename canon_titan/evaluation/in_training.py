"""Evaluation while training (TOML ``[eval]``): every ``every`` steps and at the last step, the
current weights are scored on lm-eval tasks and/or the run's synthetic test set, and the scores go
to the log, TensorBoard and wandb at that step.

The full weights are gathered from whatever FSDP/TP/PP layout trains them into a separate copy on
the CPU, so training state is never touched. Each weight is gathered whole on the ranks that hold
its shards (the training layout's own collectives), one at a time, and kept only where it is
needed: by rank 0, which evaluates; under pipeline parallelism each stage's first rank sends its
stage's weights to rank 0, one tensor at a time, over a gloo group of those ranks alone (gloo
connects every pair of a group's ranks at once: a group of the whole job would open a socket per
rank in every process). So rank 0 holds the model once, a stage's first rank one weight at a time,
and the other ranks one weight at a time for as long as its gather takes.

Rank 0 then evaluates (``ranks = "first"``); with ``ranks = "all"`` the synthetic test items are
split over all ranks, which read the weights from a file rank 0 writes in the dump folder (memory
mapped: the ranks of a node share one copy in the page cache). lm-eval tasks always run on rank 0,
one task at a time. ``max_seconds`` bounds the whole evaluation: synthetic items stop when it is
spent (the items scored are reported) and lm-eval tasks not yet started are skipped. The other
ranks wait for rank 0's scores through the job's store (``tools/collectives``), where no
collective's timeout runs.

A stop signal (a preemption) cuts an evaluation short at its next item or model call: the step is
saved and the run stops as on any stop (exit 75). The scores so far are logged with
``eval/cut_short`` = 1, and the resumed run, which starts from that step's weights, evaluates it
again before its first step.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from canon_titan.convert.hf import hf_model_in_memory
from canon_titan.data.tokenizers import build_tokenizer
from canon_titan.evaluation import lm
from canon_titan.evaluation.synthetic import greedy_continuation
from canon_titan.hf import DTYPES
from canon_titan.tools.collectives import gather_on_rank_zero, rank_zero_decides
from canon_titan.tools.fileio import write_atomic
from synthetic_data.tasks import make_task, summarize

UNFINISHED_FILE = "eval_cut_short.json"
"""In the dump folder: the step whose evaluation a stop signal cut short (the resumed run's first
evaluation)."""
WEIGHTS_FILE = "eval_weights.pt"
"""In the dump folder, while an evaluation with ``ranks = "all"`` runs: the weights it scores."""


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
    dump_folder: str = ""
    """Where the cut-short record and the weights for ``ranks = "all"`` go ("": none)."""


class EvalStopped(Exception):
    """A stop signal came during an lm-eval task (raised from the model's forward)."""


def _interleave_groups(items: list) -> list:
    """Items in round-robin order over their groups, so a time limit cuts every group evenly."""
    by_group: dict[str, list] = {}
    for item in items:
        by_group.setdefault(item.group, []).append(item)
    out, lists = [], list(by_group.values())
    for i in range(max(map(len, lists), default=0)):
        out += [group[i] for group in lists if i < len(group)]
    return out


def stage_leaders(world: int, pp: int) -> list[int]:
    """The first rank of each pipeline stage (TorchTitan's mesh puts ``pp`` outermost): the ranks
    that hold a stage's weights for the evaluation; rank 0 alone without pipeline parallelism."""
    return list(range(0, world, world // pp)) if pp > 1 else [0]


def _whole(value) -> torch.Tensor:
    """A state-dict entry whole, detached: a DTensor gathered over its mesh (on each rank of it)."""
    if isinstance(value, DTensor):
        if value.device.type != value.device_mesh.device_type:  # offloaded to the CPU
            value = value.to(value.device_mesh.device_type)
        return value.full_tensor().detach()
    return value.detach()


class InTrainingEval:
    def __init__(
        self, settings: EvalSettings, parallel_dims, device: torch.device, total_steps: int
    ):
        self.settings, self.parallel_dims, self.device = settings, parallel_dims, device
        self.total_steps = total_steps
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        pp = parallel_dims.pp if parallel_dims.pp_enabled else 1
        self.leaders = stage_leaders(self.world, pp)
        self.timeout = timedelta(seconds=max(3600.0, 4 * settings.max_seconds))
        """How long the other ranks wait for rank 0's scores."""
        self.group = None
        if self.distributed and len(self.leaders) > 1:
            # Every rank calls new_group; only its members connect. gloo: weights go on the CPU.
            self.group = dist.new_group(self.leaders, backend="gloo", timeout=self.timeout)
        self.cut_short = False
        """Whether a stop signal cut the last evaluation short."""
        self._checked_cut_short = False
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
        """Every model tensor, whole and on the CPU, on rank 0 (an empty dict elsewhere)."""
        leader = self.leaders[self.rank // (self.world // len(self.leaders))]
        entries = [item for part in model_parts for item in get_model_state_dict(part).items()]
        if self.rank == leader != 0:
            dist.send_object_list([len(entries)], dst=0, group=self.group)
        state: dict[str, torch.Tensor] = {}
        for name, value in entries:
            whole = _whole(value)  # a collective over the ranks that hold its shards
            if self.rank == leader == 0:
                state[name] = whole.cpu()
            elif self.rank == leader:
                self._send(name, whole.cpu())
            del whole
        if self.rank == 0:
            for other in self.leaders[1:]:
                state.update(self._receive(other))
        return state

    def _send(self, name: str, tensor: torch.Tensor) -> None:
        dist.send_object_list([(name, tuple(tensor.shape), tensor.dtype)], dst=0, group=self.group)
        dist.send(tensor.contiguous(), dst=0, group=self.group)

    def _receive(self, leader: int) -> dict[str, torch.Tensor]:
        """A stage's weights from its first rank, one tensor at a time."""
        count = [None]
        dist.recv_object_list(count, src=leader, group=self.group)
        state = {}
        for _ in range(count[0]):
            meta = [None]
            dist.recv_object_list(meta, src=leader, group=self.group)
            name, shape, dtype = meta[0]
            state[name] = torch.empty(shape, dtype=dtype)
            dist.recv(state[name], src=leader, group=self.group)
        return state

    def _titan_model(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        with torch.device("meta"):
            model = self.settings.adapter.model_config.build()
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_states(buffer_device=self.device)
        model.load_state_dict(state)
        return model.to(DTYPES[self.settings.dtype]).eval()

    def _shared_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``ranks = "all"``: rank 0's weights on every rank, through a file in the dump folder."""
        path = Path(self.settings.dump_folder) / WEIGHTS_FILE

        def write() -> None:
            tmp = path.with_name(f"{path.name}.tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)

        rank_zero_decides(write, "eval-weights-written", timeout=self.timeout)
        return state if self.rank == 0 else torch.load(path, mmap=True, weights_only=True)

    # ------------------------------------------------------------------ scorers

    def _synthetic(self, state, deadline: float, stop: Callable[[], bool]) -> dict[str, float]:
        s = self.settings
        if self._task is None:
            self._task = make_task(s.dataset, **s.task_params)
        items = _interleave_groups(self._task.test_items(s.test_seed, s.synthetic_count))
        workers = self.world if s.ranks == "all" else 1
        done = []
        stopped = False
        if self.rank < workers:
            model = self._titan_model(state)
            tokenizer = self._text_tokenizer() if self._task.text else None
            for index in range(self.rank, len(items), workers):
                stopped = stop()
                if stopped or time.monotonic() > deadline:
                    break
                done.append((index, greedy_continuation(model, items[index], tokenizer, s.seq_len)))
            del model
        if workers > 1:
            parts = gather_on_rank_zero((done, stopped), "eval-synthetic", timeout=self.timeout)
            if self.rank != 0:
                return {}
            done = sorted(pair for part, _ in parts for pair in part)
            stopped = any(flag for _, flag in parts)
        self.cut_short |= stopped
        if self.rank != 0:
            return {}
        result = summarize(self._task, [items[i] for i, _ in done], [c for _, c in done])
        name = self._task.name
        metrics = {
            f"eval/{name}/accuracy": result["overall"]["accuracy"],
            f"eval/{name}/items": len(done),
        }
        metrics.update(
            {f"eval/{name}/{group}": g["accuracy"] for group, g in result["groups"].items()}
        )
        if len(done) < len(items) and not stopped:
            logger.warning(
                f"[eval] {name}: time limit reached after {len(done)}/{len(items)} test items"
            )
        return metrics

    def _text_tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = build_tokenizer(
                self.settings.tokenizer_kind, self.settings.tokenizer_path
            )
        return self._tokenizer

    def _lm_eval(self, state, deadline: float, stop: Callable[[], bool]) -> dict[str, float]:
        s = self.settings
        if self._hf_tokenizer is None:
            self._hf_tokenizer = lm.hf_tokenizer(s.tokenizer_kind, s.tokenizer_path)
        tokenizer = self._hf_tokenizer
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        model = hf_model_in_memory(
            s.adapter, state.__getitem__, dtype=s.dtype, max_seq_len=s.seq_len, tokenizer_ids=ids
        ).to(self.device)

        def stop_here(module, args):
            if stop():
                raise EvalStopped

        model.register_forward_pre_hook(stop_here)
        metrics = {}
        for task in s.tasks:
            if time.monotonic() > deadline:
                logger.warning(f"[eval] time limit reached: lm-eval task {task} skipped")
                continue
            try:
                result = lm.evaluate(
                    model,
                    tokenizer,
                    [task],
                    limit=s.limit,
                    max_length=lm.default_max_length(s.seq_len),
                    batch_size=s.batch_size,
                    manager=self._task_manager,
                )
            except EvalStopped:
                self.cut_short = True
                break
            metrics.update({f"eval/{k}": v for k, v in lm.metric_values(result).items()})
        return metrics

    # ------------------------------------------------------------------ entry points

    def run(
        self, model_parts, step: int, stop: Callable[[], bool] = lambda: False
    ) -> dict[str, float]:
        """Evaluate the current weights as those of ``step`` (call on every rank); returns the
        metrics on every rank. ``stop()`` says whether a stop signal has come: the evaluation then
        ends at its next item or model call, and ``cut_short`` holds."""
        s = self.settings
        start = time.monotonic()
        deadline = start + s.max_seconds
        self.cut_short = False
        if self.rank == 0:
            logger.info(f"[eval] step {step}: evaluating")
        state = self._full_state(model_parts)
        if s.ranks == "all" and s.synthetic and self.distributed:
            state = self._shared_weights(state)
        metrics: dict[str, float] = {}
        if s.synthetic:
            metrics.update(self._synthetic(state, deadline, stop))
        if s.tasks and self.rank == 0 and not self.cut_short:
            metrics.update(self._lm_eval(state, deadline, stop))
        del state
        if self.rank == 0:
            metrics["eval/seconds"] = time.monotonic() - start
            metrics["eval/cut_short"] = float(self.cut_short)
        metrics = rank_zero_decides(
            lambda: self._close(metrics, step), "eval-result", timeout=self.timeout
        )
        self.cut_short = bool(metrics["eval/cut_short"])
        return metrics

    def _close(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """On rank 0, after an evaluation: the weights file removed, the cut-short record kept or
        cleared, the scores logged."""
        folder = Path(self.settings.dump_folder) if self.settings.dump_folder else None
        if folder is not None:
            (folder / WEIGHTS_FILE).unlink(missing_ok=True)
            record = folder / UNFINISHED_FILE
            if metrics["eval/cut_short"]:
                write_atomic(record, json.dumps({"step": step}))
            else:
                record.unlink(missing_ok=True)
        shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in metrics.items())
        if metrics["eval/cut_short"]:
            logger.warning(
                f"[eval] step {step}: cut short by a stop signal ({shown}); the step is "
                "saved, and the resumed run evaluates it before its first step"
            )
        else:
            logger.info(f"[eval] step {step}: {shown}")
        return metrics

    def cut_short_before(self, step: int) -> bool:
        """Whether a stop signal cut short the evaluation of ``step`` in the run before this one
        (``step``: the one this run resumes from), asked once, before the first step: the record in
        the dump folder, read by rank 0, goes; a record of another step (the run resumed from an
        older checkpoint) leaves that evaluation cut short, as its scores say."""
        if self._checked_cut_short or not self.settings.dump_folder:
            return False
        self._checked_cut_short = True
        record = Path(self.settings.dump_folder) / UNFINISHED_FILE

        def read() -> int | None:
            try:
                cut = int(json.loads(record.read_text())["step"])
            except (OSError, ValueError, KeyError, TypeError):
                return None
            record.unlink(missing_ok=True)
            if cut != step:
                logger.warning(
                    f"[eval] the evaluation of step {cut} was cut short by a stop "
                    f"signal and this run resumes from step {step}: it stays cut short"
                )
            return cut

        return rank_zero_decides(read, "eval-cut-short-before") == step

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
