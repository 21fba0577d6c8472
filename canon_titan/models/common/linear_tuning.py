"""A linear model's kernels tuned before the run's first collective
(``canon_titan/kernels/tuning.py`` says why).

``tuned_first(parallelize)`` wraps a family's ``parallelize_fn``: after parallelizing, each rank
builds one mixer at its own shapes (local batch, or the pipeline's micro-batch; the sequence length;
its share of the heads under tensor parallelism; the activations' dtype, ``[training]
mixed_precision_param``) and runs a forward and backward of it on random inputs, so that the
recurrence's Triton kernels tune and compile for exactly the calls of the first step (the Canon ops
and short convolutions are Inductor's to tune under compile, as each block compiles). Rank 0 times
the candidates; the other ranks run its choices (``tuning.tuned_on_rank_zero``). Then
every rank waits, through the process group's store, until every rank has done the same: a rank
that takes longer keeps the others waiting there, before any collective of the run, not inside
the first step's collectives, whose timeout (``[comm] init_timeout_seconds``) would end the job.

Nothing runs when the recurrence runs on torch, where no Triton kernel can run (a CPU without
Triton's interpreter), or when ``canon-titan plan`` builds the run for another machine. The random
numbers come from a forked generator: the model's initialisation draws what it would have drawn
without this.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch
from torchtitan.config import TORCH_DTYPE_MAP

from canon_titan.kernels.backends import KernelEnvironment, runs_cuda_kernel
from canon_titan.kernels.tuning import device_for_kernels, progress, tuned_on_rank_zero

_tuned: set[str] = set()
"""The shapes this process has tuned (a pipeline rank parallelizes each of its stages)."""


def tuned_first(parallelize):
    """``parallelize`` (a family's ``parallelize_fn``), then ``tune_mixer`` at the run's shapes."""

    @functools.wraps(parallelize)
    def parallelize_and_tune(model, *, parallel_dims, training, parallelism, **kwargs):
        model = parallelize(
            model, parallel_dims=parallel_dims, training=training, parallelism=parallelism, **kwargs
        )
        batch = (
            parallelism.pipeline_parallel_microbatch_size
            if parallel_dims.pp_enabled
            else training.local_batch_size
        )
        # From the config, which every rank has whole (a pipeline stage's model holds some of the
        # layers).
        tune_mixer(
            model.config.args,
            model.config.layers[0].mixer.backend,
            batch=batch,
            seq_len=training.seq_len,
            tp=parallel_dims.tp,
            dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        )
        return model

    return parallelize_and_tune


def tune_mixer(
    args, backend: str, *, batch: int, seq_len: int, tp: int, dtype: torch.dtype
) -> None:
    """One forward and backward of a mixer of ``args`` (a family's ``[model]`` args) with
    ``backend`` (resolved) at one rank's shapes, tuned by rank 0 for every rank
    (``tuned_on_rank_zero``). Once per process and shape."""
    device = device_for_kernels()
    if (
        backend == "torch"
        or KernelEnvironment.current().planned
        or not runs_cuda_kernel(backend, torch.empty(0, device=device))
    ):
        return
    local = dataclasses.replace(args, dim=args.dim // tp, n_heads=args.n_heads // tp)
    shape = (
        f"{args.label} mixer on {backend}, batch {batch} x {seq_len}, {local.n_heads} heads, "
        f"{dtype}"
    )
    if shape in _tuned:
        return
    _tuned.add(shape)
    started = time.perf_counter()
    progress(f"{shape}: a forward and backward before the first collective")
    tuned_on_rank_zero(
        lambda: run_mixer(local, backend, batch=batch, seq_len=seq_len, dtype=dtype, device=device),
        shape,
    )
    progress(f"{shape}: tuned in {time.perf_counter() - started:.1f} s")


def run_mixer(
    args, backend: str, *, batch: int, seq_len: int, dtype: torch.dtype, device: torch.device
) -> None:
    """A forward and backward of a mixer of ``args`` on random inputs, from a forked random
    generator."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with torch.device(device):
            mixer = args.mixer_config(backend).build()
            mixer.init_states()
        mixer.to(dtype)
        x = torch.randn(batch, seq_len, args.dim, device=device, dtype=dtype, requires_grad=True)
        mixer(x).float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
