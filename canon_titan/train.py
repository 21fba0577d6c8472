"""Training entry point: ``torchrun ... -m canon_titan.train --config FILE.toml [--section.key value ...]``."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

from torchtitan.tools.logging import init_logger, logger

from canon_titan.components.checkpointer import NonFiniteParameters, SaveFailed
from canon_titan.components.divergence import Diverged
from canon_titan.components.exit_codes import STOPPED, report_exit
from canon_titan.components.preemption import PREEMPTED_EXIT, Preempted
from canon_titan.config import ConfigError, load
from canon_titan.config.build import build_trainer_config
from canon_titan.convert.dcp_io import NoLoadableCheckpoint
from canon_titan.data.documents import DataError
from canon_titan.data.inputs import DataConfigError
from canon_titan.launch.ownership import DumpFolderInUse, DumpFolderUnusable, die_with_parent, lock_dump_folder
from canon_titan.launch.resume_checks import ResumeRefused
from canon_titan.tools import runtime
from canon_titan.trainer import FinishedRun


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    parser = argparse.ArgumentParser(
        prog="canon_titan.train", description=__doc__,
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
        if int(os.environ.get("RANK", "0")) == 0:
            lock_dump_folder(run["job"]["dump_folder"])
    except ConfigError as e:
        print(f"canon-titan: config error: {e}", file=sys.stderr)
        return 2
    except (DumpFolderInUse, DumpFolderUnusable) as e:
        print(f"canon-titan: {e}", file=sys.stderr)
        return 2
    runtime.apply()
    logger.info(f"Run config {run.source} ({run['model']['name']} {run['model']['flavor']})")

    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            if torch.distributed.get_world_size() != 1:
                raise SystemExit("canon-titan: a seed checkpoint must be created by a single process")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except (NoLoadableCheckpoint, FinishedRun, ResumeRefused) as e:
        print(f"canon-titan: {e}", file=sys.stderr)
        return 2
    except (DataConfigError, DataError) as e:  # found as the loader opens the data (a damaged token shard, ...)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"canon-titan: data error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:
        logger.warning(str(e))
        return PREEMPTED_EXIT
    except (Diverged, NonFiniteParameters, SaveFailed) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"canon-titan: {e}", file=sys.stderr)
        return STOPPED
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
