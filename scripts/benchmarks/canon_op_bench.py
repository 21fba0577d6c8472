"""The Canon op on its own, for bench_canon.py (this folder is first on its sys.path).

``traffic``: the bytes the op's kernels and host-side torch ops read and write per LlamaCanon layer,
forward and backward, counted from the launches the op makes on meta tensors at the model's shapes
(each tensor argument of a kernel moved once: halo re-reads hit the caches), and the buffers it
allocates. Device-independent; runs anywhere.

``bwd_blocks``: on a GPU, the backward kernels alone at each candidate configuration (the backward's
blocks are fixed, not autotuned, so that dw/db are bitwise reproducible: this picks the fixed ones),
against the backward's memory bound.

``fwd_blocks``: on a GPU, the forward kernels alone at each candidate configuration of
``canon.FORWARD_CONFIGS`` (the forward's blocks are fixed, not autotuned, so that every rank runs
the same: this checks the fixed ones against the others), against the forward's memory bound.

``ops``: on a GPU, forward+backward time of Canon calls (the Triton kernels, and fla's
``causal_conv1d`` on the same work) against the memory bound (``traffic``'s bytes over the bandwidth
of a large device copy), the first call's compile-and-autotune time and the configurations the
autotuner chose. Without a GPU it runs tiny shapes in Triton's interpreter (checks the code
path; the times mean nothing).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model_registry
from canon_titan.kernels import aot, canon


@dataclass(frozen=True)
class Call:
    """One Canon call of a layer: a convolution over ``channels`` (a slice of rows ``row_width``
    wide when set), or Canon-D's SwiGLU over ``channels`` = the hidden width."""

    name: str
    channels: int
    swiglu: bool = False
    scaled: bool = False
    residual: bool = True
    activation: bool = False
    bias: bool = False
    row_width: int | None = None


def llama_canon_layer(flavor: str) -> list[Call]:
    args = model_registry.model_args("llama_canon", flavor)
    kv = args.kv_heads * args.head_dim
    return [
        Call("A", args.dim, scaled=True),
        Call("B q", args.dim, scaled=args.qk_norm),
        Call("B k", kv, scaled=args.qk_norm),
        Call("B v", kv),
        Call("C", args.dim, scaled=True),
        Call("D", args.hidden_dim, swiglu=True),
    ]


def mamba2_short_conv(flavor: str) -> Call:
    """Mamba2's conv1d over x|B|C, a slice of in_proj's output."""
    args = model_registry.model_args("mamba2", flavor)
    inner = 2 * args.dim
    return Call(
        "b (Mamba2)",
        inner + 2 * args.state_size,
        residual=False,
        activation=True,
        bias=True,
        row_width=2 * inner + 2 * args.state_size + args.n_heads,
    )


def inputs(call: Call, batch: int, seq: int, device, dtype=torch.bfloat16, gen=None) -> dict:
    def randn(*shape, width=None):
        full = (
            torch.randn(*shape[:-1], width or shape[-1], generator=gen, dtype=torch.float32)
            if gen is not None
            else torch.empty(*shape[:-1], width or shape[-1], dtype=torch.float32, device="meta")
        )
        return full.to(device, dtype)[..., : shape[-1]]

    c = call.channels
    out = {
        "x": randn(batch, seq, c, width=call.row_width),
        "weight": randn(2 * c if call.swiglu else c, 4),
        "bias": randn(2 * c if call.swiglu else c) if call.bias else None,
    }
    if call.swiglu:
        out["up"] = randn(batch, seq, c)
    if call.scaled:
        out["row_scale"], out["col_scale"] = randn(batch, seq).float(), randn(c)
    return out


# ----------------------------------------------------------------------------- bytes moved


