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
to stderr.
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
import time
from dataclasses import dataclass, field, replace

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
        out = ["--parallelism.data_parallel_replicate_degree", str(self.dp_replicate),
               "--parallelism.data_parallel_shard_degree", str(self.dp_shard),
               "--parallelism.tensor_parallel_degree", str(self.tp),
               "--parallelism.pipeline_parallel_degree", str(self.pp),
               "--parallelism.context_parallel_degree", str(self.cp),
               "--training.local_batch_size", str(self.local_batch),
               "--training.global_batch_size", str(global_batch),
               "--activation_checkpoint.mode", self.ac,
               "--parallelism.fsdp_reshard_after_forward", self.reshard]
        if self.pp > 1:
            out += ["--parallelism.pipeline_parallel_schedule", self.schedule,
                    "--parallelism.pipeline_parallel_microbatch_size", "1"]
        out += ["--float8.enable", "true" if self.float8 else "false"]
        if self.float8:
            out += ["--float8.recipe_name", self.float8]
        if self.float8 and self.float8 != "tensorwise":
            # FSDP's float8 all-gather is tensor-wise: a row-wise layout of a config that gathers in
            # float8 gathers in the param dtype (a tensor-wise layout keeps the config's choice).
            out += ["--float8.enable_fsdp_float8_all_gather", "false",
                    "--float8.precompute_float8_dynamic_scale_for_fsdp", "false"]
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
        parts = [f"HSDP {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"FSDP {self.dp_shard}"]
        parts += [f"TP {self.tp}"] if self.tp > 1 else []
        parts += [f"PP {self.pp} {self.schedule}"] if self.pp > 1 else []
        parts += [f"CP {self.cp}"] if self.cp > 1 else []
        accumulation = global_batch // (self.local_batch * self.dp)
        parts.append(f"local {self.local_batch}" + (f" x {accumulation} accum" if accumulation > 1 else ""))
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structures(gpus: int, gpus_per_node: int, layers: int, global_batch: int, cp_allowed: bool):
    """(tp, pp, cp) whose product divides ``gpus``, the rest data-parallel (FSDP over all of it) with
    a data-parallel size that divides the global batch: TP within a node, CP without TP or PP
    (canon-titan's limit), PP dividing the layers. HSDP and the looped pipeline schedule are
    variants of the best of these (``hsdp_shard``, ``PP_SCHEDULES``)."""
    for tp in DEGREES:
        for pp in DEGREES:
            for cp in DEGREES if cp_allowed else (1,):
                if tp > gpus_per_node or (cp > 1 and (tp > 1 or pp > 1)) or gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                if global_batch % dp or (pp > 1 and layers % pp):
                    continue
                yield tp, pp, cp


def hsdp_shard(layout: Layout, gpus_per_node: int) -> int:
    """The shard degree of HSDP with one node's worth of data-parallel ranks per shard group (0: none:
    under PP the node holds pipeline ranks too, or the shard would be all of the data parallelism)."""
    per_node = gpus_per_node // (layout.tp * layout.cp) if gpus_per_node % (layout.tp * layout.cp) == 0 else 0
    return per_node if layout.pp == 1 and 1 < per_node < layout.dp and layout.dp % per_node == 0 else 0


PP_MAX_MICROBATCHES_PER_STAGE = 2
"""Under PP the local batch is cut into microbatches of one sequence; the search takes at most this
many per stage (a plan records every microbatch, so its cost grows with them; past a few per stage
the bubble is small already)."""
PP_PROBE_BUDGET_S = 1800
"""With a layout without PP that fits, pipeline layouts are probed only under a budget this large."""


def local_batches(per_rank: int, pp: int) -> list[int]:
    """The local batches (sequences per step per data-parallel rank) that divide its share of the
    global batch, largest first; under PP at least one microbatch per stage and at most
    ``PP_MAX_MICROBATCHES_PER_STAGE``."""
    return [b for b in reversed(_divisors(per_rank))
            if pp == 1 or pp <= b <= PP_MAX_MICROBATCHES_PER_STAGE * pp]


# ------------------------------------------------------------------------------------ workers


def _plan_figures(config, overrides, gpus, gpu, gpus_per_node, attention):
    """Run in a worker: one plan's figures (or its error)."""
    from canon_titan.config import ConfigError
    from canon_titan.plan.planner import PlanError, plan

    began = time.perf_counter()
    try:
        result = plan(config, overrides, gpus=gpus, gpu=gpu, gpus_per_node=gpus_per_node, advise=False,
                      attention=attention)
    except (ConfigError, PlanError) as e:
        return {"error": str(e).splitlines()[0][:300], "seconds": time.perf_counter() - began}
    return {"fits": result.fits, "device_bytes": result.worst.device_bytes,
            "live_bytes": result.worst.memory.total, "step_s": result.step_s,
            "tokens_per_s_per_gpu": result.tokens_per_s_per_gpu, "mfu": result.mfu,
            "gpu_hours": result.gpu_hours, "accumulation": result.accumulation,
            "seconds": time.perf_counter() - began}


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


class _Pool:
    """Plans in worker processes (spawned: the parent's torch state is not theirs), or in this
    process when one worker is asked for."""

    def __init__(self, workers: int):
        self._pool = futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) \
            if workers > 1 else None

    def map(self, calls: list[tuple]) -> list[dict]:
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


