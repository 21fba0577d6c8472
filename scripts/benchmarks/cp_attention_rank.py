"""One context-parallel rank's attention, timed on one GPU: what the planner cannot take from any
source in text (issue 42: CP 4 and 8 of TorchTitan's table 2 measured 1.42-1.47x slower than
planned).

TorchTitan's December 2024 CP runs used PyTorch's ring attention
(``torch.distributed.tensor.experimental``'s ``_templated_ring_attention``: one SDPA call per ring
step on the rank's queries and the keys it holds at that step, load-balanced head-tail chunks, the
partial outputs merged in fp32, the key and value gradients accumulated in fp32 and passed on).
Canon-titan's CP gathers the keys and values and runs one SDPA call per contiguous run of the rank's
queries (``canon_titan.models.common.context_parallel.ContextShards.attention``). Both do a rank's
causal share of the attention FLOPs; what else each costs is what this measures.

The collectives run on a fake process group (``torch.testing._internal.distributed.fake_pg``): no
data moves, so the figures are the rank's compute alone, at the real shapes (the rank's own kernels,
merges, copies and fp32 accumulations), on one GPU. For each CP degree and implementation it times
the forward and forward + backward of one layer's attention on the first and the last rank (their
calls differ: the ring's step i runs all queries against half the keys on ranks r >= i, half the
queries against all keys on the others), the same SDPA calls alone ("kernels"), and prints beside
them what the planner gives the same FLOPs (``canon_titan.plan.estimate``: the flash backend's
efficiency on the GPU's peak).

    .venv/bin/python scripts/benchmarks/cp_attention_rank.py [--cp 1,2,4,8] [--seq-local 32768]
        [--heads 32] [--kv-heads 8] [--head-dim 128] [--rotate allgather|alltoall] [--reps 3]
            [--json OUT]
        [--tiny]

Defaults are TorchTitan's table 2 (Llama 3.1 8B: 32 heads of 128, keys and values repeated to 32
heads before SDPA as its Llama did, 32,768 tokens per rank at every CP degree). ``--kv-heads``
(fewer than ``--heads``) gives canon-titan's gather grouped-query K and V, as its models attend
(SDPA's ``enable_gqa``, on the lower-right causal path); the ring, whose flash calls take K and V
with every head, gets them repeated. Before timing, each degree's first and last rank check
canon-titan's gather against plain causal SDPA over the whole sequence (the rank's outputs and the
gradients its queries send back; the gather's collective answered in this process with every rank's
rows): the script stops with the difference if they disagree. On a CPU (``--tiny``: toy shapes, the
CPU's flash kernel) it checks that the script runs and records each implementation's SDPA calls; the
times mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from canon_titan.tools.fileio import write_atomic  # noqa: E402

aten = torch.ops.aten
IMPLEMENTATIONS = ("ring", "canon")


def ring_module():
    """PyTorch's ring attention module (moved into ``_context_parallel`` in 2.8)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        from torch.distributed.tensor.experimental import _attention
    return _attention


class Flash:
    """The SDPA flash ops the ring calls, on the device's kernels (the CPU's on a CPU), counting
    each call's (queries, keys, is_causal)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.calls: list[tuple[str, int, int, bool]] = []

    def forward(self, q, k, v, *, is_causal, dropout_p=0.0, scale=None, **_):
        self.calls.append(("forward", q.shape[2], k.shape[2], bool(is_causal)))
        if self.cuda:
            return aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, scale=scale
            )
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, scale=scale
        )

    def saved(self, rest) -> dict:
        """The flash forward's outputs after (out, logsumexp) that its backward takes (none on a
        CPU)."""
        names = ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset")
        return dict(zip(names, rest[:6])) if self.cuda else {}

    def backward(
        self,
        *,
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        is_causal,
        dropout_p=0.0,
        scale=None,
        **kw,
    ):
        self.calls.append(("backward", query.shape[2], key.shape[2], bool(is_causal)))
        if self.cuda:
            return aten._scaled_dot_product_flash_attention_backward(
                grad_out,
                query,
                key,
                value,
                out,
                logsumexp,
                kw["cum_seq_q"],
                kw["cum_seq_k"],
                kw["max_q"],
                kw["max_k"],
                dropout_p,
                is_causal,
                kw["philox_seed"],
                kw["philox_offset"],
                scale=scale,
            )
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale
        )


def fake_group(rank: int, size: int):
    """A process group of ``size`` ranks in which this process is ``rank`` and no data moves."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    return dist.group.WORLD


