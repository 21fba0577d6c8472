"""A planner-only patch of DTensor's sharding propagation: the scan for ``_StridedShard`` placements
once per foreach op instead of once per tensor in it (``strided_shard_scan_once_per_op``).

A plan builds and steps hundreds of ranks in one process, each rank's first step propagating
sharding afresh, so it pays the quadratic scan every time; a training process pays it once, on its
first step, and runs torch's own code. The patched name and what the stand-in assumes of it are
pinned in ``tests/test_upstream.py``.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading


class _ArgsSpecs:
    """What torch's ``_propagate_use_strided_shard_flag`` reads of an op's schema: its arguments'
    specs."""

    __slots__ = ("args_spec",)

    def __init__(self, specs: list):
        self.args_spec = specs


def strided_shard_scan_once_per_op() -> None:
    """DTensor's sharding propagation calls ``_propagate_use_strided_shard_flag`` for every child
    strategy of a foreach op (one per tensor in its lists), and each call scans all of the op's
    arguments for ``_StridedShard`` placements: quadratic in the number of tensors. A fused AdamW
    step over an 8B model's parameters made 2.5 million such checks, 8 of the 55 s
    ``canon-titan plan`` took for LlamaCanon-8B on 512 GPUs under a profiler. The scan's answer
    is the same for every child: with no strided argument torch's function returns at once, and
    otherwise its flag is True if any strided argument's flag is (the fixes it applies to a child
    write that answer, so they cannot change it). This
    scans once per op (the same schema object and argument tuple) and then calls torch's function
    only where some argument is strided, with a stand-in schema holding one argument that gives
    the same answer, so torch's own code fixes up each child; arguments whose flag is unset
    (None) get torch's full scan. It applies only where torch's function reads nothing of the
    schema but its argument specs (its source says so, which ``tests/test_upstream.py`` holds to the
    torch installed), which is all the stand-in carries."""
    try:
        from torch.distributed.tensor import _sharding_prop as sharding_prop
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return
    original = getattr(sharding_prop, "_propagate_use_strided_shard_flag", None)
    if original is None or getattr(original, "_canon_titan_shim", False):
        return
    try:  # the stand-in below carries the argument specs alone: only where that is all torch reads
        if set(re.findall(r"op_schema\.(\w+)", inspect.getsource(original))) != {"args_spec"}:
            return
    except (OSError, TypeError):
        return
    last = threading.local()  # (schema, its argument tuple, its stand-in) of this thread's last op

    def stand_in(op_schema):
        strided = [
            spec
            for spec in op_schema.args_spec
            if any(isinstance(p, _StridedShard) for p in spec.placements)
        ]
        flags = [spec.use_strided_shard_as_shard_order for spec in strided]
        if not strided:
            return None
        if None in flags:
            return op_schema
        return _ArgsSpecs([strided[flags.index(True)] if True in flags else strided[0]])

    @functools.wraps(original)
    def propagate(op_strategy, op_schema) -> None:
        schema, args, schema_stand_in = getattr(last, "op", (None, None, None))
        if schema is not op_schema or args is not op_schema.args_schema:
            schema_stand_in = stand_in(op_schema)
            last.op = (op_schema, op_schema.args_schema, schema_stand_in)
        if schema_stand_in is not None:
            propagate.original(op_strategy, schema_stand_in)

    propagate.original = original
    propagate._canon_titan_shim = True
    sharding_prop._propagate_use_strided_shard_flag = propagate
