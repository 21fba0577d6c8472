"""Value and cross-section checks of a resolved run: impossible runs fail here, before any process
group starts. The checks only read the run (``derive`` fills in what the config implies first)."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import torch
from torchtitan.tools.utils import has_cuda_capability

from canon_titan.config.run import ConfigError, RunConfig
from canon_titan.config.sections import section_schema
from canon_titan.convert.dcp_io import ConversionError, checkpoint_problem, model_mismatch
from canon_titan.data.builtin import ASSET_DIR
from canon_titan.data.documents import DataError, expand_inputs, file_kind
from canon_titan.data.held_out import SOURCE_KEYS, held_out_shards
from canon_titan.data.inputs import DataConfigError, resolve_paths
from canon_titan.data.kinds import DATASET_KINDS, SYNTHETIC
from canon_titan.data.pretokenize import read_index
from canon_titan.data.tokenizers import build_tokenizer
from canon_titan.evaluation import lm
from canon_titan.models.common.canon_args import CanonArgs
from canon_titan.models.common.context_parallel import BALANCERS
from canon_titan.models.common.deferred import deferred
from canon_titan.tools.fileio import read_from
from synthetic_data.tasks import SECTION, VOCAB

# torch.distributed.pipelining imports dynamo (about 1.4 s); only PP configs need it.
schedules = deferred("torch.distributed.pipelining.schedules")


def _fail(run: RunConfig, section: str, key: str, message: str):
    raise run.error(section, key, message)


def _positive(run: RunConfig, section: str, *keys: str) -> None:
    for key in keys:
        if run[section][key] <= 0:
            _fail(run, section, key, f"must be > 0, got {run[section][key]}")


def _batch_fits(gbs: int, local: int, dp: int, others: int, world: int) -> str:
    """Why ``gbs`` does not split over ``dp`` data-parallel ranks of ``local`` sequences, and what
    fits: a smaller local batch (gradient accumulation keeps the global batch), or a GPU count."""
    message = (
        f"is {gbs}, which is not a multiple of local_batch_size x data-parallel degree "
        f"({local} x {dp} = {local * dp}) at {world} processes"
    )
    locals_ = [n for n in range(local - 1, 0, -1) if gbs % (n * dp) == 0][:2]
    fits = [f"--training.local_batch_size {n}" for n in locals_]
    if gbs % local == 0:
        degrees = [d for d in range(1, gbs // local + 1) if (gbs // local) % d == 0]
        below = [d * others for d in degrees if d * others < world][-1:]
        above = [d * others for d in degrees if d * others > world][:1]
        fits += [f"{n} processes" for n in below + above]
    return message + (f"; fits: {', or '.join(fits)}" if fits else "")


MAX_STEPS = 2**62
"""Steps are stored as int64 in checkpoints and metrics."""
MAX_SEQ_LEN = 2**24


def check_finite(run: RunConfig) -> None:
    """No NaN or infinity in any number of any section."""
    for section, body in run.sections.items():
        for key, value in body.items():
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                _fail(run, section, key, f"must be a finite number, got {value}")


def _world_size() -> int | None:
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


# What a CUDA-only kernel backend reports on a machine that cannot run it
# (``kernels.backends.backend_problem``); static validation (``environment = False``) checks a
# config for another machine and skips these.
_HARDWARE_MESSAGES = ("need a CUDA GPU", "does not import here", "(this machine:")


def check_model(run: RunConfig, environment: bool) -> None:
    for key, message in run.model_args.validate():
        if (
            not environment
            and key in ("canon_backend", "kernel_backend")
            and any(m in message for m in _HARDWARE_MESSAGES)
        ):
            continue
        _fail(run, "model", key, message)
    dataloader = run["dataloader"]
    if (
        getattr(run.model_args, "canon_document_reset", False)
        and not dataloader["document_masking"]
        and dataloader["dataset"] not in SYNTHETIC
    ):
        _fail(
            run,
            "model",
            "canon_document_reset",
            "does nothing without document positions: set [dataloader] "
            "document_masking = true (text datasets; the synthetic tasks always have them)",
        )


def check_training(run: RunConfig) -> None:
    training = run["training"]
    _positive(run, "training", "local_batch_size", "seq_len", "steps", "max_norm", "gc_freq")
    if training["steps"] > MAX_STEPS:
        _fail(
            run,
            "training",
            "steps",
            f"is {training['steps']}; at most {MAX_STEPS} (stored as a 64-bit integer)",
        )
    if training["seq_len"] > MAX_SEQ_LEN:
        _fail(
            run,
            "training",
            "seq_len",
            f"is {training['seq_len']:,}; at most {MAX_SEQ_LEN:,} tokens per sequence",
        )
    gbs = training["global_batch_size"]
    if gbs != -1 and gbs <= 0:
        _fail(
            run, "training", "global_batch_size", f"must be > 0 or -1 (local batch x dp), got {gbs}"
        )
    if gbs > 0 and gbs % training["local_batch_size"]:
        _fail(
            run,
            "training",
            "global_batch_size",
            f"must be a multiple of local_batch_size "
            f"({training['local_batch_size']}) x the data-parallel degree, got {gbs}",
        )
    _positive(run, "comm", "init_timeout_seconds", "train_timeout_seconds")
    opt = run["optimizer"]
    _positive(run, "optimizer", "lr")
    if len(opt["betas"]) != 2 or not all(0 <= b < 1 for b in opt["betas"]):
        _fail(run, "optimizer", "betas", f"must be two numbers in [0, 1), got {opt['betas']}")
    if opt["eps"] <= 0:
        _fail(run, "optimizer", "eps", f"must be > 0, got {opt['eps']}")
    if opt["weight_decay"] < 0:
        _fail(run, "optimizer", "weight_decay", f"must be >= 0, got {opt['weight_decay']}")
    sched = run["lr_scheduler"]
    if sched["warmup_steps"] < 0:
        _fail(run, "lr_scheduler", "warmup_steps", "must be >= 0")
    if sched["total_steps"] is not None and sched["total_steps"] < training["steps"]:
        _fail(
            run,
            "lr_scheduler",
            "total_steps",
            f"is {sched['total_steps']}, below [training] steps = "
            f"{training['steps']}: past its end the schedule has no value (a linear decay "
            "turns the learning rate "
            "negative, a cosine one back up, and one without decay steps stops the run); "
            "set it >= steps, or "
            "remove it to follow steps",
        )
    if not 0 <= sched["min_lr_factor"] <= 1:
        _fail(
            run, "lr_scheduler", "min_lr_factor", f"must be in [0, 1], got {sched['min_lr_factor']}"
        )
    if sched["decay_ratio"] is not None and not 0 <= sched["decay_ratio"] <= 1:
        _fail(
            run,
            "lr_scheduler",
            "decay_ratio",
            f"must be in [0, 1] (WSD decay share), got {sched['decay_ratio']}",
        )
    if run["metrics"]["log_freq"] <= 0:
        _fail(run, "metrics", "log_freq", "must be > 0")
    check_checkpoint(run)


def check_checkpoint(run: RunConfig) -> None:
    """TorchTitan's checkpoint rules, with the key named, before any process starts."""
    ckpt = run["checkpoint"]
    if ckpt["interval"] <= 0:
        _fail(run, "checkpoint", "interval", f"must be > 0, got {ckpt['interval']}")
    if ckpt["keep_latest_k"] < 0 or ckpt["keep_latest_k"] == 1:
        _fail(
            run,
            "checkpoint",
            "keep_latest_k",
            f"is {ckpt['keep_latest_k']}; 0 keeps every checkpoint, otherwise at "
            "least 2 (the newest may still be being written)",
        )
    if ckpt["purge_before_save"] and not ckpt["keep_latest_k"]:
        _fail(
            run,
            "checkpoint",
            "purge_before_save",
            "deletes the checkpoints beyond keep_latest_k - 1 before each "
            "save: it needs keep_latest_k >= 2 (0 keeps every checkpoint)",
        )
    if not ckpt["folder"].strip():
        _fail(run, "checkpoint", "folder", "must not be empty (a folder inside [job] dump_folder)")
    if ckpt["load_step"] < -1:
        _fail(
            run,
            "checkpoint",
            "load_step",
            f"is {ckpt['load_step']}; a step number, or -1 for the newest",
        )
    if ckpt["last_save_in_hf"] and not ckpt["last_save_model_only"]:
        _fail(
            run,
            "checkpoint",
            "last_save_in_hf",
            "needs last_save_model_only = true (HF files hold weights only)",
        )
    if ckpt["initial_load_in_hf"] and not ckpt["initial_load_model_only"]:
        _fail(run, "checkpoint", "initial_load_in_hf", "needs initial_load_model_only = true")
    if "model" in ckpt["exclude_from_loading"]:
        _fail(run, "checkpoint", "exclude_from_loading", "cannot exclude 'model'")
    if ckpt["async_mode"] != "disabled":
        # TorchTitan's asynchronous save returns after staging: a write error stays in its
        # background future, "checkpoint saved" and a preempted exit come before the files are
        # complete, and keep_latest_k purges older checkpoints while the new one may still fail.
        _fail(
            run,
            "checkpoint",
            "async_mode",
            f"is {ckpt['async_mode']!r}; only 'disabled' is supported (an "
            "asynchronous save would be reported, and older checkpoints purged, before it "
            "is complete)",
        )