def ring_step(flash: Flash, group, q, k, v, backward: bool, rotate: str):
    """Torch's ring attention, forward (and backward) of one layer, as its SDPA handler calls it."""
    ring = ring_module()
    ring._cp_options.rotate_method = {
        "allgather": ring._RotateMethod.ALL_GATHER,
        "alltoall": ring._RotateMethod.ALL_TO_ALL,
    }[rotate]
    out, lse, *rest = ring._templated_ring_attention(
        group, 2, flash.forward, q, k, v, is_causal=True, dropout_p=0.0, scale=None
    )
    if not backward:
        return out
    grads = ring._templated_ring_attention_backward(
        group,
        2,
        flash.backward,
        grad_out=torch.ones_like(out),
        grad_out_name="grad_out",
        query=q,
        key=k,
        value=v,
        out=out,
        logsumexp=lse,
        is_causal=True,
        dropout_p=0.0,
        scale=None,
        **flash.saved(rest),
    )
    return grads[0]


def canon_step(shards, q, k, v, backward: bool):
    """Canon-titan's CP attention of one layer: [batch, L, heads, dim] in (K and V with their own
    heads), as its blocks call it."""
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    out = shards.attention(q, k, v, enable_gqa=k.shape[2] != q.shape[2])
    if backward:
        out.backward(torch.ones_like(out))
    return out


def check_against_causal(cp: int, rank: int, args, device: str, dtype) -> float:
    """Canon-titan's CP attention on ``rank`` of ``cp`` against plain causal SDPA over the whole
    sequence: the rank's outputs and the gradients of the query, key and value rows that its
    queries' loss sends back. The gather's collective is answered here with every rank's rows of the
    whole sequence (a fake process group moves no data), so the rank runs its own code from the
    gather's output on. Raises AssertionError past bf16's rounding; returns the largest
    difference."""
    from canon_titan.models.common import context_parallel
    from canon_titan.models.common.context_parallel import ContextShards, rank_positions

    group = fake_group(rank, cp)
    batch, seq = 1, args.seq_local * cp
    gen = torch.Generator(device).manual_seed(cp * 100 + rank)
    q, k, v = (
        torch.randn(
            batch, seq, heads, args.head_dim, device=device, dtype=dtype, generator=gen
        ).requires_grad_()
        for heads in (args.heads, args.kv_heads, args.kv_heads)
    )
    probe = torch.randn(
        batch, args.seq_local, args.heads, args.head_dim, device=device, dtype=dtype, generator=gen
    )
    positions = rank_positions(seq, cp, "headtail")
    mine = torch.tensor(positions[rank], device=device)
    gqa = args.kv_heads != args.heads
    whole = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=gqa
    ).transpose(1, 2)
    expected = [whole[:, mine]] + list(
        torch.autograd.grad((whole[:, mine] * probe).sum(), (q, k, v))
    )

    every_rank = iter([torch.cat([t[:, p].transpose(0, 1) for p in positions]) for t in (k, v)])
    gather = context_parallel.all_gather_autograd
    context_parallel.all_gather_autograd = lambda x, group: next(every_rank)
    try:
        shards = ContextShards.build(group, positions, device)
        out = shards.attention(q[:, mine], k[:, mine], v[:, mine], enable_gqa=gqa)
        got = [out] + list(torch.autograd.grad((out * probe).sum(), (q, k, v)))
    finally:
        context_parallel.all_gather_autograd = gather
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, expected))
    scale = max(b.float().abs().max().item() for b in expected)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert worst <= tolerance * scale, (
        f"CP {cp} rank {rank}: the gather's attention differs from causal SDPA by "
        f"{worst:.3g} (largest value {scale:.3g})"
    )
    return worst


class SDPACalls(TorchFunctionMode):
    """Records each ``F.scaled_dot_product_attention`` call as a forward call of ``flash`` (queries,
    keys,
    causal: the flag, or torch's causal bias, which canon-titan passes aligned to the lower right,
    where the flash kernel's causal flag aligns)."""

    def __init__(self, flash: Flash):
        super().__init__()
        self.flash = flash

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            from torch.nn.attention.bias import CausalBias

            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            causal = bool(kwargs.get("is_causal", False)) or isinstance(mask, CausalBias)
            self.flash.calls.append(("forward", args[0].shape[2], args[1].shape[2], causal))
        return func(*args, **kwargs)


