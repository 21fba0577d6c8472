"""What one training step does, op by op, as PyTorch dispatches it: each op's FLOPs, the bytes it
reads and writes and the storages it reads and creates, every storage's life (allocations, frees
and the storage resizes FSDP2 uses for its gathered parameters), and every collective with its
bytes and process group. It works the same on fake tensors (a plan) and on real ones (the tests
hold plans to real runs with it).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from canon_titan.plan.flops import op_kind  # importing it registers the FLOP formulas of our ops
from canon_titan.plan.kernel_counts import spec

ALLOCATION_ROUNDING = 512
"""The CUDA caching allocator hands out multiples of 512 bytes."""

ROWWISE_CAST_BYTES = {"INPUT": 12.1, "GRAD_OUTPUT": 3.9}
"""Bytes per element that a compiled step moves, beyond the plan's fused passes, to cast an
activation operand of a float8 GEMM with row-wise (or column-wise) scales (torchao's ``rowwise``
recipes), per GEMM it enters: the linear's input (``INPUT``: its forward GEMM, and its
grad-weight GEMM scaled per column) and its output gradient (``GRAD_OUTPUT``: the grad-input
and grad-weight GEMMs). Fitted to half of torchao's published microbenchmark of a row-wise
float8 linear and held to the other half (docs/benchmarks/planner.md, "Row-wise float8 casts at
their measured cost"); ``scripts/benchmarks/fit_rowwise_casts.py`` refits them for the compile
model as it stands (``estimate.fused_region_bytes``). In eager mode every recorded cast op is its
own kernel and is counted in full instead."""

_FACTORIES = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}
_COLLECTIVE_NAMES = {
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
    "send": "send",
    "recv": "recv",
    "isend": "send",
    "irecv": "recv",
    "batch_p2p": "send/recv",
    "shard_dim_alltoall": "all_to_all",
}


def collective_kind(func) -> str:
    name = func._schema.name.split("::")[-1].strip("_")
    for prefix, kind in _COLLECTIVE_NAMES.items():
        if name.startswith(prefix):
            return kind
    return name


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place (its arguments marked as written in its schema)."""
    out = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


def causal_share(queries: int, keys: int, diagonal: int = 0) -> float:
    """The share of a [queries, keys] score matrix that ``tril(diagonal)`` keeps: query i sees
    keys 0 .. i + diagonal. Causal attention is ``diagonal = keys - queries`` (aligned to the lower
    right, as the fused kernels and ``causal_lower_right`` have it; 0 for a square one)."""
    if not queries or not keys:
        return 1.0
    a = diagonal + 1  # query i sees min(max(i + a, 0), keys) keys
    none_until = min(max(1 - a, 0), queries)
    all_from = max(min(max(keys - a, 0), queries), none_until)
    growing = (all_from - 1 + none_until) * (all_from - none_until) // 2 + a * (
        all_from - none_until
    )
    return (growing + (queries - all_from) * keys) / (queries * keys)


def tf32_allowed() -> bool:
    """Whether cuBLAS may run fp32 matmuls as TF32 in this process. PyTorch's default is no, and
    neither TorchTitan nor canon-titan changes it; ``fp32_precision`` follows the legacy
    ``allow_tf32`` and ``set_float32_matmul_precision`` too."""
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


