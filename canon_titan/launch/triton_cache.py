"""Triton's kernel cache on the nodes of a job.

Triton keeps its compiled kernels (and, with ``TRITON_CACHE_AUTOTUNING=1``, its autotuning
choices) in ``TRITON_CACHE_DIR``, by default ``~/.triton/cache``: on a cluster usually a home folder
on NFS or GPFS, where a thousand ranks compiling the same kernels would write and rename the same
small files at once (a storm of metadata operations on the shared server, and the home quota).
So the launch scripts (``scripts/run_train.sh``, ``scripts/train.slurm``) give each node a cache on
its local disk, and the torchrun wrapper seeds it, once per node before any worker starts, from a
shared pre-tuned cache when ``CANON_TITAN_TRITON_SEED`` names one (``python -m
canon_titan.launch.pretune`` writes one; ``docs/launching.md``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SEED_ENV = "CANON_TITAN_TRITON_SEED"


def cache_dir() -> Path:
    """Where this process's Triton kernels are cached (Triton's own default when unset)."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def seed_cache(seed: Path, cache: Path) -> int:
    """Copy into ``cache`` every file of ``seed`` that it lacks, each written whole under a name of
    its own and then renamed (a worker of an earlier run reading the cache never sees half a file);
    how many were copied. Files the cache has already are kept (they are the same kernels)."""
    copied = 0
    for path in sorted(p for p in seed.rglob("*") if p.is_file()):
        target = cache / path.relative_to(seed)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.seeding")
        shutil.copyfile(path, partial)
        os.replace(partial, target)
        copied += 1
    return copied


def seeded_from_environment() -> tuple[str | None, str | None]:
    """Seed this node's cache from ``CANON_TITAN_TRITON_SEED`` when it is set: (a line saying what
    was copied, None), or (None, why not) when the seed cannot be read; (None, None) unset."""
    seed = os.environ.get(SEED_ENV)
    if not seed:
        return None, None
    if not Path(seed).is_dir():
        return None, (
            f"{SEED_ENV}={seed} is not a folder: give it the TRITON_CACHE_DIR a "
            "pre-tuning run wrote (python -m canon_titan.launch.pretune), "
            "or unset it"
        )
    cache = cache_dir()
    try:
        copied = seed_cache(Path(seed), cache)
    except OSError as e:
        return None, (
            f"cannot copy the pre-tuned Triton cache {seed} into {cache} "
            f"(TRITON_CACHE_DIR): {e.strerror or e}"
        )
    return f"Triton cache {cache}: {copied} files copied from {seed} ({SEED_ENV})", None
