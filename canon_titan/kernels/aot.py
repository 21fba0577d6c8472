"""Ahead-of-time compilation of the Canon op's Triton kernels for a GPU that need not be here.

The op's launch code runs on meta tensors at the shapes the models use (nothing is allocated or
launched): each kernel launch it makes is recorded, then compiled by Triton for the target (sm_90 by
default: H100/H200) with every configuration the launch may run with (each autotuning config, or
the fixed one it passes). Triton hands the PTX to the ptxas it bundles, whose report gives the
registers, stack and spill bytes; the PTX gives the global load instructions (16-byte vector loads
against 2-byte scalar ones, which unaligned row strides cause) and the barriers inside loops
(reductions across warps repeated on every iteration: docs/benchmarks/gpu.md has what they cost the
backward kernels on an H200). The launches are recorded and compiled by
``canon_titan.kernels.sass``, which also counts their SASS (``canon_titan.plan.kernel_cost`` prices
them).

    python -m canon_titan.kernels.aot                 # the table for sm_90
    python -m canon_titan.kernels.aot --json out.json

It runs the real Triton, so not under ``TRITON_INTERPRET=1``. With ``CANON_TITAN_FULL_AUTOTUNE=1``
it compiles every forward candidate of ``canon.FORWARD_CONFIGS`` (the forward kernels' blocks are
otherwise fixed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget

from canon_titan.kernels import canon, sass
from canon_titan.kernels.backends import INTERPRETED
from canon_titan.kernels.sass import SM90
from canon_titan.tools.fileio import write_atomic

SEQ_LEN = 4096
MISALIGNED = "b Mamba2-3B, bias+SiLU, row stride 12568"
ALIGNED_TWIN = "b twin, row stride 12576"


@dataclass
class Compiled:
    case: str
    kernel: str
    config: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    vector_loads: int
    """``ld.global.v*`` instructions in the PTX."""
    scalar_2byte_loads: int
    loop_barriers: int
    """``bar.sync`` instructions inside the PTX's loops: a reduction across warps (shared memory and
    a barrier) that runs on every iteration instead of once."""
    loop_loads: int
    """``ld.global`` instructions inside the PTX's loops (a backward program's per-tile loads)."""
    seconds: float

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


def _meta(*shape, dtype=torch.bfloat16, width=None):
    """A meta tensor of ``shape``; with ``width``, a slice of the first ``shape[-1]`` channels of a
    wider [.., width] tensor (its row stride is ``width``)."""
    if width is None:
        return torch.empty(*shape, dtype=dtype, device="meta")
    return torch.empty(*shape[:-1], width, dtype=dtype, device="meta")[..., : shape[-1]]


def model_cases(seq_len: int = SEQ_LEN) -> dict:
    """The op's variants as the models call them, at real widths (batch 1): name -> callable that
    runs the op's forward and backward launch code."""
    t = seq_len
    scale = (_meta(1, t, dtype=torch.float32), _meta(2048))

    def conv(x, weight, bias=None, row_scale=None, col_scale=None, *, residual, activation):
        def run():
            y = canon.conv_forward(x, weight, bias, row_scale, col_scale, residual, activation)
            if row_scale is not None and not activation:  # the models' backward of a fused norm
                canon.conv_weight_grads(y, x, weight, bias, row_scale, col_scale, residual)
            else:
                canon.conv_backward(y, x, weight, bias, row_scale, col_scale, residual, activation)

        return run

    def swiglu(gate, up, weight):
        def run():
            y = canon.swiglu_forward(gate, up, weight, None, True, False)
            canon.swiglu_backward(y, gate, up, weight, None, True, False)

        return run

    return {
        # Canon-A/C (and Canon-B on q, k) with the RMSNorm before them fused: LlamaCanon-1B's width.
        "A/C 1B, fused norm": conv(
            _meta(1, t, 2048), _meta(2048, 4), None, *scale, residual=True, activation=False
        ),
        # Canon-B on v: no norm before it, the input's gradient in the kernel.
        "B v 1B": conv(_meta(1, t, 2048), _meta(2048, 4), residual=True, activation=False),
        # Canon-D and the SwiGLU after it: LlamaCanon-8B's hidden width.
        "D 8B, swiglu": swiglu(_meta(1, t, 14336), _meta(1, t, 14336), _meta(2 * 14336, 4)),
        # The linear models' short convolution b; Mamba2-3B's reads a slice of in_proj's output, row
        # stride 2*6144 + 2*128 + 24 = 12568, a multiple of 8 but not of 16 (which Triton alone
        # recognises); its twin with a row stride of 12576 shows what an aligned one compiles to.
        MISALIGNED: conv(
            _meta(1, t, 6400, width=12568),
            _meta(6400, 4),
            _meta(6400),
            residual=False,
            activation=True,
        ),
        ALIGNED_TWIN: conv(
            _meta(1, t, 6400, width=12576),
            _meta(6400, 4),
            _meta(6400),
            residual=False,
            activation=True,
        ),
    }


