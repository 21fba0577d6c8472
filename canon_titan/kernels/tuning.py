"""The first step's kernel tuning: narrowed, reported, done by one rank, kept off the collectives'
clock.

fla 0.6.0 autotunes each of its Triton kernels on its first call for a new tuning key by compiling
and timing every configuration in the kernel's list: on Hopper at the 1B recipes' head sizes, 266
for GLA's forward and backward (10 kernels), 64 for the gated delta rule's (9). That takes minutes
on a GPU (the leases' figures: ``docs/benchmarks/tuning.md``), and on a cluster the first step runs
inside the first collectives' timeout (TorchTitan's 300 s).

- **Narrowing.** For the kernels in ``NARROWED`` the autotuner times only the configurations that
  can win at the recipes' shapes (28 of GLA's 266, 21 of the gated delta rule's 64), through
  Triton's documented hook, each autotuner's ``early_config_prune`` (fla's own pruning runs first).
  The rules are ``Keep``'s three classes below. Those of fla's forward kernels were chosen from an
  H200's timings of every configuration at the 1B shapes
  (``scripts/benchmarks/gpu_check_tuned.json``, which ``tests/test_linear_tuning.py`` checks them
  against); those in ``UNMEASURED`` (GLA's backward kernels, every gated-delta-rule kernel) follow
  the same classes by analogy, with no timing of their own yet. ``CANON_TITAN_FULL_AUTOTUNE=1`` in
  the environment restores fla's full search (to compare on a new GPU); on a GPU other than Hopper,
  where the rules were not measured, the full search runs anyway.
- **Progress.** Every autotuned kernel of fla and mamba-ssm logs a line as it starts tuning for a
  new key, with the seconds since this process's first tuning: the gaps are each kernel's cost.
- **One rank tunes.** A process that times the candidates itself picks from one noisy timing, and
  the step runs at the slowest rank's pick: ``tuned_on_rank_zero`` has rank 0 tune and publish its
  choice for every kernel and tuning key through the store; the other ranks put those choices in
  their autotuners' caches, so they compile one configuration per kernel and time none.
- **Off the clock.** ``wait_for_every_rank`` lets the ranks that finished wait for the others
  through the process group's store (``tools/collectives.store_barrier``: no collective, so no
  collective timeout); ``models/common/linear_tuning.py`` tunes a linear model's mixer before the
  first collective and waits there.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import triton.runtime.autotuner as autotuner
from torch.distributed import DistStoreError
from torchtitan.tools.logging import logger

from canon_titan.tools.collectives import rank_zero_decides, store_barrier

FULL_AUTOTUNE_ENV = "CANON_TITAN_FULL_AUTOTUNE"


@dataclass(frozen=True)
class Keep:
    """Which of a kernel's candidate configurations its autotuner times. A rule that would keep none
    of a list's values keeps the list whole (e.g. a kernel offering no 3-stage configuration)."""

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
"""Kernels that carry the state across chunks (one program per state tile and sequence, looping
over time): every tile on offer, since the tiles set how many programs share the GPU and that
depends on batch x heads, which fla's tuning key does not hold (GLA5-1B at 16,384 x 1: 128 programs
of 64x64, 512 of 32x32, for 132 SMs); 4 warps, 3 stages, the H200's choice for
``chunk_fwd_kernel_h`` at 1B (``docs/benchmarks/tuning.md``)."""
CHUNK_TILED = Keep(num_warps=(4, 8), num_stages=(3,), largest=("BK", "BV"))
"""Kernels with one program per chunk and value tile (thousands at the recipes' shapes): the
largest tiles fla keeps for the shape, 4 or 8 warps, 3 stages, which held the H200's winner of
``chunk_gla_fwd_kernel_o`` at 1B (every smaller tile was slower)."""
CHUNK = Keep(num_warps=(2, 4), num_stages=(3,))
"""Per-chunk kernels tuned over warps and stages only (and GLA's ``BK`` of its inter-sub-chunk
scores, whose tuning key lacks the head size): 2 or 4 warps, 3 stages, which held the H200's
winners of ``chunk_gla_fwd_A_kernel_intra_sub_intra`` and ``chunk_local_cumsum_vector_kernel``
at 1B."""

NARROWED: dict[str, dict[str, Keep]] = {
    "fla.ops.utils.cumsum": {
        "chunk_local_cumsum_vector_kernel": CHUNK,
        "chunk_local_cumsum_scalar_kernel": CHUNK,
    },
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
    "fla.ops.common.chunk_delta_h": {
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": STATE,
        "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64": STATE,
    },
    "fla.ops.common.chunk_o": {"chunk_bwd_kernel_dv_local": CHUNK, "chunk_bwd_kernel_dqkwg": CHUNK},
    "fla.ops.gated_delta_rule.wy_fast": {
        "recompute_w_u_fwd_kernel": CHUNK,
        "prepare_wy_repr_bwd_kernel": CHUNK,
    },
    "fla.ops.gated_delta_rule.chunk_fwd": {"chunk_gated_delta_rule_fwd_kkt_solve_kernel": CHUNK},
}
"""Defining module -> kernel -> the configurations its autotuner times. fla's other autotuned
kernels on these paths offer 3 configurations or fewer."""
UNMEASURED = frozenset(
    {
        "chunk_local_cumsum_scalar_kernel",
        "chunk_bwd_kernel_dh",
        "chunk_gla_bwd_kernel_dA",
        "chunk_gla_bwd_kernel_intra",
        "chunk_gla_bwd_kernel_dv",
        "chunk_gla_bwd_kernel_inter",
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
        "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",
        "chunk_bwd_kernel_dv_local",
        "chunk_bwd_kernel_dqkwg",
        "recompute_w_u_fwd_kernel",
        "prepare_wy_repr_bwd_kernel",
        "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
    }
)
"""The kernels of ``NARROWED`` whose rule no lease has timed (no entry of theirs in
``scripts/benchmarks/gpu_check_tuned.json``): a rule by analogy with the forward kernel of its
class. A lease checks one with ``CANON_TITAN_FULL_AUTOTUNE=1`` (``docs/benchmarks/tuning.md``)."""