class _HostOps(TorchDispatchMode):
    """Bytes read and written by the torch ops that compute (views and allocations move nothing),
    and bytes allocated."""

    def __init__(self):
        super().__init__()
        self.moved = self.allocated = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func._opname.startswith("empty"):
            self.allocated += sum(_nbytes(t) for t in outputs)
        elif not func.is_view:
            tensors = [
                t
                for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            ]
            self.moved += sum(_nbytes(t) for t in tensors + outputs)
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _launch_bytes(launches) -> int:
    """Each distinct tensor argument of each launch (one view passed twice counts once), read or
    written once."""
    total = 0
    for _, args, _ in launches:
        views = {
            (a.untyped_storage()._cdata, a.storage_offset(), a.shape, a.stride()): a
            for a in args
            if isinstance(a, torch.Tensor)
        }
        total += sum(_nbytes(t) for t in views.values())
    return total


def traffic(call: Call, batch: int, seq: int) -> dict:
    """Bytes of the op's forward and backward on meta tensors (bf16 activations, as in training)."""
    t = inputs(call, batch, seq, "meta")
    host = _HostOps()

    def run():
        with host:
            y = _forward(call, t)()
            _backward(call, t, y, bodies=True)()

    launches = aot.record_launches(run)
    return {
        "call": call.name,
        "kernels": len(launches),
        "kernel_bytes": _launch_bytes(launches),
        "host_bytes": host.moved,
        "allocated_bytes": host.allocated,
    }


def layer_traffic(flavor: str, batch: int, seq: int) -> list[dict]:
    return [traffic(call, batch, seq) for call in llama_canon_layer(flavor)]


# ----------------------------------------------------------------------------- GPU timings


def _time_ms(fn, reps: int) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=max(1, reps // 4), rep=reps)
    started = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - started)


def _fwd_bwd(op, tensors: dict, dy: torch.Tensor):
    leaves = {
        k: v.detach().requires_grad_()
        for k, v in tensors.items()
        if v is not None and v.is_floating_point()
    }
    frozen = {k: v for k, v in tensors.items() if k not in leaves}

    def step():
        out = op(**leaves, **frozen)
        torch.autograd.grad(
            out, list(leaves.values()), dy, allow_unused=True
        )  # fla has no fused norm scales

    return step


def _canon_op(call: Call, backend: str):
    def op(x, weight, bias=None, up=None, row_scale=None, col_scale=None):
        if call.swiglu:
            return canon.canon_swiglu(
                x,
                up,
                weight,
                bias,
                residual=call.residual,
                activation=call.activation,
                backend=backend,
            )
        return canon.canon_conv(
            x,
            weight,
            bias,
            row_scale=row_scale,
            col_scale=col_scale,
            residual=call.residual,
            activation=call.activation,
            backend=backend,
        )

    return op


def _fla_op(call: Call):
    """fla's causal_conv1d on the same work (without the fused norm: it has none)."""
    from fla.modules.causal_conv1d import causal_conv1d

    activation = "silu" if call.activation else None

    def conv(x, weight, bias):
        return causal_conv1d(
            x, weight, bias, residual=x if call.residual else None, activation=activation
        )[0]

    def op(x, weight, bias=None, up=None, row_scale=None, col_scale=None):
        if call.swiglu:
            w_gate, w_up = weight.split(call.channels)
            b_gate, b_up = bias.split(call.channels) if bias is not None else (None, None)
            return torch.nn.functional.silu(conv(x, w_gate, b_gate)) * conv(up, w_up, b_up)
        return conv(x, weight, bias)

    return op


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), 100)
    return 2 * _nbytes(src) / (ms / 1000)


def _tuned_configs() -> dict:
    out = {}
    for name in ("_canon_fwd_kernel", "_canon_swiglu_fwd_kernel"):
        kernel = getattr(canon, name)
        if hasattr(kernel, "cache"):  # an Autotuner (not the interpreter's heuristics)
            out[name] = {str(key): str(config) for key, config in kernel.cache.items()}
    return out


