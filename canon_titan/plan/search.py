"""``canon-titan plan --search``: the fastest layout of a run that fits a given cluster, keeping
its global batch (and with it the recipe's training semantics).

What it tries: every factorization of the GPUs into data-parallel, tensor-, pipeline- and
context-parallel degrees that the model family and canon-titan accept, the data parallelism as
FSDP over all of it and (without PP) as HSDP with one node's shard; for each, the
activation-checkpoint modes and the largest local batch that fits (the rest of the global batch
by accumulation); for the best of those, keeping the gathered weights after the forward
(``fsdp_reshard_after_forward never``), the other pipeline schedule, and float8 (listed apart: it
changes the numerics).

How, in three passes:
1. **Bounds.** A layout whose divisibility the config checks refuse, or whose parameters,
   gradients and optimizer state alone exceed the GPU (fp32 master weights and Adam: 16 bytes a
   parameter over the FSDP x TP x PP shards), is dropped before any planning.
2. **Probes.** The others are planned with a few layers (one and two per pipeline stage), which
   takes a few seconds each on a 2-core machine, and extrapolated linearly in the layers: every
   block of these models costs the same memory and time, and the rest (embedding, output, loss,
   optimizer) is what the one-layer probe holds beyond a layer (memory: the reserved peak, and no
   less than the live peak plus the probes' allocator slack, ``extrapolate``). Memory and the time
   per accumulation group are then interpolated in the local batch between the smallest and largest
   local batch probed, to find the largest local batch that fits (with ``MARGIN`` to spare) and its
   step time.
   Pipeline layouts are probed only when no layout without PP fits, or under a budget of
   ``PP_PROBE_BUDGET_S`` (a plan records every microbatch of every stage: slow).
3. **Plans.** The best probed layouts are planned in full (``plan``), and their variants; only
   full plans are reported, so the overrides of any row, handed back to ``canon-titan plan``, give
   its figures. They go in order of value: three layouts to print, the best one's variants and its
   float8, then the rest of ``top`` and the other candidates, the next two's variants, float8 of
   the second, and last the variants of the best FSDP and the best HSDP layout planned. A round of
   plans (one per worker) starts only if it is expected to end within the budget: its slowest
   layout's probes' own wall time extrapolated in the layers, scaled by how the config's own plan
   and the rounds so far compared with theirs. The search ends within the budget, with what it had
   time for.

Probes and plans run in worker processes (one per core, at most ``MAX_WORKERS``); progress goes
to stderr, and every ``HEARTBEAT_S`` while a plan or a round runs.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field, replace

from canon_titan.plan.calibration import ModelKind, kind_of

MARGIN = 0.03
"""The share of the GPU's memory a layout must leave free to be offered (and a probe's extrapolated
peak to be planned in full)."""
MAX_WORKERS = 4
DEGREES = (1, 2, 4, 8)
PP_SCHEDULES = ("1F1B", "Interleaved1F1B")
LOOPED = {"Interleaved1F1B"}
AC_MODES = ("none", "selective", "full")
STATE_BYTES_PER_PARAMETER = {"float32": 16, "bfloat16": 8}
"""Parameters, gradients and AdamW's two moments in the training dtype."""
HEARTBEAT_S = 30.0
"""How often a search says what it is still waiting for (the config's own plan of an 8B model at its
gradient accumulation takes minutes on a loaded 2-core machine)."""
BUDGET_KEYS = ("not probed (budget)", "not planned in full (budget)")
"""The ``tried`` counts of what the budget left out."""


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    local_batch: int
    ac: str
    reshard: str = "default"
    schedule: str = "1F1B"
    float8: str = ""

    def overrides(self, global_batch: int) -> list[str]:
        """The ``--section.key value`` arguments that make a run of this layout."""
        out = [
            "--parallelism.data_parallel_replicate_degree",
            str(self.dp_replicate),
            "--parallelism.data_parallel_shard_degree",
            str(self.dp_shard),
            "--parallelism.tensor_parallel_degree",
            str(self.tp),
            "--parallelism.pipeline_parallel_degree",
            str(self.pp),
            "--parallelism.context_parallel_degree",
            str(self.cp),
            "--training.local_batch_size",
            str(self.local_batch),
            "--training.global_batch_size",
            str(global_batch),
            "--activation_checkpoint.mode",
            self.ac,
            "--parallelism.fsdp_reshard_after_forward",
            self.reshard,
        ]
        if self.pp > 1:
            out += [
                "--parallelism.pipeline_parallel_schedule",
                self.schedule,
                "--parallelism.pipeline_parallel_microbatch_size",
                "1",
            ]
        out += ["--float8.enable", "true" if self.float8 else "false"]
        if self.float8:
            out += ["--float8.recipe_name", self.float8]
        if self.float8 and self.float8 != "tensorwise":
            # FSDP's float8 all-gather is tensor-wise: a row-wise layout of a config that gathers in
            # float8 gathers in the param dtype (a tensor-wise layout keeps the config's choice).
            out += [
                "--float8.enable_fsdp_float8_all_gather",
                "false",
                "--float8.precompute_float8_dynamic_scale_for_fsdp",
                "false",
            ]
        return out

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @classmethod
    def from_text(cls, text: str) -> "Layout":
        """``describe`` read back (the README's words for a layout); ValueError names a part it
        does not know."""
        fields: dict = {"dp_replicate": 1, "tp": 1, "pp": 1, "cp": 1}
        for part in text.split(", "):
            words = part.split()
            if words[0] == "FSDP":
                fields["dp_shard"] = int(words[1])
            elif words[0] == "HSDP":
                fields["dp_replicate"], fields["dp_shard"] = map(int, words[1].split("x"))
            elif words[0] in ("TP", "PP", "CP"):
                fields[words[0].lower()] = int(words[1])
                if words[0] == "PP":
                    fields["schedule"] = words[2]
            elif words[0] == "local":
                fields["local_batch"] = int(words[1])
            elif words[0] == "AC":
                fields["ac"] = words[1]
            elif part == "keep gathered weights":
                fields["reshard"] = "never"
            elif words[0] == "float8":
                fields["float8"] = words[1]
            else:
                raise ValueError(f"{text!r}: {part!r} is not a part of a layout")
        return cls(**fields)

    def describe(self, global_batch: int) -> str:
        parts = [
            f"HSDP {self.dp_replicate}x{self.dp_shard}"
            if self.dp_replicate > 1
            else f"FSDP {self.dp_shard}"
        ]
        parts += [f"TP {self.tp}"] if self.tp > 1 else []
        parts += [f"PP {self.pp} {self.schedule}"] if self.pp > 1 else []
        parts += [f"CP {self.cp}"] if self.cp > 1 else []
        accumulation = global_batch // (self.local_batch * self.dp)
        parts.append(
            f"local {self.local_batch}" + (f" x {accumulation} accum" if accumulation > 1 else "")
        )
        parts.append(f"AC {self.ac}")
        if self.reshard == "never":
            parts.append("keep gathered weights")
        if self.float8:
            parts.append(f"float8 {self.float8}")
        return ", ".join(parts)