KERNEL_PACKAGES = {"fla": "fla.ops", "mamba_ssm": "mamba_ssm.ops.triton"}
WATCHED: list[autotuner.Autotuner] = []
"""The autotuners ``watch`` narrows and reports: those whose choices rank 0 makes for every rank."""


def autotuner_of(obj) -> autotuner.Autotuner | None:
    """The autotuner of a kernel object (under its ``triton.heuristics``), or None."""
    while isinstance(obj, autotuner.Heuristics):
        obj = obj.fn
    return obj if isinstance(obj, autotuner.Autotuner) else None


def rules_measured_here() -> bool:
    """Whether ``NARROWED``'s rules were measured on this kind of GPU: Hopper (sm_90), where they
    were chosen. Elsewhere (an A100's or a consumer GPU's shared memory may not hold the largest
    tiles) the autotuner times fla's whole list. Without a GPU (Triton's interpreter, which times
    nothing) the rules apply, as in tests."""
    return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] == 9


class _Watched:
    """An autotuner's ``early_config_prune``: Triton calls it when a new tuning key starts its
    search."""

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
    """Narrow (``NARROWED``) and report every autotuned kernel of ``package`` (``fla`` or
    ``mamba_ssm``, imported): once per process, before its first kernel runs."""
    import importlib

    if package == "fla":
        for module_name, kernels in NARROWED.items():
            module = importlib.import_module(module_name)
            missing = [k for k in kernels if autotuner_of(getattr(module, k, None)) is None]
            if missing:
                raise RuntimeError(
                    f"canon_titan.kernels.tuning: {module_name} has no autotuned kernel "
                    f"{', '.join(missing)} (another flash-linear-attention version?)"
                )
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
            WATCHED.append(tuner)


TUNING_WAIT = timedelta(seconds=1800)
"""How long a rank waits for rank 0's tuning, and for the other ranks to be done (a rank that died
ends the job sooner: torchrun stops its workers)."""


def wait_for_every_rank(what: str) -> None:
    """Return once every rank of the default process group has called this (for ``what``, in the
    same order), waiting through the group's store: a rank still tuning or compiling its kernels
    keeps the others here, where no collective timeout runs, rather than in the first collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    started = time.perf_counter()
    try:
        store_barrier("kernel-tuning-done", TUNING_WAIT)
    except DistStoreError:
        raise RuntimeError(
            f"rank {dist.get_rank()} waited {TUNING_WAIT.seconds} s for the other "
            f"ranks to finish tuning their kernels ({what})"
        ) from None
    waited = time.perf_counter() - started
    if waited >= 1.0:
        logger.info(f"kernel tuning: every rank done after {waited:.1f} s of waiting")


def _name(tuner: autotuner.Autotuner) -> str:
    return f"{tuner.base_fn.__module__}.{tuner.base_fn.__name__}"


def choices(tuners: list[autotuner.Autotuner]) -> dict[str, dict[tuple, str]]:
    """The configuration each autotuner chose for each tuning key it has seen, by kernel and key
    (as Triton writes the configuration: the same text names the same one of its list anywhere)."""
    return {
        _name(t): {key: str(config) for key, config in t.cache.items()} for t in tuners if t.cache
    }


def pin(tuners: list[autotuner.Autotuner], chosen: dict[str, dict[tuple, str]]) -> int:
    """Put ``chosen`` (another process's ``choices``) into these autotuners' caches, each as the
    configuration of the autotuner's own list with the same text (its own hooks with it): a kernel
    called with a pinned key compiles that configuration and times none. How many were pinned."""
    pinned = 0
    for tuner in tuners:
        own = {str(config): config for config in tuner.configs}
        for key, text in chosen.get(_name(tuner), {}).items():
            if text in own:
                tuner.cache[key] = own[text]
                pinned += 1
            else:
                logger.warning(
                    f"kernel tuning: rank 0 chose a configuration that {_name(tuner)} "
                    f"does not offer here ({text}); this rank tunes it itself"
                )
    return pinned


def tuned_on_rank_zero(
    run: Callable[[], None], what: str, tuners: list[autotuner.Autotuner] | None = None
) -> None:
    """``run()`` (a call of the kernels at the first step's shapes) tunes them on rank 0; every
    other rank pins rank 0's choices (``pin``), then runs it, compiling without timing; then every
    rank waits for the others (``wait_for_every_rank``). So every rank runs the same configuration
    of each kernel and tuning key."""
    tuners = WATCHED if tuners is None else tuners

    def tune() -> dict[str, dict[tuple, str]]:
        run()
        return choices(tuners)

    chosen = rank_zero_decides(tune, "kernel-tuning", timeout=TUNING_WAIT)
    if dist.is_initialized() and dist.get_rank() != 0:
        progress(f"{what}: {pin(tuners, chosen)} choices of rank 0 pinned")
        run()
    wait_for_every_rank(what)


def device_for_kernels() -> torch.device:
    """Where this process's Triton kernels run: its current GPU, or the CPU under Triton's
    interpreter."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
