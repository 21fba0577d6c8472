"""TorchTitan's Trainer with canon-titan's additions: the resolved TOML saved with the run,
progress (step, percentage, ETA) logged with the metrics, evaluation during training, resuming
past damaged checkpoints, resuming at another data-parallel size, and complete Hugging Face
folders from ``[checkpoint] last_save_in_hf``."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import torch
import tyro
from torch.distributed.tensor import DTensor
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.distributed.utils import set_determinism
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from canon_titan.components.checkpointer import newest_checkpoint_line
from canon_titan.components.divergence import (
    RECORD_SIZE,
    Diverged,
    DivergenceSection,
    LossGuard,
    NonFiniteLoss,
    StepVerdict,
)
from canon_titan.components.preemption import Preempted, StopSignals
from canon_titan.components.progress import Progress
from canon_titan.components.queued_step import QueuedCopies
from canon_titan.components.resume_checks import (
    ResumeRefused,
    check_resume,
    loads_model_only,
    saved_loader_keys,
)
from canon_titan.components.step_records import StepRecords
from canon_titan.convert.dcp_io import (
    NoLoadableCheckpoint,
    hf_export_steps,
    model_only_steps,
    resume_step,
)
from canon_titan.convert.hf import tokenizer_info, write_hf_files
from canon_titan.evaluation.in_training import EvalSettings, InTrainingEval
from canon_titan.models.common.context_parallel import context_parallel_inputs
from canon_titan.models.common.tensor_parallel import sum_partial_gradients
from canon_titan.tools import runtime
from canon_titan.tools.collectives import rank_zero_decides
from canon_titan.tools.fileio import write_atomic

RUN_CONFIG_FILE = "run_config.toml"


class FinishedRun(RuntimeError):
    pass


def finished_message(dump_folder: str, step: int, steps: int) -> str:
    return (
        f"dump folder {dump_folder} already holds a finished run: its checkpoint "
        f"step-{step} reaches "
        f"[training] steps = {steps}, so there is nothing to train. Raise steps to "
        "continue it, or use "
        "another [job] dump_folder for a new run"
    )


def resume_point(
    folder: str, load_step: int, steps: int, dump_folder: str
) -> tuple[int, list[str]]:
    """The checkpoint step a run resumes from (-1: a fresh start) and the newer step folders it
    skips; FinishedRun when a checkpoint or a Hugging Face export already reaches ``steps``."""
    weights_only = max([*hf_export_steps(folder), *model_only_steps(folder)], default=-1)
    if weights_only >= steps:
        raise FinishedRun(finished_message(dump_folder, weights_only, steps))
    step, skipped = resume_step(folder, load_step)
    if step >= steps:
        raise FinishedRun(finished_message(dump_folder, step, steps))
    return step, skipped


@dataclass
class ResumePlan:
    """Where a run resumes (``step``, -1: a fresh start) and what of that checkpoint it takes."""

    step: int
    skipped: list[str]
    """One line per newer step folder skipped."""
    resumes: bool
    """A checkpoint the run continues from (not a fresh start or a ``load_only`` one)."""
    warnings: list[str] = field(default_factory=list)
    new_data_pass: bool = False
    model_only: bool = False
    loader_keys: list[str] = field(default_factory=list)


RESUME_REFUSALS = (FinishedRun, NoLoadableCheckpoint, ResumeRefused)
"""What rank 0's resume decision may refuse with, on every rank."""


def config_changes(previous_file: str, new_toml: str, shown: int = 8) -> str:
    """The ``[section] key: old -> new`` differences between a run's earlier resolved config and
    this one ("" when there is none or nothing differs)."""
    import tomllib

    try:
        with open(previous_file, "rb") as f:
            old = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return ""
    new = tomllib.loads(new_toml)
    changes = [
        f"[{section}] {key}: {old.get(section, {}).get(key)!r} -> {value!r}"
        for section, body in new.items()
        for key, value in body.items()
        if old.get(section, {}).get(key) != value
    ]
    more = f" (and {len(changes) - shown} more)" if len(changes) > shown else ""
    return "; ".join(changes[:shown]) + more


class _DropRecord(logging.Filter):
    """Drops the log record whose message is ``message`` while ``when()`` holds."""

    def __init__(self, message: str, when):
        super().__init__()
        self.message, self.when = message, when

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == self.message and self.when())