@dataclass
class Outcome:
    """A full plan's figures for a layout."""

    layout: Layout
    fits: bool
    device_bytes: int
    tokens_per_s_per_gpu: float
    mfu: float
    step_s: float
    gpu_hours: float
    error: str = ""


@dataclass
class SearchResult:
    config: str
    gpus: int
    gpu_name: str
    global_batch: int
    seq_len: int
    steps: int
    recipe: Outcome | None
    """The config's own layout on these GPUs (None: it is not a valid run there)."""
    ranked: list[Outcome]
    """Full plans that fit, bf16, fastest first."""
    float8: list[Outcome]
    """Full plans that fit with float8, fastest first."""
    tried: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    model_kind: ModelKind | None = None
    """The run's kind of model without float8 (a row's is this with its float8): its plan error."""
    budget_s: float = 0.0
    own_plan_s: float = 0.0
    """The wall time of the config's own plan, the first thing the search does."""

    @property
    def budget_ran_out(self) -> bool:
        """Whether the budget left layouts unprobed or unplanned."""
        return any(self.tried.get(key) for key in BUDGET_KEYS)

    @property
    def best(self) -> Outcome | None:
        """What ``--write`` writes: the fastest layout planned that fits, or else the config's own
        if it fits (None: no layout planned fits)."""
        if self.ranked:
            return self.ranked[0]
        return self.recipe if self.recipe is not None and self.recipe.fits else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structures(gpus: int, gpus_per_node: int, layers: int, global_batch: int, cp_allowed: bool):
    """(tp, pp, cp) whose product divides ``gpus``, the rest data-parallel (FSDP over all of it)
    with a data-parallel size that divides the global batch: TP within a node, CP without PP
    (canon-titan's limit), PP dividing the layers. HSDP and the looped pipeline schedule are
    variants of the best of these (``hsdp_shard``, ``PP_SCHEDULES``)."""
    for tp in DEGREES:
        for pp in DEGREES:
            for cp in DEGREES if cp_allowed else (1,):
                if tp > gpus_per_node or (cp > 1 and pp > 1) or gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                if global_batch % dp or (pp > 1 and layers % pp):
                    continue
                yield tp, pp, cp


def hsdp_shard(layout: Layout, gpus_per_node: int) -> int:
    """The shard degree of HSDP with one node's worth of data-parallel ranks per shard group (0:
    none: under PP the node holds pipeline ranks too, or the shard would be all of the data
    parallelism)."""
    per_node = (
        gpus_per_node // (layout.tp * layout.cp)
        if gpus_per_node % (layout.tp * layout.cp) == 0
        else 0
    )
    return (
        per_node if layout.pp == 1 and 1 < per_node < layout.dp and layout.dp % per_node == 0 else 0
    )


PP_MAX_MICROBATCHES_PER_STAGE = 2
"""Under PP the local batch is cut into microbatches of one sequence; the search takes at most this
many per stage (a plan records every microbatch, so its cost grows with them; past a few per stage
the bubble is small already)."""
PP_PROBE_BUDGET_S = 1800
"""With a layout without PP that fits, pipeline layouts are probed only under a budget this
large."""


def local_batches(per_rank: int, pp: int) -> list[int]:
    """The local batches (sequences per step per data-parallel rank) that divide its share of the
    global batch, largest first; under PP at least one microbatch per stage and at most
    ``PP_MAX_MICROBATCHES_PER_STAGE``."""
    return [
        b
        for b in reversed(_divisors(per_rank))
        if pp == 1 or pp <= b <= PP_MAX_MICROBATCHES_PER_STAGE * pp
    ]


# ------------------------------------------------------------------------------------ workers


