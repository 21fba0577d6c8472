"""The host's side of a linear model's layer, counted on a CPU: for one block's forward and
backward, each custom op of canon-titan that runs (the recurrence of fla or mamba-ssm, the Canon
ops), with per call the Python functions it calls, the Triton kernels it launches and the torch
kernels it runs (aten ops that are not views or allocations), and the host time it holds.

On a GPU a compiled block runs its own code as Inductor's kernels, and the Canon ops' too (there
they are
``torch.library.triton_op``s, whose kernels Inductor launches from its own code), but the
recurrence's custom ops stay Python calls that run the wrapper and the package's host code and
launch its Triton kernels one by one, which can hold the host longer than the kernels run
(Mamba2Canon-1B at 4096 on an H200: docs/benchmarks/gpu.md). The Canon ops' rows here are their
eager path (in the interpreter they are plain custom ops).

The Triton launches are stubbed (counted, not run: the host's work, not the interpreter's), in
Triton's interpreter mode so that the packages' host code runs as on a GPU. The counts are exact and
the same on every machine; the times are this CPU's, an indication only. ``python
scripts/benchmarks/linear_host.py`` (or ``bench_linear.py --tables host``) prints them, and
``tests/test_linear_host.py`` holds the counts.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from collections import Counter, defaultdict

if os.environ.get("TRITON_INTERPRET") != "1":
    if __name__ == "__main__":  # Triton reads it once, when its kernels are defined
        os.execve(
            sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"}
        )
    raise RuntimeError(
        "linear_host needs TRITON_INTERPRET=1 set before torch and triton are imported"
    )

import torch
import triton.runtime.interpreter as interpreter
import triton.runtime.jit as jit

import model_registry

NO_KERNEL = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::as_strided",
    "aten::view",
    "aten::_reshape_alias",
    "aten::_unsafe_view",
    "aten::resize_",
    "aten::set_",
    "aten::detach",
    "aten::alias",
    "aten::lift_fresh",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::expand",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::select",
    "aten::slice",
    "aten::split",
    "aten::unbind",
    "aten::split_with_sizes",
    "aten::narrow",
    "aten::unflatten",
    "aten::reshape",
    "aten::flatten",
    "aten::contiguous",
    "aten::to",
    "aten::_to_copy",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::result_type",
    "aten::is_nonzero",
    "aten::item",
    "aten::_local_scalar_dense",
}
"""aten ops that launch no kernel on a GPU themselves (views, allocations, dispatch-only wrappers
whose copies show as their own ``aten::copy_``)."""


def _custom_ops() -> dict:
    """canon-titan's custom ops registered so far: the code object of each one's Python body -> its
    name."""
    from torch._library.custom_ops import OPDEFS

    return {
        op._init_fn.__code__: name.split("::", 1)[1]
        for name, op in OPDEFS.items()
        if name.startswith("canon_titan::")
    }


class _Counts:
    """Python calls and Triton launches inside each custom op (by the op whose body is
    innermost)."""

    def __init__(self, ops: dict):
        self.ops, self.stack = ops, []
        self.python, self.launches, self.calls = Counter(), Counter(), Counter()

    def profile(self, frame, event, arg):
        if event == "call":
            op = self.ops.get(frame.f_code)
            if op is not None:
                self.stack.append((op, frame))
                self.calls[op] += 1
            elif self.stack:
                self.python[self.stack[-1][0]] += 1
        elif event == "return" and self.stack and self.stack[-1][1] is frame:
            self.stack.pop()

    def launch(self):
        if self.stack:
            self.launches[self.stack[-1][0]] += 1


@contextlib.contextmanager
def _stubbed_launches(counting: list[_Counts]):
    """Triton kernel launches counted (by ``counting[0]``) and skipped (their outputs are left as
    allocated)."""
    saved = jit.JITFunction.run, interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        counting[0].launch()

    jit.JITFunction.run = interpreter.InterpretedFunction.run = run
    try:
        yield
    finally:
        jit.JITFunction.run, interpreter.InterpretedFunction.run = saved


def _leaves(event) -> list:
    return (
        [leaf for child in event.cpu_children for leaf in _leaves(child)]
        if event.cpu_children
        else [event]
    )


DOCUMENTS = (5, 1, 40, 18)
"""The documents of each row with ``documents``: shorter than a chunk, one token, across a 64-token
chunk."""


def layer_host_path(
    family: str,
    canon_set: str = "AbbCD",
    *,
    batch: int = 1,
    seq_len: int = 64,
    repeats: int = 5,
    documents: bool = False,
) -> dict:
    """One block's forward and backward of ``family``'s debug flavor with its CUDA kernels (the
    recurrence's package, the Triton Canon op), after one untimed pass: per custom op, its calls and
    per call its Python calls, Triton launches and torch kernels (one pass), and its host
    microseconds (the median call over
    ``repeats`` passes under torch's profiler); and the layer's totals. With ``documents`` each row
    packs ``DOCUMENTS`` with the boundaries the loaders send (``kernels/documents.py``), and the
    Canon layers run on the torch backend (the Triton Canon op takes no positions yet)."""
    from canon_titan.kernels.documents import Documents, document_boundaries

    cuda = {"gla5": "fla", "gdn2": "fla", "mamba2": "mamba_ssm"}[family]
    spec = model_registry.model_spec(
        family,
        "debug",
        {
            "n_layers": 1,
            "canon_set": canon_set,
            "kernel_backend": cuda,
            "canon_backend": "torch" if documents else "triton",
        },
    )
    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    block = model.layers["0"]
    x = torch.randn(batch, seq_len, spec.model.args.dim, requires_grad=True)
    args = (x,)
    if documents:
        if sum(DOCUMENTS) != seq_len:
            raise ValueError(f"documents: rows of {sum(DOCUMENTS)} tokens, not {seq_len}")
        positions = torch.cat([torch.arange(n) for n in DOCUMENTS]).expand(batch, -1)
        args = (x, Documents(positions, **document_boundaries(positions)), positions)
    ops = _custom_ops()
    counting = [_Counts(ops)]
    with _stubbed_launches(counting):
        # The first call of each kernel tunes it: not the steady state.
        block(*args).sum().backward()
        counts = counting[0] = _Counts(ops)
        sys.setprofile(counts.profile)
        try:
            block(*args).sum().backward()
        finally:
            sys.setprofile(None)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                block(*args).sum().backward()
    kernels, host_us = Counter(), defaultdict(list)
    for event in prof.events():
        op = event.name.split("::", 1)[1] if event.name.startswith("canon_titan::") else None
        if op in counts.calls:
            host_us[op].append(event.cpu_time_total)
            kernels[op] += sum(
                1
                for leaf in _leaves(event)
                if leaf.name.startswith("aten::") and leaf.name not in NO_KERNEL
            )
    per_op = {
        op: {
            "calls": n,
            "python_calls": counts.python[op] // n,
            "triton_launches": counts.launches[op] // n,
            "torch_kernels": kernels[op] // (n * repeats),
            "host_us": statistics.median(host_us[op]),
        }
        for op, n in sorted(counts.calls.items())
    }
    total = {
        key: sum(v["calls"] * v[key] for v in per_op.values())
        for key in ("python_calls", "triton_launches", "torch_kernels", "host_us")
    }
    return {
        "family": family,
        "canon_set": canon_set,
        "batch": batch,
        "seq_len": seq_len,
        "documents": documents,
        "ops": per_op,
        "total": {**total, "custom_op_calls": sum(counts.calls.values())},
    }


def table(results: list[dict]) -> str:
    """Markdown: one row per family and custom op, then the layer's totals."""
    lines = [
        "**Host path per layer** (one block's forward and backward, debug shapes, Triton "
        "launches stubbed; "
        "host us: the median call on this CPU, eager)",
        "",
        "| model | custom op | calls | Python calls / call | Triton launches / call | "
        "torch kernels / call | "
        "host us / call |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        model = f"{r['family']}:{r['canon_set']}" + (" documents" if r.get("documents") else "")
        for op, v in r["ops"].items():
            lines.append(
                f"| {model} | {op} | {v['calls']} | {v['python_calls']} | "
                f"{v['triton_launches']} | {v['torch_kernels']} | {v['host_us']:,.0f} |"
            )
        t = r["total"]
        lines.append(
            f"| {model} | **layer** | {t['custom_op_calls']} | {t['python_calls']} | "
            f"{t['triton_launches']} | {t['torch_kernels']} | {t['host_us']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="gla5,gdn2,mamba2", help="comma list of gla5, gdn2, mamba2")
    p.add_argument("--json", help="also write the results here")
    p.add_argument(
        "--documents",
        action="store_true",
        help="also each layer with packed documents (the recurrence's document ops)",
    )
    args = p.parse_args(argv)
    families = args.models.split(",")
    unknown = [f for f in families if f not in ("gla5", "gdn2", "mamba2")]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)}; allowed: gla5, gdn2, mamba2")
    results = [
        layer_host_path(family, documents=documents)
        for family in families
        for documents in ((False, True) if args.documents else (False,))
    ]
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
