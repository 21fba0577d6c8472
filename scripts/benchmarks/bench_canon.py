#!/usr/bin/env python
"""What Canon-ABCD costs: ``llama`` against ``llama_canon`` at one shape, three ways.

  --mode trainer  the real trainer (torchrun, TorchTitan's metrics) for both models in turn:
                  tokens/s, MFU and peak memory after the warm-up steps, and the ratios. This is
                  the figure of record on a GPU; the default shape is the 1B recipes', 8 x 4096.
  --mode raw      a bare forward/backward/AdamW loop per model (eager and/or compiled blocks).
  --mode saved    bytes of activations one compiled block saves for the backward, per token
                  (parameters excluded), for llama and llama_canon with each Canon backend. Runs on
                  a CPU (the Triton kernels in the interpreter): the activation-memory part of the
                  memory ratio, device-independent.
  --mode bytes    bytes one compiled block moves per token, as a GPU runs it (Inductor's Triton
                  kernels generated for sm_90 on this CPU, not run): Inductor's own kernels (its
                  scheduler's count) and the Canon op's kernels, for llama, llama_canon and
                  llama_canon with each Canon position alone (what each adds); the kernel launches
                  and the Canon ops' Python calls of one step.
  --mode traffic  bytes the Triton Canon op moves through memory per LlamaCanon layer (forward and
                  backward, per token), counted from its kernel launches at the flavor's shapes
                  (meta tensors: runs anywhere, instantly), and the buffers it allocates.
  --mode ops      the Canon op alone on a GPU: forward+backward time of Canon-A/C, Canon-D and
                  Mamba2's short convolution at the flavor's widths against fla's causal_conv1d and
                  the memory bound, the first call's compile-and-autotune time, the autotuner's
                  choices. Without a GPU, tiny shapes in Triton's interpreter (a check of the code).
  --mode bwd_blocks, --mode fwd_blocks
                  the Canon backward (forward) kernels alone on a GPU at each candidate block
                  configuration against their memory bound: the fixed blocks are chosen from it.

Every case runs in its own process, so peak memory is that case's alone.

  .venv/bin/python scripts/benchmarks/bench_canon.py --mode trainer  # GPU: 1B, 8 x 4096, compile
  .venv/bin/python scripts/benchmarks/bench_canon.py --mode trainer --batch 2  # the second row
  # CPU, 1B block, about 2 min
  .venv/bin/python scripts/benchmarks/bench_canon.py --mode bytes --seq-len 4096
  # both backends, one run
  .venv/bin/python scripts/benchmarks/bench_canon.py --mode trainer --canon-backend triton,torch
  # CPU
  .venv/bin/python scripts/benchmarks/bench_canon.py --mode trainer --flavor debug --seq-len 256
      --steps 6 --no-compile
  .venv/bin/python scripts/benchmarks/bench_canon.py --mode saved --seq-len 256  # CPU, 1B block
  .venv/bin/python scripts/benchmarks/bench_canon.py --mode raw --flavor debug --seq-len 512
  # any machine
  .venv/bin/python scripts/benchmarks/bench_canon.py --mode traffic --flavor 8B --batch 1
  .venv/bin/python scripts/benchmarks/bench_canon.py --mode ops  # GPU: 1B widths, bs 2 x 4096
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
from torch.autograd.graph import saved_tensors_hooks

import model_registry
from canon_titan.components.loss import squared_nll_loss
from canon_titan.tools.fileio import write_atomic

MODELS = ("llama", "llama_canon")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--mode",
        choices=("trainer", "raw", "saved", "bytes", "traffic", "ops", "bwd_blocks", "fwd_blocks"),
        default="trainer",
    )
    p.add_argument("--flavor", default="1B", help="flavor of both families (debug, 1B, 3B, 8B)")
    p.add_argument("--dim", type=int, help="override the flavor's width")
    p.add_argument("--n-layers", type=int, help="override the flavor's depth")
    p.add_argument("--n-heads", type=int)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument(
        "--batch",
        type=int,
        help="per-process batch (default: trainer 8, the 1B recipes'; bytes 1; else 2)",
    )
    p.add_argument(
        "--canon-backend",
        default="auto",
        help="llama_canon's canon_backend; trainer: a comma list runs llama_canon once per backend",
    )
    p.add_argument(
        "--models", default="llama,llama_canon", help="trainer: llama and/or llama_canon"
    )
    p.add_argument(
        "--trainer-args",
        default="",
        help="trainer: more overrides for every run, e.g. '--float8.enable=true "
        "--float8.recipe_name=rowwise'",
    )
    p.add_argument("--steps", type=int, default=30, help="trainer: steps; raw: timed steps")
    p.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="steps left out of the averages (compilation, autotuning)",
    )
    p.add_argument(
        "--no-compile", dest="compile", action="store_false", help="trainer: eager blocks"
    )
    p.add_argument("--nproc", type=int, default=1, help="trainer: processes (FSDP over them)")
    p.add_argument("--modes", default="eager,compiled", help="raw: eager and/or compiled")
    p.add_argument(
        "--reps", type=int, default=50, help="ops: milliseconds of timed repetitions per case (GPU)"
    )
    p.add_argument(
        "--canon-sets",
        default="ABCD,A,B,C,D",
        help="bytes: the llama_canon blocks compared with llama's (comma list of canon_set values)",
    )
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.batch is None:
        args.batch = {"trainer": 8, "bytes": 1}.get(args.mode, 2)
    return args


def shape_overrides(args) -> dict:
    out = {
        k: v
        for k, v in (("dim", args.dim), ("n_layers", args.n_layers), ("n_heads", args.n_heads))
        if v
    }
    if args.n_heads and args.flavor == "debug":
        out["n_kv_heads"] = args.n_heads
    return out


def model_overrides(args, model: str, backend: str | None = None) -> dict:
    out = shape_overrides(args)
    if model == "llama_canon":
        out.update(canon_set="ABCD", canon_backend=backend or args.canon_backend)
    return out


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ----------------------------------------------------------------------------- trainer


def trainer_cases(args) -> list[tuple[str, str | None]]:
    """(model, canon backend) per run: llama, and llama_canon with each backend of
    --canon-backend."""
    models = args.models.split(",")
    backends = args.canon_backend.split(",")
    return [(m, None) for m in models if m == "llama"] + [
        ("llama_canon", b) for b in backends if "llama_canon" in models
    ]


def run_trainer(args) -> list[dict]:
    from trainer_bench import run_case

    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, backend in trainer_cases(args):
            label = model if backend is None else f"{model} ({backend})"
            print(
                f"[bench] trainer: {label} {args.flavor}, seq {args.seq_len}, batch "
                f"{args.batch} x {args.nproc}, "
                f"{args.steps} steps ...",
                flush=True,
            )
            keys = {"name": model, "flavor": args.flavor, **model_overrides(args, model, backend)}
            try:
                result = run_case(
                    keys,
                    os.path.join(tmp, label.replace(" ", "_")),
                    seq_len=args.seq_len,
                    batch=args.batch,
                    steps=args.steps,
                    warmup=args.warmup,
                    compile=args.compile,
                    nproc=args.nproc,
                    extra=tuple(args.trainer_args.split()),
                    profile=True,
                )
            except RuntimeError as e:
                raise SystemExit(f"[bench] {e}") from None
            results.append({**result, "canon_backend": backend, "label": label})
    print(
        f"\ntrainer, flavor {args.flavor}, seq {args.seq_len}, batch {args.batch} x "
        f"{args.nproc} process(es), "
        f"compile {args.compile}{', ' + args.trainer_args if args.trainer_args else ''}; "
        "medians over steps "
        f"{args.warmup + 1}-{args.steps}"
    )
    print(
        f"{'model':<22} {'tokens/s':>10} {'MFU %':>7} {'peak reserved GiB':>18} "
        f"{'peak active GiB':>16} "
        f"{'step 1 s':>9}"
    )
    for r in results:
        print(
            f"{r['label']:<22} {r['tokens_per_s']:>10,.0f} {r['mfu_pct']:>7.2f} "
            f"{r['peak_reserved_gib']:>18.2f} "
            f"{r['peak_active_gib']:>16.2f} {r['first_step_s']:>9.1f}"
        )
    from gpu_check_report import _canon_step

    base = next((r for r in results if r["model"] == "llama"), None)
    for r in results:
        print(f"kernels of {r['label']}: {r['kernels']}")
        profile = r.get("profile_summary")
        if isinstance(profile, dict):
            print(
                f"profiled step of {r['label']}: {profile['total_ms']:,.1f} ms of kernels: "
                + ", ".join(f"{kind} {ms:,.1f}" for kind, ms in profile["kinds_ms"].items())
            )
        if base is not None and r is not base:
            print("\n".join(line for line in _canon_step(r, base) if line))
            print(
                f"{r['label']} / llama: throughput "
                f"x{r['tokens_per_s'] / base['tokens_per_s']:.3f} (target >= 0.97), "
                f"peak reserved x{r['peak_reserved_gib'] / base['peak_reserved_gib']:.3f}, "
                f"peak active x{r['peak_active_gib'] / base['peak_active_gib']:.3f} "
                "(target <= 1.05)"
            )
    return results


# ----------------------------------------------------------------------------- raw loop


def raw_case(args, model_name: str, mode: str) -> dict:
    device = _device()
    spec = model_registry.model_spec(
        model_name, args.flavor, {**model_overrides(args, model_name), "max_seq_len": args.seq_len}
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.model.build()
    model.init_states()
    n_params = sum(p.numel() for p in model.parameters())
    if mode == "compiled":
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, spec.model.vocab_size, (args.batch, args.seq_len + 1), device=device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )

    def step():
        with autocast:
            logits = model(tokens[:, :-1])
        loss = squared_nll_loss(logits, tokens[:, 1:], 0.0) / tokens[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "model": model_name,
        "mode": mode,
        "params": n_params,
        "tokens_per_s": args.batch * args.seq_len * args.steps / elapsed,
        "step_ms": 1000 * elapsed / args.steps,
        "peak_mem_gib": peak / 2**30,
        "memory_kind": "cuda max allocated" if device.type == "cuda" else "process peak RSS",
    }


# ----------------------------------------------------------------------------- saved activations


def saved_case(args, model_name: str, backend: str | None) -> dict:
    """Activation bytes per token that one compiled block saves for its backward (bf16)."""
    device = _device()
    overrides = {
        **model_overrides(args, model_name, backend),
        "n_layers": 1,
        "max_seq_len": args.seq_len,
    }
    spec = model_registry.model_spec(model_name, args.flavor, overrides)
    with torch.device(device):
        model = spec.model.build()
    model.init_states()
    block = torch.compile(model.layers["0"].to(torch.bfloat16), fullgraph=True)
    x = torch.randn(args.batch, args.seq_len, spec.model.dim, dtype=torch.bfloat16, device=device)
    block(x.clone().requires_grad_()).sum().backward()  # compile
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = block(x.clone().requires_grad_())
    out.sum().backward()
    return {
        "model": model_name,
        "canon_backend": backend,
        "bytes_per_token": sum(storages.values()) / (args.batch * args.seq_len),
    }


def run_saved(args) -> list[dict]:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    results = []
    for model, backend in (("llama", None), ("llama_canon", "torch"), ("llama_canon", "triton")):
        print(f"[bench] saved activations: {model} {backend or ''} ...", flush=True)
        case = f"saved:{model}:{backend or ''}"
        results.append(_subprocess_case(args, case, env))
    base = results[0]["bytes_per_token"]
    print(
        f"\nactivations saved for the backward by one compiled {args.flavor} block (bf16), "
        "per token "
        f"(batch {args.batch} x seq {args.seq_len}, parameters excluded)"
    )
    print(f"{'model':<12} {'backend':<8} {'bytes/token':>12} {'vs llama':>9}")
    for r in results:
        print(
            f"{r['model']:<12} {r['canon_backend'] or '-':<8} {r['bytes_per_token']:>12,.0f} "
            f"{r['bytes_per_token'] / base:>9.3f}"
        )
    return results


# ----------------------------------------------------------------------------- a compiled block's
# bytes


CANON_KERNELS = (
    "_canon_fwd_kernel",
    "_canon_swiglu_fwd_kernel",
    "_canon_bwd_kernel",
    "_canon_swiglu_bwd_kernel",
)


def bytes_case(args, model_name: str, canon_set: str | None) -> dict:
    """One compiled block (bf16, the Triton Canon op) as a GPU runs it, generated on this CPU
    without running a kernel (``inductor_bytes.HopperCodegen``): Inductor's own kernels' bytes per
    graph, and each kernel launch of one forward+backward step after the compiling one (Inductor's
    and the Canon op's), and how many times the Canon ops' Python bodies ran in that step."""
    from collections import Counter

    from canon_titan.kernels import canon
    from inductor_bytes import HopperCodegen

    codegen = HopperCodegen()
    # CPU tensors take the Triton kernels here: none runs.
    canon._use_triton = lambda backend, x, kernel_size: (
        backend == "triton" and kernel_size in canon.TRITON_KERNEL_SIZES
    )
    overrides = {**shape_overrides(args), "n_layers": 1, "max_seq_len": args.seq_len}
    if canon_set is not None:
        overrides.update(canon_set=canon_set, canon_backend="triton")
    spec = model_registry.model_spec(model_name, args.flavor, overrides)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # FSDP's bf16 parameters, as the trainer computes
    try:
        block = spec.model.build().layers["0"]
    finally:
        torch.set_default_dtype(default)
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(args.batch, args.seq_len, spec.model.dim, dtype=torch.bfloat16)

    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def step():
        with saved_tensors_hooks(pack, lambda t: t):
            y = compiled(x.clone().requires_grad_())
        y.backward(torch.ones_like(y))

    step()
    bodies = {
        fn.__code__
        for fn in (
            canon.conv_forward,
            canon.conv_backward,
            canon.swiglu_forward,
            canon.swiglu_backward,
        )
    }
    body_calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in bodies:
            body_calls[frame.f_code.co_name] += 1

    codegen.launches.clear()
    saved.clear()
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    if len(codegen.graphs) != 2:
        raise SystemExit(
            f"expected a forward and a backward graph, Inductor compiled {len(codegen.graphs)}"
        )
    canon_launches = [(name, nbytes) for name, nbytes in codegen.launches if name in CANON_KERNELS]
    return {
        "model": model_name,
        "canon_set": canon_set,
        "tokens": args.batch * args.seq_len,
        "inductor": {"forward": codegen.graphs[0], "backward": codegen.graphs[1]},
        "launches": len(codegen.launches),
        "canon_launches": canon_launches,
        "canon_bytes": sum(nbytes for _, nbytes in canon_launches),
        "op_body_calls": dict(body_calls),
        "saved_bytes": sum(saved.values()),
    }


def block_bytes(rows: list[dict]) -> dict:
    """Bytes per token of each variant: Inductor's kernels per phase, the Canon kernels, the
    total."""
    out = {}
    for r in rows:
        inductor = {phase: g["bytes"] / r["tokens"] for phase, g in r["inductor"].items()}
        canon_kernels = r["canon_bytes"] / r["tokens"]
        out[r["canon_set"] or "llama"] = {
            **inductor,
            "canon_kernels": canon_kernels,
            "total": sum(inductor.values()) + canon_kernels,
            "inductor_kernels": sum(g["kernels"] for g in r["inductor"].values()),
            "launches": r["launches"],
            "saved": r["saved_bytes"] / r["tokens"],
        }
    return out


def run_bytes(args) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"
    }  # the GPU's code path, not run
    rows = []
    # Llama's block, then LlamaCanon's with each canon_set: by default all four positions, then each
    # alone (what each position adds).
    for model, canon_set in [("llama", None)] + [
        ("llama_canon", c) for c in args.canon_sets.split(",")
    ]:
        print(f"[bench] compiled block bytes: {model} {canon_set or ''} ...", flush=True)
        rows.append(_subprocess_case(args, f"bytes:{model}:{canon_set or ''}", env))
    table = block_bytes(rows)
    base = table["llama"]["total"]
    print(
        f"\nbytes one compiled {args.flavor} block moves per token (batch {args.batch} x "
        f"seq {args.seq_len}, bf16, "
        "forward + backward, matmuls and attention excluded): Inductor's own kernels (its "
        "scheduler's count) "
        "and the Triton Canon op's kernels (each tensor argument of a launch once)"
    )
    print(
        f"{'block':<22} {'Inductor fwd':>12} {'Inductor bwd':>12} {'Canon kernels':>13} "
        f"{'total':>9} "
        f"{'x llama':>8} {'+ vs llama':>10} {'launches':>9} {'saved':>8}"
    )
    for name, r in table.items():
        label = "llama" if name == "llama" else f"llama_canon {name}"
        print(
            f"{label:<22} {r['forward']:>12,.0f} {r['backward']:>12,.0f} "
            f"{r['canon_kernels']:>13,.0f} "
            f"{r['total']:>9,.0f} {r['total'] / base:>8.3f} {r['total'] - base:>+10,.0f} "
            f"{r['launches']:>9} "
            f"{r['saved']:>8,.0f}"
        )
    print(
        "(saved: activation bytes the compiled forward keeps for the backward, per token, "
        "parameters excluded)"
    )
    return {"rows": rows, "per_token": table}


# ----------------------------------------------------------------------------- the op alone


def run_traffic(args) -> list[dict]:
    from canon_op_bench import layer_traffic

    rows = layer_traffic(args.flavor, args.batch, args.seq_len)
    tokens = args.batch * args.seq_len
    print(
        f"Triton Canon op, one llama_canon {args.flavor} layer, batch {args.batch} x seq "
        f"{args.seq_len}, bf16: "
        "bytes moved per token, forward + backward (kernel launches, each tensor argument "
        "once; torch ops "
        "around them), and bytes allocated per token"
    )
    print(
        f"{'call':<6} {'launches':>8} {'kernels B/token':>16} {'torch ops B/token':>18} "
        f"{'allocated B/token':>18}"
    )
    for r in rows:
        print(
            f"{r['call']:<6} {r['kernels']:>8} {r['kernel_bytes'] / tokens:>16,.0f} "
            f"{r['host_bytes'] / tokens:>18,.0f} "
            f"{r['allocated_bytes'] / tokens:>18,.0f}"
        )
    total = {
        k: sum(r[k] for r in rows) / tokens
        for k in ("kernel_bytes", "host_bytes", "allocated_bytes")
    }
    print(
        f"{'layer':<6} {sum(r['kernels'] for r in rows):>8} {total['kernel_bytes']:>16,.0f} "
        f"{total['host_bytes']:>18,.0f} {total['allocated_bytes']:>18,.0f}"
    )
    print(f"moved per layer: {(total['kernel_bytes'] + total['host_bytes']) * tokens / 1e9:.3f} GB")
    return rows


def run_ops(args) -> dict:
    from canon_op_bench import llama_canon_layer, mamba2_short_conv, ops

    layer = {call.name: call for call in llama_canon_layer(args.flavor)}
    result = ops(
        [layer["A"], layer["D"], mamba2_short_conv(args.flavor)],
        args.batch,
        args.seq_len,
        args.reps,
    )
    print(
        f"Canon op, forward + backward, {result['device']}, flavor {args.flavor} widths, "
        f"batch {args.batch} x seq "
        f"{args.seq_len}"
        + (
            f"; device copy {result['copy_bandwidth_gb_s']:,.0f} GB/s"
            if result["copy_bandwidth_gb_s"]
            else ""
        )
    )
    print(
        f"{'call':<11} {'channels':>8} {'first call s':>12} {'triton ms':>10} "
        f"{'fla ms':>8} {'bound ms':>9}"
    )
    for r in result["calls"]:
        fla, bound = r.get("fla_causal_conv1d_ms"), r.get("bound_ms")
        print(
            f"{r['call']:<11} {r['channels']:>8} {r['first_call_s']:>12.2f} "
            f"{r['triton_ms']:>10.3f} "
            f"{fla if fla is not None else float('nan'):>8.3f} "
            f"{bound if bound is not None else float('nan'):>9.3f}"
        )
    for kernel, choices in result["tuned"].items():
        for key, config in choices.items():
            print(f"autotuned {kernel} {key}: {config}")
    return result


def _run_blocks(args, kind: str) -> dict:
    """``--mode bwd_blocks`` / ``fwd_blocks``: the block sweep of the Canon ``kind`` kernels."""
    import canon_op_bench as bench

    sweep = bench.backward_blocks if kind == "backward" else bench.forward_blocks
    result = sweep(bench.swept_calls(kind, args.flavor), args.batch, args.seq_len, args.reps)
    print(
        f"Canon {kind} kernels by block configuration, {result['device']}, flavor "
        f"{args.flavor} widths, batch "
        f"{args.batch} x seq {args.seq_len} (* = the fixed configuration now)"
    )
    print(f"{'call':<11} {'channels':>8} {'config':>10} {'ms':>8} {'bound ms':>9}")
    for r in result["rows"]:
        bound = r["bound_ms"] if r["bound_ms"] is not None else float("nan")
        print(
            f"{r['call']:<11} {r['channels']:>8} "
            f"{r['config']:>10}{'*' if r['current'] else ' '} {r['ms']:>8.3f} "
            f"{bound:>9.3f}"
        )
    return result


# ----------------------------------------------------------------------------- driver


def _subprocess_case(args, case: str, env=None) -> dict:
    argv = sys.argv[1:]
    if "--json" in argv:  # the driver writes it
        at = argv.index("--json")
        argv = argv[:at] + argv[at + 2 :]
    argv = [a for a in argv if not a.startswith("--json=")]
    proc = subprocess.run(
        [sys.executable, __file__, *argv, "--case", case],
        capture_output=True,
        text=True,
        env=env or dict(os.environ),
    )
    if proc.returncode:
        raise SystemExit(f"[bench] case {case} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_raw(args) -> list[dict]:
    results = []
    for mode in args.modes.split(","):
        for model in MODELS:
            print(f"[bench] raw: {model} {mode} ...", flush=True)
            results.append(_subprocess_case(args, f"raw:{model}:{mode}"))
    print(
        f"\nraw loop, flavor {args.flavor}, batch {args.batch}, seq {args.seq_len}, "
        f"{args.steps} timed steps "
        f"after {args.warmup} warm-up steps"
    )
    print(
        f"{'model':<12} {'mode':<9} {'params':>13} {'tokens/s':>10} {'ms/step':>9} {'peak GiB':>9}"
    )
    for r in results:
        print(
            f"{r['model']:<12} {r['mode']:<9} {r['params']:>13,} {r['tokens_per_s']:>10,.0f} "
            f"{r['step_ms']:>9.1f} {r['peak_mem_gib']:>9.2f}"
        )
    by = {(r["model"], r["mode"]): r for r in results}
    for mode in args.modes.split(","):
        base, canon = by[("llama", mode)], by[("llama_canon", mode)]
        print(
            f"Canon-ABCD overhead ({mode}): throughput "
            f"x{canon['tokens_per_s'] / base['tokens_per_s']:.3f}, "
            f"peak memory x{canon['peak_mem_gib'] / base['peak_mem_gib']:.3f} "
            f"({results[0]['memory_kind']})"
        )
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.case:
        kind, model, extra = args.case.split(":")
        case = {"raw": raw_case, "saved": saved_case, "bytes": bytes_case}[kind](
            args, model, extra if kind == "raw" else extra or None
        )
        print(json.dumps(case))
        return 0
    results = {
        "trainer": run_trainer,
        "raw": run_raw,
        "saved": run_saved,
        "bytes": run_bytes,
        "traffic": run_traffic,
        "ops": run_ops,
        "bwd_blocks": lambda args: _run_blocks(args, "backward"),
        "fwd_blocks": lambda args: _run_blocks(args, "forward"),
    }[args.mode](args)
    if args.json:
        write_atomic(args.json, json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