def _plan_figures(config, overrides, gpus, gpu, gpus_per_node, attention):
    """Run in a worker: one plan's figures (or its error)."""
    from canon_titan.config import ConfigError
    from canon_titan.plan.planner import PlanError, plan

    began = time.perf_counter()
    try:
        result = plan(
            config,
            overrides,
            gpus=gpus,
            gpu=gpu,
            gpus_per_node=gpus_per_node,
            advise=False,
            attention=attention,
        )
    except (ConfigError, PlanError) as e:
        return {"error": str(e).splitlines()[0][:300], "seconds": time.perf_counter() - began}
    return {
        "fits": result.fits,
        "device_bytes": result.worst.device_bytes,
        "live_bytes": result.worst.memory.total,
        "step_s": result.step_s,
        "tokens_per_s_per_gpu": result.tokens_per_s_per_gpu,
        "mfu": result.mfu,
        "gpu_hours": result.gpu_hours,
        "accumulation": result.accumulation,
        "seconds": time.perf_counter() - began,
    }


def extrapolate(pair: list[dict], layers: int) -> tuple[float, float, int] | None:
    """A probe pair's figures (one and two layers a stage) at ``layers`` a stage: memory, seconds
    per accumulation group and the accumulation; None where a probe failed. Every block costs the
    same, so time and the live peak grow linearly in the layers. The allocator's slack over the live
    peak need not: the replay's fragmentation can fall from one layer to two, and at the GPU's
    memory the replay releases its cache (LlamaCanon-8B on 64 H100s, HSDP 8x2 x CP 4, local 96
    reserves 84.9 GB at one layer and 84.7 at two, which extrapolates to a fit, where its live peak,
    54.7 and 73.7 GB, extrapolates to the 643 GB that planning it in full gives). So memory is the
    reserved peak extrapolated, and no less than the live peak extrapolated plus the probes' larger
    slack."""
    if any("error" in f for f in pair):
        return None
    one, two = pair

    def linear(key: str) -> float:
        return one[key] + (layers - 1) * (two[key] - one[key])

    slack = max(f["device_bytes"] - f["live_bytes"] for f in pair)
    memory = max(linear("device_bytes"), linear("live_bytes") + slack)
    return memory, linear("step_s") / one["accumulation"], one["accumulation"]


