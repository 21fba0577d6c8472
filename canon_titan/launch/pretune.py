"""``python -m canon_titan.launch.pretune CONFIG.toml [--section.key value ...]``: before a linear
model's first run on a machine, tune one rank's kernels on its GPU into Triton's cache
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``), which the run's processes then read instead of
tuning (``models/common/linear_tuning.py``)."""

from __future__ import annotations

import argparse
import sys

import torch
from torchtitan.config import TORCH_DTYPE_MAP

from canon_titan.config import ConfigError, load
from canon_titan.kernels.backends import runs_cuda_kernel
from canon_titan.kernels.tuning import device_for_kernels
from canon_titan.models.common.linear_args import LinearArgs
from canon_titan.models.common.linear_tuning import tune_mixer
from canon_titan.tools.startup import init_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m canon_titan.launch.pretune",
        description=__doc__,
        epilog="Other arguments: --section.key value overrides.",
    )
    parser.add_argument("config", help="a linear model's TOML run config (gla5, gdn2, mamba2)")
    args, overrides = parser.parse_known_args(argv)
    init_logging()
    try:
        run = load(args.config, overrides, environment=False)
    except ConfigError as e:
        print(f"canon-titan: config error: {e}", file=sys.stderr)
        return 2
    if not isinstance(run.model_args, LinearArgs):
        print(
            f"canon-titan: {run.label()}: [model] name: the kernel tuning is for gla5, gdn2 and "
            "mamba2",
            file=sys.stderr,
        )
        return 2
    par, training = run["parallelism"], run["training"]
    backend = run.model_spec().model.layers[0].mixer.backend
    if backend == "torch" or not runs_cuda_kernel(
        backend, torch.empty(0, device=device_for_kernels())
    ):
        print(
            f"canon-titan: {run.label()}: its recurrence runs on torch here ({backend!r}): "
            "nothing to tune",
            file=sys.stderr,
        )
        return 2
    pipelined = par["pipeline_parallel_degree"] > 1
    batch = par["pipeline_parallel_microbatch_size"] if pipelined else training["local_batch_size"]
    tune_mixer(
        run.model_args,
        backend,
        batch=batch,
        seq_len=training["seq_len"],
        tp=par["tensor_parallel_degree"],
        dtype=TORCH_DTYPE_MAP[training["mixed_precision_param"]],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