def check_initial_load(run: RunConfig, environment: bool) -> None:
    """For this machine, ``initial_load_path`` must be a DCP checkpoint that loads, or with
    ``initial_load_in_hf`` a Hugging Face folder of the run's model."""
    ckpt = run["checkpoint"]
    path = ckpt["initial_load_path"]
    if ckpt["initial_load_in_hf"] and not path:
        _fail(
            run,
            "checkpoint",
            "initial_load_in_hf",
            "needs [checkpoint] initial_load_path: the Hugging Face folder to start from",
        )
    if not path or not environment or "://" in path:
        return
    if not Path(path).is_dir():
        _fail(run, "checkpoint", "initial_load_path", f"{path} does not exist")
    if ckpt["initial_load_in_hf"]:
        problem = hf_folder_problem(run, path)
        if problem:
            _fail(run, "checkpoint", "initial_load_path", problem)
        return
    if not (Path(path) / ".metadata").is_file():
        _fail(
            run,
            "checkpoint",
            "initial_load_path",
            f"{path} is not a DCP checkpoint folder (no .metadata; "
            "`canon-titan convert from-hf` writes one)",
        )
    problem = checkpoint_problem(path) or model_mismatch(
        path, run.state_dict_adapter().shapes, run.label()
    )
    if problem:
        _fail(run, "checkpoint", "initial_load_path", f"cannot be loaded: {problem}")


