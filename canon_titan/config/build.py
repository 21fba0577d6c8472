"""A resolved ``RunConfig`` -> the TorchTitan ``Trainer.Config`` (our subclass) that runs it."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from canon_titan.components.divergence import DivergenceSection
from canon_titan.components.float8 import float8_converter
from canon_titan.components.loss import ZLossCrossEntropy
from canon_titan.components.validation import HeldOutValidator
from canon_titan.config.run import ConfigError, RunConfig
from canon_titan.config.titan_sections import titan_sections
from canon_titan.config.toml_writer import run_toml
from canon_titan.data.builtin import ASSET_DIR
from canon_titan.data.held_out import validation_loader
from canon_titan.data.kinds import STREAM, SYNTHETIC
from canon_titan.data.packed import PackedTextDataLoader
from canon_titan.data.streaming import StreamingTextDataLoader
from canon_titan.data.synthetic import loader_config
from canon_titan.data.tokenizers import tokenizer_config
from canon_titan.evaluation.in_training import EvalSettings
from canon_titan.evaluation.synthetic import DEFAULT_TEST_SEED
from canon_titan.trainer import CanonMetrics, CanonTrainer
from synthetic_data.tasks import SECTION


def _model_spec(run: RunConfig):
    """The run's spec, its model config float8-converted when ``[float8]`` asks (on a copy: the
    run's own config stays the plain one, which evaluation and conversion build)."""
    spec = run.model_spec()
    f8 = run["float8"]
    if not f8["enable"]:
        return spec
    compiled = run["compile"]["enable"] and "model" in run["compile"]["components"]
    return dataclasses.replace(
        spec, model=float8_converter(f8, compiled).convert(copy.deepcopy(spec.model))
    )


def _activation_checkpoint(section: dict):
    kwargs = {k: section[k] for k in ("preserve_rng_state", "determinism_check", "debug")}
    if section["mode"] == "selective":
        return SelectiveAC.Config(**kwargs)
    if section["mode"] == "full":
        return FullAC.Config(**kwargs)
    return None


def _dataloader(run: RunConfig):
    section = run["dataloader"]
    if section["dataset"] in SYNTHETIC:
        return loader_config(run)
    common = (
        "dataset",
        "text_key",
        "on_error",
        "seed",
        "add_bos",
        "add_eos",
        "document_masking",
        "num_workers",
        "pin_memory",
    )
    if section["dataset"] in STREAM:
        keys = common + ("sources", "weights", "shuffle_buffer")
        return StreamingTextDataLoader.Config(**{k: section[k] for k in keys})
    keys = common + ("dataset_path", "shuffle", "infinite")
    return PackedTextDataLoader.Config(
        **{k: section[k] for k in keys}, held_out_fraction=run["validation"]["held_out_fraction"]
    )


def _eval_settings(run: RunConfig, tokenizer_path: str):
    section = run["eval"]
    if not section["every"]:
        return None
    dataset = run["dataloader"]["dataset"]
    task = (
        {k: v for k, v in run[SECTION[dataset]].items() if v is not None}
        if dataset in SECTION
        else {}
    )
    return EvalSettings(
        **{**section, "limit": section["limit"] or None},
        adapter=run.state_dict_adapter(),
        tokenizer_kind=run["tokenizer"]["kind"],
        tokenizer_path=tokenizer_path,
        seq_len=run["training"]["seq_len"],
        dataset=dataset,
        task_params=task,
        test_seed=DEFAULT_TEST_SEED,
        dump_folder=run["job"]["dump_folder"],
    )


def _validator(run: RunConfig):
    section = run["validation"]
    if not section["enable"]:
        return HeldOutValidator.Config()  # off: TorchTitan's trainer builds no validator
    return HeldOutValidator.Config(
        enable=True,
        freq=section["every"],
        steps=section["steps"] or -1,
        tokens=section["tokens"],
        dataloader=validation_loader(run),
        last_step=run["training"]["steps"],
    )