def ops(calls: list[Call], batch: int, seq: int, reps: int) -> dict:
    """Timings of ``calls`` (forward + backward, bf16 on a GPU; float32 in the interpreter)."""
    import triton

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    bandwidth = copy_bandwidth() if cuda else None
    results = []
    # A fresh Triton cache: the first call pays what a first training step pays (compile and tune).
    previous = triton.knobs.cache.dir
    with tempfile.TemporaryDirectory() as cache:
        triton.knobs.cache.dir = cache
        for call in calls:
            gen = torch.Generator().manual_seed(0)
            t = inputs(call, batch, seq, device, dtype, gen)
            dy = torch.randn(batch, seq, call.channels, generator=gen).to(device, dtype)
            # Compiled on a GPU, as the models run it: the fused norms' input gradient is torch ops
            # there, fused by Inductor with the norm's backward (in eager, several kernels).
            op = _canon_op(call, "triton")
            triton_step = _fwd_bwd(torch.compile(op) if cuda else op, t, dy)
            started = time.perf_counter()
            triton_step()
            if cuda:
                torch.cuda.synchronize()
            row = {
                "call": call.name,
                "channels": call.channels,
                "first_call_s": time.perf_counter() - started,
                "triton_ms": _time_ms(triton_step, reps),
            }
            if cuda:
                row["fla_causal_conv1d_ms"] = _time_ms(_fwd_bwd(_fla_op(call), t, dy), reps)
                moved = traffic(call, batch, seq)
                row["bound_ms"] = 1000 * (moved["kernel_bytes"] + moved["host_bytes"]) / bandwidth
            results.append(row)
        triton.knobs.cache.dir = previous
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        "batch": batch,
        "seq": seq,
        "copy_bandwidth_gb_s": bandwidth / 1e9 if bandwidth else None,
        "calls": results,
        "tuned": _tuned_configs(),
    }


BACKWARD_CANDIDATES = [(64, 4, 1), (64, 8, 1), (128, 4, 1), (128, 8, 1), (128, 8, 2)]
"""(BLOCK_C, U, num_warps) of the backward kernels, each tried by ``backward_blocks``: two or four
channels a thread, the next 4 or 8 rows' loads in flight. None spills on sm_90 (``python -m
canon_titan.kernels.aot`` with the blocks set)."""


def _backward(call: Call, t: dict, dy: torch.Tensor, bodies: bool = False):
    """The call's backward kernels as the models launch them: through the ops (eager, on a device),
    or their bodies (``bodies``: on meta tensors, whose launches ``aot.record_launches`` records).
    With a fused norm and no SiLU they compute the weight's and the column scale's gradients; the
    input's is Inductor's, fused with the norm's backward (``canon._canon_conv_grad``)."""
    ops = torch.ops.canon_titan
    swiglu, weights, conv = (
        (canon.swiglu_backward, canon.conv_weight_grads, canon.conv_backward)
        if bodies
        else (ops.canon_swiglu_backward, ops.canon_conv_weight_grads, ops.canon_conv_backward)
    )
    if call.swiglu:
        return lambda: swiglu(
            dy, t["x"], t["up"], t["weight"], t["bias"], call.residual, call.activation
        )
    if call.scaled and not call.activation:
        return lambda: weights(
            dy, t["x"], t["weight"], t["bias"], t["row_scale"], t["col_scale"], call.residual
        )
    return lambda: conv(dy, *_conv_args(call, t))


def _conv_args(call: Call, t: dict) -> tuple:
    """A convolution's arguments (after the gradient, in a backward): the input, weight, bias,
    scales and flags."""
    x, scales = t["x"], (t.get("row_scale"), t.get("col_scale"))
    return x, t["weight"], t["bias"], *scales, call.residual, call.activation


