"""The TOML sections: which dataclass defines each section's keys, and canon-titan's defaults.

Sections backed by a TorchTitan config expose its fields verbatim (same names, same meaning), so
TorchTitan's documentation applies. The rest are small dataclasses of our own, defined here.
``[model]`` is special: its keys are ``name``, ``flavor`` and the fields of that model family's
args dataclass (``canon_titan/models/<name>/args.py``; its flavors in ``model_registry/<name>.py``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.config.configs import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.tools.profiler import Profiler

from canon_titan.components.checkpointer import CanonCheckpointer
from canon_titan.components.divergence import DivergenceSection
from canon_titan.data.kinds import DATASET_KINDS
from synthetic_data.tasks import PARAMS


@dataclass(kw_only=True)
class JobSection:
    description: str = ""
    dump_folder: str = "./outputs"
    """Where checkpoints, TensorBoard events, wandb files and the resolved config go."""
    seed: int | None = 777
    """Base RNG seed (model init, dropout); None draws one on rank 0."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms (slower)."""
    print_config: bool = False
    stop_grace_seconds: int = 90
    """After SIGTERM or SIGINT (preemption, a time limit, Ctrl-C): seconds to finish the step and
    save it before exiting anyway; keep it below the scheduler's warning (SLURM
    --signal=TERM@120)."""


@dataclass(kw_only=True)
class TokenizerSection:
    kind: Literal["hf", "sentencepiece", "tiktoken"] = "hf"
    """hf: tokenizer.json folder; sentencepiece: Llama-2 tokenizer.model; tiktoken: Llama-3 BPE
    ranks file."""
    path: str | None = None
    """The tokenizer file or its folder; None uses the built-in tokenizer (kind = "hf")."""


@dataclass(kw_only=True)
class DataloaderSection:
    dataset: Literal[tuple(DATASET_KINDS)] = "builtin"
    """builtin: the project's corpus; files: document files tokenized in memory at start-up;
    tokens: a folder from `canon-titan data tokenize` (memory-mapped); stream: documents read and
    tokenized while training, from `sources` mixed by `weights`. depo1 ... capo_bios: a synthetic
    playground task generated on the fly, with its parameters in [depo], [brevo], [mano], [lano]
    or [capo]."""
    dataset_path: str | None = None
    """files: glob of documents; tokens: the token folder."""
    sources: list[str] = field(default_factory=list)
    """stream: per source, a glob of document files or "hf:NAME[:CONFIG[:SPLIT]]" (Hub
    streaming)."""
    weights: list[float] = field(default_factory=list)
    """stream: mixture weights, one per source (default equal)."""
    text_key: str = "text"
    on_error: Literal["fail", "skip"] = "fail"
    """A bad record (not JSON, no text field, truncated .zst): fail, or skip and count it."""
    seed: int = 777
    shuffle: bool = True
    """builtin/files/tokens: shuffle the windows per epoch."""
    shuffle_buffer: int = 64
    """stream: windows held in the shuffle buffer (1 = no shuffle)."""
    num_workers: int = 0
    """builtin/files/tokens/stream: loader worker processes per rank, which read and pack the next
    batches while the step runs (0 = in the training process)."""
    pin_memory: bool = True
    """Build each batch in pinned (page-locked) host memory where CUDA is available, so that its
    copy to the GPU is a DMA the host does not wait for; false: pageable memory."""
    add_bos: bool = True
    add_eos: bool = True
    infinite: bool = True
    """builtin/files/tokens: start a new epoch when the data runs out, instead of stopping."""
    document_masking: bool = False
    """Keep each packed document apart (positions restart at every BOS): attention and RoPE inside
    it; the linear models' state, short convolutions and Canon layers start at it; LlamaCanon's
    Canon layers with [model] canon_document_reset. The reference runs across documents. Synthetic
    tasks always restart positions at every sample."""
    allow_changed_data: bool = False
    """Resume although the data differs from the checkpoint's (its loader state then starts a new
    pass over the new data); without it such a resume is refused."""
    answer_only_loss: bool | None = None
    """Synthetic integer-token tasks: train only on answer tokens, the other labels are ignored by
    the loss. Unset: true for those tasks (the reference's choice), false for text (capo_bios and
    the text datasets train on every token)."""