def causal_share_flops(calls, heads: int, head_dim: int) -> int:
    """Forward FLOPs of the calls' attended scores (QK^T and PV, 4 x d per query-key pair): a causal
    call with n queries and m keys attends n (m - n) + n (n + 1) / 2 pairs (aligned lower right)."""
    total = 0
    for phase, n, m, causal in calls:
        if phase != "forward":
            continue
        pairs = n * (m - n) + n * (n + 1) // 2 if causal else n * m
        total += 4 * heads * head_dim * pairs
    return total


def timed(fn, reps: int, cuda: bool) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after one warm-up (bench_float8_gemm's
    timer)."""
    from bench_float8_gemm import _timer

    return _timer(torch.device("cuda" if cuda else "cpu"), reps)(fn)


def kernels_alone_ms(
    calls, batch: int, heads: int, head_dim: int, device: str, dtype, reps: int
) -> float:
    """The same SDPA calls, each on fresh tensors of its shape, with nothing between them."""
    flash = Flash(device)
    total = 0.0
    shapes = {}
    for phase, n, m, causal in calls:
        shapes.setdefault((n, m, causal), 0)
        if phase == "forward":
            shapes[(n, m, causal)] += 1
    for (n, m, causal), count in shapes.items():
        q = torch.randn(batch, heads, n, head_dim, device=device, dtype=dtype)
        k, v = (
            torch.randn(batch, heads, m, head_dim, device=device, dtype=dtype) for _ in range(2)
        )

        def both():
            out, lse, *rest = flash.forward(q, k, v, is_causal=causal)
            flash.backward(
                grad_out=torch.ones_like(out),
                query=q,
                key=k,
                value=v,
                out=out,
                logsumexp=lse,
                is_causal=causal,
                **flash.saved(rest),
            )

        total += count * timed(both, reps, flash.cuda)
    return total


def planned_ms(flops: int, head_dim: int, gpu_key: str) -> float:
    """The planner's time for a forward and backward of these attention FLOPs (the backward 2.5x the
    forward's) on the flash backend: the model the calibration points are planned with."""
    from canon_titan.plan.estimate import attention_efficiency
    from canon_titan.plan.gpus import GPUS

    gpu = GPUS[gpu_key]
    efficiency = attention_efficiency(gpu, SimpleNamespace(head_dim=head_dim), "flash")
    return 1e3 * 3.5 * flops / (gpu.bf16_tflops * 1e12 * efficiency)


def measure(cp: int, rank: int, impl: str, args, device: str, dtype) -> dict:
    from canon_titan.models.common.context_parallel import ContextShards, rank_positions

    group = fake_group(rank, cp)
    batch, length = 1, args.seq_local
    flash = Flash(device)
    if impl == "ring":
        q, k, v = (
            torch.randn(batch, args.heads, length, args.head_dim, device=device, dtype=dtype)
            for _ in range(3)
        )

        def run(backward):
            return ring_step(flash, group, q, k, v, backward, args.rotate)
    else:
        shards = ContextShards.build(group, rank_positions(length * cp, cp, "headtail"), device)
        q, k, v = (
            torch.randn(batch, length, heads, args.head_dim, device=device, dtype=dtype)
            for heads in (args.heads, args.kv_heads, args.kv_heads)
        )

        def run(backward):
            return canon_step(shards, q, k, v, backward)

    if impl == "ring":
        run(True)
        calls = list(flash.calls)
    else:  # its calls as torch sees them; the backward runs one backward kernel per forward call
        with SDPACalls(flash):
            run(True)
        calls = flash.calls + [("backward", *c[1:]) for c in flash.calls]
    forward_ms = timed(lambda: run(False), args.reps, flash.cuda)
    both_ms = timed(lambda: run(True), args.reps, flash.cuda)
    kernels = kernels_alone_ms(calls, batch, args.heads, args.head_dim, device, dtype, args.reps)
    flops = causal_share_flops(calls, args.heads, args.head_dim)
    row = {
        "cp": cp,
        "rank": rank,
        "implementation": impl,
        "calls": calls,
        "forward_ms": forward_ms,
        "forward_backward_ms": both_ms,
        "kernels_ms": kernels,
        "forward_flops": flops,
        "planned_ms": planned_ms(flops, args.head_dim, args.gpu),
        "tflops": 3.5 * flops / (both_ms * 1e9) if both_ms else 0.0,
    }
    row["overhead_per_ring_step_ms"] = (
        (both_ms - kernels) / (cp - 1) if impl == "ring" and cp > 1 else None
    )
    return row