def hf_folder_problem(run: RunConfig, path: str) -> str | None:
    """Why the Hugging Face folder ``path`` cannot start the run's model, or None."""
    from canon_titan.convert.hf import checked_hf_folder

    if not any(Path(path).glob("*.safetensors")):
        return f"{path} has no .safetensors files (initial_load_in_hf reads a Hugging Face folder)"
    try:
        checked_hf_folder(Path(path), run)
    except ConversionError as e:
        return str(e)
    return None


def check_parallelism(run: RunConfig, environment: bool) -> None:
    par, training, args = run["parallelism"], run["training"], run.model_args
    for key in (
        "data_parallel_replicate_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
        "expert_parallel_degree",
        "pipeline_parallel_microbatch_size",
    ):
        if par[key] < 1:
            _fail(run, "parallelism", key, f"must be >= 1, got {par[key]}")
    if par["data_parallel_shard_degree"] == 0 or par["data_parallel_shard_degree"] < -1:
        _fail(
            run,
            "parallelism",
            "data_parallel_shard_degree",
            "must be >= 1, or -1 for the remaining ranks",
        )
    tp, pp = par["tensor_parallel_degree"], par["pipeline_parallel_degree"]
    others = par["data_parallel_replicate_degree"] * tp * pp * par["context_parallel_degree"]
    world = _world_size()
    if world is not None:
        shard = par["data_parallel_shard_degree"]
        if shard == -1 and world % others:
            _fail(
                run,
                "parallelism",
                "tensor_parallel_degree",
                f"replicate x tp x pp x cp = {others} does not divide the world size {world}",
            )
        elif shard != -1 and others * shard != world:
            _fail(
                run,
                "parallelism",
                "data_parallel_shard_degree",
                f"replicate x shard x tp x pp x cp = {others * shard} but the world size "
                f"is {world}",
            )
        dp = run.data_parallel_size(world)
        gbs = training["global_batch_size"]
        if gbs != -1 and gbs % (training["local_batch_size"] * dp):
            _fail(
                run,
                "training",
                "global_batch_size",
                _batch_fits(gbs, training["local_batch_size"], dp, others, world),
            )
    problem = args.tensor_parallel_problem(tp)
    if problem:
        _fail(run, "parallelism", "tensor_parallel_degree", problem)
    if (
        tp > 1
        and par["enable_sequence_parallel"]
        and training["seq_len"] % (tp * par["context_parallel_degree"])
    ):
        _fail(
            run,
            "training",
            "seq_len",
            f"must be divisible by tensor_parallel_degree x context_parallel_degree "
            f"({tp * par['context_parallel_degree']}) with sequence parallel",
        )
    if pp > 1:
        if training["local_batch_size"] % par["pipeline_parallel_microbatch_size"]:
            _fail(
                run,
                "parallelism",
                "pipeline_parallel_microbatch_size",
                f"must divide training.local_batch_size ({training['local_batch_size']})",
            )
        try:
            schedules.get_schedule_class(par["pipeline_parallel_schedule"])
        except ValueError as e:
            _fail(run, "parallelism", "pipeline_parallel_schedule", str(e))
    if par["spmd_backend"] != "partial_dtensor":
        _fail(
            run,
            "parallelism",
            "spmd_backend",
            "canon-titan's models use DTensor tensor-parallel plans: only "
            "'partial_dtensor' is supported",
        )
    cp = par["context_parallel_degree"]
    if cp > 1:
        problem = args.context_parallel_problem(cp)
        if problem:
            _fail(run, "parallelism", "context_parallel_degree", problem)
        if pp > 1:
            _fail(
                run,
                "parallelism",
                "context_parallel_degree",
                "context parallelism combines with FSDP/HSDP and tensor parallelism here, "
                "not with pipeline "
                "parallelism (see docs/parallelism.md)",
            )
        if par["context_parallel_load_balancer"] not in BALANCERS:
            _fail(
                run,
                "parallelism",
                "context_parallel_load_balancer",
                f"must be 'headtail', got {par['context_parallel_load_balancer']!r} ('ptrr' needs "
                "FlexAttention block masks; TorchTitan's unbalanced split, None, has no "
                "TOML spelling)",
            )
        chunks = 2 * cp if par["context_parallel_load_balancer"] else cp
        if training["seq_len"] % (2 * cp):
            _fail(
                run,
                "training",
                "seq_len",
                f"must be divisible by 2 x context_parallel_degree ({2 * cp})",
            )
        kernel = (
            getattr(args, "canon_kernel", 1)
            if isinstance(args, CanonArgs) and args.enabled()
            else 1
        )
        if training["seq_len"] // chunks < kernel - 1:
            _fail(
                run,
                "training",
                "seq_len",
                f"split in {chunks} chunks for context parallelism, each must hold "
                f"at least canon_kernel - 1 = {kernel - 1} tokens",
            )