def _inner(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors that hold a wrapper subclass's data (torchao's ``Float8TrainingTensor``: its
    float8 data and scale), or None for a plain tensor. DTensors are not unwrapped here: the
    recorder lets DTensor run their ops on the local shards, which it records."""
    if isinstance(t, DTensor) or not is_traceable_wrapper_subclass(t):
        return None
    names, _ = t.__tensor_flatten__()
    return [x for x in (getattr(t, name) for name in names) if isinstance(x, torch.Tensor)]


def tensor_bytes(t: torch.Tensor) -> int:
    """What reading or writing ``t`` moves: a wrapper subclass moves its inner tensors (a float8
    tensor's 1-byte data, not the 2 bytes of the dtype it reports)."""
    inner = _inner(t)
    if inner is not None:
        return sum(tensor_bytes(x) for x in inner)
    return t.numel() * t.element_size()


@dataclass
class Op:
    kind: str
    """``matmul``, ``attention``, ``canon``, ``recurrence`` (GLA, gated delta rule, SSD) or
    ``other``."""
    phase: str
    """``forward``, ``backward`` (activation-checkpoint recomputation included) or ``optimizer``."""
    name: str
    flops: int
    bytes: int
    dtype: torch.dtype | None
    reads: tuple[int, ...]
    """Storages read (their ids), with the bytes of the tensors read from each."""
    read_bytes: tuple[int, ...]
    writes: tuple[int, ...]
    write_bytes: tuple[int, ...]
    fp8: bool = False
    """A matmul of float8 operands (or one inside a float8 linear, where the plan emulates them)."""
    attended: float = 1.0
    """An attention op's share of the score matrix that is computed: a causal mask's kept entries
    (fused kernels skip the fully masked blocks), 1 for no mask or any other mask."""
    head_dim: int = 0
    """An attention op's head dim (its query's last dimension; 0 for other ops)."""
    tf32: bool = False
    """fp32 operands run on TF32 tensor cores: a matmul or attention op in a step that allows it
    (``tf32_allowed``), a recurrence always (fla's and mamba-ssm's Triton ``tl.dot`` takes fp32 as
    TF32 by default)."""
    after: int = -1
    """For a step the recorder adds after an op that hides it (torchao's rescale after a float8
    GEMM), that op's index; -1 for the ops dispatched."""
    compiled_only: bool = False
    """A cost that only compiled code pays over what its ops move (``ROWWISE_CAST_BYTES``): eager
    mode runs each recorded op as its own kernel, which the plan already counts in full."""
    call: tuple[str, list] | None = None
    """A Canon or recurrence op's call: the op and its arguments (``kernel_counts.spec``), which
    ``kernel_cost`` prices by the kernels the call launches."""


@dataclass
class Collective:
    kind: str
    group: tuple[int, ...]
    """The global ranks of its process group."""
    bytes: int
    """The bytes of the tensor it moves per rank: an all-gather's output, a reduce-scatter's input,
    an all-reduce's tensor, a send's or receive's buffer."""
    phase: str
    op_index: int
    """Where in the op sequence it was issued."""


@dataclass
class StepTrace:
    ops: list[Op] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    memory_events: list[tuple[int, int, int]] = field(default_factory=list)
    """(op index, storage id, change in bytes) in order."""
    resized: set[int] = field(default_factory=set)
    """Storages resized in place (FSDP2's gathered parameters)."""
    collective_buffers: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Storages passed to a collective, with the collective's group (global ranks)."""
    collective_buffer_kinds: dict[int, str] = field(default_factory=dict)
    """The same storages, with the kind of the first collective they were passed to."""
    marks: dict[str, int] = field(default_factory=dict)
    """Named points in the op sequence (the driver's)."""


class StepRecorder(TorchDispatchMode):
    """Records a ``StepTrace`` of what is dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.trace = StepTrace()
        self._ids = WeakIdKeyDictionary()
        self._sizes: dict[int, int] = {}
        self._next_id = 0
        self.phase_override: str | None = None
        self._fp8_context = 0
        self._tf32 = False
        self._orig_resize = None
        self._depth = 0
        self._paused = 0
        # Causal masks that PyTorch's CPU attention materializes where the GPU kernels take a flag
        # (``causal_lower_right``): storage id -> the share of scores they keep. They and the ones
        # tensor they are cut from are left out of the memory a plan counts.
        self._causal_masks: dict[int, float] = {}
        self._ones: set[int] = set()
        # Row-wise float8 casts: the storage each float8 cast's elementwise results come from
        # (followed back through the cast's same-sized ops, inside a float8 linear's forward or
        # its backward node) and the casts already charged (``_rowwise_casts``).
        self._sources: dict[int, int] = {}
        self._casts_charged: set[tuple] = set()

    # --- storages -------------------------------------------------------------------------------

    def storage_id(self, t: torch.Tensor) -> int:
        inner = _inner(t)
        if inner:
            # A wrapper's data is its first inner tensor's storage: a view or transpose of a
            # float8 tensor is a view of the same data, and moves nothing.
            return self.storage_id(inner[0])
        st = t.untyped_storage()
        sid = self._ids.get(st)
        if sid is None:
            sid = self._next_id
            self._next_id += 1
            self._ids[st] = sid
            size = st.nbytes()
            self._sizes[sid] = size
            self.trace.memory_events.append((len(self.trace.ops), sid, size))
            weakref.finalize(st, self._freed, sid)
        return sid

    def _freed(self, sid: int) -> None:
        self._sources.pop(sid, None)
        size = self._sizes.pop(sid, 0)
        if size:
            self.trace.memory_events.append((len(self.trace.ops), sid, -size))

    def register(self, tensors) -> set[int]:
        """Storage ids of tensors that exist before recording (parameters, optimizer state, ...)."""
        return {self.storage_id(t) for t in tensors}

    def _unaccounted(self, sid: int) -> None:
        """A storage that is no GPU memory: its allocation is taken back out of the trace."""
        for i in range(len(self.trace.memory_events) - 1, -1, -1):
            if self.trace.memory_events[i][1] == sid:
                del self.trace.memory_events[i]
                break
        self._sizes[sid] = 0

    def _causal_mask(self, func, args, inputs, writes, outputs) -> None:
        """Follow a causal mask through its making: ones, ``tril``, and ``where`` to a float
        bias."""
        packet = func._overloadpacket
        if packet is torch.ops.aten.ones and writes:
            self._ones.add(writes[0])
        elif (
            packet is torch.ops.aten.tril
            and outputs
            and outputs[0].dtype == torch.bool
            and outputs[0].dim() == 2
        ):
            source = self.storage_id(inputs[0])
            if source in self._ones:
                queries, keys = outputs[0].shape
                diagonal = args[1] if len(args) > 1 else 0
                self._causal_masks[writes[0]] = causal_share(queries, keys, diagonal)
                self._unaccounted(source)
                self._unaccounted(writes[0])
        elif (
            packet is torch.ops.aten.where
            and inputs
            and writes
            and self.storage_id(inputs[0]) in self._causal_masks
        ):
            self._causal_masks[writes[0]] = self._causal_masks[self.storage_id(inputs[0])]
            self._unaccounted(writes[0])

    def _attended(self, func, args, kwargs) -> float:
        query, key = _argument(func, args, kwargs, "query"), _argument(func, args, kwargs, "key")
        if query is None or key is None:
            return 1.0
        if _argument(func, args, kwargs, "is_causal"):
            return causal_share(query.shape[-2], key.shape[-2], key.shape[-2] - query.shape[-2])
        mask = _argument(func, args, kwargs, "attn_mask")
        if isinstance(mask, torch.Tensor):
            return self._causal_masks.get(self.storage_id(mask), 1.0)
        return 1.0

    def _resize(self, st, size):
        self._orig_resize(st, size)
        sid = self._ids.get(st)
        if sid is not None:
            new = st.nbytes()
            old = self._sizes.get(sid, 0)
            if new != old:
                self._sizes[sid] = new
                self.trace.memory_events.append((len(self.trace.ops), sid, new - old))
                self.trace.resized.add(sid)

    def __enter__(self):
        if not self._depth:
            self._tf32 = tf32_allowed()  # as the step runs: after the run's own build set it up
            # FSDP2 frees and re-allocates its gathered parameters by resizing their storages,
            # which dispatch does not see (torch's MemTracker patches it the same way).
            self._orig_resize = torch.UntypedStorage.resize_
            recorder = self

            def resize_(st, size):
                recorder._resize(st, size)

            torch.UntypedStorage.resize_ = resize_
            # DTensor finds an op's output shape by running it on fake global tensors: no kernel.
            self._orig_propagate = ShardingPropagator._propagate_tensor_meta_non_cached

            def propagate(propagator, op_schema):
                with recorder.paused():
                    return recorder._orig_propagate(propagator, op_schema)

            ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *args):
        self._depth -= 1
        if not self._depth:
            torch.UntypedStorage.resize_ = self._orig_resize
            ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate
        return super().__exit__(*args)

    @contextlib.contextmanager
    def paused(self):
        """Ops inside are not recorded (set-up work that belongs to no step)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def mark(self, name: str) -> None:
        self.trace.marks[name] = len(self.trace.ops)

    # --- ops ------------------------------------------------------------------------------------

    def phase(self) -> str:
        if self.phase_override:
            return self.phase_override
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if any(isinstance(t, DTensor) for t in inputs):
            # A DTensor op runs as ops on its local shards: let DTensor handle it, and record those.
            return NotImplemented
        out = func(*args, **kwargs)
        if func in collective_ops:
            if func not in sync_ops:
                self._collective(func, out, args, kwargs)
            return out
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        reads = tuple(self.storage_id(t) for t in inputs)
        writes = tuple(self.storage_id(t) for t in outputs)
        packet = func._overloadpacket
        formula = flop_registry.get(packet)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        mutated = _mutated(func, args, kwargs)
        if (
            mutated and not outputs
        ):  # in place, returning nothing (foreach ops, the fused optimizers)
            outputs = mutated
            writes = tuple(self.storage_id(t) for t in outputs)
        if func in _FACTORIES or (
            not mutated and (not outputs or all(sid in reads for sid in writes))
        ):
            # An allocation, a view, or an op returning no tensor (a size, a device): no data moves.
            read_bytes, write_bytes = (0,) * len(inputs), (0,) * len(outputs)
        else:
            read_bytes = tuple(tensor_bytes(t) for t in inputs)
            write_bytes = tuple(tensor_bytes(t) for t in outputs)
        kind = op_kind(packet)
        if (
            kind == "other"
            and len(writes) == 1
            and reads
            and outputs[0].numel() > 1
            and outputs[0].numel() == inputs[0].numel()
            and writes[0] != reads[0]
            and (self._fp8_context > 0 or _in_float8_backward())
        ):  # a float8 cast's own ops
            self._sources[writes[0]] = self._sources.get(reads[0], reads[0])
        dtype = inputs[0].dtype if inputs else (outputs[0].dtype if outputs else None)
        fp8 = kind == "matmul" and (
            self._fp8_context > 0
            or _in_float8_backward()
            or any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in inputs)
        )
        self._causal_mask(func, args, inputs, writes, outputs)
        attended = self._attended(func, args, kwargs) if kind == "attention" else 1.0
        head_dim = _head_dim(func, args, kwargs) if kind == "attention" else 0
        tf32 = kind == "recurrence" or (kind in ("matmul", "attention") and self._tf32)
        call = (func._schema.name, spec(list(args))) if kind in ("canon", "recurrence") else None
        self.trace.ops.append(
            Op(
                kind,
                self.phase(),
                str(packet).split("::")[-1],
                int(flops),
                sum(read_bytes) + sum(write_bytes),
                dtype,
                reads,
                read_bytes,
                writes,
                write_bytes,
                fp8,
                attended,
                head_dim,
                tf32,
                call=call,
            )
        )
        gemm = len(self.trace.ops) - 1
        if fp8 and len(outputs) == 1 and _rescaled_after_gemm(inputs):
            self._rescale(inputs, outputs[0])
        if fp8:
            self._rowwise_casts(inputs, gemm)
        return out

    def _rowwise_casts(self, inputs: list[torch.Tensor], gemm: int) -> None:
        """What Inductor's kernels for torchao's row-wise casts move beyond one fused pass
        (``ROWWISE_CAST_BYTES``), for each activation operand of a float8 GEMM scaled per row or
        per column: read as bytes from a storage of its own, so that it adds to the compiled
        region it falls in and to nothing else. ``gemm``: the GEMM's op index. Linears that take
        the same input (the attention's wq, wk and wv; the MLP's w1 and w3) cast it the same way
        in one compiled graph, which AOTAutograd's common-subexpression elimination
        (``torch._functorch.config.cse``, on by default) makes one cast: it is charged once per
        source tensor, role, scale shape and phase."""
        for t in inputs:
            inner = _inner(t)
            role = getattr(getattr(t, "_gemm_input_role", None), "name", None)
            if (
                not inner
                or len(inner) < 2
                or inner[1].numel() <= 1
                or role not in ROWWISE_CAST_BYTES
            ):
                continue
            data = self.storage_id(inner[0])
            cast = (self._sources.get(data, data), role, tuple(inner[1].shape), self.phase())
            if cast in self._casts_charged:
                continue  # the same cast of the same tensor (wq, wk and wv's input): one kernel
            self._casts_charged.add(cast)
            extra = int(ROWWISE_CAST_BYTES[role] * t.numel())
            if not extra:
                continue
            source = self._next_id
            self._next_id += 1
            self.trace.ops.append(
                Op(
                    "other",
                    self.phase(),
                    f"float8 row-wise cast of the {role.lower()} (Inductor)",
                    0,
                    extra,
                    t.dtype,
                    (source,),
                    (extra,),
                    (),
                    (),
                    after=gemm,
                    compiled_only=True,
                )
            )

    def _rescale(self, inputs: list[torch.Tensor], output: torch.Tensor) -> None:
        """What torchao's ``addmm_float8_unwrapped`` runs after a GEMM of row-wise scaled operands
        with slow accumulation (``_rescaled_after_gemm``): the GEMM is cuBLAS's tensor-wise one at
        unit scales, then the output is multiplied in place by the outer product of the two
        operands' inverse scales, an fp32 [M, N] tensor (materialized in eager mode; under compile
        the product fuses into the multiply, which stays a kernel of its own after the GEMM:
        Inductor does not fuse into cuBLAS's epilogue, pytorch/ao#2184)."""
        scales = [x for t in inputs if (inner := _inner(t)) for x in inner[1:]][:2]
        scale_ids = tuple(self.storage_id(x) for x in scales)
        scale_bytes = tuple(tensor_bytes(x) for x in scales)
        out_id, out_bytes = self.storage_id(output), tensor_bytes(output)
        product_id, product_bytes = self._next_id, output.numel() * 4
        self._next_id += 1
        phase, gemm = self.phase(), len(self.trace.ops) - 1
        self.trace.memory_events.append((len(self.trace.ops), product_id, product_bytes))
        self.trace.ops.append(
            Op(
                "other",
                phase,
                "float8 rowwise scales outer product",
                output.numel(),
                sum(scale_bytes) + product_bytes,
                torch.float32,
                scale_ids,
                scale_bytes,
                (product_id,),
                (product_bytes,),
                after=gemm,
            )
        )
        self.trace.ops.append(
            Op(
                "other",
                phase,
                "float8 rowwise output rescale",
                output.numel(),
                2 * out_bytes + product_bytes,
                output.dtype,
                (out_id, product_id),
                (out_bytes, product_bytes),
                (out_id,),
                (out_bytes,),
                after=gemm,
            )
        )
        self.trace.memory_events.append((len(self.trace.ops), product_id, -product_bytes))

    def _collective(self, func, out, args, kwargs) -> None:
        try:
            group = CollectiveOp.get_process_group(func, args)
            ranks = tuple(dist.get_process_group_ranks(group))
        except (TypeError, ValueError, RuntimeError):
            ranks = ()
        try:
            nbytes = CollectiveOp.get_comm_tensor_size(func, out, args, kwargs)
        except TypeError:
            nbytes = 0
        kind = collective_kind(func)
        self.trace.collectives.append(
            Collective(kind, ranks, nbytes, self.phase(), len(self.trace.ops))
        )
        for t in (a for a in tree_flatten((args, out))[0] if isinstance(a, torch.Tensor)):
            sid = self.storage_id(t)
            self.trace.collective_buffers.setdefault(sid, ranks)
            self.trace.collective_buffer_kinds.setdefault(sid, kind)

    # float8 linears in the plan run torchao's emulation (no fp8 matmul on a CPU); their matmuls
    # are the GPU's fp8 ones: in their forward (between these calls) and in their autograd
    # function's backward.
    def enter_fp8_linear(self) -> None:
        self._fp8_context += 1

    def exit_fp8_linear(self) -> None:
        self._fp8_context -= 1