@dataclass(kw_only=True)
class OptimizerSection:
    name: Literal["AdamW", "Adam"] = "AdamW"
    lr: float = 8e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Applied to every parameter (norms, embeddings, Canon weights too), as in the reference."""
    implementation: Literal["for-loop", "foreach", "fused"] = "fused"


@dataclass(kw_only=True)
class ActivationCheckpointSection:
    mode: Literal["none", "selective", "full"] = "none"
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False


@dataclass(kw_only=True)
class Float8Section:
    enable: bool = False
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "rowwise"
    emulate: bool = False
    """Emulate float8 matmuls in high precision: tests the float8 path on hardware without it."""
    filter_fqns: list[str] = field(default_factory=lambda: ["lm_head"])
    """Linear layers whose name contains one of these stay in high precision."""
    enable_fsdp_float8_all_gather: bool = False
    """FSDP all-gathers the float8 linears' weights in float8 (one byte an element; each rank casts
    its shard, with one all-reduce of the weight's amax) instead of in the param dtype: half the
    gathered bytes and buffers of those weights. Tensorwise scaling only (one scale a weight)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With ``enable_fsdp_float8_all_gather``: after the checkpoint load and each optimizer step,
    compute every float8 weight's scale in one all-reduce, instead of one all-reduce a weight at its
    all-gather. Required under tensor parallelism (the all-gather's own amax is a TP shard's)."""


@dataclass(kw_only=True)
class MetricsSection:
    log_freq: int = 10
    enable_tensorboard: bool = True
    save_tb_folder: str = "tb"
    save_for_all_ranks: bool = False
    enable_wandb: bool = False
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """Sets WANDB_MODE unless the environment already does."""
    wandb_project: str = "canon-titan"
    disable_color_printing: bool = False


@dataclass(kw_only=True)
class EvalSection:
    every: int = 0
    """Evaluate every this many steps and at the last step (0 = never)."""
    tasks: list[str] = field(default_factory=list)
    """lm-eval tasks, groups or suites (avg10, all13, eval/ tasks such as multihop_1hop)."""
    synthetic: bool = False
    """Score the run's synthetic task (its held-out test set) with greedy generation."""
    synthetic_count: int = 20
    """Synthetic test items per group (e.g. per hop count)."""
    limit: int = 100
    """Items per lm-eval task (0 = every item, as the release recipes evaluate)."""
    ranks: Literal["first", "all"] = "first"
    """first: rank 0 evaluates while the others wait; all: synthetic items are split over all
    ranks (each holds a full copy of the weights). lm-eval tasks always run on rank 0."""
    max_seconds: float = 600.0
    """Time budget per evaluation: remaining synthetic items and lm-eval tasks are skipped."""
    dtype: Literal["fp32", "bf16"] = "bf16"
    batch_size: int = 1
    data_dir: str | None = None
    """Folder of the local test files of the eval/ tasks (default $CANON_EVAL_DATA or
    ./eval_data)."""
    include_path: list[str] = field(default_factory=list)
    """More folders of lm-eval task YAMLs."""


@dataclass(kw_only=True)
class ValidationSection:
    enable: bool = False
    """The mean token loss (and its perplexity) on held-out data during training; the release
    recipes keep it off, as the release's ``validation: null``."""
    every: int = 500
    """Validate every this many steps and at the last step."""
    steps: int = 0
    """Batches per validation (each [training] local_batch_size sequences a data-parallel rank);
    0: as many as ``tokens`` needs, or with neither every window of the held-out data once."""
    tokens: int = 0
    """Tokens per validation instead of ``steps`` (rounded up to whole batches)."""
    dataset_path: str | None = None
    """tokens: a held-out token folder from `canon-titan data tokenize`; files: a glob of held-out
    documents."""
    held_out_fraction: float = 0.0
    """tokens: validate on this fraction of the run's own shards (spread over the folder), which
    training then skips."""
    sources: list[str] = field(default_factory=list)
    """stream: the held-out sources, mixed equally (globs of document files or
    "hf:NAME[:CONFIG[:SPLIT]]")."""
    seed: int = 20261205
    """Synthetic tasks: the seed of the held-out sample stream (the same for every run validated on
    it; not [dataloader] seed); stream: of its mixture."""


