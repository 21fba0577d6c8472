#!/usr/bin/env python
"""What Canon-ABCD costs: ``llama`` against ``llama_canon`` at one shape, three ways.

  --mode trainer  the real trainer (torchrun, TorchTitan's metrics) for both models in turn:
                  tokens/s, MFU and peak memory after the warm-up steps, and the ratios. This is
                  the figure of record on a GPU; the default shape is the 1B recipe's at seq 4096.
  --mode raw      a bare forward/backward/AdamW loop per model (eager and/or compiled blocks).
  --mode saved    bytes of activations one compiled block saves for the backward, per token
                  (parameters excluded), for llama and llama_canon with each Canon backend. Runs on
                  a CPU (the Triton kernels in the interpreter): the activation-memory part of the
                  memory ratio, device-independent.

Every case runs in its own process, so peak memory is that case's alone.

  .venv/bin/python scripts/bench_canon.py --mode trainer                      # GPU: 1B, seq 4096, bs 2, compile
  .venv/bin/python scripts/bench_canon.py --mode trainer --flavor debug --seq-len 256 --steps 6 --no-compile  # CPU
  .venv/bin/python scripts/bench_canon.py --mode saved --seq-len 256          # CPU, 1B block
  .venv/bin/python scripts/bench_canon.py --mode raw --flavor debug --seq-len 512
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
from canon_titan.loss import squared_nll_loss

MODELS = ("llama", "llama_canon")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("trainer", "raw", "saved"), default="trainer")
    p.add_argument("--flavor", default="1B", help="flavor of both families (debug, 1B, 3B, 8B)")
    p.add_argument("--dim", type=int, help="override the flavor's width")
    p.add_argument("--n-layers", type=int, help="override the flavor's depth")
    p.add_argument("--n-heads", type=int)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2, help="per-process batch")
    p.add_argument("--canon-backend", default="auto", help="trainer/raw: llama_canon's canon_backend")
    p.add_argument("--steps", type=int, default=30, help="trainer: steps; raw: timed steps")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the averages (compilation, autotuning)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="trainer: eager blocks")
    p.add_argument("--nproc", type=int, default=1, help="trainer: processes (FSDP over them)")
    p.add_argument("--modes", default="eager,compiled", help="raw: eager and/or compiled")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--case", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def shape_overrides(args) -> dict:
    out = {k: v for k, v in (("dim", args.dim), ("n_layers", args.n_layers), ("n_heads", args.n_heads)) if v}
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


def run_trainer(args) -> list[dict]:
    from trainer_bench import run_case

    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in MODELS:
            print(f"[bench] trainer: {model} {args.flavor}, seq {args.seq_len}, batch {args.batch} x {args.nproc}, "
                  f"{args.steps} steps ...", flush=True)
            keys = {"name": model, "flavor": args.flavor, **model_overrides(args, model)}
            try:
                results.append(run_case(keys, os.path.join(tmp, model), seq_len=args.seq_len, batch=args.batch,
                                        steps=args.steps, warmup=args.warmup, compile=args.compile,
                                        nproc=args.nproc))
            except RuntimeError as e:
                raise SystemExit(f"[bench] {e}") from None
    base, canon = results
    print(f"\ntrainer, flavor {args.flavor}, seq {args.seq_len}, batch {args.batch} x {args.nproc} process(es), "
          f"compile {args.compile}; medians over steps {args.warmup + 1}-{args.steps}")
    print(f"{'model':<12} {'tokens/s':>10} {'MFU %':>7} {'peak reserved GiB':>18} {'peak active GiB':>16}")
    for r in results:
        print(f"{r['model']:<12} {r['tokens_per_s']:>10,.0f} {r['mfu_pct']:>7.2f} {r['peak_reserved_gib']:>18.2f} "
              f"{r['peak_active_gib']:>16.2f}")
    print(f"kernels: {canon['kernels']}")
    print(f"llama_canon / llama: throughput x{canon['tokens_per_s'] / base['tokens_per_s']:.3f} (target >= 0.97), "
          f"peak reserved x{canon['peak_reserved_gib'] / base['peak_reserved_gib']:.3f}, "
          f"peak active x{canon['peak_active_gib'] / base['peak_active_gib']:.3f} (target <= 1.05)")
    return results


# ----------------------------------------------------------------------------- raw loop


def raw_case(args, model_name: str, mode: str) -> dict:
    device = _device()
    spec = model_registry.model_spec(model_name, args.flavor, {**model_overrides(args, model_name),
                                                               "max_seq_len": args.seq_len})
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
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))

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
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"model": model_name, "mode": mode, "params": n_params,
            "tokens_per_s": args.batch * args.seq_len * args.steps / elapsed,
            "step_ms": 1000 * elapsed / args.steps, "peak_mem_gib": peak / 2**30,
            "memory_kind": "cuda max allocated" if device.type == "cuda" else "process peak RSS"}


# ----------------------------------------------------------------------------- saved activations


def saved_case(args, model_name: str, backend: str | None) -> dict:
    """Activation bytes per token that one compiled block saves for its backward (bf16)."""
    device = _device()
    overrides = {**model_overrides(args, model_name, backend), "n_layers": 1, "max_seq_len": args.seq_len}
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
    return {"model": model_name, "canon_backend": backend,
            "bytes_per_token": sum(storages.values()) / (args.batch * args.seq_len)}


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
    print(f"\nactivations saved for the backward by one compiled {args.flavor} block (bf16), per token "
          f"(batch {args.batch} x seq {args.seq_len}, parameters excluded)")
    print(f"{'model':<12} {'backend':<8} {'bytes/token':>12} {'vs llama':>9}")
    for r in results:
        print(f"{r['model']:<12} {r['canon_backend'] or '-':<8} {r['bytes_per_token']:>12,.0f} "
              f"{r['bytes_per_token'] / base:>9.3f}")
    return results


# ----------------------------------------------------------------------------- driver


def _subprocess_case(args, case: str, env=None) -> dict:
    argv = [a for a in sys.argv[1:] if not a.startswith("--json")]
    proc = subprocess.run([sys.executable, __file__, *argv, "--case", case], capture_output=True, text=True,
                          env=env or dict(os.environ))
    if proc.returncode:
        raise SystemExit(f"[bench] case {case} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_raw(args) -> list[dict]:
    results = []
    for mode in args.modes.split(","):
        for model in MODELS:
            print(f"[bench] raw: {model} {mode} ...", flush=True)
            results.append(_subprocess_case(args, f"raw:{model}:{mode}"))
    print(f"\nraw loop, flavor {args.flavor}, batch {args.batch}, seq {args.seq_len}, {args.steps} timed steps "
          f"after {args.warmup} warm-up steps")
    print(f"{'model':<12} {'mode':<9} {'params':>13} {'tokens/s':>10} {'ms/step':>9} {'peak GiB':>9}")
    for r in results:
        print(f"{r['model']:<12} {r['mode']:<9} {r['params']:>13,} {r['tokens_per_s']:>10,.0f} "
              f"{r['step_ms']:>9.1f} {r['peak_mem_gib']:>9.2f}")
    by = {(r["model"], r["mode"]): r for r in results}
    for mode in args.modes.split(","):
        base, canon = by[("llama", mode)], by[("llama_canon", mode)]
        print(f"Canon-ABCD overhead ({mode}): throughput x{canon['tokens_per_s'] / base['tokens_per_s']:.3f}, "
              f"peak memory x{canon['peak_mem_gib'] / base['peak_mem_gib']:.3f} ({results[0]['memory_kind']})")
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.case:
        kind, model, extra = args.case.split(":")
        case = raw_case(args, model, extra) if kind == "raw" else saved_case(args, model, extra or None)
        print(json.dumps(case))
        return 0
    results = {"trainer": run_trainer, "raw": run_raw, "saved": run_saved}[args.mode](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
