"""Ahead-of-time compilation of the Canon op's Triton kernels for a GPU that need not be here.

The op's launch code runs on meta tensors at the shapes the models use (nothing is allocated or
launched): each kernel launch it makes is recorded, then compiled by Triton for the target (sm_90 by
default: H100/H200) with every configuration the launch may run with (each autotuning config, or
the fixed one it passes). Triton hands the PTX to the ptxas it bundles, whose report gives the
registers, stack and spill bytes; the PTX gives the global load instructions (16-byte vector loads
against 2-byte scalar ones, which unaligned row strides cause) and the barriers inside loops
(reductions across warps repeated on every iteration: what made the backward kernels run at a
twelfth of the memory bandwidth on an H200, 2026-11-26).

    python -m canon_titan.kernels.aot                 # the table for sm_90
    python -m canon_titan.kernels.aot --json out.json

It runs the real Triton, so not under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from canon_titan.kernels import canon
from canon_titan.kernels.backends import INTERPRETED
from canon_titan.tools.fileio import write_atomic

SM90 = GPUTarget("cuda", 90, 32)
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
    """``bar.sync`` instructions inside the PTX's loops: a reduction across warps (shared memory and a
    barrier) that runs on every iteration instead of once."""
    loop_loads: int
    """``ld.global`` instructions inside the PTX's loops (a backward program's per-tile loads)."""
    seconds: float

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


class _Recorder:
    """Stands in for a kernel in ``canon``: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


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
        "A/C 1B, fused norm": conv(_meta(1, t, 2048), _meta(2048, 4), None, *scale, residual=True, activation=False),
        # Canon-B on v: no norm before it, the input's gradient in the kernel.
        "B v 1B": conv(_meta(1, t, 2048), _meta(2048, 4), residual=True, activation=False),
        # Canon-D and the SwiGLU after it: LlamaCanon-8B's hidden width.
        "D 8B, swiglu": swiglu(_meta(1, t, 14336), _meta(1, t, 14336), _meta(2 * 14336, 4)),
        # The linear models' short convolution b; Mamba2-3B's reads a slice of in_proj's output, row
        # stride 2*6144 + 2*128 + 24 = 12568, a multiple of 8 but not of 16 (which Triton alone
        # recognises); its twin with a row stride of 12576 shows what an aligned one compiles to.
        MISALIGNED: conv(_meta(1, t, 6400, width=12568), _meta(6400, 4), _meta(6400), residual=False,
                         activation=True),
        ALIGNED_TWIN: conv(_meta(1, t, 6400, width=12576), _meta(6400, 4), _meta(6400), residual=False,
                           activation=True),
    }


def record_launches(run) -> list[tuple]:
    """(kernel, args, kwargs) of every launch ``run()`` makes."""
    launches: list[tuple] = []
    names = [name for name, value in vars(canon).items() if isinstance(value, triton.runtime.KernelInterface)]
    originals = {name: getattr(canon, name) for name in names}
    wrap = canon.wrap_triton
    try:
        for name in names:
            setattr(canon, name, _Recorder(originals[name], launches))
        canon.wrap_triton = lambda kernel: kernel  # the op bodies launch through it
        run()
    finally:
        for name, kernel in originals.items():
            setattr(canon, name, kernel)
        canon.wrap_triton = wrap
    return launches


def _jit_function(kernel) -> JITFunction:
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def _configs(kernel) -> list[dict]:
    """The launch's possible meta-parameters: every autotuning config, or (none here) the ones it passes."""
    if isinstance(kernel, triton.runtime.Autotuner):
        return [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in kernel.configs]
    return [{}]