def _row(r: dict) -> str:
    per_step = (
        "-" if r["overhead_per_ring_step_ms"] is None else f"{r['overhead_per_ring_step_ms']:.2f}"
    )
    calls = sum(1 for c in r["calls"] if c[0] == "forward")
    return (
        f"| {r['cp']} | {r['implementation']} | {r['rank']} | {calls} | {r['forward_ms']:.2f} | "
        f"{r['forward_backward_ms']:.2f} | {r['kernels_ms']:.2f} | "
        f"{r['forward_backward_ms'] - r['kernels_ms']:.2f} | "
        f"{per_step} | {r['tflops']:.1f} | {r['planned_ms']:.2f} | "
        f"x{r['forward_backward_ms'] / r['planned_ms']:.2f} |"
    )


HEADER = [
    "| CP | implementation | rank | SDPA calls (fwd) | forward ms | fwd+bwd ms | its SDPA "
    "calls alone ms "
    "| the rest ms | the rest per ring step ms | TFLOPS (fwd+bwd) | planned ms | measured "
    "/ planned |",
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def table(report: dict) -> list[str]:
    """A title line, then the table of ``report``'s rows (gpu_check's report shows it)."""
    kv_heads = report.get("kv_heads", report["heads"])
    gqa = f" (canon-titan's K/V: {kv_heads} heads)" if kv_heads != report["heads"] else ""
    title = (
        f"One CP rank's attention of one layer, {report['device']}, torch "
        f"{report['torch']}: {report['seq_local']:,} "
        f"tokens per rank, {report['heads']} heads of {report['head_dim']}{gqa}; "
        "collectives on a fake process "
        f"group (compute only); planned on the {report['gpu']} entry's flash efficiency"
    )
    rows = sorted(report["rows"], key=lambda r: (r["cp"], r["implementation"] != "ring", r["rank"]))
    return [title, "", *HEADER, *(_row(r) for r in rows)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", default="1,2,4,8", help="CP degrees, comma-separated")
    p.add_argument(
        "--seq-local",
        type=int,
        default=32768,
        help="tokens per rank (default: TorchTitan's table 2)",
    )
    p.add_argument("--heads", type=int, default=32)
    p.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="K/V heads of canon-titan's gather (grouped-query attention; default: --heads)",
    )
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--rotate",
        choices=("allgather", "alltoall"),
        default="allgather",
        help="how the ring passes keys and values (torch's _RotateMethod; no data moves here)",
    )
    p.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--gpu",
        default=None,
        help="the planner's GPU entry to compare with (default: from the device)",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU: checks the script")
    args = p.parse_args(argv)
    try:
        degrees = [int(c) for c in args.cp.split(",")]
    except ValueError:
        p.error(f"--cp: comma-separated integers, got {args.cp!r}")
    impls = args.implementations.split(",")
    if bad := [i for i in impls if i not in IMPLEMENTATIONS]:
        p.error(f"--implementations: {bad} not in {IMPLEMENTATIONS}")
    if bad := [c for c in degrees if c < 1]:
        p.error(f"--cp: degrees must be >= 1, got {bad}")
    if args.tiny:
        args.seq_local, args.heads, args.head_dim, args.reps = 64, 2, 16, 1
        args.kv_heads = 1 if args.kv_heads else None
    args.kv_heads = args.kv_heads or args.heads
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        p.error(f"--kv-heads: must divide --heads ({args.heads}), got {args.kv_heads}")
    if args.seq_local % 2:
        p.error(
            "--seq-local: the head-tail split needs an even number of tokens per rank, "
            f"got {args.seq_local}"
        )
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.gpu is None:
        args.gpu = "h200" if cuda and "H200" in torch.cuda.get_device_name() else "h100"
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "gpu": args.gpu,
        "seq_local": args.seq_local,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "rotate": args.rotate,
        "rows": [],
        "checked": [],
    }
    if "canon" in impls:  # a wrong result is not worth timing: checked first
        for cp in degrees:
            for rank in sorted({0, cp - 1}):
                worst = check_against_causal(cp, rank, args, device, dtype)
                report["checked"].append({"cp": cp, "rank": rank, "max_abs_diff": worst})
                print(
                    f"CP {cp} rank {rank}: the gather's attention equals causal SDPA "
                    "(largest difference "
                    f"{worst:.3g})",
                    flush=True,
                )
    # Torch's ring at every degree first (what the calibration points ran), then canon-titan's; the
    # report is rewritten after each row, so a run stopped by its time limit keeps what it measured.
    for impl in impls:
        for cp in degrees:
            for rank in sorted({0, cp - 1}):
                row = measure(cp, rank, impl, args, device, dtype)
                report["rows"].append(row)
                print(_row(row), flush=True)
                if args.json:
                    write_atomic(Path(args.json), json.dumps(report, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    print("\n".join(table(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
