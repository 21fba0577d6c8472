"""``plan(config, overrides, gpus=N, ...)``: a run resolved and checked as ``train`` does it, built
as one rank (each pipeline stage under PP) of a world of N on fake tensors, one step recorded, and
from that: memory against the GPU, FLOPs, collective volumes, step time, throughput, MFU and the
run's GPU-hours; for a run that does not fit, the changes that make it fit, each planned the same
way."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from unittest.mock import patch

from canon_titan.config import ConfigError, load
from canon_titan.data.kinds import SYNTHETIC
from canon_titan.kernels.backends import KernelEnvironment, planned_machine
from canon_titan.plan.allocator import replay
from canon_titan.plan.calibration import ModelKind, kind_of
from canon_titan.plan.estimate import (
    ATTENTION_BACKENDS,
    DATA_PARALLEL_GROUPS,
    RankTime,
    bubble_slots,
    compiled_memory_events,
    default_attention_backend,
    rank_time,
    repeats,
)
from canon_titan.plan.fake_world import PIPELINE_UNSHARD, RankStep, fake_rank_step
from canon_titan.plan.gpus import GIB, GPU
from canon_titan.plan.recorder import MemoryPeak, memory_peak
from canon_titan.tools.cuda_allocator import expandable_segments

OUTSIDE_PYTORCH_GIB = 1.5
"""GPU memory PyTorch's allocator does not see: the CUDA context, NCCL's buffers, library
workspaces."""
REST = ("buffers", "gathered parameters", "communication buffers")
LOOPED_SCHEDULES = {
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
}
"""Pipeline schedules with several stages per rank."""


class PlanError(RuntimeError):
    """The run cannot be planned (and would not start): the message says why."""


@dataclass
class RankKind:
    role: str
    rank: int
    memory: MemoryPeak
    time: RankTime
    state_bytes: dict[str, int]
    """Bytes of this rank's parameters, gradients and optimizer state."""
    model_flops: int
    """FLOPs of the step as the trainer's MFU counts them: 3x the forward's matmul, attention and
    custom-kernel FLOPs (recomputation excluded), over every accumulation group."""
    reserved_bytes: int
    """The peak as ``torch.cuda.max_memory_reserved`` would show it: the step's allocations and
    frees replayed through the caching allocator (``allocator.replay``), on the GPU's memory."""
    allocator_retries: int = 0
    """Times in the replayed steps that the allocator reached the GPU's memory and released its
    cached free segments to go on (each a device synchronize and ``cudaFree``s)."""

    @property
    def device_bytes(self) -> int:
        return self.reserved_bytes + int(OUTSIDE_PYTORCH_GIB * GIB)

    def breakdown(self) -> dict[str, int]:
        """Bytes at the peak: parameters, gradients, optimizer state, activations and the rest
        (buffers, FSDP's gathered parameters and collective buffers, the allocator's slack)."""
        by = self.memory.by_category
        rest = sum(by.get(k, 0) for k in REST) + self.reserved_bytes - self.memory.total
        return {
            "parameters": by.get("parameters", 0),
            "gradients": by.get("gradients", 0),
            "optimizer state": by.get("optimizer state", 0),
            "activations": by.get("activations", 0),
            "rest": rest,
        }


@dataclass
class Plan:
    config: str
    model: str
    overrides: list[str]
    gpu: GPU
    gpus: int
    gpus_per_node: int
    parallel: dict[str, int]
    local_batch: int
    seq_len: int
    accumulation: int
    global_batch: int
    steps: int
    compiled: bool
    activation_checkpoint: str
    kinds: list[RankKind]
    step_s: float
    bubble_s: float
    flops_per_token: int
    param_count: int
    model_kind: ModelKind
    """Whose GPU runs say how far the plan's time is off (``calibration``)."""
    attention: str = "flash"
    """The SDPA backend the attention ops are costed on (``estimate.ATTENTION_EFFICIENCY``)."""
    pipeline_unshard: str = "stage"
    """When a looped pipeline schedule gathers a stage's parameters
    (``fake_world.PIPELINE_UNSHARD``)."""
    planner_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    advice: list[tuple[str, Plan]] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_s / self.gpus

    @property
    def mfu(self) -> float:
        """Model FLOPs (the trainer's count) per second per GPU over the GPU's dense bf16 peak."""
        return self.flops_per_token * self.tokens_per_s_per_gpu / (self.gpu.bf16_tflops * 1e12)

    @property
    def wall_s(self) -> float:
        return self.steps * self.step_s

    @property
    def gpu_hours(self) -> float:
        return self.wall_s * self.gpus / 3600

    @property
    def worst(self) -> RankKind:
        return max(self.kinds, key=lambda k: k.device_bytes)

    @property
    def fits(self) -> bool:
        return all(k.device_bytes <= self.gpu.memory_bytes for k in self.kinds)

    @property
    def margin_bytes(self) -> int:
        return self.gpu.memory_bytes - self.worst.device_bytes


