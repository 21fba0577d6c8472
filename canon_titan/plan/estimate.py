"""Step time from a recorded step: a roofline per op, collectives from their bytes and the links
their process groups cross, FSDP's overlap, the pipeline bubble.

Compute. Each op takes the longer of its FLOPs at the GPU's peak for its kind and its bytes at
the HBM bandwidth, each at the fraction of peak that such kernels reach (``EFFICIENCY``), and no
less than ``MIN_KERNEL_S``. The Canon op's and the recurrences' (GLA, gated delta rule, SSD) calls
are priced instead by their own kernels, compiled for the GPU and counted
(``kernel_cost.call_seconds``: each launch the longest of its bytes, its instructions' issue and its
tensor-core work), where the instrument prices the GPU; elsewhere by the roofline above. Causal
attention does its causal share of the counted FLOPs (flash kernels skip the masked blocks;
``recorder.causal_share``), at the efficiency of the SDPA backend that runs it (FlashAttention-2
or cuDNN) for its head dim (``ATTENTION_EFFICIENCY``).

Compile. The plan runs eagerly (fake tensors cannot run compiled code). With ``[compile]`` on,
TorchTitan compiles each block of the model, and the loss where ``[compile] components`` names it
(``fake_world.CompiledBlocks`` records which ops ran inside them): every run of consecutive
elementwise/reduction ops there between two matmuls, attention or custom kernels (Inductor's
fusion boundaries) is one kernel that reads what it takes from outside and writes what is used
outside; matmuls, attention and the custom kernels are unchanged, and the embedding, the output
projection, FSDP's copies and the optimizer stay eager. Memory: what such a run creates and uses
only inside itself is never stored, and what only the backward reads is recomputed there from
the run's inputs where that keeps fewer bytes alive (``compiled_memory_events``). One exception to
the single fused pass is measured, not modelled: torchao's row-wise float8 casts, which Inductor
compiles into kernels that move far more (``recorder.ROWWISE_CAST_BYTES``).

Communication. A collective over n ranks moves ``(n - 1) / n`` of its buffer per rank (twice for
an all-reduce) at the bus bandwidth of the slowest link its group crosses: NVLink inside a node
(at the rate NCCL's topology model gives it, ``GPU.nccl_nvlink_gb_s``), the GPU's network link
between nodes, after NCCL's latency (a start, then a hop per step of its ring, or of its tree for
an all-reduce where that is faster: it grows with ranks and nodes).
FSDP's all-gathers and reduce-scatters overlap the compute of their phase (prefetching), except
the first all-gather of a phase and the last reduce-scatter;
tensor-, context- and pipeline-parallel traffic and the loss reductions are on the critical path.

Pipeline. A step is ``microbatches + bubble`` microbatch slots of the slowest stage's work per
accumulation group, the bubble being ``(stages - 1) / (stages per rank)`` slots for 1F1B-style
schedules and none for the zero-bubble ones.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from canon_titan.plan.fake_world import RankStep
from canon_titan.plan.gpus import GPU

EFFICIENCY = {
    # A training step's bf16 GEMMs on the H100 SXM: ~70% of the dense peak (cuBLAS, NVIDIA's own
    # GEMM benchmarks), below the best shape's 80.3% (``GPU.matmul_efficiency``): the layers'
    # shapes quantize into waves of tiles less well. Other parts: ``matmul_efficiency``.
    "matmul": 0.70,
    # SDPA forward+backward where ``ATTENTION_EFFICIENCY`` has no figure for the backend and part.
    "attention": 0.45,
    # Triton kernels of the recurrences (fla, mamba-ssm): chunked, tensor-core bound at ~35% of
    # peak.
    "recurrence": 0.35,
    "canon": 0.35,
    # Streaming elementwise kernels reach ~80% of HBM bandwidth.
    "memory": 0.80,
}
ATTENTION_BACKENDS = ("cudnn", "flash")
ATTENTION_EFFICIENCY = {
    # (SDPA backend, compute capability major): {head dim: share of the bf16 peak for a causal
    # forward + backward (the backward does 2.5x the forward's FLOPs)}.
    # FlashAttention-2 (torch's "flash" backend) on Hopper: 35% of the H100's peak forward (the
    # FlashAttention-3 paper, Shah et al. 2024, abstract and Fig. 5: ~335 TFLOPS at head dim 128)
    # and ~290 TFLOPS backward (its Fig. 6): 3.5 / (1/335 + 2.5/290) = 302 TFLOPS, 0.30 of 989. It
    # is written for Ampere; head dim 64 runs at about the same share.
    ("flash", 9): {64: 0.30, 128: 0.30},
    # cuDNN's fused attention on Hopper: at head dim 128 ~600 TFLOPS forward and ~450 backward
    # (the same paper's Figs. 5-6): 3.5 / (1/600 + 2.5/450) = 485, 0.49 of 989; at head dim 64,
    # 0.39, the share a profiled H200 step measured (docs/benchmarks/kernels.md, "Figures that were
    # in code comments").
    ("cudnn", 9): {64: 0.39, 128: 0.49},
}
"""Attention kernels' efficiency by the SDPA backend that runs them and the head dim (linear
between the head dims given, the nearest one outside them)."""
H100_BEST_SHAPE = 0.803
"""The H100 SXM's best-shape bf16 GEMM efficiency (``gpus.GPUS["h100"].matmul_efficiency``)."""
MIN_KERNEL_S = 3e-6
"""The shortest a kernel launch takes on the GPU."""
COLLECTIVE_START_S = 8.4e-6
RING_HOP_S = {"nvlink": 3.4e-6, "network": 14e-6}
TREE_HOP_S = {"nvlink": 4.0e-6, "network": 14e-6}
"""NCCL's latency model for its Simple protocol (NCCL's tuning.cc, whose figures
``torch._inductor.comm_analysis`` carries): a fixed start, then one hop per step of the algorithm,
over NVLink inside a node or the network between nodes."""
DATA_PARALLEL_GROUPS = {"fsdp", "dp_shard", "dp_replicate"}
ZERO_BUBBLE = {"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}


@dataclass
class CollectiveCost:
    kind: str
    group: str
    ranks: int
    link: str
    bytes: int
    count: int
    seconds: float


@dataclass
class RankTime:
    compute_s: dict[str, float]
    """Per op kind (matmul, attention, canon, recurrence, other), the whole step."""
    collectives: list[CollectiveCost]
    exposed_comm_s: float
    """Communication not hidden behind compute."""
    step_s: float
    """Compute and exposed communication (a pipeline's bubble is the plan's: the slowest stage sets
    it)."""
    flops_by_kind: dict[str, int]
    """Every FLOP the step runs (recomputation included), per op kind."""
    kernels: int
    optimizer_share: float = 0.0
    """The optimizer's share of the compute (outside the pipeline's microbatches)."""
    kernels_unpriced: str | None = None
    """Why the Canon and recurrence ops were priced by the roofline rather than by their kernels."""

    @property
    def compute_total_s(self) -> float:
        return sum(self.compute_s.values())

    @property
    def executed_flops(self) -> int:
        return sum(self.flops_by_kind.values())


def repeats(step: RankStep, op_index: int) -> int:
    """How many times the op (or collective) at ``op_index`` runs in the full step: the second
    recorded accumulation group stands for every group after the first."""
    marks = step.trace.marks
    if step.groups_run < 2 or step.accumulation <= step.groups_run:
        return 1
    if marks.get("group 1", 0) <= op_index < marks.get("optimizer", 1 << 62):
        return step.accumulation - 1
    return 1


def _peak_flops(gpu: GPU, op) -> float:
    if op.fp8 and gpu.fp8_tflops:
        return gpu.fp8_tflops * 1e12
    if op.dtype is not None and op.dtype.is_floating_point and op.dtype.itemsize >= 4:
        # fp32 operands: TF32 tensor cores where the step allows them (``Op.tf32``), else CUDA
        # cores.
        return (gpu.tf32_tflops if op.tf32 else gpu.fp32_tflops) * 1e12
    return gpu.bf16_tflops * 1e12


def matmul_efficiency(gpu: GPU, op) -> float:
    """The share of its peak a training step's GEMM reaches on ``gpu``: the part's best-shape GEMM
    efficiency (measured: its power limit holds a lower clock than the peak assumes on some parts,
    not on others) times the share of the best shape's rate that a layer's shapes reach, as
    measured on the H100 SXM (``EFFICIENCY["matmul"]`` over its best shape's)."""
    best = gpu.fp8_matmul_efficiency if op.fp8 and gpu.fp8_tflops else gpu.matmul_efficiency
    return best * EFFICIENCY["matmul"] / H100_BEST_SHAPE


def default_attention_backend(gpu: GPU) -> str:
    """The SDPA backend torch picks on ``gpu`` for a training step's bf16 causal attention: cuDNN
    on sm90 and sm100 (``check_prefer_cudnn_attention`` in torch's ``sdp_utils.cpp``, on by
    default from torch 2.9: pytorch/pytorch#162073; the H200 leases' profiles ran cuDNN's kernels,
    docs/benchmarks/gpu.md), FlashAttention-2 elsewhere. Torch 2.5.1 to 2.8 put flash first on every
    part."""
    return "cudnn" if gpu.capability in ((9, 0), (10, 0)) else "flash"


def attention_efficiency(gpu: GPU, op, backend: str) -> float:
    """The share of the peak an attention op reaches (``ATTENTION_EFFICIENCY``; ``EFFICIENCY``'s
    generic figure for a backend and part it does not have)."""
    table = ATTENTION_EFFICIENCY.get((backend, gpu.capability[0]))
    if not table or not op.head_dim:
        return EFFICIENCY["attention"]
    dims = sorted(table)
    if op.head_dim <= dims[0]:
        return table[dims[0]]
    if op.head_dim >= dims[-1]:
        return table[dims[-1]]
    above = next(d for d in dims if d >= op.head_dim)
    below = max(d for d in dims if d <= op.head_dim)
    if above == below:
        return table[above]
    share = (op.head_dim - below) / (above - below)
    return table[below] + share * (table[above] - table[below])


KERNEL_KINDS = ("canon", "recurrence")
"""The op kinds priced by their own kernels (``kernel_seconds``)."""


def kernel_seconds(step: RankStep, gpu: GPU) -> tuple[dict[int, float], str | None]:
    """Seconds of each Canon and recurrence op of the step (by op index) from its kernels
    (``kernel_cost.call_seconds``), and why none are where the instrument does not price them."""
    from canon_titan.plan import kernel_cost, kernel_counts

    ops = [(i, op) for i, op in enumerate(step.trace.ops) if op.kind in KERNEL_KINDS and op.call]
    if not ops:
        return {}, None
    keys = {i: kernel_counts.call_key(*op.call) for i, op in ops}
    calls = {keys[i]: op.call for i, op in ops}
    try:
        seconds = kernel_cost.call_seconds(list(calls.values()), gpu)
    except kernel_cost.InstrumentError as e:
        return {}, f"the kernel cost instrument failed ({e})"
    if seconds is None:
        return {}, f"the kernel cost instrument prices sm_90 parts, not the {gpu.name}"
    return {i: seconds[keys[i]] for i, _ in ops}, None


def _op_seconds(gpu: GPU, kind: str, op, nbytes: int, attention: str = "flash") -> float:
    flops = op.flops * op.attended
    t_mem = nbytes / (gpu.hbm_tb_s * 1e12 * EFFICIENCY["memory"])
    if kind == "matmul":
        efficiency = matmul_efficiency(gpu, op)
    elif kind == "attention":
        efficiency = attention_efficiency(gpu, op, attention)
    else:
        efficiency = EFFICIENCY.get(kind)
    t_flops = flops / (_peak_flops(gpu, op) * efficiency) if efficiency and flops else 0.0
    return max(t_flops, t_mem, MIN_KERNEL_S)


def _fused_regions(
    ops, compiled_ops=None, graphs: dict[int, int] | None = None
) -> list[tuple[int, int]]:
    """Runs [start, end) of consecutive ``other`` (elementwise, reduction, copy) ops within one
    phase and one compiled graph (``graphs``: op index -> graph; None: one graph), of the ops inside
    the compiled blocks (``compiled_ops``; None: any)."""
    graphs = graphs or {}
    regions, start = [], None
    for i, op in enumerate(ops):
        fusible = op.kind == "other" and (compiled_ops is None or i in compiled_ops)
        if start is not None and (
            not fusible or op.phase != ops[start].phase or graphs.get(i) != graphs.get(start)
        ):
            regions.append((start, i))
            start = None
        if fusible and start is None:
            start = i
    if start is not None:
        regions.append((start, len(ops)))
    return regions


def _region_bytes(
    ops,
    start: int,
    end: int,
    readers: dict[int, list[int]],
    born: dict[int, int],
    inlined: dict[int, tuple[tuple[int, int], ...]] | None = None,
) -> int:
    """What a fused region moves: the tensors it reads from outside it, and the tensors it writes
    that are used outside it or outlive it. A tensor in ``inlined`` (``_inlined``) is never stored:
    a region that reads it reads the stored tensors it is computed from instead, and a region that
    stores nothing moves nothing."""
    inlined = inlined or {}
    written_inside = set()
    moved = stored = 0

    def load(sid: int, nbytes: int) -> None:
        nonlocal moved
        if sid in written_inside:
            return
        written_inside.add(sid)  # read once into the kernel
        if sid in inlined and born.get(sid, -1) < start:
            for source, source_bytes in inlined[sid]:
                load(source, source_bytes)
        else:
            moved += nbytes

    charged = 0
    for i in range(start, end):
        op = ops[i]
        if op.compiled_only:  # a measured cost of compiled code (``recorder.ROWWISE_CAST_BYTES``)
            charged += op.bytes
            continue
        for sid, nbytes in zip(op.reads, op.read_bytes):
            # an op that only looks at a tensor (``prim.device``, a view's metadata) reads no bytes
            # and does not bring it into the kernel: the op that loads it does
            if nbytes:
                load(sid, nbytes)
        for sid, nbytes in zip(op.writes, op.write_bytes):
            if nbytes == 0:
                continue
            exported = born.get(sid, -1) < start or any(
                r >= end or r < start for r in readers.get(sid, ())
            )
            if (exported or not readers.get(sid)) and sid not in inlined:
                stored += nbytes
            written_inside.add(sid)
    # a run that stores nothing (its results all inlined where they are used) is no kernel at all
    return charged + (moved + stored if stored else 0)


def _inlined(
    ops,
    regions: list[tuple[int, int]],
    readers: dict[int, list[int]],
    born: dict[int, int],
    kept: set[int],
    graphs: dict[int, int] | None = None,
) -> dict[int, tuple[tuple[int, int], ...]]:
    """The tensors a compiled step never stores, with (storage, bytes) of what each is computed
    from. Inductor inlines a pointwise result into the kernels that use it (it realizes a buffer
    for a reduction's result, for a matmul's, attention's or custom kernel's input, and for what
    leaves the compiled graph), so an elementwise op's output that only elementwise ops of the same
    phase read, in later fused runs of the same compiled graph (``graphs``: op index -> graph;
    None: one graph), is recomputed in each of them from the op's own inputs; a block's output is
    its graph's output, and is stored. A pointwise op writes at least a quarter of the bytes it
    reads (a cast from fp32 to float8); a reduction writes less. Tensors read across phases (saved
    for the backward) are the memory model's to place (``_compiled_placement``), not this one's."""
    graphs = graphs or {}
    region_of = {i: (a, b) for a, b in regions for i in range(a, b)}
    inlined: dict[int, tuple[tuple[int, int], ...]] = {}
    for a, b in regions:
        for i in range(a, b):
            op = ops[i]
            written = sum(op.write_bytes)
            if not written or written * 4 < max(op.read_bytes, default=0):
                continue  # a reduction (or a view): its result is realized
            for sid, nbytes in zip(op.writes, op.write_bytes):
                if not nbytes or sid in kept or born.get(sid) != i:
                    continue
                later = [r for r in readers.get(sid, ()) if r >= b]
                if not later or any(
                    region_of.get(r) is None
                    or ops[r].phase != op.phase
                    or graphs.get(r) != graphs.get(i)
                    for r in later
                ):
                    continue
                if any(r < a for r in readers.get(sid, ())):
                    continue
                inlined[sid] = tuple(
                    (src, n) for src, n in zip(op.reads, op.read_bytes) if n and src != sid
                )
    return inlined


def _readers_and_births(ops) -> tuple[dict[int, list[int]], dict[int, int]]:
    """The ops that load each storage (an op that reads no bytes of it, a view or ``prim.device``,
    only looks at it), and the op that first writes it."""
    readers: dict[int, list[int]] = defaultdict(list)
    born: dict[int, int] = {}
    for i, op in enumerate(ops):
        for sid, nbytes in zip(op.reads, op.read_bytes):
            if nbytes:
                readers[sid].append(i)
        for sid in op.writes:
            born.setdefault(sid, i)
    return readers, born


def _lives(events) -> tuple[dict[int, int], dict[int, int]]:
    """Each storage's size (its largest allocation) and the op index of its last free."""
    size: dict[int, int] = {}
    freed: dict[int, int] = {}
    for op_index, sid, delta in events:
        if delta > 0:
            size[sid] = max(size.get(sid, 0), delta)
        else:
            freed[sid] = op_index
    return size, freed


def _compiled_placement(step: RankStep) -> tuple[set[int], dict[int, int]]:
    """``compiled_memory_events``' decisions: the storages a compiled step never stores, and the
    op index until which each storage kept for a recomputation stays alive."""
    ops = step.trace.ops
    readers, born = _readers_and_births(ops)
    size, freed = _lives(step.trace.memory_events)
    kept = set(step.trace.collective_buffers) | set(step.categories)
    away: set[int] = set()
    held_until: dict[int, int] = {}
    for start, end in _fused_regions(ops, step.compiled_ops, step.compiled_graphs):
        phase = ops[start].phase
        if phase == "optimizer":
            continue
        inputs = {
            sid for i in range(start, end) for sid in ops[i].reads if born.get(sid, -1) < start
        }
        saved: dict[int, int] = {}  # storage -> the last backward op that reads it
        for i in range(start, end):
            for sid in ops[i].writes:
                if sid in kept or born.get(sid) != i:
                    continue
                if not readers.get(sid):
                    continue  # nothing in the step reads it: it leaves the run
                later = [r for r in readers[sid] if not start <= r < end]
                if any(ops[r].kind != "other" or ops[r].phase == phase for r in later):
                    continue
                if not later:
                    away.add(sid)
                elif ops[i].reads:  # saved for the backward, and computed from the run's inputs
                    saved[sid] = max(later)
        if not saved:
            continue
        until = max(saved.values())
        extended = sum(
            size.get(sid, 0) for sid in inputs if sid not in kept and freed.get(sid, until) < until
        )
        if extended <= sum(size.get(sid, 0) for sid in saved):
            away.update(saved)
            for source in inputs:
                held_until[source] = max(held_until.get(source, 0), until)
    return away, held_until


def compiled_memory_events(step: RankStep) -> list[tuple[int, int, int]]:
    """The step's allocations and frees as a compiled step makes them. A storage that an elementwise
    run creates and only that run uses is fused away. One that only the backward reads besides
    (saved for it) is either stored as in eager mode or recomputed in the backward from the run's
    inputs, which then stay alive until that point instead: Inductor's min-cut partitioner takes
    whichever saves fewer bytes (recomputing elementwise work on a tie), so the run's saved outputs
    are dropped only when they weigh at least as much as the inputs whose life that extends (under
    activation checkpointing the inputs were freed after the forward, and keeping them costs more
    than the outputs the checkpoint already drops). A storage an allocation makes (``empty``, FSDP's
    buffers) has nothing to be recomputed from. What a matmul, attention, a custom kernel, a
    collective or a later op of the same phase reads is stored as in eager mode."""
    away, held_until = _compiled_placement(step)
    events = []
    for op_index, sid, delta in step.trace.memory_events:
        if sid in away:
            continue
        if delta < 0 and held_until.get(sid, -1) > op_index:
            op_index = held_until[sid]
        events.append((op_index, sid, delta))
    events.sort(key=lambda e: e[0])  # stable: a storage's own events keep their order
    return events


def fused_region_bytes(step: RankStep) -> list[tuple[int, int, int]]:
    """The fused kernels of a compiled step, as (first op, end op, bytes moved): every run of
    elementwise ops inside the compiled code (``_fused_regions``; TorchTitan compiles the model, not
    the optimizer), each reading and writing what ``_region_bytes`` counts, with what Inductor
    inlines (``_inlined``) and what the partitioner recomputes in the backward instead of saving
    it (``_compiled_placement``, as the memory model keeps it) loaded from what it is computed
    from. ``scripts/benchmarks/inductor_bytes.py`` holds it to Inductor's own count."""
    ops = step.trace.ops
    readers, born = _readers_and_births(ops)
    regions = [
        (a, b)
        for a, b in _fused_regions(ops, step.compiled_ops, step.compiled_graphs)
        if ops[a].phase != "optimizer"
    ]
    kept = set(step.trace.collective_buffers) | set(step.categories)
    inlined = _inlined(ops, regions, readers, born, kept, step.compiled_graphs)
    for sid in _compiled_placement(step)[0]:
        if sid in born and sid not in inlined:
            producer = ops[born[sid]]
            inlined[sid] = tuple(
                (src, n) for src, n in zip(producer.reads, producer.read_bytes) if n and src != sid
            )
    return [(a, b, _region_bytes(ops, a, b, readers, born, inlined)) for a, b in regions]


def compute_seconds(
    step: RankStep,
    gpu: GPU,
    compiled: bool,
    attention: str = "flash",
    kernels_s: dict[int, float] | None = None,
) -> tuple[dict[str, float], dict[str, int], int]:
    """Seconds and executed FLOPs per op kind for the whole step, and the kernels launched
    (attention on the SDPA backend ``attention``; the ops in ``kernels_s``, op index -> seconds, at
    those: ``kernel_seconds``)."""
    ops = step.trace.ops
    kernels_s = kernels_s or {}
    seconds: dict[str, float] = defaultdict(float)
    flops: dict[str, int] = defaultdict(int)
    kernels = 0
    fused_at = (
        {start: (end, nbytes) for start, end, nbytes in fused_region_bytes(step)}
        if compiled
        else {}
    )
    i = 0
    while i < len(ops):
        op = ops[i]
        scale = repeats(step, i)
        if i in fused_at:
            end, nbytes = fused_at[i]
            region_flops = sum(o.flops for o in ops[i:end])
            if nbytes or region_flops:
                seconds["other"] += scale * max(
                    nbytes / (gpu.hbm_tb_s * 1e12 * EFFICIENCY["memory"]), MIN_KERNEL_S
                )
                kernels += int(scale)
            flops["other"] += int(scale * region_flops)
            i = end
            continue
        if (op.bytes or op.flops) and not op.compiled_only:
            op_s = kernels_s.get(i) or _op_seconds(gpu, op.kind, op, op.bytes, attention)
            seconds[op.kind] += scale * op_s
            kernels += int(scale)
        flops[op.kind] += int(scale * op.flops)
        i += 1
    return dict(seconds), dict(flops), kernels


def _link(ranks: tuple[int, ...], gpus_per_node: int) -> str:
    nodes = {r // gpus_per_node for r in ranks}
    return "network" if len(nodes) > 1 else "nvlink"


def collective_latency(kind: str, n: int, nodes: int) -> float:
    """A collective's latency over n ranks on ``nodes`` nodes: a ring all-gather, reduce-scatter or
    all-to-all takes n - 1 steps (nodes - 1 of them between nodes), a ring all-reduce twice that;
    a tree all-reduce 2 (n / nodes - 1) hops inside the nodes and 2 log2(nodes) between them, and
    NCCL takes the faster of the two; a send or receive one hop."""
    if n <= 1:
        return 0.0
    if kind in ("send", "recv", "send/recv"):
        return COLLECTIVE_START_S + RING_HOP_S["network" if nodes > 1 else "nvlink"]
    steps, between = (2 * (n - 1), 2 * (nodes - 1)) if kind == "all_reduce" else (n - 1, nodes - 1)
    ring = (
        COLLECTIVE_START_S
        + (steps - between) * RING_HOP_S["nvlink"]
        + between * RING_HOP_S["network"]
    )
    if kind != "all_reduce":
        return ring
    tree = COLLECTIVE_START_S + 2 * (
        (n // nodes - 1) * TREE_HOP_S["nvlink"] + (nodes.bit_length() - 1) * TREE_HOP_S["network"]
    )
    return min(ring, tree)


def collective_seconds(
    kind: str, nbytes: int, n: int, link: str, gpu: GPU, nodes: int = 1
) -> float:
    if n <= 1:
        return 0.0
    bandwidth = (gpu.network_gb_s if link == "network" else gpu.collective_nvlink_gb_s) * 1e9
    factor = {"all_reduce": 2 * (n - 1) / n, "send": 1.0, "recv": 0.0, "send/recv": 1.0}.get(
        kind, (n - 1) / n
    )
    return collective_latency(kind, n, nodes) + nbytes * factor / bandwidth


def collectives(step: RankStep, gpu: GPU, gpus_per_node: int):
    """Collective costs grouped by kind and group; per phase, the seconds of the data-parallel ones
    (which prefetching overlaps with compute) and how many they are; per phase, the seconds of the
    others (on the critical path)."""
    grouped: dict[tuple[str, str], CollectiveCost] = {}
    overlappable: dict[str, float] = defaultdict(float)
    units: dict[str, int] = defaultdict(int)
    exposed: dict[str, float] = defaultdict(float)
    for c in step.trace.collectives:
        scale = repeats(step, c.op_index)
        name = step.group_names.get(tuple(sorted(c.group)), "other") if c.group else "other"
        link = _link(c.group, gpus_per_node) if c.group else "nvlink"
        n = len(c.group)
        nodes = len({r // gpus_per_node for r in c.group}) or 1
        seconds = scale * collective_seconds(c.kind, c.bytes, n, link, gpu, nodes)
        key = (c.kind, name)
        if key not in grouped:
            grouped[key] = CollectiveCost(c.kind, name, n, link, 0, 0, 0.0)
        cost = grouped[key]
        cost.bytes += int(scale * c.bytes)
        cost.count += int(scale)
        cost.seconds += seconds
        phase = "backward" if c.phase == "optimizer" and name in DATA_PARALLEL_GROUPS else c.phase
        if name in DATA_PARALLEL_GROUPS and n > 1:
            overlappable[phase] += seconds
            units[phase] += 1
        else:
            exposed[phase] += seconds
    return sorted(grouped.values(), key=lambda c: -c.seconds), overlappable, units, exposed


def _phase_share(
    step: RankStep, gpu: GPU, attention: str, kernels_s: dict[int, float]
) -> dict[str, float]:
    """Each phase's share (forward, backward, optimizer) of the step's eager op time."""
    per_phase: dict[str, float] = defaultdict(float)
    for i, op in enumerate(step.trace.ops):
        if (op.bytes or op.flops) and not op.compiled_only:
            op_s = kernels_s.get(i) or _op_seconds(gpu, op.kind, op, op.bytes, attention)
            per_phase[op.phase] += repeats(step, i) * op_s
    total = sum(per_phase.values()) or 1.0
    return {phase: t / total for phase, t in per_phase.items()}


def bubble_slots(schedule: str, ranks: int, stages_per_rank: int) -> float:
    """Idle microbatch slots of a pipeline schedule over ``ranks`` pipeline ranks, per accumulation
    group."""
    if ranks <= 1 or schedule in ZERO_BUBBLE:
        return 0.0
    return (ranks - 1) / stages_per_rank


def rank_time(
    step: RankStep, gpu: GPU, *, compiled: bool, gpus_per_node: int, attention: str = "flash"
) -> RankTime:
    """This rank's step without the pipeline bubble (which the slowest stage sets: ``plan``)."""
    kernels_s, unpriced = kernel_seconds(step, gpu)
    compute, flops, kernels = compute_seconds(step, gpu, compiled, attention, kernels_s)
    costs, overlappable, units, exposed = collectives(step, gpu, gpus_per_node)
    total_compute = sum(compute.values())
    share = _phase_share(step, gpu, attention, kernels_s)
    exposed_s = sum(exposed.values())
    for phase in ("forward", "backward"):
        comm = overlappable.get(phase, 0.0)
        if not comm:
            continue
        phase_compute = total_compute * share.get(phase, 0.0)
        # The first all-gather of a phase (or its last reduce-scatter) waits alone.
        exposed_s += comm / units[phase] + max(0.0, comm - phase_compute)
    return RankTime(
        compute,
        costs,
        exposed_s,
        total_compute + exposed_s,
        flops,
        kernels,
        share.get("optimizer", 0.0),
        unpriced,
    )
