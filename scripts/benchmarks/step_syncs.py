#!/usr/bin/env python
"""What makes the host wait for the GPU in a training step, measured on a GPU (the CPU suite's
``tests/test_host_work.py`` counts the same with ``host_syncs.py``'s model of CUDA; this is CUDA).

One trainer per rank (the debug Llama, the built-in corpus), five steps; step 4, not a logged one,
runs under ``torch.cuda.set_sync_debug_mode("warn")`` (torch warns at each synchronising call it
makes) and torch's profiler, whose CUDA runtime calls give the synchronisations torch does not see
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, a plain
``cudaMemcpy``) and how long each ``cudaMemcpyAsync`` took to return (a copy from pageable memory is
staged by the driver inside that call). Cases:

  pinned     one GPU, the batches in pinned memory (``[dataloader] pin_memory = true``, the default)
  pageable   the same with pageable batches: the contrast is the measurement
  pp         pipeline parallel 2 (with FSDP 2 on four GPUs or more): whether the schedule's loss
             comes back to the CPU (TorchTitan's comment at its copy says PP + FSDP does)

  python scripts/benchmarks/step_syncs.py OUT.json [--cases pinned,pageable,pp]

Writes one JSON object: per case, the warnings, the synchronising runtime calls by name, and the
longest ``cudaMemcpyAsync`` in microseconds; a case that cannot run here says why.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "train_configs" / "llama_debug.toml"
STEPS, MEASURED = 5, 4
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
CASES = {
    "pinned": (1, ["--dataloader.pin_memory", "true"]),
    "pageable": (1, ["--dataloader.pin_memory", "false"]),
    "pp": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
        ],
    ),
}


def measured_step(trainer, step: int) -> dict:
    """Wrap ``trainer``'s step ``step`` in the sync debug mode and the profiler; what they saw."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    seen: dict = {}
    train_step = trainer.train_step

    def train_step_measured(data_iterator):
        if trainer.step != step:
            return train_step(data_iterator)
        torch.cuda.synchronize()
        with (
            warnings.catch_warnings(record=True) as caught,
            profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
        ):
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(data_iterator)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        names = [event.name for event in prof.events()]
        copies = [e.cpu_time_total for e in prof.events() if e.name == "cudaMemcpyAsync"]
        seen.update(
            warnings=sorted({str(w.message).splitlines()[0] for w in caught}),
            syncs={name: names.count(name) for name in SYNCS if name in names},
            longest_memcpy_async_us=max(copies, default=0.0),
            memcpy_async_calls=len(copies),
        )

    trainer.train_step = train_step_measured
    return seen


def worker(out: str, overrides: list[str]) -> None:
    """One rank under torchrun: train, measure the step, rank 0 writes ``out``."""
    import torch.distributed as dist

    from canon_titan.config import load
    from canon_titan.config.build import build_trainer_config
    from canon_titan.tools import runtime

    runtime.apply()
    bf16 = ["--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"]
    run = load(
        CONFIG,
        [
            "--training.steps",
            str(STEPS),
            "--metrics.log_freq",
            "5",
            "--checkpoint.enable",
            "false",
            "--metrics.enable_tensorboard",
            "false",
            *bf16,
            *overrides,
        ],
        environment=False,
    )
    trainer = build_trainer_config(run).build()
    seen = measured_step(trainer, MEASURED)
    try:
        trainer.train()
    finally:
        trainer.close()
    everyone = [None] * dist.get_world_size() if dist.is_initialized() else [seen]
    if dist.is_initialized():
        dist.all_gather_object(everyone, seen)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"ranks": everyone}))


def run_case(name: str) -> dict:
    import torch

    nproc, overrides = CASES[name]
    if not torch.cuda.is_available() or torch.cuda.device_count() < nproc:
        return {"skipped": f"needs {nproc} GPU(s)"}
    if name == "pp" and torch.cuda.device_count() >= 4:
        nproc, overrides = 4, [*overrides, "--parallelism.data_parallel_shard_degree", "2"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seen.json")
        overrides = [*overrides, "--job.dump_folder", os.path.join(tmp, "run")]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            __file__,
            WORKER,
            out,
            *overrides,
        ]
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            env=dict(os.environ, WANDB_MODE="offline"),
        )
        if proc.returncode:
            return {"failed": (proc.stdout + proc.stderr)[-3000:]}
        return {"nproc": nproc, **json.loads(Path(out).read_text())}


WORKER = "--worker"
"""First argument of a rank's command: ``--worker OUT [--section.key value ...]``."""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WORKER]:
        worker(argv[1], argv[2:])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", help="the JSON file to write")
    parser.add_argument(
        "--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}"
    )
    args = parser.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; cases: {', '.join(CASES)}")
    result = {}
    for name in args.cases.split(","):
        result[name] = run_case(name)
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