def check_features(run: RunConfig, environment: bool) -> None:
    f8, compile_ = run["float8"], run["compile"]
    # Like recipe_name and emulate, the all-gather keys do nothing while float8 is off.
    if f8["enable"] and f8["enable_fsdp_float8_all_gather"] and f8["recipe_name"] != "tensorwise":
        _fail(
            run,
            "float8",
            "enable_fsdp_float8_all_gather",
            "gathers each weight in float8 with one scale: it "
            f"needs recipe_name = 'tensorwise', got {f8['recipe_name']!r}",
        )
    if (
        f8["enable"]
        and f8["precompute_float8_dynamic_scale_for_fsdp"]
        and not f8["enable_fsdp_float8_all_gather"]
    ):
        _fail(
            run,
            "float8",
            "precompute_float8_dynamic_scale_for_fsdp",
            "precomputes the scales of FSDP's float8 "
            "all-gather: it needs enable_fsdp_float8_all_gather = true",
        )
    if (
        f8["enable"]
        and f8["enable_fsdp_float8_all_gather"]
        and not f8["precompute_float8_dynamic_scale_for_fsdp"]
        and run["parallelism"]["tensor_parallel_degree"] > 1
    ):
        _fail(
            run,
            "float8",
            "enable_fsdp_float8_all_gather",
            "under tensor parallelism needs "
            "precompute_float8_dynamic_scale_for_fsdp = true: without it torchao scales "
            "each rank's float8 gather "
            "by the amax of its TP shard (it reduces over the FSDP mesh alone), not of "
            "the whole weight as float8 "
            "without the all-gather does",
        )
    if f8["enable"]:
        if environment and f8["emulate"] and compile_["enable"] and not has_cuda_capability(8, 9):
            _fail(
                run,
                "float8",
                "emulate",
                "emulated float8 runs in eager mode only on hardware without "
                "float8; set [compile] enable = false",
            )
        if environment and not f8["emulate"] and not has_cuda_capability(8, 9):
            _fail(
                run,
                "float8",
                "enable",
                "real float8 needs an NVIDIA GPU with compute capability >= 8.9 (Ada/Hopper); "
                "none is visible. Use [float8] emulate = true to test the code path",
            )
    if environment and run["training"]["enable_cpu_offload"]:
        if torch._utils._get_available_device_type() is None:
            _fail(
                run,
                "training",
                "enable_cpu_offload",
                "offloads accelerator memory to the CPU; this machine has no accelerator "
                "and trains on the CPU already",
            )
    profiling = run["profiling"]
    if profiling["enable_profiling"] or profiling["enable_memory_snapshot"]:
        _positive(run, "profiling", "profile_freq")
        if profiling["enable_profiling"] and (
            profiling["profile_freq"] < profiling["profiler_warmup"] + profiling["profiler_active"]
        ):
            _fail(
                run,
                "profiling",
                "profile_freq",
                f"is {profiling['profile_freq']}; it must be at least "
                "profiler_warmup + profiler_active "
                f"({profiling['profiler_warmup'] + profiling['profiler_active']}): "
                "each cycle waits, warms up, then records",
            )
    if profiling["enable_profiling"]:
        # torch.profiler.schedule's own bounds, which it asserts only when the first profiled step
        # starts.
        _positive(run, "profiling", "profiler_active")
        for key in (
            "profiler_warmup",
            "profiler_repeat",
            "profiler_skip_first",
            "profiler_skip_first_wait",
        ):
            if profiling[key] is not None and profiling[key] < 0:
                _fail(run, "profiling", key, f"must be >= 0, got {profiling[key]}")
    if profiling["enable_memory_snapshot"]:
        _positive(run, "profiling", "memory_snapshot_max_entries")
        if profiling["memory_snapshot_freq"] is not None:
            _positive(run, "profiling", "memory_snapshot_freq")
    if environment and profiling["enable_memory_snapshot"] and not torch.cuda.is_available():
        _fail(
            run,
            "profiling",
            "enable_memory_snapshot",
            "records CUDA allocator snapshots (torch.cuda.memory); this machine has no CUDA GPU",
        )
    ac = run["activation_checkpoint"]
    if ac["mode"] != "none" and ac["determinism_check"] not in ("default", "none"):
        _fail(
            run,
            "activation_checkpoint",
            "determinism_check",
            f"must be 'default' or 'none' (torch.utils."
            f"checkpoint's), got {ac['determinism_check']!r}",
        )
    if compile_["enable"]:
        from torch import _dynamo  # only a compiled run pays for its import

        if compile_["backend"] not in _dynamo.list_backends(exclude_tags=()):
            _fail(
                run,
                "compile",
                "backend",
                f"is {compile_['backend']!r}, not a torch.compile backend here; "
                f"the usual ones: {', '.join(_dynamo.list_backends())}",
            )
    for component in compile_["components"]:
        if component not in ("model", "loss"):
            _fail(
                run,
                "compile",
                "components",
                f"entries must be 'model' or 'loss', got {component!r}",
            )