def backward_blocks(
    calls: list[Call], batch: int, seq: int, reps: int, candidates=BACKWARD_CANDIDATES
) -> dict:
    """Milliseconds of each call's backward kernels (and the host ops around them) at each candidate
    configuration; the memory bound is the backward launches' bytes over the copy bandwidth."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    bandwidth = copy_bandwidth() if cuda else None
    chosen = {"conv": canon.BACKWARD_BLOCKS, "swiglu": canon.SWIGLU_BACKWARD_BLOCKS}
    names = {"conv": "BACKWARD_BLOCKS", "swiglu": "SWIGLU_BACKWARD_BLOCKS"}
    rows = []
    try:
        for call in calls:
            gen = torch.Generator().manual_seed(0)
            t = inputs(call, batch, seq, device, dtype, gen)
            dy = torch.randn(batch, seq, call.channels, generator=gen).to(device, dtype)
            kind = "swiglu" if call.swiglu else "conv"
            meta = inputs(call, batch, seq, "meta")
            bound = None
            if cuda:
                moved = _launch_bytes(
                    aot.record_launches(
                        _backward(call, meta, meta["x"].new_empty(dy.shape), bodies=True)
                    )
                )
                bound = 1000 * moved / bandwidth
            for block_c, unroll, warps in candidates:
                blocks = {**chosen[kind], "BLOCK_C": block_c, "U": unroll, "num_warps": warps}
                setattr(canon, names[kind], blocks)
                step = _backward(call, t, dy)
                step()  # compiles
                rows.append(
                    {
                        "call": call.name,
                        "channels": call.channels,
                        "kind": kind,
                        "config": backward_label(blocks),
                        "ms": _time_ms(step, reps),
                        "bound_ms": bound,
                        "current": blocks == chosen[kind],
                    }
                )
    finally:
        canon.BACKWARD_BLOCKS, canon.SWIGLU_BACKWARD_BLOCKS = chosen["conv"], chosen["swiglu"]
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        "batch": batch,
        "seq": seq,
        "rows": rows,
    }


def _forward(call: Call, t: dict):
    """The call's forward kernel as the models launch it (the op's body: eager, or on meta tensors
    for ``aot.record_launches``)."""
    if call.swiglu:
        return lambda: canon.swiglu_forward(
            t["x"], t["up"], t["weight"], t["bias"], call.residual, call.activation
        )
    return lambda: canon.conv_forward(*_conv_args(call, t))


def forward_candidates() -> list[dict]:
    """``canon.FORWARD_CONFIGS`` as values of ``canon.FORWARD_BLOCKS``."""
    return [{**c.kwargs, "num_warps": c.num_warps} for c in canon.FORWARD_CONFIGS]


def forward_label(blocks: dict) -> str:
    return f"{blocks['CHUNK']}x{blocks['BLOCK_C']}/{blocks['num_warps']}w"


def backward_label(blocks: dict) -> str:
    return f"{blocks['BLOCK_C']}/{blocks['num_warps']}w U{blocks['U']}"


def swept_calls(kind: str, flavor: str) -> list[Call]:
    """The calls a block sweep of the ``kind`` ("forward", "backward") kernels times: Canon-A and
    Canon-D (and B-v's narrower forward) of a LlamaCanon layer, and Mamba2's short convolution."""
    layer = {call.name: call for call in llama_canon_layer(flavor)}
    names = ["A", "D"] if kind == "backward" else ["A", "B v", "D"]
    return [layer[name] for name in names] + [mamba2_short_conv(flavor)]


def forward_blocks(calls: list[Call], batch: int, seq: int, reps: int) -> dict:
    """Milliseconds of each call's forward kernel at each configuration of
    ``canon.FORWARD_CONFIGS`` (set as ``canon.FORWARD_BLOCKS``, which the launches pass); the
    memory bound is the launch's bytes over the copy bandwidth. In the interpreter the blocks are
    its own (``canon._interpreter_blocks``): the rows check the code path only."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    bandwidth = copy_bandwidth() if cuda else None
    fixed = canon.FORWARD_BLOCKS
    rows = []
    try:
        for call in calls:
            gen = torch.Generator().manual_seed(0)
            t = inputs(call, batch, seq, device, dtype, gen)
            bound = None
            if cuda:
                launches = aot.record_launches(_forward(call, inputs(call, batch, seq, "meta")))
                bound = 1000 * _launch_bytes(launches) / bandwidth
            for blocks in forward_candidates():
                canon.FORWARD_BLOCKS = blocks
                step = _forward(call, t)
                step()  # compiles
                rows.append(
                    {
                        "call": call.name,
                        "channels": call.channels,
                        "config": forward_label(blocks),
                        "ms": _time_ms(step, reps),
                        "bound_ms": bound,
                        "current": blocks == fixed,
                    }
                )
    finally:
        canon.FORWARD_BLOCKS = fixed
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        "batch": batch,
        "seq": seq,
        "rows": rows,
    }
