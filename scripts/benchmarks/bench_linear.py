#!/usr/bin/env python
"""Train-step throughput, memory and sequence-length scaling of the linear models (gla5, gdn2,
mamba2; Canon 'AbbCD' and the conv baseline 'bb') against ``llama_canon`` (Canon-ABCD attention).

Markdown tables (ready for docs/benchmarks/):

1. throughput: every model at one width (``--dim``, ``--layers``) and shape (``--batch`` x
   ``--seq-len``): tokens/s, step time, parameters and peak memory (CPU: the process's peak RSS
   and its increase over the RSS after building model and optimizer, i.e. activations, gradients,
   AdamW state and allocator slack; CUDA: ``torch.cuda.max_memory_allocated`` and its increase
   over the allocated memory after building the model).
2. scaling: every model at ``--scaling-dim`` for each of ``--scaling-seqs`` (batch
   ``--scaling-batch``): tokens/s and step time. Linear models keep tokens/s about flat (step time
   x8 from 1k to 8k tokens); attention's quadratic term makes it fall.

3. trainer (``--tables trainer``, for a GPU): the real trainer (torchrun, TorchTitan's metrics,
   compile, bf16) for llama, llama_canon and the three linear models with Canon-AbCD at
   ``--trainer-flavor`` (1B), one row per model at each of ``--trainer-seqs`` in order: the recipes'
   16,384 x 1 first (the figure of record; target: each linear model >= 1.5x Llama's tokens/s), then
   4096 (``--trainer-tokens`` tokens per step: 4096 x 2) for information: tokens/s, MFU, peak memory
   and the first step's seconds (from the model's build: compile and kernel tuning). The kernels
   each run used are listed.
4. host (``--tables host``, on a CPU): each custom op's host path in one layer, counted
   (``linear_host.py``).
5. documents (``--tables documents``, on a CPU): what keeping packed documents apart costs per
   layer. Bytes and kernels of one compiled block's own code at ``--documents-flavor`` (1B) and
   ``--documents-tokens`` tokens, as Inductor's scheduler counts them for a Hopper GPU
   (``inductor_bytes.HopperCodegen``; the recurrence's custom ops left out: their kernels are
   fla's and mamba-ssm's), with and without document boundaries (four documents a row); then each
   custom op's Triton launches and torch kernels with and without them (``linear_host.py
   --documents``). The Canon layers run on the torch backend in both (the Triton Canon op takes no
   positions yet), Canon-AbCD and without Canon layers ('').

For tables 1 and 2, a step is forward + backward + AdamW on random tokens, after ``--warmup``
untimed steps; the tables give the median of the timed steps. Each model runs in its own process
(its cases in order, the scaling sequences ascending, so the process's peak RSS after a case is that
case's peak). CPU runs fp32 with the torch kernels; CUDA runs bf16 autocast with
``--kernel-backend`` (``auto`` picks fla / mamba_ssm when they import). On CPU the workers keep
freed memory mapped (``--malloc keep``): with glibc's defaults every step page-faults its large
activations in again, which on a small VM made steps up to ~1.7x slower and very noisy. Progress
goes to stderr, tables to stdout.

  # CPU default, ~5 min on 2 cores
  OMP_NUM_THREADS=2 .venv/bin/python scripts/benchmarks/bench_linear.py
  .venv/bin/python scripts/benchmarks/bench_linear.py --device cuda --dim 1024 --layers 8 --batch 8
      --seq-len 2048 \\
      --scaling-dim 512 --scaling-seqs 2048,4096,8192,16384,32768      # on a GPU
  .venv/bin/python scripts/benchmarks/bench_linear.py --tables scaling --models gla5:bb,llama_canon
  .venv/bin/python scripts/benchmarks/bench_linear.py --tables trainer  # on a GPU
  .venv/bin/python scripts/benchmarks/bench_linear.py --tables host  # any machine
  .venv/bin/python scripts/benchmarks/bench_linear.py --tables documents             # on a CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import model_registry

DEFAULT_MODELS = "gla5:AbbCD,gla5:bb,gdn2:AbbCD,gdn2:bb,mamba2:AbbCD,mamba2:bb,llama_canon:ABCD"
TRAINER_MODELS = "llama,llama_canon:ABCD,gla5:AbbCD,gdn2:AbbCD,mamba2:AbbCD"
TRAINER_TARGETS = {16384: 1.5}
"""The linear models' tokens/s over Llama's at the recipes' shape; other lengths are for
information."""
LINEAR = ("gla5", "gdn2", "mamba2")
BASELINE = "llama_canon:ABCD"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: cuda when torch.cuda.is_available(), else cpu",
    )
    p.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help="comma list of family[:canon_set] (families gla5, gdn2, mamba2, llama_canon, llama)",
    )
    p.add_argument(
        "--kernel-backend",
        default="auto",
        choices=("auto", "torch", "cuda"),
        help="recurrence kernel of the linear models; cuda = the family's CUDA package "
        "(fla for gla5/gdn2, mamba_ssm for mamba2)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("OMP_NUM_THREADS", 2)),
        help="torch CPU threads (default $OMP_NUM_THREADS or 2)",
    )
    p.add_argument(
        "--tables",
        default="throughput,scaling",
        help="comma list of throughput, scaling, trainer, host, documents",
    )
    # table 1
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--heads",
        type=int,
        help="heads of every model (default dim // 64: key head 64, value head 128, Mamba2 "
        "head 128)",
    )
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument(
        "--steps", type=int, default=5, help="timed steps (fewer if --case-budget runs out)"
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps (the first creates the AdamW state)"
    )
    # table 2
    p.add_argument("--scaling-dim", type=int, default=128)
    p.add_argument("--scaling-layers", type=int, help="default --layers")
    p.add_argument("--scaling-seqs", default="1024,2048,4096,8192")
    p.add_argument("--scaling-batch", type=int, default=1)
    p.add_argument("--scaling-steps", type=int, default=3)
    p.add_argument(
        "--scaling-warmup",
        type=int,
        default=2,
        help="untimed steps per sequence length (the first steps at a new length allocate)",
    )
    # shape details
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument(
        "--state-size",
        type=int,
        help="Mamba2 state N (default dim // heads, so all families hold the same recurrent state)",
    )
    p.add_argument(
        "--mamba-chunk",
        type=int,
        default=64,
        help="Mamba2 chunk size (GLA/GDN torch kernels use 64; the release's 256 is a GPU choice)",
    )
    p.add_argument(
        "--case-budget",
        type=float,
        default=30.0,
        help="stop a case's timed steps early once this many seconds have passed (>= 2 steps)",
    )
    p.add_argument(
        "--malloc",
        default="keep",
        choices=("keep", "default"),
        help="keep: run the workers with glibc's MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ "
        "raised so "
        "freed activations stay mapped instead of being page-faulted in again every step (on a "
        "small VM the faults cost up to half the step time); default: glibc as is",
    )
    # table 3
    p.add_argument(
        "--trainer-models",
        default=TRAINER_MODELS,
        help="family[:canon_set] list; the first is the baseline",
    )
    p.add_argument("--trainer-flavor", default="1B")
    p.add_argument("--trainer-seqs", default="16384,4096", help="in the order of the table's rows")
    p.add_argument(
        "--trainer-tokens",
        type=int,
        default=8192,
        help="tokens per step and process (batch = tokens // seq)",
    )
    p.add_argument("--trainer-steps", type=int, default=30)
    p.add_argument(
        "--trainer-warmup",
        type=int,
        default=10,
        help="steps left out of the medians (compile, autotuning)",
    )
    p.add_argument("--trainer-no-compile", dest="trainer_compile", action="store_false")
    # table 5
    p.add_argument("--documents-flavor", default="1B")
    p.add_argument(
        "--documents-tokens",
        type=int,
        default=4096,
        help="tokens of the one row (documents of its 17, 37, 7 and 39 hundredths)",
    )
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--bytes-worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- shapes -------------------------------------------------------------------------------------


def parse_model(spec: str) -> tuple[str, str]:
    family, _, canon = spec.partition(":")
    if family == "llama_canon" and not canon:
        canon = "ABCD"
    if family in LINEAR and not canon:
        canon = "AbbCD"
    return family, canon


def llama_hidden(dim: int) -> int:
    """SwiGLU hidden size 8/3 dim rounded up to 64, so a Llama layer (4 d^2 attention + 8 d^2 MLP)
    has the parameters of a linear layer (6 d^2 mixer + 6 d^2 MLP)."""
    return -(-8 * dim // 3 // 64) * 64


def overrides(
    family: str,
    canon: str,
    *,
    dim: int,
    layers: int,
    heads: int,
    vocab: int,
    max_seq: int,
    device: str,
    kernel_backend: str,
    state_size: int | None,
    mamba_chunk: int,
) -> dict:
    out = {"dim": dim, "n_layers": layers, "n_heads": heads, "vocab_size": vocab}
    if family in LINEAR:
        out["canon_set"] = canon
        out["canon_backend"] = "torch" if device == "cpu" else "auto"
        if device == "cpu":
            # 'auto' resolves by torch.cuda.is_available(), not by where the tensors are.
            out["kernel_backend"] = "torch"
        elif kernel_backend == "cuda":
            out["kernel_backend"] = {"gla5": "fla", "gdn2": "fla", "mamba2": "mamba_ssm"}[family]
        else:
            out["kernel_backend"] = kernel_backend
        if family == "mamba2":
            out["state_size"] = state_size or dim // heads
            out["chunk_size"] = mamba_chunk
    else:
        head_dim = dim // heads
        out.update(
            n_kv_heads=heads,
            ffn_hidden_dim=llama_hidden(dim),
            max_seq_len=max_seq,
            rope_dim=max(2, head_dim // 4 // 2 * 2),
        )  # a quarter of the head, as the release
        if family == "llama_canon":
            out["canon_set"] = canon
            out["canon_backend"] = "torch" if device == "cpu" else "auto"
    return out


# --- worker: one model, its cases in order ----------------------------------------------------


def rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def progress(msg: str) -> None:
    print("PROGRESS " + msg, flush=True)


def run_worker(job: dict) -> None:
    logging.getLogger().setLevel(logging.WARNING)  # the families log their kernel choice at INFO
    torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    family, canon = job["family"], job["canon"]
    spec = model_registry.model_spec(family, "debug", job["overrides"])
    torch.manual_seed(0)
    with device:
        model = spec.model.build()
    model.init_states()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    kernel = getattr(model.layers["0"], "mixer", None)
    kernel = kernel.backend if kernel is not None else "sdpa"
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = device.type == "cuda"
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if cuda
        else torch.autocast("cpu", enabled=False)
    )
    vocab = job["overrides"]["vocab_size"]
    name = f"{family}:{canon}" if canon else family
    dev_name = torch.cuda.get_device_name(device) if cuda else cpu_name()

    # Memory is counted from here (model built; the first step adds gradients and AdamW state), once
    # for all
    # cases: a CPU process keeps what it freed, so an RSS taken between cases would hide that
    # memory.
    base = torch.cuda.memory_allocated() if cuda else rss_bytes()

    def step(tokens):
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    for batch, seq in job["cases"]:
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for i in range(job["warmup"]):
            progress(
                f"{name} dim {job['overrides']['dim']} batch {batch} seq {seq}: warm-up "
                f"{i + 1}/{job['warmup']}"
            )
            step(tokens)
        times = []
        started = time.perf_counter()
        for i in range(job["steps"]):
            progress(
                f"{name} dim {job['overrides']['dim']} batch {batch} seq {seq}: step "
                f"{i + 1}/{job['steps']}"
            )
            t0 = time.perf_counter()
            step(tokens)
            times.append(time.perf_counter() - t0)
            if len(times) >= 2 and time.perf_counter() - started > job["budget"]:
                break
        peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
        med = statistics.median(times)
        print(
            "RESULT "
            + json.dumps(
                {
                    "model": name,
                    "family": family,
                    "canon": canon,
                    "kernel": kernel,
                    "params": n_params,
                    "dim": job["overrides"]["dim"],
                    "layers": job["overrides"]["n_layers"],
                    "heads": job["overrides"]["n_heads"],
                    "batch": batch,
                    "seq": seq,
                    "steps": len(times),
                    "step_ms": 1000 * med,
                    "step_ms_mean": 1000 * statistics.fmean(times),
                    "step_ms_min": 1000 * min(times),
                    "loadavg_1min": os.getloadavg()[0],
                    "tokens_per_s": batch * seq / med,
                    "peak_mib": peak / 2**20,
                    "peak_increase_mib": (peak - base) / 2**20,
                    "memory_kind": "cuda max allocated" if cuda else "process peak RSS",
                    "device": dev_name,
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "autocast": "bf16" if cuda else "fp32",
                    "malloc": "keep" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "default",
                }
            ),
            flush=True,
        )
        del tokens


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu (" + line.split(":", 1)[1].strip() + ")"
    except OSError:
        pass
    return "cpu"


# --- driver -------------------------------------------------------------------------------------

KEEP_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**40), "MALLOC_TRIM_THRESHOLD_": str(2**40)}


FAILED: list[str] = []


def spawn(job: dict, threads: int, malloc: str) -> list[dict]:
    """Run one worker; relay its progress to stderr, return its results (a failed worker's done
    cases)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if malloc == "keep":
        env = {**KEEP_MALLOC, **env}  # values the caller set win
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    results = []
    tty = sys.stderr.isatty()
    last_case = None
    for line in proc.stdout:
        if line.startswith("PROGRESS "):
            msg = line[9:].rstrip()
            if tty:  # one status line, rewritten in place
                print(f"\r[bench_linear] {msg:<90}", end="", file=sys.stderr, flush=True)
            elif msg.rsplit(": ", 1)[0] != last_case:  # a log: one line per case
                last_case = msg.rsplit(": ", 1)[0]
                print(f"[bench_linear] {last_case} ...", file=sys.stderr, flush=True)
        elif line.startswith("RESULT "):
            r = json.loads(line[7:])
            results.append(r)
            print(
                f"{chr(13) if tty else ''}[bench_linear] {r['model']} dim {r['dim']} batch "
                f"{r['batch']} "
                f"seq {r['seq']}: {r['tokens_per_s']:,.0f} tokens/s, {r['step_ms']:,.0f} ms/step"
                f"{' ' * 20 if tty else ''}",
                file=sys.stderr,
                flush=True,
            )
    err = proc.stderr.read()
    if proc.wait():
        name = f"{job['family']}:{job['canon']}" if job["canon"] else job["family"]
        FAILED.append(f"{name} dim {job['overrides']['dim']}")
        print(
            f"\n[bench_linear] {name} failed (rc {proc.returncode}):\n{err[-4000:]}",
            file=sys.stderr,
        )
    return results