def _categories(step: RankStep) -> dict[int, str]:
    categories = dict(step.categories)
    trace = step.trace
    for sid in trace.resized:
        categories.setdefault(sid, "gathered parameters")
    for sid, ranks in trace.collective_buffers.items():
        if step.group_names.get(tuple(sorted(ranks))) in DATA_PARALLEL_GROUPS:
            categories.setdefault(sid, "communication buffers")
    return categories


COLLECTIVE_STREAMS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 2}
"""The streams FSDP2 allocates its collectives' buffers on (its all-gather copy-in stream; its
reduce-scatter stream, where HSDP's all-reduce runs too); 0 is the compute stream."""
STATE_CATEGORIES = ("buffers", "parameters", "optimizer state")


def reserved_peak(
    step: RankStep, events=None, capacity: int | None = None, expandable: bool | None = None
):
    """The step's ``max_memory_reserved``: its allocations and frees (``events``, or the trace's)
    replayed twice through the caching allocator (on ``capacity`` bytes; with expandable segments if
    ``expandable``, by default unless this environment's ``PYTORCH_ALLOC_CONF`` turns them off, as
    the run's would), data-parallel collective
    buffers on FSDP2's streams, the parameters, buffers and optimizer state allocated once. Returns
    the allocator after the replay."""
    trace = step.trace
    streams = {
        sid: COLLECTIVE_STREAMS.get(trace.collective_buffer_kinds.get(sid, ""), 0)
        for sid, ranks in trace.collective_buffers.items()
        if step.group_names.get(tuple(sorted(ranks))) in DATA_PARALLEL_GROUPS
    }
    persistent = {sid for sid, category in step.categories.items() if category in STATE_CATEGORIES}
    return replay(
        trace.memory_events if events is None else events,
        streams=streams,
        persistent=persistent,
        capacity=capacity,
        expandable=expandable_segments() if expandable is None else expandable,
    )


def _model_flops(step: RankStep) -> int:
    """3x the forward's counted FLOPs, over the whole step's accumulation groups."""
    return sum(
        3 * op.flops * repeats(step, i)
        for i, op in enumerate(step.trace.ops)
        if op.phase == "forward" and op.flops
    )