def _argument(func, args, kwargs, name: str):
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[i] if i < len(args) else kwargs.get(name, argument.default_value)
    return None


def _head_dim(func, args, kwargs) -> int:
    query = _argument(func, args, kwargs, "query")
    return int(query.shape[-1]) if isinstance(query, torch.Tensor) and query.dim() else 0


def _rescaled_after_gemm(inputs: list[torch.Tensor]) -> bool:
    """A GEMM of two torchao float8 tensors scaled per row (and per column) whose GEMM config asks
    for slow accumulation (the backward GEMMs of torchao's ``rowwise`` recipe): torchao runs it as a
    tensor-wise GEMM followed by a rescale of its output (``StepRecorder._rescale``), because
    PyTorch's row-wise CUTLASS kernel is much slower without fast accumulation."""
    operands = [t for t in inputs if _inner(t) is not None and hasattr(t, "_linear_mm_config")]
    if len(operands) != 2 or any(t._scale.numel() <= 1 for t in operands):
        return False
    from torchao.float8.float8_ops import choose_scaled_mm_config

    a, b = operands
    config = choose_scaled_mm_config(
        a._gemm_input_role, a._linear_mm_config, b._gemm_input_role, b._linear_mm_config
    )
    return not config.use_fast_accum


def _in_float8_backward() -> bool:
    node = torch._C._current_autograd_node()
    return node is not None and "float8" in node.name()


