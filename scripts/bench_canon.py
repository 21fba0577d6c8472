#!/usr/bin/env python
"""Train-step throughput and peak memory of ``llama`` vs ``llama_canon`` (Canon-ABCD) at one shape.

Each (model, mode) case runs in its own process, so peak memory is that case's alone (peak RSS
on CPU, peak allocated CUDA memory on GPU). Prints a table and the Canon overhead ratios.

  .venv/bin/python scripts/bench_canon.py                          # CPU-sized default shape
  .venv/bin/python scripts/bench_canon.py --flavor 1B --seq-len 4096 --batch 2   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MODELS = ("llama", "llama_canon")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debug", help="flavor of both families (debug, 1B, 3B, 8B)")
    p.add_argument("--dim", type=int, help="override the flavor's width")
    p.add_argument("--n-layers", type=int, help="override the flavor's depth")
    p.add_argument("--n-heads", type=int)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation happens here)")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--case", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def overrides(args, model: str) -> dict:
    out = {k: v for k, v in (("dim", args.dim), ("n_layers", args.n_layers), ("n_heads", args.n_heads)) if v}
    out["max_seq_len"] = args.seq_len
    if args.n_heads and args.flavor == "debug":
        out["n_kv_heads"] = args.n_heads
    if model == "llama_canon":
        out["canon_set"] = "ABCD"
    return out


def run_case(args) -> dict:
    import torch

    import model_registry
    from canon_titan.loss import squared_nll_loss

    model_name, mode = args.case.split(":")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = model_registry.model_spec(model_name, args.flavor, overrides(args, model_name))
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.model.build()
    model.init_states()
    n_params = sum(p.numel() for p in model.parameters())
    if mode == "compiled":
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    vocab = spec.model.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

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
    return {"model": model_name, "mode": mode, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "params": n_params, "tokens_per_s": args.batch * args.seq_len * args.steps / elapsed,
            "step_ms": 1000 * elapsed / args.steps, "peak_mem_gib": peak / 2**30,
            "memory_kind": "cuda max allocated" if device.type == "cuda" else "process peak RSS"}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args)))
        return 0
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--json")]
    results = []
    for mode in args.modes.split(","):
        for model in MODELS:
            print(f"[bench] {model} {mode} ...", flush=True)
            proc = subprocess.run([sys.executable, __file__, *passthrough, "--case", f"{model}:{mode}"],
                                  capture_output=True, text=True, env=dict(os.environ))
            if proc.returncode:
                print(proc.stderr[-4000:], file=sys.stderr)
                return proc.returncode
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    shape = f"flavor {args.flavor}" + "".join(f", {k} {v}" for k, v in overrides(args, "llama").items())
    print(f"\nshape: {shape}, batch {args.batch}, seq {args.seq_len}, device {results[0]['device']}, "
          f"{args.steps} timed steps after {args.warmup} warm-up steps")
    print(f"{'model':<12} {'mode':<9} {'params':>13} {'tokens/s':>10} {'ms/step':>9} {'peak GiB':>9}")
    for r in results:
        print(f"{r['model']:<12} {r['mode']:<9} {r['params']:>13,} {r['tokens_per_s']:>10,.0f} "
              f"{r['step_ms']:>9.1f} {r['peak_mem_gib']:>9.2f}")
    by = {(r["model"], r["mode"]): r for r in results}
    for mode in args.modes.split(","):
        base, canon = by[("llama", mode)], by[("llama_canon", mode)]
        print(f"Canon-ABCD overhead ({mode}): throughput x{canon['tokens_per_s'] / base['tokens_per_s']:.3f}, "
              f"peak memory x{canon['peak_mem_gib'] / base['peak_mem_gib']:.3f} ({results[0]['memory_kind']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
