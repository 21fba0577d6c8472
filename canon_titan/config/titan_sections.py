"""TorchTitan's own configs of a run's sections (parallelism, compile, checkpoint, training, LR
schedule, optimizer, comm), constructed so that their checks run; ``config validate`` stops here,
``build.build_trainer_config`` assembles the trainer's config from them.

Everything imported here is light (TorchTitan's config dataclasses); the trainer, the model stack
and the data libraries are not, and ``config validate`` answers without them.
"""

from __future__ import annotations

import os

import torch
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.config.configs import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.tools.logging import logger
from torchtitan.tools.profiler import Profiler

from canon_titan.components.checkpointer import CanonCheckpointer
from canon_titan.components.lr_schedule import ResumableSchedulers
from canon_titan.components.optimizer import GuardedOptimizers
from canon_titan.config.loader import load
from canon_titan.config.run import ConfigError, RunConfig


def titan_sections(run: RunConfig) -> dict:
    """The TorchTitan config of each section, by ``Trainer.Config`` field (``[profiling]`` is its
    ``profiler``); a ValueError of theirs becomes a ConfigError naming the section."""
    opt = run["optimizer"]
    ckpt = dict(run["checkpoint"])
    # TorchTitan warns on every run that model-only has no effect without an initial load path.
    ckpt["initial_load_model_only"] = ckpt["initial_load_model_only"] and bool(
        ckpt["initial_load_path"]
    )
    float8 = run["float8"]
    # The scales are set after every change of the weights: the load that starts training, each
    # update.
    precompute = float8["enable"] and float8["precompute_float8_dynamic_scale_for_fsdp"]
    builders = {
        "parallelism": lambda: ParallelismConfig(**run["parallelism"]),
        "compile": lambda: CompileConfig(**run["compile"]),
        "checkpoint": lambda: CanonCheckpointer.Config(**ckpt, precompute_float8_scales=precompute),
        "optimizer": lambda: GuardedOptimizers.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name=opt["name"],
                    optimizer_kwargs={
                        "lr": opt["lr"],
                        "betas": tuple(opt["betas"]),
                        "eps": opt["eps"],
                        "weight_decay": opt["weight_decay"],
                    },
                )
            ],
            implementation=opt["implementation"],
            precompute_float8_scales=precompute,
        ),
        "lr_scheduler": lambda: _lr_schedule(run),
        "training": lambda: TrainingConfig(**run["training"]),
        "profiler": lambda: Profiler.Config(**run["profiling"]),
        # NCCL's flight recorder (and its comm_traces/ folder) only exist with CUDA.
        "comm": lambda: CommConfig(
            **run["comm"], **({} if torch.cuda.is_available() else {"trace_buf_size": 0})
        ),
    }
    built = {}
    for section, build in builders.items():
        try:
            built[section] = build()
        except ValueError as e:
            raise ConfigError(run.source, f"[{section}]", str(e)) from e
    return built


CHECKED_ENV = "CANON_TITAN_LAUNCH_CHECKED"
"""Set by ``canon-titan train`` for its workers: the launcher has run the launch checks and shown
their warnings (``launch/prelaunch.py``), and the config's own (a warmup shortened here)."""


def _lr_schedule(run: RunConfig) -> ResumableSchedulers.Config:
    """TorchTitan's schedule config with a warmup no longer than the schedule: TorchTitan shortens
    a longer one as it builds the schedule, then logs the config's as the run's ("total steps 2
    (warmup 10)")."""
    schedule = dict(run["lr_scheduler"])
    total = schedule["total_steps"] or run["training"]["steps"]
    if schedule["warmup_steps"] > total:
        # once a run: the launcher says it (it checks before torchrun), its workers do not
        if os.environ.get(CHECKED_ENV) != "1":
            logger.warning(
                f"[lr_scheduler] warmup_steps ({schedule['warmup_steps']}) is longer than "
                f"the schedule's {total} steps: the learning rate warms up over all {total}"
            )
        schedule["warmup_steps"] = total
    return ResumableSchedulers.Config(**schedule)


def load_or_report(path: str, overrides: list[str], environment: bool = True, build=titan_sections):
    """The resolved run, after our checks and TorchTitan's own, or the error. ``build(run)`` makes
    TorchTitan's configs: of the sections (what ``config validate`` checks), or ``train``'s whole
    ``Trainer.Config`` with the model (``config.build.build_trainer_config``)."""
    try:
        run = load(path, overrides, environment)
        build(run)
        return run, None
    except ConfigError as e:
        return None, str(e)