def round_up(nbytes: int, to: int = ALLOCATION_ROUNDING) -> int:
    return -(-nbytes // to) * to


@dataclass
class MemoryPeak:
    total: int
    """Peak bytes alive at once, each storage rounded up as the CUDA allocator rounds it."""
    op_index: int
    phase: str
    by_category: dict[str, int]


def memory_peak(
    trace: StepTrace,
    categories: dict[int, str],
    default: str = "activations",
    events: list[tuple[int, int, int]] | None = None,
) -> MemoryPeak:
    """The highest total of live storages over the trace (or over ``events``, the trace's
    allocations and frees rearranged), and what was alive then by category (``categories``:
    storage id -> name; others count as ``default``)."""
    live: dict[int, int] = {}
    total, best, best_at = 0, -1, 0
    events = trace.memory_events if events is None else events
    for i, (_, sid, delta) in enumerate(events):
        old = live.get(sid, 0)
        new = old + delta
        live[sid] = new
        total += round_up(new) - round_up(old)
        if total > best:
            best, best_at = total, i
    live = defaultdict(int)
    for _, sid, delta in events[: best_at + 1]:
        live[sid] += delta
    by_category: dict[str, int] = defaultdict(int)
    for sid, size in live.items():
        if size > 0:
            by_category[categories.get(sid, default)] += round_up(size)
    op_index = events[best_at][0] if events else 0
    phase = trace.ops[min(op_index, len(trace.ops) - 1)].phase if trace.ops else "forward"
    return MemoryPeak(max(best, 0), op_index, phase, dict(by_category))