# Keys holding paths (or globs of them), made absolute in the run_config.toml a run writes, so the
# resolved copy works from any directory (eval, convert and report read it later from elsewhere).
PATH_KEYS = {
    ("job", "dump_folder"),
    ("tokenizer", "path"),
    ("dataloader", "dataset_path"),
    ("dataloader", "sources"),
    ("checkpoint", "initial_load_path"),
    ("eval", "data_dir"),
    ("eval", "include_path"),
    ("lano", "grammar"),
    ("capo", "bior_path"),
    ("validation", "dataset_path"),
    ("validation", "sources"),
}


def absolute_paths(sections: dict) -> dict:
    def absolute(value):
        if isinstance(value, list):
            return [absolute(v) for v in value]
        if not isinstance(value, str) or not value or "://" in value or value.startswith("hf:"):
            return value
        return os.path.abspath(os.path.expanduser(value))

    return {
        name: {
            key: absolute(value) if (name, key) in PATH_KEYS else value
            for key, value in body.items()
        }
        for name, body in sections.items()
    }


def _set_wandb_env(metrics: dict) -> None:
    os.environ.setdefault("WANDB_MODE", metrics["wandb_mode"])
    os.environ.setdefault("WANDB_PROJECT", metrics["wandb_project"])


def colour_output() -> bool:
    """Colour codes in the log only for a terminal: the launcher passes on whether its output is
    one (its workers write into pipes either way); without it, this process's stdout decides."""
    decided = os.environ.get("CANON_TITAN_COLOR")
    return decided == "1" if decided in ("0", "1") else sys.stdout.isatty()


def build_trainer_config(run: RunConfig):
    """Construct the trainer config; TorchTitan's own config checks surface as ConfigError."""
    job, metrics = run["job"], run["metrics"]
    _set_wandb_env(metrics)
    sections = titan_sections(run)
    spec = _model_spec(run)
    loss = (
        ZLossCrossEntropy.Config()
        if run.model_args.z_loss
        else CrossEntropyLoss.Config(global_vocab_size=run.model_args.vocab_size)
    )
    try:
        config = CanonTrainer.Config(
            model_spec=spec,
            hf_assets_path=run["tokenizer"]["path"] or str(ASSET_DIR),
            tokenizer_kind=run["tokenizer"]["kind"],
            dump_folder=job["dump_folder"],
            tokenizer=tokenizer_config(run["tokenizer"]["kind"]),
            dataloader=_dataloader(run),
            activation_checkpoint=_activation_checkpoint(run["activation_checkpoint"]),
            metrics=CanonMetrics.Config(
                **{
                    k: metrics[k]
                    for k in (
                        "log_freq",
                        "enable_tensorboard",
                        "save_tb_folder",
                        "save_for_all_ranks",
                        "enable_wandb",
                    )
                },
                disable_color_printing=metrics["disable_color_printing"] or not colour_output(),
                last_step=run["training"]["steps"],
            ),
            debug=DebugConfig(
                seed=job["seed"],
                deterministic=job["deterministic"],
                print_config=job["print_config"],
            ),
            model_seed=run.model_args.seed,
            loss=loss,
            run_toml=run_toml(run, absolute_paths(run.sections), record=True),
            divergence=DivergenceSection(**run["divergence"]),
            stop_grace_seconds=job["stop_grace_seconds"],
            allow_changed_data=run["dataloader"]["allow_changed_data"],
            model_label=run.label(),
            evaluation=_eval_settings(run, run["tokenizer"]["path"] or str(ASSET_DIR)),
            validator=_validator(run),
            **sections,
        )
    except ValueError as e:
        raise ConfigError(run.source, "[training]", str(e)) from e
    if spec is not run.model_spec():
        # The trainer fits its (float8) copy to the run (RoPE length); evaluation builds the plain
        # one.
        run.model_spec().model.update_from_config(config=config)
    return config