def check_ignored_data_keys(run: RunConfig) -> None:
    """A key set to something other than its default that the chosen dataset never reads (a resolved
    config, which lists every key, keeps the defaults there)."""
    dataset = run["dataloader"]["dataset"]
    reads = DATASET_KINDS[dataset] | {"dataset", "seed", "answer_only_loss", "allow_changed_data"}
    defaults = {key: default for key, (_, default) in section_schema("dataloader").items()}
    for (section, key), _ in run.origins.items():
        if section == "dataloader" and key not in reads and run["dataloader"][key] != defaults[key]:
            readers = sorted(kind for kind, keys in DATASET_KINDS.items() if key in keys)
            if (
                dataset == "builtin" and readers
            ):  # the default dataset: a path or sources means one's own data
                wanted = (
                    _dataset_for(run["dataloader"][key]) if key == "dataset_path" else readers[0]
                )
                _fail(
                    run,
                    "dataloader",
                    key,
                    f"is set, but dataset = 'builtin' (the built-in corpus) reads no "
                    f'{key}: for your own data set dataset = "{wanted}" ({key} is read by '
                    "dataset = "
                    f"{' or '.join(map(repr, readers))}), or remove it "
                    f"(--dataloader.{key} unset)",
                )
            _fail(
                run,
                "dataloader",
                key,
                f"is set, but dataset = {dataset!r} does not read it; remove it "
                f"(--dataloader.{key} unset) (it reads {', '.join(sorted(reads - {'dataset'}))})",
            )


def _dataset_for(path: str) -> str:
    """The dataset kind a path is for: a folder of `canon-titan data tokenize` is 'tokens', else
    'files'."""
    return "tokens" if (Path(path) / "index.json").is_file() else "files"


def check_paths_exist(run: RunConfig) -> None:
    """Every input path that does not exist, named at once (an unedited recipe has two placeholders:
    fixing one and running again to learn of the next wastes a launch)."""
    data, tokenizer = run["dataloader"], run["tokenizer"]
    paths = {("tokenizer", "path"): tokenizer["path"]}
    if data["dataset"] in ("files", "tokens") and not any(
        c in (data["dataset_path"] or "") for c in "*?["
    ):
        paths[("dataloader", "dataset_path")] = data["dataset_path"]
    missing = [
        (key, path)
        for key, path in paths.items()
        if path and "://" not in path and not os.path.exists(path)
    ]
    if missing:
        raise ConfigError(
            run.origins.get(missing[0][0], run.source),
            "",
            "; ".join(f"[{s}] {k} = {p!r} does not exist{read_from(p)}" for (s, k), p in missing)
            + (" (edit each, or pass --section.key value)" if len(missing) > 1 else ""),
        )


