"""What Inductor's own scheduler moves for one compiled Llama block, against what the plan's compile
model counts for it (``canon_titan.plan.estimate.fused_region_bytes``), forward and backward.

    .venv/bin/python scripts/benchmarks/inductor_bytes.py [--shape 8b|small] [--tokens N]
        [--ac none|selective|full] [--json]

The block is the ``llama`` family's, bf16, at Llama 3.1 8B's shape (``--shape 8b``: dim 4096, 32
heads, 8 KV heads, SwiGLU 14336) or a small one (``small``: 512, 8, 2, 1024), under TorchTitan's
activation checkpointing (``--ac``, its ``SelectiveAC``/``FullAC`` wrappers as the trainer applies
them) and ``torch.compile(fullgraph=True)``, as TorchTitan compiles each block.

Inductor side: this machine has no GPU, so Inductor is made to generate its Triton kernels (the
GPU code path: Triton scheduling, fusion and buffer realization) for a Hopper target on CPU
tensors (``cpu_backend = "triton"``), and the kernels and the matmuls are not run (their outputs
are garbage; only the graphs matter): ``HopperCodegen``, which ``bench_canon.py --mode bytes`` uses
too, for LlamaCanon's block against Llama's. For each kernel Inductor generates (extern kernels and
templates, i.e. matmuls and attention, left out), its ``get_read_write_buffers_sizes()``: the bytes
Inductor itself counts for that kernel (what its ``inductor_metrics`` log reports as
``num_bytes_accessed``). Graph 0 is the forward, graph 1 the backward (recomputation included).

Plan side: the same block recorded by the plan's recorder on fake tensors, forward and backward
through ``ones``, every op compiled; the fused runs' bytes per phase.

The attention's extern kernel is the CPU one here (the layout copies Inductor puts around it can
differ from CUDA's flash kernel's), and the plan splits its fused runs at every matmul where
Inductor also fuses sibling runs that share an input across them (SwiGLU's backward: three runs
in the plan, one kernel in Inductor). ``tests/test_plan_calibration.py`` holds the plan within
25% of Inductor per phase at the small shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SHAPES = {"8b": (4096, 32, 8, 14336), "small": (512, 8, 2, 1024)}
"""dim, heads, KV heads, SwiGLU hidden."""


def build_block(shape: str, tokens: int, ac: str):
    import torch

    from canon_titan.models.llama.args import LlamaArgs

    dim, heads, kv_heads, hidden = SHAPES[shape]
    args = LlamaArgs(
        dim=dim,
        n_layers=1,
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_hidden_dim=hidden,
        vocab_size=1000,
        max_seq_len=tokens,
        rope_theta=500000.0,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # FSDP's bf16 parameters, as the trainer computes
    try:
        block = args.block_config().build()
    finally:
        torch.set_default_dtype(default)
    if ac == "none":
        return block
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    policy = SelectiveAC if ac == "selective" else FullAC
    return policy(policy.Config())._wrap_block(block, base_fqn="layers.0")


def plan_bytes(shape: str, tokens: int, ac: str) -> dict[str, dict[str, int]]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from canon_titan.plan.estimate import fused_region_bytes
    from canon_titan.plan.fake_world import RankStep
    from canon_titan.plan.recorder import StepRecorder

    with FakeTensorMode():
        block = build_block(shape, tokens, ac)
        x = torch.randn(1, tokens, SHAPES[shape][0], dtype=torch.bfloat16, requires_grad=True)
        recorder = StepRecorder()
        with recorder:
            y = block(x)
            y.backward(torch.ones_like(y))
    step = RankStep(
        0, recorder.trace, {}, {}, {}, accumulation=1, groups_run=1, tokens_per_group=tokens
    )
    phases: dict[str, dict[str, int]] = {}
    for start, _, nbytes in fused_region_bytes(step):
        phase = phases.setdefault(recorder.trace.ops[start].phase, {"kernels": 0, "bytes": 0})
        phase["kernels"] += 1
        phase["bytes"] += nbytes
    return phases


class HopperCodegen:
    """Inductor made to generate its Triton kernels for a Hopper target on CPU tensors, none of them
    run (process-wide patches: use it in a process of its own). ``graphs`` collects each compiled
    graph's own kernels and bytes as Inductor's scheduler counts them (extern kernels, templates and
    user-defined Triton kernels left out); ``launches`` every kernel launch the compiled code makes
    (name, and the bytes of its distinct tensor arguments, each moved once), Inductor's and the
    user-defined kernels of ``torch.library.triton_op``s alike."""

    def __init__(self):
        import torch._inductor.config as inductor_config
        import torch.utils._triton as torch_triton
        import triton
        from torch._inductor.graph import GraphLowering
        from torch._inductor.runtime import triton_heuristics
        from torch._inductor.select_algorithm import extern_kernels
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        self.graphs: list[dict[str, int]] = []
        self.launches: list[tuple[str, int]] = []
        target = GPUTarget("cuda", 90, 32)
        torch_triton.triton_backend = lambda: make_backend(target)

        # what torch asks Triton's (absent) GPU driver: the target of a user kernel's TTIR
        class Hopper:
            @staticmethod
            def get_current_target():
                return target

        triton.runtime.driver.set_active(Hopper())
        inductor_config.cpu_backend = "triton"
        inductor_config.force_disable_caches = True  # a cached graph skips the scheduler
        inductor_config.compile_threads = 1
        triton_heuristics.CachingAutotuner.precompile = lambda self, *a, **k: None
        triton_heuristics.CachingAutotuner.run = lambda autotuner, *args, **kwargs: (
            self.launches.append((autotuner.fn.__name__, _argument_bytes(args)))
        )
        for name in ("mm", "bmm", "addmm"):
            setattr(extern_kernels, name, lambda *a, out=None, **k: out)
        codegen = GraphLowering.codegen

        def counting_codegen(lowering, *args, **kwargs):
            result = codegen(lowering, *args, **kwargs)
            kernels = [
                n for n in lowering.scheduler.nodes if not (n.is_extern() or n.is_template())
            ]
            self.graphs.append(
                {
                    "kernels": len(kernels),
                    "bytes": sum(n.get_read_write_buffers_sizes() for n in kernels),
                }
            )
            return result

        GraphLowering.codegen = counting_codegen


def _argument_bytes(args) -> int:
    import torch

    views = {
        (a.untyped_storage().data_ptr(), a.storage_offset(), a.shape, a.stride()): a
        for a in args
        if isinstance(a, torch.Tensor)
    }
    return sum(t.numel() * t.element_size() for t in views.values())


def inductor_bytes(shape: str, tokens: int, ac: str) -> dict[str, dict[str, int]]:
    """Inductor's kernels and bytes per graph (process-wide patches: run it in its own process)."""
    import torch

    codegen = HopperCodegen()
    block = torch.compile(build_block(shape, tokens, ac), fullgraph=True)
    x = torch.randn(1, tokens, SHAPES[shape][0], dtype=torch.bfloat16, requires_grad=True)
    y = block(x)
    y.backward(torch.ones_like(y))
    if len(codegen.graphs) != 2:
        raise SystemExit(
            f"expected a forward and a backward graph, Inductor compiled {len(codegen.graphs)}"
        )
    return {"forward": codegen.graphs[0], "backward": codegen.graphs[1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--ac", choices=("none", "selective", "full"), default="selective")
    parser.add_argument(
        "--json", action="store_true", help="print {phase: {plan, inductor}} as JSON"
    )
    args = parser.parse_args()
    if args.tokens <= 0:
        parser.error(f"--tokens must be > 0, got {args.tokens}")
    import warnings

    warnings.filterwarnings("ignore")
    planned = plan_bytes(args.shape, args.tokens, args.ac)
    measured = inductor_bytes(args.shape, args.tokens, args.ac)
    if args.json:
        print(
            json.dumps(
                {
                    phase: {"plan": planned.get(phase, {}), "inductor": measured[phase]}
                    for phase in measured
                }
            )
        )
        return 0
    print(f"Llama block {args.shape}, {args.tokens} tokens, activation checkpointing {args.ac}")
    print(
        f"{'phase':<10} {'Inductor kernels':>16} {'Inductor MiB':>13} {'plan runs':>10} "
        f"{'plan MiB':>9} {'plan/Inductor':>14}"
    )
    for phase, got in measured.items():
        mine = planned.get(phase, {"kernels": 0, "bytes": 0})
        print(
            f"{phase:<10} {got['kernels']:>16} {got['bytes'] / 2**20:>13.1f} {mine['kernels']:>10} "
            f"{mine['bytes'] / 2**20:>9.1f} {mine['bytes'] / got['bytes']:>13.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