def search(config: str, base_overrides: list[str], *, gpus: int, gpu, gpus_per_node: int = 8, top: int = 5,
           budget_s: float = 580.0, workers: int | None = None, attention: str | None = None,
           float8: bool = True, pipelines: bool | None = None, progress=None) -> SearchResult:
    """Search the layouts of ``config`` (with ``base_overrides``) on ``gpus`` GPUs of kind ``gpu``.
    ``pipelines``: probe pipeline layouts always (True), only when no layout without PP fits (False),
    or as the budget decides (None: always from ``PP_PROBE_BUDGET_S``)."""
    from unittest.mock import patch

    import torch

    from canon_titan.config import ConfigError, load

    started = time.perf_counter()
    say = progress or (lambda message: None)
    with patch.dict(os.environ, WORLD_SIZE=str(gpus)):
        run = load(config, base_overrides, environment=False)  # ConfigError: the caller's to report
    training = run["training"]
    dp_recipe = run.data_parallel_size(gpus) if training["global_batch_size"] == -1 else 1
    global_batch = training["global_batch_size"] if training["global_batch_size"] != -1 \
        else training["local_batch_size"] * dp_recipe
    layers = run.model_args.n_layers
    with torch.device("meta"):
        parameters = sum(p.numel() for p in run.model_spec().model.build().parameters())
    state_per_param = STATE_BYTES_PER_PARAMETER.get(str(training.get("dtype", "float32")), 16)
    cp_allowed = not getattr(run.model_args, "context_parallel_problem", lambda cp: None)(2)
    tried = {"structures": 0, "HSDP forms": 0, "refused by the config checks": 0,
             "over memory by their state alone": 0, "probed": 0, "planned in full": 0}
    workers = max(1, min(workers or os.cpu_count() or 1, MAX_WORKERS))
    pool = _Pool(workers)

    def valid(layout: Layout) -> bool:
        with patch.dict(os.environ, WORLD_SIZE=str(gpus)):
            try:
                load(config, [*base_overrides, *layout.overrides(global_batch)], environment=False)
            except ConfigError:
                return False
        return True

    def call(layout: Layout, extra=()):
        return (config, [*base_overrides, *layout.overrides(global_batch), *extra], gpus, gpu, gpus_per_node,
                attention)

    def outcome(layout: Layout, figures: dict) -> Outcome:
        if "error" in figures:
            return Outcome(layout, False, 0, 0.0, 0.0, 0.0, 0.0, figures["error"])
        # what the search offers leaves MARGIN of the GPU free: the plan's memory is within 8% of the
        # published runs' (README), not exact
        return Outcome(layout, figures["fits"] and figures["device_bytes"] <= gpu.memory_bytes * (1 - MARGIN),
                       figures["device_bytes"], figures["tokens_per_s_per_gpu"], figures["mfu"], figures["step_s"],
                       figures["gpu_hours"])

    try:
        # The config's own layout on these GPUs, for comparison.
        say("planning the config's own layout")
        began = time.perf_counter()
        recipe_figures = _plan_figures(config, list(base_overrides), gpus, gpu, gpus_per_node, attention)
        recipe_s = 0.0 if "error" in recipe_figures else time.perf_counter() - began
        par = run["parallelism"]
        recipe = None if "error" in recipe_figures else Outcome(
            Layout(par["data_parallel_replicate_degree"], run.data_parallel_size(gpus) // par["data_parallel_replicate_degree"],
                   par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["context_parallel_degree"],
                   training["local_batch_size"], run["activation_checkpoint"]["mode"],
                   str(par["fsdp_reshard_after_forward"]), par["pipeline_parallel_schedule"],
                   run["float8"]["recipe_name"] if run["float8"]["enable"] else ""),
            recipe_figures["fits"], recipe_figures["device_bytes"], recipe_figures["tokens_per_s_per_gpu"],
            recipe_figures["mfu"], recipe_figures["step_s"], recipe_figures["gpu_hours"])

        # 1. Bounds.
        shapes: list[tuple[Layout, list[int]]] = []
        for tp, pp, cp in structures(gpus, gpus_per_node, layers, global_batch, cp_allowed):
            tried["structures"] += 1
            dp = gpus // (tp * pp * cp)
            batches = local_batches(global_batch // dp, pp)
            if not batches:
                tried["refused by the config checks"] += 1
                continue
            if parameters * state_per_param / (dp * tp * pp) > gpu.memory_bytes:
                tried["over memory by their state alone"] += 1
                continue
            # FSDP over all the data parallelism, and HSDP with one node's shard: at scale the two
            # differ most in what crosses the network, so each is probed (a variant of the best
            # alone would miss a structure whose FSDP form ranks low only for its network traffic)
            fsdp = Layout(1, dp, tp, pp, cp, batches[0], "none")
            forms = [fsdp]
            shard = hsdp_shard(fsdp, gpus_per_node)
            if shard and parameters * state_per_param / (shard * tp * pp) <= gpu.memory_bytes:
                forms.append(replace(fsdp, dp_replicate=dp // shard, dp_shard=shard))
            for form in forms:
                modes = []
                for ac in AC_MODES:
                    if valid(replace(form, ac=ac)):
                        modes.append(ac)
                    else:
                        tried["refused by the config checks"] += 1
                if modes:
                    shapes.append((replace(form, ac=modes[0]), batches, modes))
                    tried["HSDP forms"] += form.dp_replicate > 1
        say(f"{len(shapes)} parallel layouts to probe ({tried['structures']} factorizations, "
            f"{tried['HSDP forms']} of them also as HSDP; "
            f"{tried['over memory by their state alone']} over memory by their state alone, "
            f"{tried['refused by the config checks']} refused by the config checks)")

        # 2. Probes, in rounds: for each layout the fastest checkpointing mode at the largest local
        # batch first; where that does not fit, the same mode at the smallest batch (to interpolate)
        # and the next mode at the largest, and so on.
        capacity = gpu.memory_bytes * (1 - MARGIN)

        def probe_calls(layout: Layout):
            return [call(layout, ["--model.n_layers", str(k * layout.pp)]) for k in (1, 2)]

        probed: dict[Layout, tuple | None] = {}
        plan_seconds: dict[Layout, float] = {}  # a full plan's wall time, from the probes' own in the layers

        def needs(shape: Layout, batches: list[int], modes: list[str]) -> list[Layout]:
            out = []
            for ac in modes:
                big = replace(shape, ac=ac, local_batch=batches[0])
                if big not in probed:
                    return out + [big]
                if probed[big] and probed[big][0] <= capacity:
                    return out  # fits at the largest batch: slower modes cannot be faster
                small = replace(big, local_batch=batches[-1])
                if small != big and small not in probed:
                    out.append(small)
            return out

        def probe(group: list, deadline: float) -> None:
            while True:
                todo = [lay for shape, batches, modes in group for lay in needs(shape, batches, modes)]
                if not todo:
                    return
                if time.perf_counter() - started > deadline:
                    say("probe budget spent: ranking what was probed")
                    return
                say(f"probing {len(todo)} layouts ({2 * len(todo)} few-layer plans on {workers} worker(s))")
                for i in range(0, len(todo), 2 * workers):
                    if i and time.perf_counter() - started > deadline:
                        # checked between chunks too: a round of probes of an 8B model on a loaded
                        # machine takes minutes, and what is left of the budget is for full plans
                        say(f"probe budget spent after {len(probed)} layouts: ranking what was probed")
                        return
                    chunk = todo[i:i + 2 * workers]
                    figures = pool.map([c for lay in chunk for c in probe_calls(lay)])
                    for n, lay in enumerate(chunk):
                        probed[lay] = extrapolate(figures[2 * n:2 * n + 2], layers // lay.pp)
                        one, two = (f.get("seconds", 0.0) for f in figures[2 * n:2 * n + 2])
                        plan_seconds[lay] = one + (layers // lay.pp - 1) * max(two - one, 0.0)
                    say(f"probed {len(probed)} layouts, {time.perf_counter() - started:.0f} s")

        def fitting_probes() -> bool:
            return any(p and p[0] <= capacity for p in probed.values())

        # Pipeline layouts cost far more to plan (every microbatch of every stage is recorded: a
        # minute for an 8B model on 8 stages) and pay a bubble: they are probed when nothing else
        # fits, or when the budget is large (PP_PROBE_BUDGET_S).
        probe([shape for shape in shapes if shape[0].pp == 1], budget_s * 0.6)
        pipelined = [shape for shape in shapes if shape[0].pp > 1]
        if pipelines is None:
            pipelines = budget_s >= PP_PROBE_BUDGET_S
        if pipelined and (not fitting_probes() or pipelines):
            probe(pipelined, budget_s * 0.6)
        elif pipelined:
            tried["pipeline layouts not probed (a layout without PP fits)"] = len(pipelined)
        tried["probed"] = len(probed)

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
                # memory and the time per accumulation group, linear in the local batch between the probes
                b0, b1 = batches[-1], batches[0]
                for b in batches:
                    share = (b - b0) / (b1 - b0)
                    if small[0] + share * (big[0] - small[0]) <= capacity:
                        group_s = small[1] + share * (big[1] - small[1])
                        estimates.append((group_s * (global_batch // (b * shape.dp)),
                                          replace(shape, ac=ac, local_batch=b)))
                        break
        estimates.sort(key=lambda e: e[0])
        say(f"{len(estimates)} layouts fit by the probes; planning the best in full")

        # 3. Full plans, in order of value (module docstring), each round of ``workers`` plans
        # started only when it is expected to end within the budget (round_s).
        planned: dict[Layout, Outcome] = {}
        budget_cut: list[Layout] = []

        def round_s(chunk: list[Layout]) -> float:
            """A round's expected wall time: its slowest layout's, by the probes of its parallel
            structure (their slowest), times the worst that a round so far took against its
            expectation (a float8 plan records more; workers share cores); without probes, the
            slowest round so far."""
            guesses = []
            for lay in chunk:
                same = [t for p, t in plan_seconds.items() if (p.tp, p.pp, p.cp) == (lay.tp, lay.pp, lay.cp)]
                guesses.append(max(same or plan_seconds.values() or [0.0]))
            return max(guesses) * slowdown if max(guesses) > 0 else slowest_round

        def plan_all(layouts: list[Layout]) -> None:
            nonlocal slowdown, slowest_round
            todo = [lay for lay in dict.fromkeys(layouts) if lay not in planned and lay not in budget_cut]
            if not todo:
                return
            chunks = [todo[i:i + workers] for i in range(0, len(todo), workers)]
            if not budget_cut:
                say(f"planning {len(todo)} layouts in full ({time.perf_counter() - started:.0f} s so far)")
            for n, chunk in enumerate(chunks):
                expected = round_s(chunk)
                if budget_cut or time.perf_counter() - started + expected > budget_s:
                    if not budget_cut:
                        say(f"budget: the rest not planned in full (the next {len(chunk)} would take about "
                            f"{expected:.0f} s; {budget_s - (time.perf_counter() - started):.0f} s of --budget-s left)")
                    budget_cut.extend(lay for rest in chunks[n:] for lay in rest)
                    return
                began = time.perf_counter()
                for layout, figures in zip(chunk, pool.map([call(lay) for lay in chunk])):
                    planned[layout] = outcome(layout, figures)
                took = time.perf_counter() - began
                slowest_round = max(slowest_round, took)
                if expected > 0 and plan_seconds:
                    slowdown = max(slowdown, took * slowdown / expected)
                tried["planned in full"] = len(planned)
                left = sum(round_s(rest) for rest in chunks[n + 1:])
                say(f"planned {len(planned)} layouts in full, {time.perf_counter() - started:.0f} s"
                    + (f"; these {len(todo)} done in about {left:.0f} s" if left else ""))

        def retry(chosen: list[Layout]) -> None:
            """A best-guess batch that did not fit, one step smaller."""
            smaller = []
            for layout in chosen:
                if layout in planned and not planned[layout].fits and not planned[layout].error:
                    batches = [b for b in local_batches(global_batch // layout.dp, layout.pp) if b < layout.local_batch]
                    smaller += [replace(layout, local_batch=batches[0])] if batches else []
            plan_all(smaller)

        def ranked(with_float8: bool) -> list[Outcome]:
            return sorted((o for o in planned.values() if o.fits and bool(o.layout.float8) == with_float8),
                          key=lambda o: -o.tokens_per_s_per_gpu)

        def variants(layouts: list[Layout]) -> list[Layout]:
            out = []
            for lay in layouts:
                if lay.dp_shard > 1:
                    out.append(replace(lay, reshard="never"))
                shard = hsdp_shard(lay, gpus_per_node)
                if shard:
                    out.append(replace(lay, dp_replicate=lay.dp // shard, dp_shard=shard))
                if lay.pp > 1:
                    other = [s for s in PP_SCHEDULES if s != lay.schedule]
                    out += [replace(lay, schedule=s) for s in other if layers % (lay.pp * (2 if s in LOOPED else 1)) == 0]
            return [v for v in out if valid(v)]

        def with_float8(layouts: list[Layout]) -> list[Layout]:
            if not (float8 and gpu.fp8_tflops):
                return []
            return [t for t in (replace(lay, float8=name) for lay in layouts for name in ("tensorwise", "rowwise"))
                    if valid(t)]

        def best(count: int) -> list[Layout]:
            return [o.layout for o in ranked(False)[:count]]

        def best_of_each_form() -> list[Layout]:
            """The fastest layout planned of each data-parallel form, FSDP over all the data
            parallelism and HSDP: keeping the gathered weights spares an FSDP form its all-gathers
            in the backward, across the network where its shard group spans nodes (an HSDP form's is
            one node), so the variant can make an FSDP form that ranks below the best few the fastest."""
            out = []
            for hsdp in (False, True):
                out += [o.layout for o in ranked(False) if (o.layout.dp_replicate > 1) == hsdp][:1]
            return out

        # the config's own plan, against what the probes of its structure say, sets the first
        # rounds' expectation
        slowdown, slowest_round = 1.0, recipe_s
        own = round_s([recipe.layout]) if recipe is not None else 0.0
        if own > 0:
            slowdown = max(1.0, recipe_s / own)
        # the first rounds: three layouts to print and, on the probes' word, the best one's variants
        # and float8 (filling the rounds); then the same for the best as planned, if another
        first = [layout for _, layout in estimates[:min(top, 3)]]
        plan_all(first + variants(first[:1]) + with_float8(first[:1]))
        retry(first)
        plan_all(variants(best(1)))
        plan_all(with_float8(best(1)))
        more = [layout for _, layout in estimates[min(top, 3):max(2 * top, 6)]]
        plan_all(more)
        retry(more)
        plan_all(variants(best(3)))
        plan_all(with_float8(best(2)))
        plan_all(variants(best_of_each_form()))
        if budget_cut:
            tried["not planned in full (budget)"] = len(budget_cut)
        fitting, float8_outcomes = ranked(False), ranked(True)
    except BaseException:
        pool.terminate()
        raise
    pool.close()
    return SearchResult(config, gpus, gpu.name, global_batch, training["seq_len"], training["steps"], recipe,
                        fitting, float8_outcomes, tried, time.perf_counter() - started)


# ------------------------------------------------------------------------------------- output


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def text(result: SearchResult, top: int) -> str:
    b = result.global_batch
    out = [f"Search: {result.config} on {result.gpus} x {result.gpu_name}, global batch {b} x {result.seq_len} "
           f"tokens, {result.steps:,} steps",
           "Tried: " + ", ".join(f"{n} {what}" for what, n in result.tried.items()) + f", in {result.seconds:.0f} s", ""]

    def row(rank: str, o: Outcome) -> list[str]:
        return [f"{rank} {o.layout.describe(b)}",
                f"    {_gib(o.device_bytes)}, {o.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {100 * o.mfu:.1f}%, "
                f"{o.gpu_hours:,.0f} GPU-hours for the run",
                "    overrides: " + " ".join(o.layout.overrides(b))]

    if result.recipe is not None:
        verdict = "fits" if result.recipe.fits else "DOES NOT FIT"
        out += [f"The config's own layout ({verdict}):"] + row("  -", result.recipe) + [""]
    else:
        out += ["The config's own layout: not a valid run on these GPUs", ""]
    if not result.ranked and result.tried.get("not planned in full (budget)"):
        out.append("No layout planned in full within the budget: raise --budget-s")
    elif not result.ranked:
        out.append("No layout found that fits (more GPUs, or a smaller model)")
    else:
        out.append(f"Fastest layouts that fit with {100 * MARGIN:.0f}% of the memory spare (bf16, the recipe's "
                   f"numerics; top {min(top, len(result.ranked))}):")
        for i, o in enumerate(result.ranked[:top], 1):
            out += row(f"{i:>3}.", o)
        if result.recipe is not None and result.recipe.fits:
            best = result.ranked[0]
            out.append(f"Best against the config's own layout: x{best.tokens_per_s_per_gpu / result.recipe.tokens_per_s_per_gpu:.2f} "
                       f"tokens/s, {result.recipe.gpu_hours - best.gpu_hours:,.0f} GPU-hours saved")
    if result.float8:
        out += ["", "With float8 (changes the numerics: not a drop-in for the recipe):"]
        for i, o in enumerate(result.float8[:top], 1):
            out += row(f"{i:>3}.", o)
    return "\n".join(out)


def as_dict(result: SearchResult) -> dict:
    def one(o: Outcome) -> dict:
        return {"layout": o.layout.describe(result.global_batch), "overrides": o.layout.overrides(result.global_batch),
                "fits": o.fits, "device_bytes": o.device_bytes, "tokens_per_second_per_gpu": o.tokens_per_s_per_gpu,
                "mfu": o.mfu, "step_seconds": o.step_s, "gpu_hours": o.gpu_hours}

    return {"config": result.config, "gpus": result.gpus, "gpu": result.gpu_name, "global_batch": result.global_batch,
            "seq_len": result.seq_len, "steps": result.steps, "recipe": one(result.recipe) if result.recipe else None,
            "ranked": [one(o) for o in result.ranked], "float8": [one(o) for o in result.float8],
            "tried": result.tried, "seconds": result.seconds}


def write_toml(result: SearchResult, config: str, base_overrides: list[str], path: str) -> None:
    """The winner as a resolved TOML config (``canon-titan config show`` of the config with its
    overrides), written to a temporary file and renamed."""
    from unittest.mock import patch

    from canon_titan.config import dumps, load
    from canon_titan.tools.fileio import write_atomic

    best = result.ranked[0]
    overrides = [*base_overrides, *best.layout.overrides(result.global_batch)]
    with patch.dict(os.environ, WORLD_SIZE=str(result.gpus)):
        run = load(config, overrides, environment=False)
    header = (f"# canon-titan plan --search winner for {result.gpus} x {result.gpu_name}: "
              f"{best.layout.describe(result.global_batch)}\n# resolved from {config} with {' '.join(overrides)}\n")
    write_atomic(path, header + dumps(run.sections))