def check_data(run: RunConfig, environment: bool) -> None:
    data = run["dataloader"]
    check_ignored_data_keys(run)
    if data["num_workers"] < 0:
        _fail(run, "dataloader", "num_workers", "must be >= 0 (0: read in the training process)")
    if environment:
        check_paths_exist(run)
    if data["dataset"] in SYNTHETIC:
        check_synthetic(run, environment)
        if data["dataset"] != "capo_bios":
            return
    elif data["answer_only_loss"]:
        _fail(
            run,
            "dataloader",
            "answer_only_loss",
            f"applies to the synthetic integer-token tasks, not dataset = {data['dataset']!r}",
        )
    elif data["dataset"] == "stream":
        if not data["sources"]:
            _fail(
                run,
                "dataloader",
                "sources",
                "dataset = 'stream' needs at least one glob in sources",
            )
        if data["weights"] and (
            len(data["weights"]) != len(data["sources"]) or min(data["weights"]) <= 0
        ):
            _fail(
                run,
                "dataloader",
                "weights",
                f"needs one positive weight per source ({len(data['sources'])})",
            )
        if data["shuffle_buffer"] < 1:
            _fail(run, "dataloader", "shuffle_buffer", "must be >= 1 (1: no shuffle)")
        if environment:
            try:
                for path in expand_inputs(
                    [x for x in data["sources"] if not x.startswith("hf:")] or []
                ):
                    file_kind(path)
            except DataError as e:
                _fail(run, "dataloader", "sources", str(e))
    elif environment:
        try:
            resolve_paths(data["dataset"], data["dataset_path"])
        except (DataConfigError, DataError, OSError) as e:
            _fail(
                run,
                "dataloader",
                "dataset_path" if data["dataset"] in ("files", "tokens") else "dataset",
                str(e),
            )
    check_tokenizer(run, environment)


def check_tokenizer(run: RunConfig, environment: bool) -> None:
    """The tokenizer is named and readable, and an explicit ``[model] vocab_size`` matches it."""
    kind, path = run["tokenizer"]["kind"], run["tokenizer"]["path"]
    if path is None and kind != "hf":
        _fail(
            run,
            "tokenizer",
            "kind",
            f"{kind!r} needs a [tokenizer] path (the built-in tokenizer is kind 'hf')",
        )
    if run.tokenizer_vocab is None:
        if environment:
            _fail(run, "tokenizer", "path", f"no {kind} tokenizer at {path}")
        return
    if run.weights_vocab is not None:
        return  # converting weights, which need no tokenizer
    vocab_size = run.model_args.vocab_size
    if ("model", "vocab_size") in run.origins and vocab_size != run.tokenizer_vocab:
        _fail(
            run,
            "model",
            "vocab_size",
            f"is {vocab_size} but the {kind} tokenizer at {path or ASSET_DIR} has "
            f"{run.tokenizer_vocab} ids; remove the key to follow the tokenizer",
        )


def check_synthetic(run: RunConfig, environment: bool) -> None:
    """The chosen task's samples fit ``seq_len``; integer-token tasks need a vocabulary of VOCAB
    ids."""
    dataset = run["dataloader"]["dataset"]
    if dataset == "capo_bios" and run["dataloader"]["answer_only_loss"]:
        _fail(
            run,
            "dataloader",
            "answer_only_loss",
            f"{dataset} trains on whole biographies; set it to false",
        )
    if dataset != "capo_bios" and run.model_args.vocab_size < VOCAB:
        _fail(
            run,
            "model",
            "vocab_size",
            f"is {run.model_args.vocab_size}; {dataset} uses token ids up to "
            f"{VOCAB - 1}, so it must be >= {VOCAB} (or remove the key)",
        )
    own = SECTION[dataset]
    if not environment and any(run[own].get(k) for k in ("grammar", "bior_path")):
        return  # the task needs its file
    task = run.task
    seq_len = run["training"]["seq_len"]
    longest, shortest = task.max_length(), task.min_length()
    if longest is not None and longest > seq_len + 1:
        _fail(
            run,
            "training",
            "seq_len",
            f"is {seq_len}, but {dataset} samples with these [{own}] settings can "
            f"be {longest} tokens long; use seq_len >= {longest - 1} or a smaller task",
        )
    if shortest is not None and shortest > seq_len + 1:
        _fail(
            run,
            "training",
            "seq_len",
            f"is {seq_len}, but the shortest {dataset} sample has {shortest} tokens",
        )
    if (
        task.text and environment
    ):  # biography lengths depend on the tokenizer: measure a few hundred
        try:
            tokenizer = build_tokenizer(
                run["tokenizer"]["kind"], run["tokenizer"]["path"] or str(ASSET_DIR)
            )
        except (FileNotFoundError, OSError):
            return  # reported by the tokenizer check
        rng = random.Random(0)
        longest = max(
            len(tokenizer.encode(task.train_sample(rng), add_bos=True, add_eos=True))
            for _ in range(200)
        )
        if longest > seq_len + 1:
            _fail(
                run,
                "training",
                "seq_len",
                f"is {seq_len}, but {dataset} biographies reach {longest} tokens "
                f"with this tokenizer; use seq_len >= {longest} (rarer longer ones are skipped)",
            )


