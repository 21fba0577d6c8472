"""The host's side of a training step, on the CPU: 2 gloo ranks of a debug run, built in this
script's own processes (the trainer as ``canon_titan.train`` builds it). For the steps between the
first and the last (neither logged: ``[metrics] log_freq`` is raised past them), on rank 0, medians
of the steps stepped under torch's profiler:

- step: the step's wall time;
- to optimizer: from the step's start to the optimizer step's launch (TorchTitan calls it after the
  backward, the divergence guard's judgement and clipping);
- outside ops: the step's time outside torch ops (Python, TorchTitan's and canon-titan's host work,
  the data loader). On a CPU the ops are the compute; on a GPU they are launches, and this is what
  the host spends besides them;
- CP shards: under context parallelism, the time the step spends building its ``ContextShards``;

and of the step before the last, counted by ``host_syncs.HostSyncs`` (too slow to time; the two
steps before the last run under it):

- waits: what would make the host wait for a GPU in that step, besides TorchTitan's blocking copies
  of the batch to the device (reads of a value the device computed, value-sized ops, blocking
  copies);
- copies: TorchTitan's blocking copies (its train_step's ``.to(device)`` of each batch tensor and
  the token count).

  .venv/bin/python scripts/benchmarks/host_step.py                         # llama_canon: FSDP 2, TP
  2, CP 2 .venv/bin/python scripts/benchmarks/host_step.py --configs llama:fsdp --steps 12
  .venv/bin/python scripts/benchmarks/host_step.py --cp-shards 131072:4 262144:8   # the CP build
  alone
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
STEP = "canon-titan step"
PARALLEL = {
    "fsdp": [],
    "tp": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_sequence_parallel",
        "true",
    ],
    "pp": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
    ],
    "cp": ["--parallelism.context_parallel_degree", "2"],
}


def _rank(
    rank: int, port: int, cases: list[str], steps: int, seq_len: int, dump: str, queue
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
    )
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from canon_titan.config import load
    from canon_titan.config.build import build_trainer_config
    from canon_titan.models.common import context_parallel
    from canon_titan.tools import runtime
    from canon_titan.trainer import CanonTrainer
    from host_syncs import HostSyncs

    CanonTrainer.takes_stop_signals = False  # one process builds one trainer per case
    runtime.apply()
    rows = []
    for case in cases:
        family, parallel = case.split(":")
        run = load(
            REPO / "train_configs" / f"{family}_debug.toml",
            [
                "--training.seq_len",
                str(seq_len),
                "--training.local_batch_size",
                "2",
                "--training.steps",
                str(steps),
                "--metrics.log_freq",
                str(10 * steps),
                "--checkpoint.enable",
                "false",
                "--metrics.enable_tensorboard",
                "false",
                "--job.dump_folder",
                f"{dump}/{family}-{parallel}",
                *PARALLEL[parallel],
            ],
            environment=False,
        )
        trainer = build_trainer_config(run).build()
        cache_clear = getattr(getattr(context_parallel, "shard_layout", None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()  # the cases share their CP group: each builds its own
        marks: dict[str, float] = {}
        shard_time = [0.0]
        train_step, optimizer_step = trainer.train_step, trainer.optimizers.step
        build = context_parallel.ContextShards.build.__func__

        def timed_build(cls, *args, **kwargs):
            start = time.perf_counter()
            try:
                return build(cls, *args, **kwargs)
            finally:
                shard_time[0] += time.perf_counter() - start

        def timed_optimizer(*args, **kwargs):
            marks.setdefault("optimizer", time.perf_counter())
            return optimizer_step(*args, **kwargs)

        measured, counter, waits = [], HostSyncs(), []

        def timed_step(data_iterator):
            if trainer.step in (steps - 2, steps - 1):
                # One counter for both: the step before the last reads what the one before it put on
                # the host.
                waits[:] = counter.step(train_step, data_iterator)
                return None
            if not 1 < trainer.step < steps - 2:
                return train_step(data_iterator)
            marks.clear()
            shard_time[0] = 0.0
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                with record_function(STEP):
                    train_step(data_iterator)
                end = time.perf_counter()
            events = prof.events()
            step = next(e for e in events if e.name == STEP)
            inside = sum(e.cpu_time_total for e in events if e.cpu_parent is step) / 1e6
            measured.append(
                (end - start, marks["optimizer"] - start, end - start - inside, shard_time[0])
            )

        context_parallel.ContextShards.build = classmethod(timed_build)
        trainer.train_step, trainer.optimizers.step = timed_step, timed_optimizer
        try:
            trainer.train()
        finally:
            trainer.close()
            context_parallel.ContextShards.build = classmethod(build)
        copies = sum(
            " at torchtitan/trainer.py:" in w and "blocking copy to the device" in w for w in waits
        )
        rows.append(
            (
                case,
                *(statistics.median(column) for column in zip(*measured)),
                len(waits) - copies,
                copies,
            )
        )
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def cp_shards(seq_len: int, size: int) -> float:
    """Seconds to build rank 0's ``ContextShards`` (head-tail split) on a fake process group of
    ``size``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from canon_titan.models.common.context_parallel import ContextShards, rank_positions

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        ContextShards.build(
            dist.group.WORLD, rank_positions(4 * size, size, "headtail"), "cpu"
        )  # its imports
        start = time.perf_counter()
        ContextShards.build(dist.group.WORLD, rank_positions(seq_len, size, "headtail"), "cpu")
        return time.perf_counter() - start
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["llama_canon:fsdp", "llama_canon:tp", "llama_canon:cp"],
        help="family:parallelism, parallelism one of " + ", ".join(PARALLEL),
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--cp-shards", nargs="*", metavar="SEQ:CP", help="time the CP shard build alone instead"
    )
    args = parser.parse_args()
    if args.cp_shards is not None:
        for spec in args.cp_shards:
            seq_len, size = map(int, spec.split(":"))
            print(
                f"ContextShards of {seq_len:,} tokens on {size} CP ranks: "
                f"{cp_shards(seq_len, size):.3f} s"
            )
        return
    for case in args.configs:
        if case.count(":") != 1 or case.split(":")[1] not in PARALLEL:
            sys.exit(
                f"--configs {case}: expected family:parallelism with parallelism one of "
                f"{', '.join(PARALLEL)}"
            )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as dump:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [
            ctx.Process(
                target=_rank, args=(r, port, args.configs, args.steps, args.seq_len, dump, queue)
            )
            for r in range(2)
        ]
        for p in procs:
            p.start()
        rows = queue.get(timeout=3600)
        for p in procs:
            p.join(timeout=60)
    print(
        f"torch {torch.__version__}, 2 gloo ranks, local batch 2 x {args.seq_len}, medians "
        "of steps "
        f"2-{args.steps - 3}, waits and copies in step {args.steps - 1} (rank 0)"
    )
    print("| run | step ms | to optimizer ms | outside ops ms | CP shards ms | waits | copies |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case, step, to_optimizer, outside, shards, waits, copies in rows:
        print(
            f"| {case} | {step * 1e3:.1f} | {to_optimizer * 1e3:.1f} | {outside * 1e3:.1f} "
            f"| {shards * 1e3:.2f} | "
            f"{waits} | {copies} |"
        )


if __name__ == "__main__":
    main()