@contextlib.contextmanager
def saying_every(say, what: str):
    """While the block runs, ``say`` every ``HEARTBEAT_S`` seconds that ``what`` still runs."""
    done, began, every = threading.Event(), time.perf_counter(), HEARTBEAT_S

    def beat() -> None:
        while not done.wait(every):
            say(f"{what}: {time.perf_counter() - began:.0f} s so far")

    thread = threading.Thread(target=beat, name="search-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class _Pool:
    """Plans in worker processes (spawned: the parent's torch state is not theirs, and each sets up
    as a canon-titan program does, dropping the same library notes), or in this process when one
    worker is asked for; ``say`` hears of a round still running every ``HEARTBEAT_S``."""

    def __init__(self, workers: int, say=lambda message: None):
        from canon_titan.tools.startup import process_setup

        self.say = say
        spawn = multiprocessing.get_context("spawn")
        self._pool = (
            futures.ProcessPoolExecutor(workers, mp_context=spawn, initializer=process_setup)
            if workers > 1
            else None
        )

    def map(self, calls: list[tuple], what: str = "planning") -> list[dict]:
        with saying_every(self.say, f"{what} ({len(calls)} plans)"):
            if self._pool is None:
                return [_plan_figures(*call) for call in calls]
            return list(self._pool.map(_plan_figures, *zip(*calls))) if calls else []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def terminate(self) -> None:
        """Stop the workers now (an interrupted or failed search leaves no planner running)."""
        if self._pool is not None:
            for process in list((self._pool._processes or {}).values()):
                process.terminate()
            self._pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------- search


@dataclass
class SearchSpace:
    """What every stage of a search knows of the run: the config with its overrides on the cluster,
    and what the config checks and the model say of it."""

    config: str
    base_overrides: list[str]
    gpus: int
    gpu: object
    gpus_per_node: int
    attention: str | None
    run: object
    """The resolved run of the config with ``base_overrides`` on these GPUs."""
    global_batch: int
    parameters: int

    @classmethod
    def resolve(
        cls,
        config: str,
        base_overrides: list[str],
        *,
        gpus: int,
        gpu,
        gpus_per_node: int,
        attention: str | None,
    ) -> SearchSpace:
        """ConfigError (the caller's to report) where the config is not a run on these GPUs."""
        from unittest.mock import patch

        import torch

        from canon_titan.config import load

        with patch.dict(os.environ, WORLD_SIZE=str(gpus)):
            run = load(config, base_overrides, environment=False)
        training = run["training"]
        dp_recipe = run.data_parallel_size(gpus) if training["global_batch_size"] == -1 else 1
        global_batch = (
            training["global_batch_size"]
            if training["global_batch_size"] != -1
            else training["local_batch_size"] * dp_recipe
        )
        with torch.device("meta"):
            parameters = sum(p.numel() for p in run.model_spec().model.build().parameters())
        return cls(
            config,
            list(base_overrides),
            gpus,
            gpu,
            gpus_per_node,
            attention,
            run,
            global_batch,
            parameters,
        )

    @property
    def layers(self) -> int:
        return self.run.model_args.n_layers

    @property
    def state_per_param(self) -> int:
        return STATE_BYTES_PER_PARAMETER.get(str(self.run["training"].get("dtype", "float32")), 16)

    @property
    def cp_allowed(self) -> bool:
        return not getattr(self.run.model_args, "context_parallel_problem", lambda cp: None)(2)

    @property
    def capacity(self) -> float:
        """The memory a layout may use: the GPU's, less ``MARGIN``."""
        return self.gpu.memory_bytes * (1 - MARGIN)

    def valid(self, layout: Layout) -> bool:
        """Whether the config checks accept ``layout`` on these GPUs."""
        from unittest.mock import patch

        from canon_titan.config import ConfigError, load

        with patch.dict(os.environ, WORLD_SIZE=str(self.gpus)):
            try:
                load(
                    self.config,
                    [*self.base_overrides, *layout.overrides(self.global_batch)],
                    environment=False,
                )
            except ConfigError:
                return False
        return True

    def call(self, layout: Layout, extra=()) -> tuple:
        """``_plan_figures``'s arguments for ``layout`` (``extra``: more overrides)."""
        return (
            self.config,
            [*self.base_overrides, *layout.overrides(self.global_batch), *extra],
            self.gpus,
            self.gpu,
            self.gpus_per_node,
            self.attention,
        )

    def outcome(self, layout: Layout, figures: dict) -> Outcome:
        if "error" in figures:
            return Outcome(layout, False, 0, 0.0, 0.0, 0.0, 0.0, figures["error"])
        # what the search offers leaves MARGIN of the GPU free: the plan's memory is within 8% of
        # the published runs' (README), not exact
        return Outcome(
            layout,
            figures["fits"] and figures["device_bytes"] <= self.capacity,
            figures["device_bytes"],
            figures["tokens_per_s_per_gpu"],
            figures["mfu"],
            figures["step_s"],
            figures["gpu_hours"],
        )

    def own_layout(self) -> Layout:
        """The config's own layout on these GPUs."""
        par, training, run = self.run["parallelism"], self.run["training"], self.run
        return Layout(
            par["data_parallel_replicate_degree"],
            run.data_parallel_size(self.gpus) // par["data_parallel_replicate_degree"],
            par["tensor_parallel_degree"],
            par["pipeline_parallel_degree"],
            par["context_parallel_degree"],
            training["local_batch_size"],
            run["activation_checkpoint"]["mode"],
            str(par["fsdp_reshard_after_forward"]),
            par["pipeline_parallel_schedule"],
            run["float8"]["recipe_name"] if run["float8"]["enable"] else "",
        )


Shape = tuple[Layout, list[int], list[str]]
"""A parallel layout to probe (at its largest local batch and fastest checkpointing mode), its local
batches (largest first) and the checkpointing modes the config checks accept for it."""


def bounded_shapes(space: SearchSpace, tried: dict[str, int]) -> list[Shape]:
    """Stage 1, bounds: every structure of the cluster (``structures``) as FSDP over all the data
    parallelism and, where it has one, as HSDP with one node's shard, less those whose state alone
    exceeds the GPU or whose every checkpointing mode the config checks refuse; ``tried`` counts
    each."""
    shapes: list[Shape] = []
    for tp, pp, cp in structures(
        space.gpus, space.gpus_per_node, space.layers, space.global_batch, space.cp_allowed
    ):
        tried["structures"] += 1
        dp = space.gpus // (tp * pp * cp)
        batches = local_batches(space.global_batch // dp, pp)
        if not batches:
            tried["refused by the config checks"] += 1
            continue
        if space.parameters * space.state_per_param / (dp * tp * pp) > space.gpu.memory_bytes:
            tried["over memory by their state alone"] += 1
            continue
        # FSDP over all the data parallelism, and HSDP with one node's shard: at scale the two
        # differ most in what crosses the network, so each is probed (a variant of the best
        # alone would miss a structure whose FSDP form ranks low only for its network traffic)
        fsdp = Layout(1, dp, tp, pp, cp, batches[0], "none")
        forms = [fsdp]
        shard = hsdp_shard(fsdp, space.gpus_per_node)
        if (
            shard
            and space.parameters * space.state_per_param / (shard * tp * pp)
            <= space.gpu.memory_bytes
        ):
            forms.append(replace(fsdp, dp_replicate=dp // shard, dp_shard=shard))
        for form in forms:
            modes = []
            for ac in AC_MODES:
                if space.valid(replace(form, ac=ac)):
                    modes.append(ac)
                else:
                    tried["refused by the config checks"] += 1
            if modes:
                shapes.append((replace(form, ac=modes[0]), batches, modes))
                tried["HSDP forms"] += form.dp_replicate > 1
    return shapes


Probe = tuple[float, float, int] | None
"""A layout's probed memory, seconds per accumulation group and accumulation (``extrapolate``);
None where a probe failed."""


def probes_needed(shape: Shape, probed: dict[Layout, Probe], capacity: float) -> list[Layout]:
    """What ``shape`` needs probed next: the fastest checkpointing mode at the largest local batch
    first; where that does not fit, the same mode at the smallest batch (to interpolate) and the
    next mode at the largest, and so on; nothing once a mode fits at the largest batch (slower
    modes cannot be faster)."""
    layout, batches, modes = shape
    out = []
    for ac in modes:
        big = replace(layout, ac=ac, local_batch=batches[0])
        if big not in probed:
            return out + [big]
        if probed[big] and probed[big][0] <= capacity:
            return out
        small = replace(big, local_batch=batches[-1])
        if small != big and small not in probed:
            out.append(small)
    return out


def probe_estimates(
    shapes: list[Shape], probed: dict[Layout, Probe], capacity: float, global_batch: int
) -> list[tuple[float, Layout]]:
    """(seconds per step, layout) of each checkpointing mode of each shape that fits by its probes,
    fastest first: at the largest local batch where that fits, else at the largest batch that fits
    with memory and the time per accumulation group linear in the local batch between the smallest
    and the largest probed."""
    estimates: list[tuple[float, Layout]] = []
    for shape, batches, modes in shapes:
        for ac in modes:
            big = probed.get(replace(shape, ac=ac, local_batch=batches[0]))
            small = probed.get(replace(shape, ac=ac, local_batch=batches[-1]))
            if big and big[0] <= capacity:
                estimates.append((big[1] * big[2], replace(shape, ac=ac, local_batch=batches[0])))
                continue
            if not big or not small or small[0] > capacity or len(batches) == 1:
                continue
            b0, b1 = batches[-1], batches[0]
            for b in batches:
                share = (b - b0) / (b1 - b0)
                if small[0] + share * (big[0] - small[0]) <= capacity:
                    group_s = small[1] + share * (big[1] - small[1])
                    estimates.append(
                        (
                            group_s * (global_batch // (b * shape.dp)),
                            replace(shape, ac=ac, local_batch=b),
                        )
                    )
                    break
    estimates.sort(key=lambda e: e[0])
    return estimates


class Prober:
    """Stage 2, probes: layouts planned with one and two layers a stage, in rounds of the workers'
    chunks, each extrapolated to the model's layers (``extrapolate``), until each shape has what it
    needs (``probes_needed``) or the probes' share of the budget is spent (checked between chunks);
    while no layout probed fits, nothing would be planned in full, and the probes go on into the
    rest of the budget."""

    def __init__(self, space: SearchSpace, pool: _Pool, workers: int, started: float, say):
        self.space, self.pool, self.workers, self.started, self.say = (
            space,
            pool,
            workers,
            started,
            say,
        )
        self.probed: dict[Layout, Probe] = {}
        self.plan_seconds: dict[Layout, float] = {}
        """A full plan's wall time, from the probes' own in the layers."""
        self.chunk_s = 0.0
        """The longest a chunk of probes took."""

    def _calls(self, layout: Layout) -> list[tuple]:
        return [self.space.call(layout, ["--model.n_layers", str(k * layout.pp)]) for k in (1, 2)]

    def probe(self, group: list[Shape], deadline: float) -> int:
        """Probe ``group`` until ``deadline`` (seconds from the search's start); how many layouts it
        left unprobed."""
        layers, capacity = self.space.layers, self.space.capacity
        while True:
            todo = [lay for shape in group for lay in probes_needed(shape, self.probed, capacity)]
            if not todo:
                return 0
            if time.perf_counter() - self.started > deadline:
                self.say("probe budget spent: ranking what was probed")
                return len(todo)
            self.say(
                f"probing {len(todo)} layouts ({2 * len(todo)} few-layer plans on "
                f"{self.workers} worker(s))"
            )
            for i in range(0, len(todo), 2 * self.workers):
                if i and time.perf_counter() - self.started > deadline:
                    # checked between chunks too: a round of probes of an 8B model on a loaded
                    # machine takes minutes, and what is left of the budget is for full plans
                    self.say(
                        f"probe budget spent after {len(self.probed)} layouts: ranking "
                        "what was probed"
                    )
                    return len(todo) - i
                chunk, began = todo[i : i + 2 * self.workers], time.perf_counter()
                figures = self.pool.map(
                    [c for lay in chunk for c in self._calls(lay)], f"probing {len(chunk)} layouts"
                )
                self.chunk_s = max(self.chunk_s, time.perf_counter() - began)
                for n, lay in enumerate(chunk):
                    self.probed[lay] = extrapolate(figures[2 * n : 2 * n + 2], layers // lay.pp)
                    one, two = (f.get("seconds", 0.0) for f in figures[2 * n : 2 * n + 2])
                    self.plan_seconds[lay] = one + (layers // lay.pp - 1) * max(two - one, 0.0)
                self.say(
                    f"probed {len(self.probed)} layouts, {time.perf_counter() - self.started:.0f} s"
                )

    def fits(self) -> bool:
        """Whether any layout probed so far fits."""
        return any(p and p[0] <= self.space.capacity for p in self.probed.values())


class FullPlans:
    """Stage 3, full plans: layouts planned in full in rounds of one per worker, a round started
    only when it is expected to end within the budget (``round_s``); ``planned`` holds their
    outcomes,
    ``budget_cut`` what the budget left out."""

    def __init__(
        self,
        space: SearchSpace,
        pool: _Pool,
        workers: int,
        started: float,
        budget_s: float,
        plan_seconds: dict[Layout, float],
        float8: bool,
        tried: dict[str, int],
        say,
    ):
        self.space, self.pool, self.workers, self.started, self.budget_s = (
            space,
            pool,
            workers,
            started,
            budget_s,
        )
        self.plan_seconds, self.float8, self.tried, self.say = plan_seconds, float8, tried, say
        self.planned: dict[Layout, Outcome] = {}
        self.budget_cut: list[Layout] = []
        self.slowdown, self.slowest_round = 1.0, 0.0

    def expect_from_own_plan(self, own: Layout | None, own_s: float) -> None:
        """The config's own plan (``own_s`` of wall time), against what the probes of its structure
        say, sets the first rounds' expectation."""
        self.slowdown, self.slowest_round = 1.0, own_s
        expected = self.round_s([own]) if own is not None else 0.0
        if expected > 0:
            self.slowdown = max(1.0, own_s / expected)

    def round_s(self, chunk: list[Layout]) -> float:
        """A round's expected wall time: its slowest layout's, by the probes of its parallel
        structure (their slowest), times the worst that a round so far took against its
        expectation (a float8 plan records more; workers share cores); without probes, the
        slowest round so far."""
        guesses = []
        for lay in chunk:
            same = [
                t
                for p, t in self.plan_seconds.items()
                if (p.tp, p.pp, p.cp) == (lay.tp, lay.pp, lay.cp)
            ]
            guesses.append(max(same or self.plan_seconds.values() or [0.0]))
        return max(guesses) * self.slowdown if max(guesses) > 0 else self.slowest_round

    def plan_all(self, layouts: list[Layout]) -> None:
        todo = [
            lay
            for lay in dict.fromkeys(layouts)
            if lay not in self.planned and lay not in self.budget_cut
        ]
        if not todo:
            return
        chunks = [todo[i : i + self.workers] for i in range(0, len(todo), self.workers)]
        if not self.budget_cut:
            self.say(
                f"planning {len(todo)} layouts in full "
                f"({time.perf_counter() - self.started:.0f} s so far)"
            )
        for n, chunk in enumerate(chunks):
            expected = self.round_s(chunk)
            if self.budget_cut or time.perf_counter() - self.started + expected > self.budget_s:
                if not self.budget_cut:
                    self.say(
                        f"budget: the rest not planned in full (the next {len(chunk)} "
                        "would take about "
                        f"{expected:.0f} s; "
                        f"{self.budget_s - (time.perf_counter() - self.started):.0f} s of "
                        "--budget-s left)"
                    )
                self.budget_cut.extend(lay for rest in chunks[n:] for lay in rest)
                return
            began = time.perf_counter()
            calls = [self.space.call(lay) for lay in chunk]
            figured = self.pool.map(calls, f"planning {len(chunk)} layouts in full")
            for layout, figures in zip(chunk, figured):
                self.planned[layout] = self.space.outcome(layout, figures)
            took = time.perf_counter() - began
            self.slowest_round = max(self.slowest_round, took)
            if expected > 0 and self.plan_seconds:
                self.slowdown = max(self.slowdown, took * self.slowdown / expected)
            self.tried["planned in full"] = len(self.planned)
            left = sum(self.round_s(rest) for rest in chunks[n + 1 :])
            self.say(
                f"planned {len(self.planned)} layouts in full, "
                f"{time.perf_counter() - self.started:.0f} s"
                + (f"; these {len(todo)} done in about {left:.0f} s" if left else "")
            )

    def retry(self, chosen: list[Layout]) -> None:
        """A best-guess batch that did not fit, one step smaller."""
        smaller = []
        for layout in chosen:
            outcome = self.planned.get(layout)
            if outcome is not None and not outcome.fits and not outcome.error:
                batches = [
                    b
                    for b in local_batches(self.space.global_batch // layout.dp, layout.pp)
                    if b < layout.local_batch
                ]
                smaller += [replace(layout, local_batch=batches[0])] if batches else []
        self.plan_all(smaller)

    def ranked(self, with_float8: bool) -> list[Outcome]:
        return sorted(
            (o for o in self.planned.values() if o.fits and bool(o.layout.float8) == with_float8),
            key=lambda o: -o.tokens_per_s_per_gpu,
        )

    def variants(self, layouts: list[Layout]) -> list[Layout]:
        """Keeping the gathered weights, HSDP with one node's shard, the other pipeline schedule:
        those the config checks accept."""
        out = []
        for lay in layouts:
            if lay.dp_shard > 1:
                out.append(replace(lay, reshard="never"))
            shard = hsdp_shard(lay, self.space.gpus_per_node)
            if shard:
                out.append(replace(lay, dp_replicate=lay.dp // shard, dp_shard=shard))
            if lay.pp > 1:
                other = [s for s in PP_SCHEDULES if s != lay.schedule]
                out += [
                    replace(lay, schedule=s)
                    for s in other
                    if self.space.layers % (lay.pp * (2 if s in LOOPED else 1)) == 0
                ]
        return [v for v in out if self.space.valid(v)]

    def with_float8(self, layouts: list[Layout]) -> list[Layout]:
        if not (self.float8 and self.space.gpu.fp8_tflops):
            return []
        return [
            t
            for t in (
                replace(lay, float8=name) for lay in layouts for name in ("tensorwise", "rowwise")
            )
            if self.space.valid(t)
        ]

    def best(self, count: int) -> list[Layout]:
        return [o.layout for o in self.ranked(False)[:count]]

    def best_of_each_form(self) -> list[Layout]:
        """The fastest layout planned of each data-parallel form, FSDP over all the data
        parallelism and HSDP: keeping the gathered weights spares an FSDP form its all-gathers
        in the backward, across the network where its shard group spans nodes (an HSDP form's is
        one node), so the variant can make an FSDP form that ranks below the best few the
        fastest."""
        out = []
        for hsdp in (False, True):
            out += [o.layout for o in self.ranked(False) if (o.layout.dp_replicate > 1) == hsdp][:1]
        return out

    def in_order_of_value(self, estimates: list[tuple[float, Layout]], top: int) -> None:
        """The module docstring's order: three layouts to print and, on the probes' word, the best
        one's variants and float8 (filling the rounds); then the same for the best as planned, if
        another; then the rest of ``top`` and the other candidates, the next two's variants, float8
        of the second, and the variants of the best FSDP and the best HSDP layout planned."""
        first = [layout for _, layout in estimates[: min(top, 3)]]
        self.plan_all(first + self.variants(first[:1]) + self.with_float8(first[:1]))
        self.retry(first)
        self.plan_all(self.variants(self.best(1)))
        self.plan_all(self.with_float8(self.best(1)))
        more = [layout for _, layout in estimates[min(top, 3) : max(2 * top, 6)]]
        self.plan_all(more)
        self.retry(more)
        self.plan_all(self.variants(self.best(3)))
        self.plan_all(self.with_float8(self.best(2)))
        self.plan_all(self.variants(self.best_of_each_form()))


def search(
    config: str,
    base_overrides: list[str],
    *,
    gpus: int,
    gpu,
    gpus_per_node: int = 8,
    top: int = 5,
    budget_s: float = 580.0,
    workers: int | None = None,
    attention: str | None = None,
    float8: bool = True,
    pipelines: bool | None = None,
    progress=None,
) -> SearchResult:
    """Search the layouts of ``config`` (with ``base_overrides``) on ``gpus`` GPUs of kind ``gpu``.
    ``pipelines``: probe pipeline layouts always (True), only when no layout without PP fits
    (False), or as the budget decides (None: always from ``PP_PROBE_BUDGET_S``)."""
    started = time.perf_counter()
    say = progress or (lambda message: None)
    space = SearchSpace.resolve(
        config, base_overrides, gpus=gpus, gpu=gpu, gpus_per_node=gpus_per_node, attention=attention
    )
    run, training = space.run, space.run["training"]
    tried = {
        "structures": 0,
        "HSDP forms": 0,
        "refused by the config checks": 0,
        "over memory by their state alone": 0,
        "probed": 0,
        "planned in full": 0,
    }
    workers = max(1, min(workers or os.cpu_count() or 1, MAX_WORKERS))
    pool = _Pool(workers, say)
    try:
        # The config's own layout on these GPUs, for comparison.
        say("planning the config's own layout")
        began = time.perf_counter()
        with saying_every(say, "planning the config's own layout"):
            recipe_figures = _plan_figures(
                config, list(base_overrides), gpus, gpu, gpus_per_node, attention
            )
        own_plan_s = time.perf_counter() - began
        recipe_s = 0.0 if "error" in recipe_figures else own_plan_s
        recipe = (
            None
            if "error" in recipe_figures
            else Outcome(
                space.own_layout(),
                recipe_figures["fits"],
                recipe_figures["device_bytes"],
                recipe_figures["tokens_per_s_per_gpu"],
                recipe_figures["mfu"],
                recipe_figures["step_s"],
                recipe_figures["gpu_hours"],
            )
        )

        shapes = bounded_shapes(space, tried)
        say(
            f"{len(shapes)} parallel layouts to probe ({tried['structures']} factorizations, "
            f"{tried['HSDP forms']} of them also as HSDP; "
            f"{tried['over memory by their state alone']} over memory by their state alone, "
            f"{tried['refused by the config checks']} refused by the config checks)"
        )

        # Pipeline layouts cost far more to plan (every microbatch of every stage is recorded: a
        # minute for an 8B model on 8 stages) and pay a bubble: they are probed when nothing else
        # fits, or when the budget is large (PP_PROBE_BUDGET_S).
        prober = Prober(space, pool, workers, started, say)
        flat = [shape for shape in shapes if shape[0].pp == 1]
        left = prober.probe(flat, budget_s * 0.6)
        if left and not prober.fits():
            # nothing would be planned in full: the probes go on, leaving the time of a chunk of
            # probes (the last one started may end that late) and of a full plan (the own one's)
            say("no layout probed fits yet: probing on into the full plans' share of the budget")
            left = prober.probe(flat, budget_s - own_plan_s - prober.chunk_s)
        pipelined = [shape for shape in shapes if shape[0].pp > 1]
        if pipelines is None:
            pipelines = budget_s >= PP_PROBE_BUDGET_S
        if pipelined and (not prober.fits() or pipelines):
            left += prober.probe(pipelined, budget_s * 0.6)
        elif pipelined:
            tried["pipeline layouts not probed (a layout without PP fits)"] = len(pipelined)
        tried["probed"] = len(prober.probed)
        if left:
            tried["not probed (budget)"] = left
        estimates = probe_estimates(shapes, prober.probed, space.capacity, space.global_batch)
        say(f"{len(estimates)} layouts fit by the probes; planning the best in full")

        full = FullPlans(
            space, pool, workers, started, budget_s, prober.plan_seconds, float8, tried, say
        )
        full.expect_from_own_plan(recipe.layout if recipe is not None else None, recipe_s)
        full.in_order_of_value(estimates, top)
        if full.budget_cut:
            tried["not planned in full (budget)"] = len(full.budget_cut)
        fitting, float8_outcomes = full.ranked(False), full.ranked(True)
    except BaseException:
        pool.terminate()
        raise
    pool.close()
    return SearchResult(
        config,
        gpus,
        gpu.name,
        space.global_batch,
        training["seq_len"],
        training["steps"],
        recipe,
        fitting,
        float8_outcomes,
        tried,
        time.perf_counter() - started,
        model_kind=kind_of(run, float8=""),
        budget_s=budget_s,
        own_plan_s=own_plan_s,
    )


# ------------------------------------------------------------------------------------- output


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _row_kind(result: SearchResult, o: Outcome) -> ModelKind:
    return replace(result.model_kind, float8=o.layout.float8)


def text(result: SearchResult, top: int) -> str:
    from canon_titan.plan.report import band_lines, banded, carried_band

    b = result.global_batch
    out = [
        f"Search: {result.config} on {result.gpus} x {result.gpu_name}, global batch {b} x "
        f"{result.seq_len} "
        f"tokens, {result.steps:,} steps",
        "Tried: "
        + ", ".join(f"{n} {what}" for what, n in result.tried.items())
        + f", in {result.seconds:.0f} s",
        "",
    ]

    def row(rank: str, o: Outcome) -> list[str]:
        band = carried_band(_row_kind(result, o))
        return [
            f"{rank} {o.layout.describe(b)}",
            f"    {_gib(o.device_bytes)}, {o.tokens_per_s_per_gpu:,.0f} tokens/s per GPU"
            f"{banded(o.tokens_per_s_per_gpu, band, lambda v: f'{v:,.0f}', per_time=True)}, MFU "
            f"{100 * o.mfu:.1f}%, {o.gpu_hours:,.0f} GPU-hours for the run"
            f"{banded(o.gpu_hours, band, lambda v: f'{v:,.0f}')}",
            "    overrides: " + " ".join(o.layout.overrides(b)),
        ]

    if result.recipe is not None:
        verdict = "fits" if result.recipe.fits else "DOES NOT FIT"
        out += [f"The config's own layout ({verdict}):"] + row("  -", result.recipe) + [""]
    else:
        out += ["The config's own layout: not a valid run on these GPUs", ""]
    if not result.ranked and result.budget_ran_out:
        fits = result.recipe is not None and result.recipe.fits
        out.append(
            f"The budget ran out before another layout was planned in full (--budget-s "
            f"{result.budget_s:.0f}, of which the config's own plan took "
            f"{result.own_plan_s:.0f} s)"
            + ("; the config's own layout above fits" if fits else "")
            + f": raise --budget-s (--budget-s {2 * result.budget_s:.0f}) to search further"
        )
    elif not result.ranked:
        out.append("No layout found that fits (more GPUs, or a smaller model)")
    else:
        out.append(
            f"Fastest layouts that fit with {100 * MARGIN:.0f}% of the memory spare (bf16, "
            "the recipe's "
            f"numerics; top {min(top, len(result.ranked))}):"
        )
        for i, o in enumerate(result.ranked[:top], 1):
            out += row(f"{i:>3}.", o)
        unplanned = result.tried.get("not planned in full (budget)", 0)
        if len(result.ranked) < top:
            out.append(
                f"  Only {len(result.ranked)} of --top {top}: "
                + (
                    f"{unplanned} more layout(s) were not planned in full within --budget-s "
                    f"{result.budget_s:.0f}; a larger --budget-s plans them"
                    if unplanned
                    else "no other layout tried fits"
                )
            )
        if result.recipe is not None and result.recipe.fits:
            best = result.ranked[0]
            out.append(
                "Best against the config's own layout: "
                f"x{best.tokens_per_s_per_gpu / result.recipe.tokens_per_s_per_gpu:.2f} "
                f"tokens/s, {result.recipe.gpu_hours - best.gpu_hours:,.0f} GPU-hours saved"
            )
    if result.float8:
        out += ["", "With float8 (changes the numerics: not a drop-in for the recipe):"]
        for i, o in enumerate(result.float8[:top], 1):
            out += row(f"{i:>3}.", o)
    shown = [
        o for o in (result.recipe, *result.ranked[:top], *result.float8[:top]) if o is not None
    ]
    out.append("")
    for kind in dict.fromkeys(_row_kind(result, o) for o in shown):
        out += band_lines(kind)
    return "\n".join(out)


def as_dict(result: SearchResult) -> dict:
    from canon_titan.plan.report import band_dict, band_range, carried_band

    def one(o: Outcome) -> dict:
        band = carried_band(_row_kind(result, o))
        return {
            "layout": o.layout.describe(result.global_batch),
            "overrides": o.layout.overrides(result.global_batch),
            "fits": o.fits,
            "device_bytes": o.device_bytes,
            "tokens_per_second_per_gpu": o.tokens_per_s_per_gpu,
            "tokens_per_second_per_gpu_measured_band": band_range(
                o.tokens_per_s_per_gpu, band, per_time=True
            ),
            "mfu": o.mfu,
            "step_seconds": o.step_s,
            "step_seconds_measured_band": band_range(o.step_s, band),
            "gpu_hours": o.gpu_hours,
            "gpu_hours_measured_band": band_range(o.gpu_hours, band),
            "plan_error": band_dict(_row_kind(result, o)),
        }

    return {
        "config": result.config,
        "gpus": result.gpus,
        "gpu": result.gpu_name,
        "global_batch": result.global_batch,
        "seq_len": result.seq_len,
        "steps": result.steps,
        "recipe": one(result.recipe) if result.recipe else None,
        "ranked": [one(o) for o in result.ranked],
        "float8": [one(o) for o in result.float8],
        "tried": result.tried,
        "seconds": result.seconds,
        "budget_seconds": result.budget_s,
        "budget_ran_out": result.budget_ran_out,
        "own_plan_seconds": result.own_plan_s,
    }


def write_toml(result: SearchResult, config: str, base_overrides: list[str], path: str) -> None:
    """``result.best`` as a resolved TOML config (``canon-titan config show`` of the config with its
    overrides), written to a temporary file and renamed."""
    from unittest.mock import patch

    from canon_titan.config import load, run_toml
    from canon_titan.tools.fileio import write_atomic

    best = result.best
    own = best is result.recipe
    overrides = [*base_overrides, *([] if own else best.layout.overrides(result.global_batch))]
    with patch.dict(os.environ, WORLD_SIZE=str(result.gpus)):
        run = load(config, overrides, environment=False)
    what = "the config's own layout (no other layout planned fits)" if own else "winner"
    header = (
        f"# canon-titan plan --search {what} for {result.gpus} x {result.gpu_name}: "
        f"{best.layout.describe(result.global_batch)}\n# resolved from {config}"
        + (f" with {' '.join(overrides)}" if overrides else "")
        + "\n"
    )
    write_atomic(path, header + run_toml(run))