class CanonMetrics(MetricsProcessor):
    """TorchTitan's metrics, plus: the last step is always logged (a run shorter than ``log_freq``
    still ends with its final loss), and on a CPU no MFU (there is no peak-FLOPS figure to divide
    by; TorchTitan's own switch for that is the one it uses for quantized models)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        last_step: Annotated[int, tyro.conf.Suppress] = 0

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        if self.device_memory_monitor.device.type == "cpu":
            self.has_quantization = True

    def should_log(self, step: int) -> bool:
        return super().should_log(step) or step == self.config.last_step


class CanonTrainer(QueuedCopies, Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        run_toml: Annotated[str, tyro.conf.Suppress] = ""
        """The resolved TOML of this run, written to ``{dump_folder}/run_config.toml``."""
        evaluation: Annotated[EvalSettings | None, tyro.conf.Suppress] = None
        """``[eval]``: evaluation during training (None = off)."""
        tokenizer_kind: Annotated[str, tyro.conf.Suppress] = "hf"
        """``[tokenizer] kind`` (its files are ``hf_assets_path``), for Hugging Face exports."""
        model_seed: Annotated[int | None, tyro.conf.Suppress] = None
        """``[model] seed``: the weights are initialised from it; ``debug.seed`` (``[job] seed``)
        seeds the run's random state after that, as the release seeds its weights with 42 and its
        run with
        777. None: ``debug.seed`` seeds the weights too."""
        divergence: Annotated[DivergenceSection, tyro.conf.Suppress] = field(
            default_factory=DivergenceSection
        )
        stop_grace_seconds: Annotated[int, tyro.conf.Suppress] = 90
        allow_changed_data: Annotated[bool, tyro.conf.Suppress] = False
        model_label: Annotated[str, tyro.conf.Suppress] = ""
        """The config file, model name and flavor, for messages."""

    takes_stop_signals = True
    """Whether the trainer takes the process's stop signals (SIGTERM, SIGINT, SIGUSR1) to finish its
    step and checkpoint; a rank that ``canon-titan plan`` steps on fake tensors does not."""

    def __init__(self, config: Config):
        # Taken once a step is done (``train_step``); until then a stop signal ends the process at
        # once.
        self.stop_signals = StopSignals(config.stop_grace_seconds, on_disk=self._on_disk)
        if config.model_seed is None:
            super().__init__(config)
        else:
            self._init_with_model_seed(config)
        self.loss_guard = LossGuard(config.divergence, self.device)
        self._records = StepRecords()
        self._group_losses: list[torch.Tensor] = []
        """This step's loss so far, one sum per gradient-accumulation group done."""
        self._last_verdict: StepVerdict | None = None
        """The newest step verdict the host has read (``_read_verdicts``)."""
        self._preempting = False
        self.global_batch_size = (
            config.training.local_batch_size
            * self.gradient_accumulation_steps
            * getattr(self.dataloader, "dp_world_size", 1)
        )
        self.progress = Progress(config.training.steps)
        self._mixture_said = False
        self.evaluator = None
        if config.evaluation is not None:
            self.evaluator = InTrainingEval(
                config.evaluation, self.parallel_dims, self.device, config.training.steps
            )
        if config.run_toml and (
            not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        ):
            os.makedirs(config.dump_folder, exist_ok=True)
            path = os.path.join(config.dump_folder, RUN_CONFIG_FILE)
            changes = config_changes(path, config.run_toml)
            if changes:
                logger.warning(
                    "the config differs from the one of the run already in "
                    f"{config.dump_folder}: {changes}"
                )
            write_atomic(path, config.run_toml)

    def _on_disk(self) -> str:
        checkpointer = getattr(self, "checkpointer", None)
        if checkpointer is None or not checkpointer.enable:
            return "checkpointing is off ([checkpoint] enable = false), so nothing was saved"
        return newest_checkpoint_line(checkpointer.folder)

    def _init_with_model_seed(self, config: Config) -> None:
        """TorchTitan seeds once, before it initialises the weights: it is given ``[model] seed``
        for that, with its per-stage offsets under PP, and ``[job] seed`` is applied the same way
        after."""
        run_debug = config.debug
        config.debug = dataclasses.replace(run_debug, seed=config.model_seed)
        try:
            super().__init__(config)
        finally:
            config.debug = run_debug
        set_determinism(self.parallel_dims, self.device, run_debug, distinct_seed_mesh_dims=["pp"])

    def train(self):
        """Resume from the newest checkpoint that loads: a newer one with a missing or truncated
        file, unreadable metadata, or a Hugging Face export, is named and skipped (TorchTitan would
        pick it and fail inside the load). A start from a Hugging Face folder reads its config.json
        first (its tensor layout). A last save in HF format gets the rest of an export beside it."""
        ckpt = self.config.checkpoint
        if ckpt.enable:
            plan = rank_zero_decides(self._resume_plan, "where to resume", refusals=RESUME_REFUSALS)
            for message in plan.skipped + plan.warnings:
                logger.warning(message)
            if ckpt.load_step >= 0:
                self.checkpointer.pinned_step = ckpt.load_step
            if plan.skipped:
                ckpt.load_step = plan.step
            if plan.step == -1 and ckpt.initial_load_in_hf:
                self.checkpointer.sd_adapter.read_source(ckpt.initial_load_path)
            if plan.resumes:
                self._prepare_resume(plan)
                self.checkpointer.before_fallback = (
                    self._resume_from
                )  # a damaged one's fallback, checked alike
        untrue = _DropRecord(
            "Training completed",
            when=lambda: self._preempting and self.step < self.config.training.steps,
        )  # TorchTitan says it however the loop ends
        logger.addFilter(untrue)
        try:
            super().train()
        finally:
            logger.removeFilter(untrue)
        self._read_verdicts(self.step)  # where the loop ended early (the data ran out)
        if (
            self.checkpointer.force_next_save
        ):  # a stop request read only now: the step it stops at is saved
            self.checkpointer.save(self.step)
        # every rank has left the loop (TorchTitan's own 2-second sleep, shimmed)
        runtime.end_barrier()
        if self.stop_signals.requested and self.step >= self.config.training.steps:
            logger.info(
                f"the stop signal came during or after the last step ({self.step}): the "
                "run is complete"
            )
        last = self._last_verdict
        if last is not None and not last.applied:  # every step skipped, the last in_a_row of them
            raise Diverged(
                f"every step this run trained ({last.in_a_row}) was skipped "
                "([divergence]), so it trained nothing; "
                f"{self.checkpointer.resume_hint(self.step + 1)}"
            )
        if self._preempting and self.step < self.config.training.steps:
            if not ckpt.enable:
                raise Preempted(
                    f"preempted at step {self.step}; nothing saved ([checkpoint] enable = false)"
                )
            raise Preempted(
                f"preempted at step {self.step}, checkpoint saved, resume with the same command"
            )
        if (
            ckpt.enable
            and ckpt.last_save_in_hf
            and not ckpt.load_only
            and self.step >= self.config.training.steps
        ):
            self._complete_hf_export()

    def post_dataloading_process(self, input_dict, labels):
        """Under context parallelism: this rank's share of every sequence, with the global positions
        the attention and Canon layers need (``ContextShards``); TorchTitan's own path otherwise."""
        if not self.parallel_dims.cp_enabled:
            return super().post_dataloading_process(input_dict, labels)
        inputs, labels, extra = context_parallel_inputs(
            input_dict,
            labels,
            self.parallel_dims.get_mesh("cp"),
            self.config.parallelism.context_parallel_load_balancer,
        )
        self.ntokens_seen += labels.numel()
        return inputs, labels, extra

    def _resume_plan(self) -> ResumePlan:
        """Where this run resumes (``resume_point``), and what of that checkpoint it takes."""
        ckpt = self.config.checkpoint
        step, skipped = resume_point(
            self.checkpointer.folder,
            ckpt.load_step,
            self.config.training.steps,
            self.config.dump_folder,
        )
        plan = ResumePlan(step=step, skipped=skipped, resumes=step >= 0 and not ckpt.load_only)
        return (
            self._checked(plan, Path(self.checkpointer.folder) / f"step-{step}")
            if plan.resumes
            else plan
        )

    def _checked(self, plan: ResumePlan, step_dir: Path) -> ResumePlan:
        """``plan`` with what the run takes of ``step_dir``, read from its metadata; ResumeRefused
        for a checkpoint that cannot continue this run (``check_resume``)."""
        verdict = check_resume(
            step_dir,
            shapes=self.checkpointer.sd_adapter.shapes,
            model=self.config.model_label,
            fingerprint=getattr(self.dataloader, "fingerprint", ""),
            allow_changed_data=self.config.allow_changed_data,
            dp_size=getattr(self.dataloader, "dp_world_size", 1),
            global_batch=self.global_batch_size,
            batch_explicit=self.config.training.global_batch_size > 0,
        )
        plan.warnings, plan.new_data_pass = verdict.warnings, verdict.new_data_pass
        plan.model_only = loads_model_only(step_dir)
        if not plan.model_only:
            plan.loader_keys = saved_loader_keys(step_dir)
        return plan

    def _resume_from(self, step_dir: Path) -> None:
        """The checkpoint a load falls back to (every rank is there), checked as the first one
        was."""
        step = int(step_dir.name.removeprefix("step-"))
        fallback = ResumePlan(step=step, skipped=[], resumes=True)
        plan = rank_zero_decides(
            lambda: self._checked(fallback, step_dir), "where to resume", refusals=RESUME_REFUSALS
        )
        for message in plan.warnings:
            logger.warning(message)
        self._prepare_resume(plan)

    def _prepare_resume(self, plan: ResumePlan) -> None:
        """Let a loader that reads every rank's state (the synthetic one), or fills in a
        fingerprint, know which entries the checkpoint holds; on changed data that may be used,
        start the loader afresh."""
        if plan.model_only:
            return  # a seed checkpoint: TorchTitan loads the model alone
        # Called again for the checkpoint a damaged one falls back to: what was excluded for the
        # first (its data changed) is not excluded for the second unless its data changed too.
        configured = self.config.checkpoint.exclude_from_loading
        fresh = plan.new_data_pass and "dataloader" not in configured
        self.checkpointer.exclude_from_loading = configured + (["dataloader"] if fresh else [])
        if not plan.new_data_pass and hasattr(self.dataloader, "expect_checkpoint"):
            self.dataloader.expect_checkpoint(plan.loader_keys)

    def state_dict(self) -> dict:
        """TorchTitan's train state, plus the global batch (its change is caught at resume; a
        checkpoint from before it loads without it, ``components/checkpointer.py``)."""
        return {**super().state_dict(), "global_batch_size": self.global_batch_size}

    def _complete_hf_export(self) -> None:
        """config.json, modeling code, tokenizer and checksums beside the safetensors TorchTitan
        wrote."""
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            if torch.distributed.get_rank() != 0:
                return
        folder = Path(self.checkpointer.folder) / f"step-{self.step}"
        # The per-rank files the safetensors writer consolidated from: a second copy of the weights.
        shutil.rmtree(folder / "sharded", ignore_errors=True)
        dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[
            self.config.checkpoint.export_dtype
        ]
        write_hf_files(
            folder,
            self.checkpointer.sd_adapter,
            dtype=dtype,
            max_seq_len=self.config.training.seq_len,
            tokenizer=tokenizer_info(self.config.tokenizer_kind, self.config.hf_assets_path),
        )
        logger.info(f"Wrote a Hugging Face export of step {self.step} to {folder}")

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        """TorchTitan's, plus, after the step's last gradient-accumulation group: under tensor
        parallelism the replicated parameters' partial gradients summed over the TP group (one
        all-reduce, ``sum_partial_gradients``); then the loss, whether the gradients are finite and
        any stop request reduced across ranks (one all-reduce on the device) and judged on the
        device, before clipping and the optimizer step."""
        loss = super().forward_backward_step(**kwargs)
        holds_loss = getattr(self, "pp_has_last_stage", True)
        part = loss.detach().float().sum() if holds_loss else torch.zeros((), device=self.device)
        self._group_losses.append(part)
        if len(self._group_losses) == self.gradient_accumulation_steps:
            if self.parallel_dims.tp_enabled:
                sum_partial_gradients(
                    self.model_parts, self.parallel_dims.get_mesh("tp").get_group()
                )
            self._judge_step(holds_loss)
        return loss

    def _judge_step(self, holds_loss: bool) -> None:
        """The step's skip flag for the optimizer and its record for the host, by device ops alone
        (``new_full`` fills on the device: a tensor made from a host value would be a copy that
        waits)."""
        step_loss = functools.reduce(torch.add, self._group_losses)
        self._group_losses = []
        stats = torch.stack(
            [
                step_loss,
                step_loss.new_full((), float(holds_loss)),
                step_loss.new_full((), float(self.stop_signals.requested)),
                self._nonfinite_gradients(),
            ]
        )
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(stats)
        loss_sum, holders, stop, nonfinite_gradients = stats.unbind()
        # Ranks of one tensor- or pipeline-parallel group hold the same loss (pipelines: the last
        # stage).
        dims = self.parallel_dims
        loss = loss_sum / (holders / max(1, dims.world_size // (dims.tp * dims.pp)))
        skip_flag, record = self.loss_guard.judge(loss, nonfinite_gradients)
        self.optimizers.skip_if(skip_flag)
        self._records.put(self.step, torch.cat([record, stop.view(1)]))

    def _nonfinite_gradients(self) -> torch.Tensor:
        """1 when this rank's gradients are not all finite, else 0: one fused norm over them."""
        grads = [p.grad for m in self.model_parts for p in m.parameters() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if not local:
            return torch.zeros((), device=self.device)
        # The max-norm: a 2-norm of finite fp32 values above ~1e19 overflows to inf.
        return (
            torch.nn.utils.get_total_norm(local, norm_type=math.inf)
            .isfinite()
            .logical_not()
            .float()
        )

    def _read_verdicts(self, through: int) -> None:
        """Act on the records of the steps up to ``through`` not yet read: say which were skipped,
        stop on one that stops the run (its update, and every later one, was not applied), and
        start saving and stopping on a stop request."""
        for step, values in self._records.take(through):
            verdict = self._last_verdict = self.loss_guard.verdict(step, values[:RECORD_SIZE])
            if verdict.stop:
                raise Diverged(
                    f"{verdict.problem}: the run stops before saving it; "
                    f"{self.checkpointer.resume_hint(step + 1)}"
                )
            if verdict.skipped:
                logger.warning(f"{verdict.problem}: its update is skipped ([divergence] section)")
            if values[RECORD_SIZE] and not self._preempting:
                self._preempting = True
                self.checkpointer.force_next_save = True

    def _decides_now(self) -> bool:
        """Whether the host reads this step's verdict at once rather than after the next step's
        work: a logged step (its loss is read anyway), a step whose checkpoint is written (none of a
        step that stops the run), the last step."""
        step, steps = self.step, self.config.training.steps
        return (
            self.metrics_processor.should_log(step)
            or step >= steps
            or self.checkpointer._should_save(step, last_step=step == steps)
        )

    def should_continue_training(self) -> bool:
        return not self._preempting and super().should_continue_training()

    def train_step(self, data_iterator):
        self.progress.step_starts()
        if self.takes_stop_signals and not self.stop_signals.installed:
            # before the step's first collective: a stop signal now finishes and saves
            self.stop_signals.install()
        if self.evaluator is not None and self.evaluator.cut_short_before(self.step - 1):
            self._evaluate(self.step - 1)  # its weights: this step has not run yet
        try:
            self.queued_train_step(
                data_iterator
            )  # TorchTitan's step, its host-to-device copies queued
        except NonFiniteLoss:  # on a logged step: a step the guard skipped goes on
            self._read_verdicts(self.step)
            last = self._last_verdict
            if last is None or last.step != self.step or not last.skipped:
                raise
            return
        self.progress.step_done(self.step)
        if self.takes_stop_signals:
            self.stop_signals.step_done()
        # The previous step's verdict, now that this step's work is queued behind it (a stop request
        # in it makes this step one that is saved); this step's own where the host decides on it
        # now.
        self._read_verdicts(self.step - 1)
        if self._decides_now():
            self._read_verdicts(self.step)
        if self.metrics_processor.should_log(self.step):
            logger.info(self.progress.line(self.step))
            if hasattr(self.dataloader, "mixture"):
                self._log_mixture()
        if self.evaluator is not None and self.evaluator.due(self.step):
            self._evaluate(self.step)

    def _evaluate(self, step: int) -> None:
        """The in-training evaluation of the weights of ``step``; one a stop signal cut short saves
        the step reached and stops, as the signal asks."""
        metrics = self.evaluator.run(
            self.model_parts, step, stop=lambda: self.stop_signals.requested
        )
        self.metrics_processor.logger.log(metrics, step)
        if self.evaluator.cut_short and not self._preempting:
            self._preempting = True
            self.checkpointer.force_next_save = True

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        super().close()

    def _log_mixture(self) -> None:
        """A streamed mixture's tokens per source: on TensorBoard at every logged step, in the log
        at the first and the last."""
        metrics, line = self.dataloader.mixture()
        self.metrics_processor.logger.log(metrics, self.step)
        if not self._mixture_said or self.step >= self.config.training.steps:
            logger.info(line)
            self._mixture_said = True