@contextlib.contextmanager
def _quiet():
    """The trainer's own log lines and warnings during the fake builds say nothing to a planner's
    user (they describe a run that is not happening). torch's loggers have a level of their own
    (``torch._logging``), which the root's does not override: DTensor warns there of the fake
    world's redistributions (HSDP x TP's gradient norm as two all-reduces) as of a real run's."""
    loggers = [logging.getLogger(), logging.getLogger("torch")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def resolve(config: str, overrides: list[str], gpus: int, gpu: GPU):
    """The run and its ``Trainer.Config``, checked as ``train`` checks them for ``gpus`` processes
    on ``gpu`` (not this machine: its data paths, tokenizer files and hardware are not checked)."""
    from canon_titan.config.build import build_trainer_config

    with (
        patch.dict(os.environ, WORLD_SIZE=str(gpus)),
        planned_machine(KernelEnvironment.planned_gpu(gpu.capability)),
    ):
        run = load(config, overrides, environment=False)
        built = run
        if run["float8"]["enable"]:
            if not gpu.fp8_tflops:
                raise PlanError(
                    f"{config}: [float8] enable: the {gpu.name} has no float8 tensor cores"
                )
            # This machine has none either: the plan builds torchao's emulation of the float8
            # linears (eager, as the fake step is anyway) and counts their matmuls at the
            # GPU's fp8 rate.
            built = load(
                config,
                [*overrides, "--float8.emulate", "true", "--compile.enable", "false"],
                environment=False,
            )
        return run, build_trainer_config(built)


def _stage_roles(pp: int, looped: bool) -> list[str]:
    if pp == 1:
        return ["every rank"]
    if looped:
        return [f"pipeline rank {s}" for s in range(pp)]
    return ["first stage"] + [f"stage {s}" for s in range(1, pp - 1)] + ["last stage"]


def plan(
    config: str,
    overrides: list[str],
    *,
    gpus: int,
    gpu: GPU,
    gpus_per_node: int = 8,
    progress=None,
    advise: bool = True,
    attention: str | None = None,
    pipeline_unshard: str = "stage",
    expandable: bool | None = None,
) -> Plan:
    """Plan ``config`` (with ``--section.key value`` ``overrides``) on ``gpus`` GPUs of kind
    ``gpu``, attention on the SDPA backend ``attention`` (default: the one torch picks on that GPU),
    a looped pipeline schedule gathering each stage's parameters as ``pipeline_unshard`` says
    (``stage``: as the pinned torch does; ``layer``: as torch before 2.10 did;
    ``fake_world.PIPELINE_UNSHARD``), the CUDA allocator with expandable segments if ``expandable``
    (default: as a training process started here would). ConfigError for what ``train`` would
    refuse; PlanError for a run that fails to build."""
    started = time.perf_counter()
    attention = attention or default_attention_backend(gpu)
    if attention not in ATTENTION_BACKENDS:
        raise PlanError(
            f"attention backend {attention!r}: expected one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if pipeline_unshard not in PIPELINE_UNSHARD:
        raise PlanError(
            f"pipeline unshard {pipeline_unshard!r}: expected one of {', '.join(PIPELINE_UNSHARD)}"
        )
    run, _ = resolve(config, overrides, gpus, gpu)
    par = run["parallelism"]
    pp = par["pipeline_parallel_degree"]

    compiled_blocks = run["compile"]["enable"] and "model" in run["compile"]["components"]
    compiled_loss = run["compile"]["enable"] and "loss" in run["compile"]["components"]
    compiled = compiled_blocks or compiled_loss
    positions = run["dataloader"]["dataset"] in SYNTHETIC or run["dataloader"]["document_masking"]
    steps: list[tuple[str, RankStep]] = []
    sent: dict = {}
    looped = par["pipeline_parallel_schedule"] in LOOPED_SCHEDULES
    for stage, role in enumerate(_stage_roles(pp, looped)):
        rank = stage * gpus // pp
        if progress:
            progress(f"building and stepping rank {rank} of {gpus} ({role}) on fake tensors")
        _, trainer_config = resolve(config, overrides, gpus, gpu)
        try:
            with _quiet(), planned_machine(KernelEnvironment.planned_gpu(gpu.capability)):
                step = fake_rank_step(
                    trainer_config,
                    rank=rank,
                    world_size=gpus,
                    positions=positions,
                    fp8_linears=run["float8"]["enable"],
                    pipeline_sent=sent,
                    compiled_blocks=compiled_blocks,
                    compiled_loss=compiled_loss,
                    pipeline_unshard=pipeline_unshard,
                )
        except (ValueError, RuntimeError, AssertionError) as e:
            raise PlanError(
                f"{config}: the run fails to build on {gpus} GPUs (rank {rank}): "
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            ) from e
        steps.append((role, step))
    kinds = []
    for role, step in steps:
        events = compiled_memory_events(step) if compiled else None
        allocator = reserved_peak(
            step,
            events,
            capacity=gpu.memory_bytes - int(OUTSIDE_PYTORCH_GIB * GIB),
            expandable=expandable,
        )
        kinds.append(
            RankKind(
                role,
                step.rank,
                memory_peak(step.trace, _categories(step), events=events),
                rank_time(
                    step, gpu, compiled=compiled, gpus_per_node=gpus_per_node, attention=attention
                ),
                step.state_bytes,
                _model_flops(step),
                allocator.peak_reserved,
                allocator.retries,
            )
        )
    first = steps[0][1]
    dp = run.data_parallel_size(gpus)
    local_batch = run["training"]["local_batch_size"]
    accumulation = first.accumulation
    bubble = 0.0
    slowest = max(kinds, key=lambda k: k.time.step_s)
    if pp > 1:
        microbatches = first.pp_microbatches * accumulation
        stages_per_rank = first.stages_per_rank
        per_microbatch = (
            slowest.time.compute_total_s * (1 - slowest.time.optimizer_share) / microbatches
        )
        bubble = (
            bubble_slots(par["pipeline_parallel_schedule"], pp, stages_per_rank)
            * per_microbatch
            * accumulation
        )
    result = Plan(
        config=config,
        model=f"{run['model']['name']} {run['model']['flavor']}",
        overrides=list(overrides),
        gpu=gpu,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        parallel={
            "dp_replicate": first.parallel["dp_replicate"],
            "dp_shard": first.parallel["dp_shard"],
            "cp": first.parallel["cp"],
            "tp": first.parallel["tp"],
            "pp": pp,
        },
        local_batch=local_batch,
        seq_len=run["training"]["seq_len"],
        accumulation=accumulation,
        global_batch=local_batch * dp * accumulation,
        steps=run["training"]["steps"],
        compiled=compiled,
        activation_checkpoint=run["activation_checkpoint"]["mode"],
        kinds=kinds,
        step_s=slowest.time.step_s + bubble,
        bubble_s=bubble,
        flops_per_token=first.flops_per_token,
        param_count=_param_count(steps, pp),
        model_kind=kind_of(run),
        attention=attention,
        pipeline_unshard=pipeline_unshard,
    )
    result.notes = _notes(run, result)
    if advise and not result.fits:
        result.advice = _advice(
            config,
            overrides,
            run,
            gpus=gpus,
            gpu=gpu,
            gpus_per_node=gpus_per_node,
            progress=progress,
            attention=attention,
        )
    result.planner_s = time.perf_counter() - started
    return result


def _param_count(steps, pp: int) -> int:
    """Parameters of the whole model (each stage holds its own under PP)."""
    if pp == 1:
        return steps[0][1].param_count
    return sum(step.param_count for _, step in steps)


def _notes(run, result: Plan) -> list[str]:
    notes = []
    if result.compiled:
        parts = " and ".join(
            name
            for key, name in (("model", "blocks"), ("loss", "loss"))
            if key in run["compile"]["components"]
        )
        eager = "the embedding, output, " + (
            "" if "loss" in run["compile"]["components"] else "loss, "
        )
        notes.append(
            f"compile: planned from the eager ops; inside the compiled {parts} each run of "
            "elementwise ops "
            "between matmuls, attention and custom kernels is one fused kernel; what only "
            "it uses is not "
            "stored, what only the backward reads is recomputed from the run's inputs "
            "where that keeps "
            f"fewer bytes; {eager}FSDP's copies and the optimizer stay eager"
        )
    else:
        notes.append("compile off: every op is its own kernel")
    notes.append(f"attention on the {result.attention} SDPA backend (--attention-backend)")
    unpriced = next(
        (k.time.kernels_unpriced for k in result.kinds if k.time.kernels_unpriced), None
    )
    if unpriced:
        notes.append(
            f"Canon and recurrence kernels at their bytes and FLOPs (the roofline): {unpriced}"
        )
    elif any(k.time.compute_s.get(kind) for k in result.kinds for kind in ("canon", "recurrence")):
        notes.append(
            "Canon and recurrence kernels priced from their sm_90 SASS "
            "(canon_titan.plan.kernel_cost): each launch the longest of its bytes, its "
            "instructions' issue and its tensor-core work"
        )
    if (
        run["parallelism"]["pipeline_parallel_degree"] > 1
        and run["parallelism"]["pipeline_parallel_schedule"] in LOOPED_SCHEDULES
    ):
        notes.append(
            "pipeline: each stage's parameters gathered all at once before its first "
            "compute (torch's "
            "schedule runtime, from 2.10)"
            if result.pipeline_unshard == "stage"
            else "pipeline: each block's parameters gathered by its FSDP hook as it runs "
            "(Interleaved1F1B "
            "before torch 2.10)"
        )
    if run["float8"]["enable"]:
        rowwise = run["float8"]["recipe_name"].startswith("rowwise")
        notes.append(
            f"float8 {run['float8']['recipe_name']}: the float8 linears' matmuls at the fp8 peak"
            + (
                "; under compile their row-wise casts cost what torchao's published microbenchmark "
                "measured (recorder.ROWWISE_CAST_BYTES)"
                if rowwise
                else ""
            )
            + "; with TP, activations and their gradients cross the TP group in high "
            "precision (the TP "
            "regions gather before their linears cast; TorchTitan's llama3 sends a "
            "tensorwise input in "
            "float8)"
            + (
                "; FSDP gathers their weights in float8 ([float8] enable_fsdp_float8_all_gather)"
                if run["float8"]["enable_fsdp_float8_all_gather"]
                else ""
            )
        )
    if result.accumulation > 2:
        notes.append(
            f"gradient accumulation: 2 of {result.accumulation} groups were stepped; the "
            "others repeat the "
            "second"
        )
    retries = max(k.allocator_retries for k in result.kinds)
    if retries and result.fits:
        notes.append(
            f"allocator: reaches the GPU's memory {retries} time(s) in two replayed steps "
            "and releases its "
            "cached free segments to go on (a device synchronize each: TorchTitan logs them as "
            "num_alloc_retries; the step time does not include them)"
        )
    return notes


def _candidates(run, gpus: int, gpus_per_node: int) -> list[tuple[str, list[str]]]:
    """Changes that lower the memory per GPU, cheapest first."""
    out = []
    ac = run["activation_checkpoint"]["mode"]
    for mode in ("selective", "full"):
        if ("none", "selective", "full").index(mode) > ("none", "selective", "full").index(ac):
            out.append((f"activation checkpointing {mode}", ["--activation_checkpoint.mode", mode]))
    local = run["training"]["local_batch_size"]
    gbs = run["training"]["global_batch_size"]
    keep = (
        []
        if gbs > 0
        else ["--training.global_batch_size", str(local * run.data_parallel_size(gpus))]
    )
    size = local // 2
    while size >= 1:
        out.append(
            (
                f"local batch {size} (same global batch, more accumulation)",
                ["--training.local_batch_size", str(size), *keep],
            )
        )
        size //= 2
    par = run["parallelism"]
    for tp in (2, 4, 8):
        if tp > par["tensor_parallel_degree"] and tp <= gpus_per_node and gpus % tp == 0:
            out.append((f"tensor parallel {tp}", ["--parallelism.tensor_parallel_degree", str(tp)]))
    for pp in (2, 4):
        if pp > par["pipeline_parallel_degree"] and gpus % pp == 0 and local >= pp:
            out.append(
                (
                    f"pipeline parallel {pp}",
                    [
                        "--parallelism.pipeline_parallel_degree",
                        str(pp),
                        "--parallelism.pipeline_parallel_microbatch_size",
                        "1",
                    ],
                )
            )
    return out


def _advice(
    config, overrides, run, *, gpus, gpu, gpus_per_node, progress, attention, tries: int = 6
):
    """The first change of each kind (AC, local batch, TP, PP) that makes the run fit, each planned;
    at most ``tries`` plans."""
    found, kinds_done = [], set()
    for label, extra in _candidates(run, gpus, gpus_per_node):
        kind = label.split()[0]
        if kind in kinds_done:
            continue
        if tries == 0:
            break
        tries -= 1
        if progress:
            progress(f"does it fit with {label}?")
        try:
            candidate = plan(
                config,
                [*overrides, *extra],
                gpus=gpus,
                gpu=gpu,
                gpus_per_node=gpus_per_node,
                progress=None,
                advise=False,
                attention=attention,
            )
        except (ConfigError, PlanError):
            continue
        if candidate.fits:
            found.append((label + " (" + " ".join(extra) + ")", candidate))
            kinds_done.add(kind)
    return found


def progress_printer(stream=None):
    """Progress lines to ``stream`` (default: ``sys.stderr`` as it is when a line is written)."""
    started = time.perf_counter()

    def show(message: str) -> None:
        print(
            f"[plan {time.perf_counter() - started:5.1f} s] {message}",
            file=stream or sys.stderr,
            flush=True,
        )

    return show