_PTXAS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _source(kernel, args: tuple, kwargs: dict, meta: dict, target: GPUTarget):
    """What Triton compiles for one launch with meta-parameters ``meta``, specialised on its arguments
    as the JIT would (ints equal to 1 become constants; multiples of 16 and 16-byte-aligned pointers
    get divisibility hints): the source and its options."""
    fn = _jit_function(kernel)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    call_kwargs = {**kwargs, **meta}
    bound_args, specialization, options = binder(*args, **call_kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, call_kwargs, bound_args, specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options


def compile_case(case: str, run, target: GPUTarget = SM90) -> list[Compiled]:
    """Every distinct kernel specialisation and configuration ``run()`` may launch, compiled."""
    results, seen = [], set()
    for kernel, args, kwargs in record_launches(run):
        for meta in _configs(kernel):
            src, options = _source(kernel, args, kwargs, meta, target)
            if (src.hash(), str(options)) in seen:
                continue
            seen.add((src.hash(), str(options)))
            log = io.StringIO()
            started = time.perf_counter()
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(src, target=target, options=options.__dict__)
            seconds = time.perf_counter() - started
            registers, spill = _PTXAS.search(log.getvalue()), _SPILL.search(log.getvalue())
            if registers is None or spill is None:
                raise RuntimeError(f"no ptxas report for {src.name}:\n{log.getvalue()}")
            ptx = compiled.asm["ptx"]
            shown = {**kwargs, **meta}
            results.append(Compiled(
                case=case, kernel=src.name,
                config=f"{shown['CHUNK']}x{shown['BLOCK_C']}/{shown.get('num_warps', 4)}w",
                registers=int(registers.group(1)), stack_bytes=int(spill.group(1)),
                spill_store_bytes=int(spill.group(2)), spill_load_bytes=int(spill.group(3)),
                vector_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.v\d", ptx)),
                scalar_2byte_loads=len(re.findall(r"ld\.global(?:\.[a-z]+)*\.[bu]16\b", ptx)),
                loop_barriers=loop_barriers(ptx), loop_loads=loop_loads(ptx), seconds=seconds))
    return results


_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


def _in_loops(ptx: str, pattern: str) -> int:
    """Lines matching ``pattern`` inside loops: a loop is a block label and a later branch back to it; each
    line between them counts once (however deep the nesting)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line.strip()))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := _BRANCH.search(line)) and labels.get(m.group(1), len(lines)) < i]
    return sum(1 for i, line in enumerate(lines) if re.search(pattern, line) and any(a <= i <= b for a, b in loops))


def loop_barriers(ptx: str) -> int:
    """``bar.sync`` instructions inside loops."""
    return _in_loops(ptx, r"bar\.sync")


def loop_loads(ptx: str) -> int:
    """Global load instructions inside loops: what a program issues per tile, against those it issues once."""
    return _in_loops(ptx, r"ld\.global")


def compile_all(target: GPUTarget = SM90, cases: dict | None = None, progress=None) -> list[Compiled]:
    results = []
    # A fresh cache: a cached kernel is not compiled again, so ptxas would not report on it.
    with tempfile.TemporaryDirectory() as cache:
        previous = triton.knobs.cache.dir
        triton.knobs.cache.dir = cache
        triton.knobs.nvidia.dump_ptxas_log = True
        try:
            for case, run in (cases or model_cases()).items():
                if progress:
                    progress(f"compiling {case} ...")
                results += compile_case(case, run, target)
        finally:
            triton.knobs.cache.dir = previous
            triton.knobs.nvidia.dump_ptxas_log = False
    return results


def table(results: list[Compiled], target: GPUTarget = SM90) -> str:
    lines = [f"Triton {triton.__version__}, sm_{target.arch}: registers per thread, spills (bytes stored/loaded), "
             "global loads in the PTX (vectors / 2-byte scalars; those inside loops), barriers inside loops, compile "
             "seconds on this machine", "",
             "| case | kernel | config | registers | spills | vector / scalar loads | loads in loops | loop barriers "
             "| compile s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        spills = f"{r.spill_store_bytes}/{r.spill_load_bytes}" if r.spills else "0"
        lines.append(f"| {r.case} | {r.kernel} | {r.config} | {r.registers} | {spills} | "
                     f"{r.vector_loads} / {r.scalar_2byte_loads} | {r.loop_loads} | {r.loop_barriers} | "
                     f"{r.seconds:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    if INTERPRETED:
        print("canon_titan.kernels.aot: unset TRITON_INTERPRET (it compiles the kernels for a GPU)", file=sys.stderr)
        return 2
    results = compile_all(progress=lambda msg: print(f"[aot] {msg}", file=sys.stderr, flush=True))
    print(table(results))
    if args.json:
        write_atomic(args.json, json.dumps({"triton": triton.__version__, "target": f"sm_{SM90.arch}",
                                            "kernels": [{**asdict(r), "spills": r.spills} for r in results]},
                                           indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