def _task_section(params_cls: type) -> type:
    """A TOML section with the keys of a synthetic task's parameters, all defaulting to None
    (= the preset of the chosen dataset, e.g. depo1's or depo2's N)."""
    hints = typing.get_type_hints(params_cls)
    return dataclasses.make_dataclass(
        params_cls.__name__.replace("Params", "Section"),
        [
            (f.name, hints[f.name] | None, field(default=None))
            for f in dataclasses.fields(params_cls)
        ],
        kw_only=True,
    )


TASK_SECTIONS = {name: _task_section(cls) for name, cls in PARAMS.items()}


@dataclass(frozen=True)
class Section:
    cls: type
    defaults: dict = field(default_factory=dict)
    """canon-titan's defaults where they differ from the dataclass's."""
    hidden: tuple[str, ...] = ()
    """Fields of a TorchTitan dataclass that a TOML file cannot set."""


SECTIONS: dict[str, Section] = {
    "job": Section(JobSection),
    "tokenizer": Section(TokenizerSection),
    "training": Section(
        TrainingConfig,
        # CUDA graphs are new in TorchTitan 0.3 and do not support PP; the reference has none.
        defaults={
            "disable_cuda_graphs": True,
            "steps": 1000,
            "local_batch_size": 8,
            "seq_len": 4096,
        },
    ),
    "optimizer": Section(OptimizerSection),
    "lr_scheduler": Section(
        LRSchedulersContainer.Config,
        defaults={"warmup_steps": 200, "decay_type": "cosine", "min_lr_factor": 0.01},
    ),
    "dataloader": Section(DataloaderSection),
    "parallelism": Section(
        ParallelismConfig,
        # spmd_types needs fully_shard to convert SPMD annotations (torch >= 2.14);
        # partial_dtensor (DTensor for model-parallel axes) works on every supported torch.
        defaults={"spmd_backend": "partial_dtensor"},
        hidden=("context_parallel_ptrr_mask_key", "pipeline_parallel_schedule_csv"),
    ),
    "checkpoint": Section(
        CanonCheckpointer.Config,
        hidden=("initial_load_in_hf_quantized", "precompute_float8_scales"),
    ),
    "activation_checkpoint": Section(ActivationCheckpointSection),
    "compile": Section(CompileConfig, hidden=("enable_async_tensor_parallel",)),
    "float8": Section(Float8Section),
    "metrics": Section(MetricsSection),
    "divergence": Section(DivergenceSection),
    "eval": Section(EvalSection),
    "validation": Section(ValidationSection),
    "comm": Section(
        CommConfig,
        hidden=("mode", "trace_buf_size", "save_traces_folder", "save_traces_file_prefix"),
    ),
    # TorchTitan's profiler: torch.profiler traces (and CUDA memory snapshots) under the dump
    # folder.
    "profiling": Section(Profiler.Config, hidden=("trace_post_processor",)),
    **{name: Section(cls) for name, cls in TASK_SECTIONS.items()},
}


def fields_of(cls, hidden=()) -> dict[str, tuple[Any, Any]]:
    """name -> (annotation, default) of a dataclass's settable fields."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in hidden or f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        out[f.name] = (hints[f.name], default)
    return out


def section_schema(name: str) -> dict[str, tuple[Any, Any]]:
    spec = SECTIONS[name]
    schema = fields_of(spec.cls, spec.hidden)
    for key, value in spec.defaults.items():
        schema[key] = (schema[key][0], value)
    return schema
