"""The first step's kernel tuning: narrowed, reported, and kept off the collectives' clock.

fla 0.6.0 autotunes each of its Triton kernels on its first call for a new tuning key by compiling and timing
every configuration in the kernel's list: on Hopper at the 1B recipes' head sizes, 266 for GLA's forward and
backward (10 kernels), 64 for the gated delta rule's (9). On the H200 leases (2026-11-26 to 28, Triton 3.6)
GLA5Canon-1B's first step was still tuning after 124 to 290 s, and on a cluster that step runs inside the first
collectives' timeout (TorchTitan's 300 s).

- **Narrowing.** For the kernels in ``NARROWED`` the autotuner times only the configurations that can win at the
  recipes' shapes (28 of GLA's 266, 21 of the gated delta rule's 64), through Triton's documented hook,
  each autotuner's ``early_config_prune`` (fla's own pruning runs first). The rules are in ``Keep``'s three
  classes below, chosen from the H200 timings of every configuration of fla's forward kernels at the 1B shapes
  (``scripts/benchmarks/gpu_check_tuned.json``, which ``tests/test_linear_tuning.py`` checks them against).
  ``CANON_TITAN_FULL_AUTOTUNE=1`` in the environment restores fla's full search (to compare on a new GPU);
  on a GPU other than Hopper, where the rules were not measured, the full search runs anyway.
- **Progress.** Every autotuned kernel of fla and mamba-ssm logs a line as it starts tuning for a new key,
  with the seconds since this process's first tuning: the gaps between lines are each kernel's cost.
- **Off the clock.** ``wait_for_every_rank`` lets the ranks that finished tuning wait for the others through the
  process group's store (no collective, so no collective timeout); ``models/common/linear_tuning.py`` tunes a
  linear model's mixer before the first collective and then waits there.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton.runtime.autotuner as autotuner

from torchtitan.tools.logging import logger

FULL_AUTOTUNE_ENV = "CANON_TITAN_FULL_AUTOTUNE"


@dataclass(frozen=True)
class Keep:
    """Which of a kernel's candidate configurations its autotuner times. A rule that would keep none of a
    list's values keeps the list whole (e.g. a kernel offering no 3-stage configuration)."""

    num_warps: tuple[int, ...] = ()
    """Warp counts kept (empty: all)."""
    num_stages: tuple[int, ...] = ()
    largest: tuple[str, ...] = ()
    """Tile parameters of which only the largest value on offer is kept."""

    def __call__(self, configs: list) -> list:
        kept = list(configs)
        for name in self.largest:
            top = max(c.kwargs[name] for c in kept)
            kept = [c for c in kept if c.kwargs[name] == top]
        for attribute, wanted in (("num_warps", self.num_warps), ("num_stages", self.num_stages)):
            chosen = [c for c in kept if getattr(c, attribute) in wanted]
            if chosen:
                kept = chosen
        return kept


STATE = Keep(num_warps=(4,), num_stages=(3,))
"""Kernels that carry the state across chunks (one program per state tile and sequence, looping over time): every
tile on offer, since the tiles set how many programs share the GPU and that depends on batch x heads, which fla's
tuning key does not hold (GLA5-1B at 16,384 x 1: 128 programs of 64x64, 512 of 32x32, for 132 SMs); 4 warps, 3
stages: the H200's choice for ``chunk_fwd_kernel_h`` at 1B (112 us; 3.5% slower with 4 stages, 14% with 2,
16% with 8 warps)."""
CHUNK_TILED = Keep(num_warps=(4, 8), num_stages=(3,), largest=("BK", "BV"))
"""Kernels with one program per chunk and value tile (thousands at the recipes' shapes): the largest tiles fla
keeps for the shape, 4 or 8 warps, 3 stages. H200, ``chunk_gla_fwd_kernel_o`` at 1B: BK 64, BV 128, 4 warps won
(116 us, stages within 0.1%), 8 warps next (+14%), every smaller tile slower."""
CHUNK = Keep(num_warps=(2, 4), num_stages=(3,))
"""Per-chunk kernels tuned over warps and stages only (and GLA's ``BK`` of its inter-sub-chunk scores, whose
tuning key lacks the head size): 2 or 4 warps, 3 stages. H200 at 1B: ``chunk_gla_fwd_A_kernel_intra_sub_intra``
2 warps (140 us, stages equal), ``chunk_local_cumsum_vector_kernel`` 2 and 4 warps within 0.3%."""

NARROWED: dict[str, dict[str, Keep]] = {
    "fla.ops.utils.cumsum": {"chunk_local_cumsum_vector_kernel": CHUNK, "chunk_local_cumsum_scalar_kernel": CHUNK},
    "fla.ops.common.chunk_h": {"chunk_fwd_kernel_h": STATE, "chunk_bwd_kernel_dh": STATE},
    "fla.ops.gla.chunk": {
        "chunk_gla_fwd_A_kernel_intra_sub_inter": Keep(num_warps=(4, 8), num_stages=(3,)),
        "chunk_gla_fwd_A_kernel_intra_sub_intra": CHUNK,
        "chunk_gla_fwd_kernel_o": CHUNK_TILED,
        "chunk_gla_bwd_kernel_dA": CHUNK,
        "chunk_gla_bwd_kernel_intra": CHUNK,
        "chunk_gla_bwd_kernel_dv": CHUNK_TILED,
        "chunk_gla_bwd_kernel_inter": CHUNK_TILED,
    },
    "fla.ops.common.chunk_delta_h": {"chunk_gated_delta_rule_fwd_kernel_h_blockdim64": STATE,
                                     "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64": STATE},
    "fla.ops.common.chunk_o": {"chunk_bwd_kernel_dv_local": CHUNK, "chunk_bwd_kernel_dqkwg": CHUNK},
    "fla.ops.gated_delta_rule.wy_fast": {"recompute_w_u_fwd_kernel": CHUNK, "prepare_wy_repr_bwd_kernel": CHUNK},
    "fla.ops.gated_delta_rule.chunk_fwd": {"chunk_gated_delta_rule_fwd_kkt_solve_kernel": CHUNK},
}
"""Defining module -> kernel -> the configurations its autotuner times. fla's other autotuned kernels on these
paths offer 3 configurations or fewer."""

