"""Training entry point: ``torchrun ... -m canon_titan.train --config FILE.toml [--section.key value
...]``."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys

from canon_titan.components.exit_codes import stop_before_training
from canon_titan.tools.cuda_allocator import use_expandable_segments
from canon_titan.tools.startup import importing, process_setup

if __name__ == "__main__":
    process_setup()  # before the imports below print
    # from the first instant: a stop signal while importing torch is one line and 75
    stop_before_training()
    use_expandable_segments()

with importing():  # seconds of imports, without the garbage collector walking them
    import torch
    from torchtitan.tools.logging import init_logger, logger

    from canon_titan.components.checkpointer import NonFiniteParameters, SaveFailed
    from canon_titan.components.divergence import Diverged
    from canon_titan.components.exit_codes import (
        PREEMPTED,
        REFUSED,
        STOPPED,
        report_exit,
        report_saved,
        say_once,
    )
    from canon_titan.components.preemption import Preempted
    from canon_titan.components.resume_checks import ResumeRefused
    from canon_titan.config import ConfigError, load
    from canon_titan.config.build import build_trainer_config
    from canon_titan.convert.dcp_io import NoLoadableCheckpoint
    from canon_titan.data.documents import DataError
    from canon_titan.data.inputs import DataConfigError
    from canon_titan.launch.ownership import die_with_parent
    from canon_titan.launch.prelaunch import agreed_verdict
    from canon_titan.tools import runtime
    from canon_titan.trainer import FinishedRun


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    parser = argparse.ArgumentParser(
        prog="canon_titan.train",
        description=__doc__,
        epilog="Any other argument is an override of the form --section.key value.",
    )
    parser.add_argument("--config", required=True, help="TOML run config (see train_configs/)")
    args, overrides = parser.parse_known_args(argv)
    return args.config, overrides


def main(argv: list[str] | None = None) -> int:
    return report_exit(_main(argv))


def _main(argv: list[str] | None) -> int:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: stop when the agent is gone
        die_with_parent(signal.SIGKILL)
    path, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    init_logger()
    try:
        run = load(path, overrides)
        config = build_trainer_config(run)
    except ConfigError as e:  # the same on every rank
        say_once(f"config error: {e}")
        return REFUSED
    # Before any rank builds or loads: rank 0 decides whether the run may start, every rank agrees.
    verdict = agreed_verdict(run)
    for message in verdict.warnings:
        logger.warning(message)
    if verdict.problem:  # every rank has it: on every node's console
        say_once(verdict.problem)
        return REFUSED
    runtime.apply()
    logger.info(f"Run config {run.source} ({run['model']['name']} {run['model']['flavor']})")

    trainer = None
    code, say = 0, None  # said after the trainer closed (its shutdown logs), so it is the last line
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            if torch.distributed.get_world_size() != 1:
                raise SystemExit(
                    "canon-titan: a seed checkpoint must be created by a single process"
                )
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except (NoLoadableCheckpoint, FinishedRun, ResumeRefused) as e:
        code, say = REFUSED, functools.partial(say_once, str(e))
    except (
        DataConfigError,
        DataError,
    ) as e:  # found as the loader opens the data (a damaged token shard, ...)
        code, say = REFUSED, functools.partial(say_once, f"data error: {e}")
    except Preempted as e:
        # 75 says "saved, requeue": only with a checkpoint of the step reached, which the torchrun
        # wrapper checks.
        code, say = PREEMPTED, functools.partial(logger.warning, str(e))
        if trainer.checkpointer.enable:
            report_saved(os.path.join(trainer.checkpointer.folder, f"step-{trainer.step}"))
        else:
            code = STOPPED
    except (Diverged, NonFiniteParameters, SaveFailed) as e:
        code, say = STOPPED, functools.partial(say_once, str(e))
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if say is not None:
        say()
    return code


if __name__ == "__main__":
    sys.exit(main())
