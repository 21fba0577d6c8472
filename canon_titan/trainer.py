"""TorchTitan's Trainer with canon-titan's additions: the resolved TOML saved with the run,
progress (step, percentage, ETA) logged with the metrics, and evaluation during training."""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from typing import Annotated

import torch
import tyro

from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from canon_titan.convert.dcp_io import resume_step
from canon_titan.evaluation.in_training import EvalSettings, InTrainingEval
from canon_titan.fileio import write_atomic

RUN_CONFIG_FILE = "run_config.toml"


class CanonTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        run_toml: Annotated[str, tyro.conf.Suppress] = ""
        """The resolved TOML of this run, written to ``{dump_folder}/run_config.toml``."""
        evaluation: Annotated[EvalSettings | None, tyro.conf.Suppress] = None
        """``[eval]``: evaluation during training (None = off)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self._progress_origin: tuple[float, int] | None = None
        self.evaluator = None
        if config.evaluation is not None:
            self.evaluator = InTrainingEval(config.evaluation, self.parallel_dims, self.device, config.training.steps)
        if config.run_toml and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            os.makedirs(config.dump_folder, exist_ok=True)
            write_atomic(os.path.join(config.dump_folder, RUN_CONFIG_FILE), config.run_toml)

    def train(self):
        """Resume from the newest checkpoint that loads: a newer one with a missing or truncated
        file, or unreadable metadata, is named and skipped (TorchTitan would pick it and fail
        inside the load)."""
        ckpt = self.config.checkpoint
        if ckpt.enable:
            step, skipped = resume_step(self.checkpointer.folder, ckpt.load_step)
            for message in skipped:
                logger.warning(message)
            if skipped:
                ckpt.load_step = step
        super().train()

    def train_step(self, data_iterator):
        if self._progress_origin is None:
            self._progress_origin = (time.perf_counter(), self.step - 1)
        super().train_step(data_iterator)
        if self.metrics_processor.should_log(self.step):
            self._log_progress()
        if self.evaluator is not None and self.evaluator.due(self.step):
            metrics = self.evaluator.run(self.model_parts, self.step)
            self.metrics_processor.logger.log(metrics, self.step)

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        super().close()

    def _log_progress(self) -> None:
        total = self.config.training.steps
        start_time, start_step = self._progress_origin
        done = self.step - start_step
        elapsed = time.perf_counter() - start_time
        eta = datetime.timedelta(seconds=round(elapsed / done * (total - self.step))) if done else "?"
        logger.info(f"progress: step {self.step}/{total} ({100 * self.step / total:.0f}%), "
                    f"elapsed {datetime.timedelta(seconds=round(elapsed))}, ETA {eta}")