def check_eval(run: RunConfig, environment: bool) -> None:
    section = run["eval"]
    if section["every"] < 0:
        _fail(run, "eval", "every", "must be >= 0 (0 = no evaluation during training)")
    if section["every"] and not section["tasks"] and not section["synthetic"]:
        _fail(
            run,
            "eval",
            "every",
            "is set, but there is nothing to evaluate: set tasks and/or synthetic = true",
        )
    if section["synthetic"] and run["dataloader"]["dataset"] not in SYNTHETIC:
        _fail(
            run,
            "eval",
            "synthetic",
            f"needs a synthetic [dataloader] dataset ({', '.join(SYNTHETIC)}), "
            f"not {run['dataloader']['dataset']!r}",
        )
    for key in ("synthetic_count", "batch_size", "max_seconds"):
        if section[key] <= 0:
            _fail(run, "eval", key, "must be > 0")
    if section["limit"] < 0:
        _fail(run, "eval", "limit", "must be >= 0 (0 = every item of each task)")
    if section["tasks"] and environment and section["every"]:
        try:
            lm.require_lm_eval()
            lm.task_manager(
                lm.expand_suites(section["tasks"]), section["data_dir"], section["include_path"]
            )
        except lm.LMEvalError as e:
            _fail(run, "eval", "tasks", str(e))


def check_validation(run: RunConfig, environment: bool) -> None:
    """``[validation]``: its amount, the held-out data of the run's dataset kind, and on this
    machine that the data is there (a path that matches nothing, a held-out fraction that leaves no
    training shard, a held-out token folder of another tokenizer fail here)."""
    section, data = run["validation"], run["dataloader"]
    dataset = data["dataset"]
    if section["every"] < 1:
        _fail(run, "validation", "every", f"must be >= 1, got {section['every']}")
    for key in ("steps", "tokens"):
        if section[key] < 0:
            _fail(run, "validation", key, f"must be >= 0, got {section[key]}")
    if section["steps"] and section["tokens"]:
        _fail(
            run,
            "validation",
            "tokens",
            "is set with steps: set one of them (how much a validation reads)",
        )
    defaults = {key: default for key, (_, default) in section_schema("validation").items()}
    reads = SOURCE_KEYS[dataset]
    for key in ("dataset_path", "held_out_fraction", "sources", "seed"):
        if key not in reads and section[key] != defaults[key]:
            source = " or ".join(reads) if reads else "its held-out split"
            _fail(
                run,
                "validation",
                key,
                f"is set, but dataset = {dataset!r} validates on {source}; remove it",
            )
    fraction, path = section["held_out_fraction"], section["dataset_path"]
    if not 0 <= fraction < 1:
        _fail(run, "validation", "held_out_fraction", f"must be in [0, 1), got {fraction}")
    if fraction and path:
        _fail(
            run,
            "validation",
            "held_out_fraction",
            "is set with dataset_path: validate on a "
            "held-out folder or on a fraction of the run's own shards, not both",
        )
    if dataset in SYNTHETIC and section["seed"] == data["seed"]:
        _fail(
            run,
            "validation",
            "seed",
            f"is {section['seed']}, the training stream's "
            "[dataloader] seed: the held-out samples must come from another seed",
        )
    if section["enable"]:
        needs = {
            "tokens": not (path or fraction),
            "files": not path,
            "stream": not section["sources"],
        }
        if needs.get(dataset):
            _fail(
                run,
                "validation",
                reads[0],
                f"dataset = {dataset!r} validates on held-out "
                f"data of its own: set {' or '.join(reads)}",
            )
        endless = dataset == "stream" or dataset in SYNTHETIC
        if endless and not (section["steps"] or section["tokens"]):
            _fail(
                run, "validation", "steps", f"dataset = {dataset!r} is endless: set steps or tokens"
            )
    if environment:
        check_held_out_data(run)


