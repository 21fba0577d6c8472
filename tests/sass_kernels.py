"""Small Triton kernels whose SASS counts follow from their source, for
``tests/test_kernel_cost_sass.py``: ``python tests/sass_kernels.py NAME...`` compiles each for sm_90
(the
real Triton: run it without ``TRITON_INTERPRET``) and prints what ``canon_titan.kernels.sass``
counts of
one launch, as JSON."""

import json
import sys

import torch
import triton
import triton.language as tl

from canon_titan.kernels import sass


@triton.jit
def looped(x_ptr, y_ptr, n, limit, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid >= limit:
        return
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(n):
        acc += tl.load(x_ptr + offsets + i * 7)
    tl.store(y_ptr + offsets, acc)


@triton.jit
def triangular(x_ptr, y_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(pid * 16):
        acc += tl.load(x_ptr + offsets + i * BLOCK)
    tl.store(y_ptr + pid * BLOCK + offsets, acc)


@triton.jit
def nested(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(4):
        for i in range(n):
            acc += tl.load(x_ptr + offsets + (i * 4 + j) * BLOCK) * (j + 1)
    tl.store(y_ptr + pid * BLOCK + offsets, acc)


@triton.jit
def exp_affine(x_ptr, y_ptr, a, b, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.math.exp2(tl.load(x_ptr + offsets) * a + b))


@triton.autotune(
    [triton.Config({}, num_warps=4, maxnreg=32), triton.Config({}, num_warps=4)], key=[]
)
@triton.jit
def wide(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    a = tl.load(x_ptr + offsets)
    b = tl.load(x_ptr + BLOCK + offsets)
    c = tl.load(x_ptr + 2 * BLOCK + offsets)
    tl.store(y_ptr + offsets, a * b + c)
    tl.store(y_ptr + BLOCK + offsets, a * c + b)
    tl.store(y_ptr + 2 * BLOCK + offsets, b * c + a)


def launches() -> dict:
    x = torch.empty(1 << 20, device="meta")
    y = torch.empty(1 << 20, device="meta")
    return {
        "looped": lambda: looped[(10,)](x, y, 200, 6, BLOCK=256, num_stages=1),
        "triangular": lambda: triangular[(64,)](x, y, BLOCK=128, num_stages=1),
        "nested": lambda: nested[(5,)](x, y, 100, BLOCK=128, num_stages=1),
        "exp_affine": lambda: exp_affine[(64,)](x, y, 0.5, 1.0, BLOCK=1024, num_warps=4),
        "wide": lambda: wide[(1,)](x, x, BLOCK=4096),
    }


def main(names: list[str]) -> dict:
    out = {}
    runs = launches()
    for name in names:
        (launch,) = sass.record_launches(runs[name])
        out[name] = []
        for config in launch.configs():
            counted = sass.count(launch, config)
            out[name].append(
                {
                    "label": config.label,
                    "iterations": counted.run.loop_iterations,
                    "programs": counted.programs,
                    "executed": counted.executed,
                    "per_element": counted.per_element(64 * 1024),
                    "static": counted.code.static,
                    "loops": counted.loop_instructions(),
                    "registers": counted.registers,
                    "spill_store_bytes": counted.spill_store_bytes,
                }
            )
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