def record_launches(run) -> list[tuple]:
    """(kernel, args, kwargs) of every launch ``run()`` makes (``sass.record_launches``)."""
    return [(launch.kernel, launch.args, launch.kwargs) for launch in sass.record_launches(run)]


def configs_of(launch: sass.Launch) -> list[sass.Config]:
    """The configurations compiled for a launch: every one it may run with."""
    return launch.configs()


def compile_case(case: str, run, target: GPUTarget = SM90) -> list[Compiled]:
    """Every distinct kernel specialisation and configuration ``run()`` may launch, compiled."""
    results, seen = [], set()
    for launch in sass.record_launches(run):
        for config in configs_of(launch):
            key = sass.compile_key(launch, config, target)
            if key in seen:
                continue
            seen.add(key)
            compiled = sass.compile_launch(launch, config, target)
            ptx = compiled.asm["ptx"]
            shown = config.kwargs
            results.append(
                Compiled(
                    case=case,
                    kernel=launch.name,
                    config=f"{shown['CHUNK']}x{shown['BLOCK_C']}/{shown.get('num_warps', 4)}w",
                    registers=compiled.registers,
                    stack_bytes=compiled.stack_bytes,
                    spill_store_bytes=compiled.spill_store_bytes,
                    spill_load_bytes=compiled.spill_load_bytes,
                    vector_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.v\d", ptx)),
                    scalar_2byte_loads=len(re.findall(r"ld\.global(?:\.[a-z]+)*\.[bu]16\b", ptx)),
                    loop_barriers=loop_barriers(ptx),
                    loop_loads=loop_loads(ptx),
                    seconds=compiled.seconds,
                )
            )
    return results


_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


def _in_loops(ptx: str, pattern: str) -> int:
    """Lines matching ``pattern`` inside loops: a loop is a block label and a later branch back to
    it; each line between them counts once (however deep the nesting)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line.strip()))}
    loops = [
        (labels[m.group(1)], i)
        for i, line in enumerate(lines)
        if (m := _BRANCH.search(line)) and labels.get(m.group(1), len(lines)) < i
    ]
    return sum(
        1
        for i, line in enumerate(lines)
        if re.search(pattern, line) and any(a <= i <= b for a, b in loops)
    )


def loop_barriers(ptx: str) -> int:
    """``bar.sync`` instructions inside loops."""
    return _in_loops(ptx, r"bar\.sync")


def loop_loads(ptx: str) -> int:
    """Global load instructions inside loops: what a program issues per tile, against those it
    issues once."""
    return _in_loops(ptx, r"ld\.global")


def compile_all(
    target: GPUTarget = SM90, cases: dict | None = None, progress=None
) -> list[Compiled]:
    results = []
    for case, run in (cases or model_cases()).items():
        if progress:
            progress(f"compiling {case} ...")
        results += compile_case(case, run, target)
    return results


def table(results: list[Compiled], target: GPUTarget = SM90) -> str:
    lines = [
        f"Triton {triton.__version__}, sm_{target.arch}: registers per thread, spills "
        "(bytes stored/loaded), "
        "global loads in the PTX (vectors / 2-byte scalars; those inside loops), barriers "
        "inside loops, compile "
        "seconds on this machine",
        "",
        "| case | kernel | config | registers | spills | vector / scalar loads | loads in "
        "loops | loop barriers "
        "| compile s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        spills = f"{r.spill_store_bytes}/{r.spill_load_bytes}" if r.spills else "0"
        lines.append(
            f"| {r.case} | {r.kernel} | {r.config} | {r.registers} | {spills} | "
            f"{r.vector_loads} / {r.scalar_2byte_loads} | {r.loop_loads} | {r.loop_barriers} | "
            f"{r.seconds:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    if INTERPRETED:
        print(
            "canon_titan.kernels.aot: unset TRITON_INTERPRET (it compiles the kernels for a GPU)",
            file=sys.stderr,
        )
        return 2
    results = compile_all(progress=lambda msg: print(f"[aot] {msg}", file=sys.stderr, flush=True))
    print(table(results))
    if args.json:
        write_atomic(
            args.json,
            json.dumps(
                {
                    "triton": triton.__version__,
                    "target": f"sm_{SM90.arch}",
                    "kernels": [{**asdict(r), "spills": r.spills} for r in results],
                },
                indent=2,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