def header(results: list[dict], what: str, extra: str) -> str:
    r = results[0]
    malloc = f", glibc malloc {r['malloc']}" if r["device"].startswith("cpu") else ""
    return (
        f"**{what}** — device {r['device']}, {r['threads']} threads, torch {r['torch']}, "
        f"{r['autocast']}{malloc}, width {r['dim']}, {r['layers']} layers, {r['heads']} "
        f"heads, {extra}"
    )


def shape_note(args, dim: int) -> str:
    heads = args.heads or max(1, dim // 64)
    state = args.state_size or dim // heads
    return (
        f"_gla5/gdn2: key head {dim // heads}, value head {2 * dim // heads}, MLP hidden "
        f"{2 * dim}; mamba2: head "
        f"{2 * dim // heads}, state {state}, chunk {args.mamba_chunk}, MLP hidden "
        f"{2 * dim}; llama_canon: "
        f"MHA head {dim // heads}, SwiGLU hidden {llama_hidden(dim)}, RoPE on a quarter of "
        "the head. Linear "
        f"models on the torch chunked kernels (chunk 64) unless the kernel column says otherwise._"
    )


def throughput_table(results: list[dict], args) -> str:
    base = next((r for r in results if r["model"] == BASELINE), None)
    mem = "peak RSS" if results[0]["memory_kind"] == "process peak RSS" else "peak alloc"
    lines = [
        header(
            results,
            "Train-step throughput",
            f"vocab {args.vocab}, batch {args.batch} x seq {args.seq_len}, "
            f"median of {args.steps} steps after {args.warmup} warm-up",
        ),
        "",
        shape_note(args, args.dim),
        "",
        "| model | canon_set | kernel | params | tokens/s | step ms | min step ms | "
        f"tokens/s vs {BASELINE} | "
        f"{mem} MiB | {mem} increase MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = f"x{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        lines.append(
            f"| {r['family']} | {r['canon'] or '-'} | {r['kernel']} | {r['params']:,} | "
            f"{r['tokens_per_s']:,.0f} | {r['step_ms']:,.0f} | {r['step_ms_min']:,.0f} | {ratio} | "
            f"{r['peak_mib']:,.0f} | {r['peak_increase_mib']:,.0f} |"
        )
    return "\n".join(lines)


def scaling_table(results: list[dict], args, seqs: list[int]) -> str:
    by_model: dict[str, dict[int, dict]] = {}
    for r in results:
        by_model.setdefault(r["model"], {})[r["seq"]] = r
    first, last = seqs[0], seqs[-1]
    mem = "peak RSS" if results[0]["memory_kind"] == "process peak RSS" else "peak alloc"
    lines = [
        header(
            results,
            "Sequence-length scaling",
            f"vocab {args.vocab}, batch {args.scaling_batch}, "
            f"median of {args.scaling_steps} steps after "
            f"{args.scaling_warmup} warm-up; cells: tokens/s (ms/step)",
        ),
        "",
        shape_note(args, args.scaling_dim),
        "",
        "| model | canon_set | "
        + " | ".join(f"T={s}" for s in seqs)
        + f" | step time T={last} / T={first} (linear: x{last // first}) | {mem} increase "
        f"MiB at T={last} |",
        "|---|---|" + "---:|" * (len(seqs) + 2),
    ]
    for _model, cases in by_model.items():
        r0 = next(iter(cases.values()))
        cells = [
            f"{cases[s]['tokens_per_s']:,.0f} ({cases[s]['step_ms']:,.0f})" if s in cases else "-"
            for s in seqs
        ]
        growth = (
            f"x{cases[last]['step_ms'] / cases[first]['step_ms']:.1f}"
            if first in cases and last in cases
            else "-"
        )
        peak = f"{cases[last]['peak_increase_mib']:,.0f}" if last in cases else "-"
        lines.append(
            f"| {r0['family']} | {r0['canon'] or '-'} | "
            + " | ".join(cells)
            + f" | {growth} | {peak} |"
        )
    return "\n".join(lines)


def run_trainer_table(args) -> tuple[list[dict], str]:
    import tempfile

    from trainer_bench import run_case

    seqs = [int(s) for s in args.trainer_seqs.split(",") if s]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in seqs:  # every model at the first length (the figure of record) before the next
            batch = max(1, args.trainer_tokens // seq)
            for spec in args.trainer_models.split(","):
                family, canon = parse_model(spec)
                keys = {
                    "name": family,
                    "flavor": args.trainer_flavor,
                    **({"canon_set": canon} if canon else {}),
                }
                print(
                    f"[bench_linear] trainer: {spec} {args.trainer_flavor}, batch {batch} "
                    f"x seq {seq} ...",
                    file=sys.stderr,
                    flush=True,
                )
                try:
                    r = run_case(
                        keys,
                        os.path.join(tmp, f"{family}-{seq}"),
                        seq_len=seq,
                        batch=batch,
                        steps=args.trainer_steps,
                        warmup=args.trainer_warmup,
                        compile=args.trainer_compile,
                    )
                except RuntimeError as e:
                    FAILED.append(f"trainer {spec} seq {seq}")
                    print(f"[bench_linear] {e}", file=sys.stderr)
                    continue
                results.append({**r, "spec": spec, "canon": canon})
    return results, trainer_table(results, args.trainer_models.split(","), seqs, args)


def trainer_table(results: list[dict], specs: list[str], seqs: list[int], args) -> str:
    """One row per length (in ``seqs``' order) and model (``specs``; the first is the base of the
    ratios)."""
    by = {(r["spec"], r["seq_len"]): r for r in results}
    base = specs[0]
    lines = [
        f"**Trainer** — flavor {args.trainer_flavor}, compile {args.trainer_compile}, "
        "medians over steps "
        f"{args.trainer_warmup + 1}-{args.trainer_steps}; the first length is the figure of record "
        f"(target x{TRAINER_TARGETS.get(seqs[0], '-')} of {base} for the linear models), "
        "the others for "
        "information",
        "",
        f"| batch x seq | model | canon_set | tokens/s | x {base} | MFU % | peak reserved "
        "GiB | step 1 s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for seq in seqs:
        for spec in specs:
            r, b = by.get((spec, seq)), by.get((base, seq))
            shape = f"{r['batch']} x {seq}" if r else f"- x {seq}"
            name = f"| {shape} | {spec.split(':')[0]} | {parse_model(spec)[1] or '-'} |"
            if r is None:
                lines.append(f"{name} failed | | | | |")
                continue
            ratio = r["tokens_per_s"] / b["tokens_per_s"] if b else float("nan")
            target = TRAINER_TARGETS.get(seq) if spec.split(":")[0] in LINEAR else None
            mark = "" if target is None else (" ok" if ratio >= target else f" < {target}")
            lines.append(
                f"{name} {r['tokens_per_s']:,.0f} | x{ratio:.2f}{mark} | {r['mfu_pct']:.1f} | "
                f"{r['peak_reserved_gib']:.1f} | {r['first_step_s']:.1f} |"
            )
    kernels = sorted({r["kernels"] for r in results if r["kernels"]})
    lines += ["", "_Kernels: " + " / ".join(kernels) + "_"] if kernels else []
    return "\n".join(lines)


DOCUMENT_SHARES = (0.17, 0.37, 0.07)
"""The row's first three documents, as shares of it; the fourth takes the rest."""


def block_bytes(job: dict) -> dict:
    """One compiled block's forward and backward kernels and bytes per token
    (``inductor_bytes.HopperCodegen``: in a process of its own), with document boundaries if
    ``job["documents"]``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch._library.custom_ops import OPDEFS

    from canon_titan.kernels.backends import KernelEnvironment, planned_machine
    from canon_titan.kernels.documents import Documents, document_boundaries
    from inductor_bytes import HopperCodegen

    codegen = HopperCodegen()
    family, tokens = job["family"], job["tokens"]
    # The recurrences' ops answer with their fake outputs: their kernels are the packages'
    # (linear_host.py).
    for name, op in OPDEFS.items():
        if name.startswith(("canon_titan::fla_", "canon_titan::mamba_")):
            op.register_kernel("cpu")(op._abstract_fn)
    with planned_machine(KernelEnvironment.planned_gpu((9, 0))):
        spec = model_registry.model_spec(
            family,
            job["flavor"],
            {
                "n_layers": 1,
                "canon_set": job["canon"],
                "canon_backend": "torch",
                "kernel_backend": {"gla5": "fla", "gdn2": "fla", "mamba2": "mamba_ssm"}[family],
            },
        )
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # FSDP's bf16 parameters, as the trainer computes
        try:
            block = spec.model.build().layers["0"]
        finally:
            torch.set_default_dtype(default)
        x = torch.randn(1, tokens, spec.model.args.dim, dtype=torch.bfloat16, requires_grad=True)
        args = (x,)
        if job["documents"]:
            lengths = [int(share * tokens) for share in DOCUMENT_SHARES]
            positions = torch.cat(
                [torch.arange(n) for n in lengths + [tokens - sum(lengths)]]
            ).unsqueeze(0)
            args = (x, Documents(positions, **document_boundaries(positions)), positions)
        y = torch.compile(block, fullgraph=True)(*args)
        y.backward(torch.ones_like(y))
    forward, backward = codegen.graphs
    return {**job, "forward": forward, "backward": backward}


def documents_table(results: list[dict], args) -> str:
    by = {(r["family"], r["canon"], r["documents"]): r for r in results}
    lines = [
        f"**Keeping documents apart: a compiled block's own code** ({args.documents_flavor}, "
        f"1 x {args.documents_tokens:,} tokens, four documents a row; bf16; Inductor's kernels for "
        "sm_90 as its scheduler counts them, the recurrence's custom ops left out; Canon layers on "
        "the torch backend)",
        "",
        "| model | forward kernels | forward KB / token | backward kernels | backward KB / token |",
        "|---|---:|---:|---:|---:|",
    ]

    def cell(plain, masked, key, unit=1):
        a, b = plain[key] / unit, masked[key] / unit
        return (
            f"{a:,.0f} -> {b:,.0f}" if unit == 1 else f"{a:,.1f} -> {b:,.1f} ({(b - a) / a:+.1%})"
        )

    for family, canon in dict.fromkeys((f, c) for f, c, _ in by):
        plain, masked = by.get((family, canon, False)), by.get((family, canon, True))
        if plain and masked:
            kb = 1000 * args.documents_tokens
            lines.append(
                f"| {family}:{canon or '(none)'} | "
                f"{cell(plain['forward'], masked['forward'], 'kernels')} | "
                f"{cell(plain['forward'], masked['forward'], 'bytes', kb)} | "
                f"{cell(plain['backward'], masked['backward'], 'kernels')} | "
                f"{cell(plain['backward'], masked['backward'], 'bytes', kb)} |"
            )
    return "\n".join(lines)


def run_documents_table(args, models) -> list[str]:
    results, out = [], []
    for family in dict.fromkeys(f for f, _ in models if f in LINEAR):
        for canon in ("AbbCD", ""):
            for documents in (False, True):
                job = {
                    "family": family,
                    "canon": canon,
                    "documents": documents,
                    "flavor": args.documents_flavor,
                    "tokens": args.documents_tokens,
                }
                proc = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--bytes-worker", json.dumps(job)],
                    capture_output=True,
                    text=True,
                )
                lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if proc.returncode or not lines:
                    FAILED.append(f"documents {family}:{canon}")
                    print(
                        f"[bench_linear] documents {job} failed:\n{proc.stderr[-4000:]}",
                        file=sys.stderr,
                    )
                    continue
                results.append(json.loads(lines[0][7:]))
                print(
                    f"[bench_linear] documents {family}:{canon or '(none)'} {documents}: done",
                    file=sys.stderr,
                    flush=True,
                )
    if results:
        out.append(documents_table(results, args))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "linear_host.py")
    proc = subprocess.run(
        [
            sys.executable,
            script,
            "--documents",
            "--models",
            ",".join(dict.fromkeys(f for f, _ in models if f in LINEAR)),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, TRITON_INTERPRET="1"),
    )
    if proc.returncode:
        FAILED.append("documents host")
        print(
            f"[bench_linear] documents host table failed:\n{proc.stderr[-4000:]}", file=sys.stderr
        )
    else:
        out.append(proc.stdout.strip())
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(json.loads(args.worker))
        return 0
    if args.bytes_worker:
        import warnings

        warnings.filterwarnings("ignore")
        print("RESULT " + json.dumps(block_bytes(json.loads(args.bytes_worker))))
        return 0
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: torch.cuda.is_available() is False", file=sys.stderr)
            return 2
    if args.device == "cpu" and args.kernel_backend == "cuda":
        print("--kernel-backend cuda needs --device cuda", file=sys.stderr)
        return 2
    tables = set(args.tables.split(","))
    models = [parse_model(m) for m in args.models.split(",") if m]
    seqs = sorted(int(s) for s in args.scaling_seqs.split(",") if s)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    all_results: dict[str, list[dict]] = {}
    out = []

    def job(family, canon, dim, layers, cases, steps, warmup):
        heads = args.heads or max(1, dim // 64)
        max_seq = max(seq for _, seq in cases)
        return {
            "family": family,
            "canon": canon,
            "device": args.device,
            "threads": args.threads,
            "cases": cases,
            "steps": steps,
            "warmup": warmup,
            "budget": args.case_budget,
            "overrides": overrides(
                family,
                canon,
                dim=dim,
                layers=layers,
                heads=heads,
                vocab=args.vocab,
                max_seq=max_seq,
                device=args.device,
                kernel_backend=args.kernel_backend,
                state_size=args.state_size,
                mamba_chunk=args.mamba_chunk,
            ),
        }

    if "throughput" in tables:
        results = []
        for family, canon in models:
            results += spawn(
                job(
                    family,
                    canon,
                    args.dim,
                    args.layers,
                    [(args.batch, args.seq_len)],
                    args.steps,
                    args.warmup,
                ),
                args.threads,
                args.malloc,
            )
        if results:
            all_results["throughput"] = results
            out.append(throughput_table(results, args))
    if "scaling" in tables:
        results = []
        layers = args.scaling_layers or args.layers
        for family, canon in models:
            results += spawn(
                job(
                    family,
                    canon,
                    args.scaling_dim,
                    layers,
                    [(args.scaling_batch, s) for s in seqs],
                    args.scaling_steps,
                    args.scaling_warmup,
                ),
                args.threads,
                args.malloc,
            )
        if results:
            all_results["scaling"] = results
            out.append(scaling_table(results, args, seqs))
    if "trainer" in tables:
        results, table = run_trainer_table(args)
        if results:
            all_results["trainer"] = results
            out.append(table)
    if (
        "host" in tables
    ):  # in a process of its own: Triton's interpreter mode is set before Triton's first import
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "linear_host.py")
        proc = subprocess.run(
            [
                sys.executable,
                script,
                "--models",
                ",".join(dict.fromkeys(f for f, _ in models if f in LINEAR)),
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, TRITON_INTERPRET="1"),
        )
        if proc.returncode:
            FAILED.append("host")
            print(f"[bench_linear] host table failed:\n{proc.stderr[-4000:]}", file=sys.stderr)
        else:
            out.append(proc.stdout.strip())
    if "documents" in tables:
        out += run_documents_table(args, models)
    elapsed = time.perf_counter() - started
    print(f"[bench_linear] done in {elapsed / 60:.1f} min", file=sys.stderr, flush=True)
    print("\n\n".join(out))
    print(
        f"\n_total benchmark time {elapsed / 60:.1f} min; 1-minute load average "
        f"{load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (about {args.threads} is this benchmark alone; "
        "more means other "
        f"processes competed for the cores and the timings are noisy)_"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_results, f, indent=2)
    if FAILED:
        print(f"[bench_linear] failed: {'; '.join(FAILED)} (see above)", file=sys.stderr)
    return 0 if out and not FAILED else 1


if __name__ == "__main__":
    sys.exit(main())
