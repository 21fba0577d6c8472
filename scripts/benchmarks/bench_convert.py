#!/usr/bin/env python
"""Time and peak RSS of converting a randomly initialised checkpoint DCP -> HF -> DCP on CPU.

  .venv/bin/python scripts/benchmarks/bench_convert.py  # LlamaCanon-1B (1.37B params)
  .venv/bin/python scripts/benchmarks/bench_convert.py --config train_configs/llama_canon_debug.toml

Each stage runs in its own process, so its peak RSS is its own. Disk needed: about 3x the model
size in the chosen dtypes (the work folder is deleted afterwards unless --keep).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from canon_titan.config import load
from canon_titan.convert.dcp_io import save_lazily
from canon_titan.convert.hf import from_hf, to_hf

REPO = Path(__file__).resolve().parents[2]


def stage(name: str, config: str, work: Path, dtype: str, max_shard: str) -> dict:
    run = load(config, environment=False)
    start = time.perf_counter()
    if name == "make":
        generator = torch.Generator().manual_seed(0)
        shapes = run.state_dict_adapter().shapes
        save_lazily(
            work / "dcp",
            {k: (v, torch.float32) for k, v in shapes.items()},
            lambda k: torch.randn(shapes[k], generator=generator) * 0.02,
        )
    elif name == "to-hf":
        to_hf(work / "dcp", work / "hf", run, dtype=dtype, max_shard_size=_bytes(max_shard))
    else:
        from_hf(work / "hf", work / "dcp_back", run)
    return {
        "stage": name,
        "seconds": time.perf_counter() - start,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def _bytes(text: str) -> int:
    return int(float(text[:-2]) * {"MB": 2**20, "GB": 2**30}[text[-2:].upper()])


def _size_gib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**30


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", default=str(REPO / "train_configs" / "LlamaCanon-1B-Nemo-1T-lr0.003.toml")
    )
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16"], default="bf16", help="dtype of the HF export"
    )
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--workdir", help="where to write (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert-"))
    if args.stage:
        print(json.dumps(stage(args.stage, args.config, work, args.dtype, args.max_shard_size)))
        return 0
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for name in ("make", "to-hf", "from-hf"):
            print(f"[bench] {name} ...", flush=True)
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--stage",
                    name,
                    "--config",
                    args.config,
                    "--workdir",
                    str(work),
                    "--dtype",
                    args.dtype,
                    "--max-shard-size",
                    args.max_shard_size,
                ],
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                print(proc.stderr[-4000:], file=sys.stderr)
                return proc.returncode
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        shapes = load(args.config, environment=False).state_dict_adapter().shapes
        n_params = sum(s.numel() for s in shapes.values())
        largest = max(s.numel() for s in shapes.values()) * 4 / 2**30
        print(
            f"\nmodel: {args.config} ({n_params / 1e9:.2f}B parameters; largest tensor "
            f"{largest:.2f} GiB fp32)"
        )
        print(
            f"sizes: DCP fp32 {_size_gib(work / 'dcp'):.2f} GiB, HF {args.dtype} "
            f"{_size_gib(work / 'hf'):.2f} GiB "
            f"(shards <= {args.max_shard_size})"
        )
        print(f"{'stage':<10} {'seconds':>9} {'peak RSS GiB':>13}")
        for r in results:
            print(f"{r['stage']:<10} {r['seconds']:>9.1f} {r['peak_rss_gib']:>13.2f}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