def check_held_out_data(run: RunConfig) -> None:
    section, data = run["validation"], run["dataloader"]
    dataset, fraction = data["dataset"], section["held_out_fraction"]
    if fraction and dataset == "tokens" and data["dataset_path"]:
        shards = [s for s in read_index(data["dataset_path"])["shards"] if s["tokens"]]
        held_out = held_out_shards(data["dataset_path"], fraction)
        if len(held_out) >= len(shards):
            _fail(
                run,
                "validation",
                "held_out_fraction",
                f"{fraction} of the {len(shards)} "
                f"shard(s) of {data['dataset_path']} holds out {len(held_out)}, which leaves no "
                "training data; use a smaller fraction, more shards, or a held-out folder "
                "(dataset_path)",
            )
    path = section["dataset_path"]
    try:
        if path and dataset == "tokens":
            if not os.path.exists(path):
                raise DataError(f"{path!r} does not exist{read_from(path)}")
            check_tokenized_alike(run, read_index(path))
        elif path and dataset == "files":
            for file in expand_inputs(path):
                file_kind(file)
        for source in section["sources"] if dataset == "stream" else []:
            for file in [] if source.startswith("hf:") else expand_inputs(source):
                file_kind(file)
    except DataError as e:
        _fail(run, "validation", "sources" if dataset == "stream" else "dataset_path", str(e))


def check_tokenized_alike(run: RunConfig, index: dict) -> None:
    """A held-out token folder was tokenized as the run tokenizes: the kind and vocabulary of its
    [tokenizer], the BOS and EOS ids of its training folder."""
    held_out = index["tokenizer"]
    training = read_index(run["dataloader"]["dataset_path"])["tokenizer"]
    expected = {
        "kind": run["tokenizer"]["kind"],
        "vocab_size": run.tokenizer_vocab or training["vocab_size"],
        "bos_id": training.get("bos_id"),
        "eos_id": training.get("eos_id"),
    }
    if any(held_out.get(key) != value for key, value in expected.items()):

        def described(t):
            return (
                f"{t['kind']} tokenizer of {t['vocab_size']} ids (BOS {t.get('bos_id')}, "
                f"EOS {t.get('eos_id')})"
            )

        _fail(
            run,
            "validation",
            "dataset_path",
            f"{run['validation']['dataset_path']} was "
            f"tokenized with a {described(held_out)} from {held_out.get('path')}, the run with a "
            f"{described(expected)}: tokenize the held-out documents with the run's [tokenizer]",
        )


def check_divergence(run: RunConfig) -> None:
    section = run["divergence"]
    for key in ("max_nonfinite_steps", "spike_window", "max_consecutive_skips"):
        if section[key] < 1:
            _fail(run, "divergence", key, "must be >= 1")
    if section["spike_factor"] and section["spike_factor"] <= 1:
        _fail(
            run,
            "divergence",
            "spike_factor",
            "must be > 1 (a multiple of the running mean loss), or 0 for no check",
        )
    if run["job"]["stop_grace_seconds"] < 1:
        _fail(run, "job", "stop_grace_seconds", "must be >= 1")


def check_job(run: RunConfig) -> None:
    """The dump folder is named; the data seed is one numpy's generators take (the packed loaders
    seed each epoch's order from it); text is read from a named field; pipeline stages split the
    layers."""
    if not run["job"]["dump_folder"].strip():
        _fail(
            run,
            "job",
            "dump_folder",
            "must name a folder (it holds the checkpoints, TensorBoard events and "
            "the run's lock; an empty one would scatter them over the current directory)",
        )
    if run["dataloader"]["seed"] < 0:
        _fail(run, "dataloader", "seed", f"must be >= 0, got {run['dataloader']['seed']}")
    data = run["dataloader"]
    if "text_key" in DATASET_KINDS[data["dataset"]] and not data["text_key"].strip():
        _fail(run, "dataloader", "text_key", 'must name the documents\' text field (e.g. "text")')
    par = run["parallelism"]
    if par["pipeline_parallel_degree"] > 1:
        for key in (
            "pipeline_parallel_first_stage_less_layers",
            "pipeline_parallel_last_stage_less_layers",
        ):
            if par[key] < 0:
                _fail(run, "parallelism", key, f"must be >= 0, got {par[key]}")
        if (
            par["pipeline_parallel_layers_per_stage"] is not None
            and par["pipeline_parallel_layers_per_stage"] < 1
        ):
            _fail(
                run,
                "parallelism",
                "pipeline_parallel_layers_per_stage",
                f"must be >= 1 (or unset), got {par['pipeline_parallel_layers_per_stage']}",
            )


def check_run(run: RunConfig, environment: bool = True) -> None:
    check_finite(run)
    check_job(run)
    check_model(run, environment)
    check_training(run)
    check_initial_load(run, environment)
    check_parallelism(run, environment)
    check_features(run, environment)
    check_data(run, environment)
    check_eval(run, environment)
    check_validation(run, environment)
    check_divergence(run)