KERNEL_PACKAGES = {"fla": "fla.ops", "mamba_ssm": "mamba_ssm.ops.triton"}


def autotuner_of(obj) -> autotuner.Autotuner | None:
    """The autotuner of a kernel object (under its ``triton.heuristics``), or None."""
    while isinstance(obj, autotuner.Heuristics):
        obj = obj.fn
    return obj if isinstance(obj, autotuner.Autotuner) else None


def rules_measured_here() -> bool:
    """Whether ``NARROWED``'s rules were measured on this kind of GPU: Hopper (sm_90), where they were chosen.
    Elsewhere (an A100's or a consumer GPU's shared memory may not hold the largest tiles) the autotuner times
    fla's whole list. Without a GPU (Triton's interpreter, which times nothing) the rules apply, as in tests."""
    return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] == 9


class _Watched:
    """An autotuner's ``early_config_prune``: Triton calls it when a new tuning key starts its search."""

    def __init__(self, name: str, own_prune, keep: Keep | None):
        self.name, self.own_prune, self.keep = name, own_prune, keep

    def __call__(self, configs, nargs, **kwargs):
        offered = self.own_prune(configs, nargs, **kwargs) if self.own_prune else configs
        full = os.environ.get(FULL_AUTOTUNE_ENV) == "1" or not rules_measured_here()
        kept = offered if self.keep is None or full else self.keep(offered)
        progress(f"{self.name}: {len(kept)} of {len(configs)} configurations")
        return kept


_first_tuning: list[float] = []


def progress(what: str) -> None:
    """One log line of the process's kernel tuning, with the seconds since its first."""
    now = time.perf_counter()
    if not _first_tuning:
        _first_tuning.append(now)
    logger.info(f"kernel tuning: {what} (+{now - _first_tuning[0]:.1f} s)")


def watch(package: str) -> None:
    """Narrow (``NARROWED``) and report every autotuned kernel of ``package`` (``fla`` or ``mamba_ssm``, imported):
    once per process, before its first kernel runs."""
    import importlib

    if package == "fla":
        for module_name, kernels in NARROWED.items():
            module = importlib.import_module(module_name)
            missing = [k for k in kernels if autotuner_of(getattr(module, k, None)) is None]
            if missing:
                raise RuntimeError(f"canon_titan.kernels.tuning: {module_name} has no autotuned kernel "
                                   f"{', '.join(missing)} (another flash-linear-attention version?)")
    root, seen = KERNEL_PACKAGES[package], set()
    for module_name in [n for n in sys.modules if n == root or n.startswith(root + ".")]:
        for obj in list(vars(sys.modules[module_name]).values()):
            tuner = autotuner_of(obj)
            if tuner is None or id(tuner) in seen or isinstance(tuner.early_config_prune, _Watched):
                continue
            seen.add(id(tuner))
            name = tuner.base_fn.__name__
            keep = NARROWED.get(tuner.base_fn.__module__, {}).get(name)
            tuner.early_config_prune = _Watched(name, tuner.early_config_prune, keep)


TUNING_WAIT_S = 1800
"""How long a rank that finished tuning waits for the others (a rank that died ends the job sooner: torchrun
stops its workers)."""


def wait_for_every_rank(what: str, poll_s: float = 1.0, report_s: float = 30.0) -> None:
    """Return once every rank of the default process group has called this with the same ``what``, waiting
    through the group's store: a rank still tuning its kernels keeps the others here, where no collective
    timeout runs, rather than in the first collective. (Each waiting rank asks the store once per ``poll_s``:
    512 ranks, 512 requests a second.)"""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"canon-titan/kernel-tuning/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{what}"
    world = dist.get_world_size()
    done = store.add(key, 1)
    started = last_report = time.perf_counter()
    while done < world:
        now = time.perf_counter()
        if now - started > TUNING_WAIT_S:
            raise RuntimeError(f"rank {dist.get_rank()} waited {TUNING_WAIT_S} s for {world - done} of {world} ranks "
                               f"to finish tuning their kernels ({what})")
        if now - last_report >= report_s:
            logger.info(f"kernel tuning: waiting for {world - done} of {world} ranks ({now - started:.0f} s)")
            last_report = now
        time.sleep(poll_s)
        done = store.add(key, 0)
    if time.perf_counter() - started >= 1.0:
        logger.info(f"kernel tuning: every rank done after {time.perf_counter() - started:.1f} s of waiting")


def device_for_kernels() -> torch.device:
    """Where this process's Triton kernels run: its current GPU, or the CPU under Triton's interpreter."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
