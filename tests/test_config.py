"""TOML config: resolution, overrides, and the errors users see (file, key, allowed values)."""

import tomllib

import pytest

from canon_titan import cli
from canon_titan.config import ConfigError, dumps, load, parse_overrides
from canon_titan.config.build import build_trainer_config
from conftest import DEBUG_CONFIG, REPO


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


MINIMAL = '[model]\nname = "llama"\nflavor = "debug"\n[training]\nseq_len = 64\n'


def test_file_values_defaults_and_override_precedence(tmp_path):
    path = write(tmp_path, MINIMAL + "steps = 5\n[optimizer]\nlr = 0.01\n")
    run = load(
        path, ["--training.steps", "9", "--optimizer.betas=[0.8, 0.9]", "--model.qk_norm", "false"]
    )
    assert run["training"]["steps"] == 9  # command line beats the file
    assert run["training"]["seq_len"] == 64  # from the file
    assert run["optimizer"]["lr"] == 0.01
    assert run["optimizer"]["betas"] == [0.8, 0.9]
    assert run["parallelism"]["spmd_backend"] == "partial_dtensor"  # canon-titan default
    assert run.model_args.qk_norm is False and run.model_args.dim == 128  # flavor + override
    assert run.origins[("training", "steps")] == "command line"


def test_integers_widen_to_float_but_bools_are_not_ints(tmp_path):
    run = load(write(tmp_path, MINIMAL + "max_norm = 2\n"))
    assert run["training"]["max_norm"] == 2
    with pytest.raises(ConfigError, match=r"\[training\] steps: expected an integer, got True"):
        load(write(tmp_path, MINIMAL + "steps = true\n"))


def test_unknown_key_names_file_key_and_allowed(tmp_path):
    path = write(tmp_path, MINIMAL + "stepz = 3\n")
    with pytest.raises(ConfigError) as e:
        load(path)
    msg = str(e.value)
    assert (
        str(path) in msg and "[training] stepz" in msg and "allowed keys:" in msg and "steps" in msg
    )


def test_unknown_model_key_lists_family_fields(tmp_path):
    with pytest.raises(
        ConfigError, match=r"\[model\] hidden_size: unknown key; allowed keys: .*ffn_hidden_dim"
    ):
        load(
            write(
                tmp_path, MINIMAL.replace('flavor = "debug"', 'flavor = "debug"\nhidden_size = 3')
            )
        )


def test_wrong_type_names_expected_type(tmp_path):
    path = write(tmp_path, MINIMAL + 'steps = "ten"\n')
    with pytest.raises(
        ConfigError, match=r"run.toml: \[training\] steps: expected an integer, got 'ten'"
    ):
        load(path)
    with pytest.raises(
        ConfigError, match=r"\[training\] dtype: expected one of 'bfloat16', 'float32', got 'fp8'"
    ):
        load(write(tmp_path, MINIMAL), ["--training.dtype", "fp8"])


def test_bad_flavor_and_name_list_what_exists(tmp_path):
    with pytest.raises(
        ConfigError, match=r"\[model\] flavor: unknown flavor '2B'.*available: debug, 1B, 3B, 8B"
    ):
        load(write(tmp_path, MINIMAL.replace('"debug"', '"2B"')))
    with pytest.raises(
        ConfigError, match=r"\[model\] name: unknown model name 'gpt2'; available: llama"
    ):
        load(write(tmp_path, MINIMAL.replace('"llama"', '"gpt2"')))


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.toml: config file not found"):
        load(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"bad.toml: not valid TOML"):
        load(write(tmp_path, "[model\nname=", "bad.toml"))


def test_unknown_section_and_missing_model(tmp_path):
    with pytest.raises(
        ConfigError, match=r"\[trainer\]: unknown section; allowed sections: model, job"
    ):
        load(write(tmp_path, MINIMAL + "[trainer]\nsteps = 1\n"))
    with pytest.raises(ConfigError, match=r"\[model\] name: required"):
        load(write(tmp_path, "[training]\nsteps = 1\n"))


@pytest.mark.parametrize(
    "override, key, message",
    [
        (["--model.rope_dim", "7"], "[model] rope_dim", "even number"),
        (["--model.n_kv_heads", "3"], "[model] n_kv_heads", "divide n_heads"),
        (
            ["--parallelism.tensor_parallel_degree", "3"],
            "[parallelism] tensor_parallel_degree",
            "must divide model n_heads",
        ),
        (["--float8.enable"], "[float8] enable", "compute capability"),
        (
            ["--float8.enable", "--float8.emulate", "--compile.enable"],
            "[float8] emulate",
            "eager mode only",
        ),
        (["--lr_scheduler.min_lr_factor", "1.5"], "[lr_scheduler] min_lr_factor", "[0, 1]"),
        (["--model.vocab_size", "100"], "[model] vocab_size", "but the hf tokenizer at"),
        (["--tokenizer.kind", "sentencepiece"], "[tokenizer] kind", "needs a [tokenizer] path"),
        (
            ["--dataloader.dataset", "files", "--dataloader.dataset_path", "/no/such/*.jsonl"],
            "[dataloader] dataset_path",
            "matches no file",
        ),
        (
            ["--parallelism.spmd_backend", "spmd_types"],
            "[parallelism] spmd_backend",
            "only 'partial_dtensor'",
        ),
        (
            ["--float8.recipe_name", "mxfp8"],
            "[float8] recipe_name",
            "expected one of 'tensorwise', 'rowwise'",
        ),
        (
            [
                "--float8.enable",
                "--float8.emulate",
                "--float8.enable_fsdp_float8_all_gather",
                "true",
            ],
            "[float8] enable_fsdp_float8_all_gather",
            "needs recipe_name = 'tensorwise', got 'rowwise'",
        ),
        (
            [
                "--float8.enable",
                "--float8.emulate",
                "--float8.recipe_name",
                "tensorwise",
                "--float8.precompute_float8_dynamic_scale_for_fsdp",
                "true",
            ],
            "[float8] precompute_float8_dynamic_scale_for_fsdp",
            "needs enable_fsdp_float8_all_gather = true",
        ),
        (
            [
                "--float8.enable",
                "--float8.emulate",
                "--float8.recipe_name",
                "tensorwise",
                "--float8.enable_fsdp_float8_all_gather",
                "true",
                "--parallelism.tensor_parallel_degree",
                "2",
            ],
            "[float8] enable_fsdp_float8_all_gather",
            "under tensor parallelism needs precompute_float8_dynamic_scale_for_fsdp = true",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "Bogus",
            ],
            "[parallelism] pipeline_parallel_schedule",
            "Bogus",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--training.local_batch_size",
                "3",
                "--parallelism.pipeline_parallel_microbatch_size",
                "2",
            ],
            "[parallelism] pipeline_parallel_microbatch_size",
            "must divide training.local_batch_size (3)",
        ),
    ],
)
def test_impossible_values_fail_before_training(override, key, message):
    with pytest.raises(ConfigError) as e:
        load(DEBUG_CONFIG, override)
    assert e.value.source == "command line" and e.value.key == key and message in e.value.message


@pytest.mark.parametrize(
    "override, key, message",
    [
        (["--job.dump_folder", ""], "[job] dump_folder", "must name a folder"),
        (["--job.dump_folder", "  "], "[job] dump_folder", "must name a folder"),
        (["--dataloader.seed", "-1"], "[dataloader] seed", "must be >= 0, got -1"),
        (
            ["--lr_scheduler.total_steps", "-3"],
            "[lr_scheduler] total_steps",
            "is -3, below [training] steps",
        ),
        (
            ["--lr_scheduler.total_steps", "5", "--training.steps", "10"],
            "[lr_scheduler] total_steps",
            "is 5, below [training] steps = 10",
        ),
        (
            ["--dataloader.text_key", ""],
            "[dataloader] text_key",
            "must name the documents' text field",
        ),
        (
            ["--profiling.enable_profiling", "--profiling.profiler_active", "0"],
            "[profiling] profiler_active",
            "must be > 0",
        ),
        (
            [
                "--profiling.enable_profiling",
                "--profiling.profiler_warmup",
                "-1",
                "--profiling.profile_freq",
                "10",
            ],
            "[profiling] profiler_warmup",
            "must be >= 0",
        ),
        (
            ["--profiling.enable_profiling", "--profiling.profiler_repeat", "-1"],
            "[profiling] profiler_repeat",
            "must be >= 0",
        ),
        (
            ["--profiling.enable_memory_snapshot", "--profiling.memory_snapshot_max_entries", "0"],
            "[profiling] memory_snapshot_max_entries",
            "must be > 0",
        ),
        (
            [
                "--activation_checkpoint.mode",
                "full",
                "--activation_checkpoint.determinism_check",
                "always",
            ],
            "[activation_checkpoint] determinism_check",
            "must be 'default' or 'none'",
        ),
        (
            ["--compile.enable", "--compile.backend", "inductr"],
            "[compile] backend",
            "not a torch.compile backend",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "0",
            ],
            "[parallelism] pipeline_parallel_layers_per_stage",
            "must be >= 1",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_first_stage_less_layers",
                "-1",
            ],
            "[parallelism] pipeline_parallel_first_stage_less_layers",
            "must be >= 0",
        ),
        (
            [
                "--checkpoint.enable",
                "--checkpoint.purge_before_save",
                "true",
                "--checkpoint.keep_latest_k",
                "0",
            ],
            "[checkpoint] purge_before_save",
            "needs keep_latest_k >= 2",
        ),
    ],
)
def test_values_that_failed_only_after_launch_are_refused(override, key, message):
    """Values that passed the checks at 432670c and failed in the trainer (a 75-147-line traceback
    after
    launch: issue 78) or after it started (the profiler's schedule, torch.compile, the checkpoint's
    AC determinism mode, pipeline stage splits): each is refused before launch, naming its key."""
    with pytest.raises(ConfigError) as e:
        load(DEBUG_CONFIG, override)
    assert e.value.key == key and message in e.value.message, (e.value.key, e.value.message)


@pytest.mark.parametrize(
    "override",
    [["--job.dump_folder", ""], ["--dataloader.seed", "-1"], ["--lr_scheduler.total_steps", "-3"]],
)
def test_canon_titan_train_refuses_them_before_it_launches_or_writes(
    tmp_path, monkeypatch, capsys, override
):
    """On the launch path of issue 78 (`canon-titan train`): one line, exit 2, torchrun never
    started, and nothing written in the current directory (at 432670c an empty dump_folder left
    .canon-titan.lock and tb/ there before the 75-147-line traceback)."""
    from canon_titan import cli
    from canon_titan.cli import train as cli_train

    launched = []
    monkeypatch.setattr(
        cli_train, "_run_torchrun", lambda *args, **kwargs: launched.append(args) or 0
    )
    monkeypatch.chdir(tmp_path)
    code = cli.main(["train", "--config", str(DEBUG_CONFIG), "--nproc", "2", *override])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not launched and list(tmp_path.iterdir()) == []
    assert len(err) == 1 and err[0].startswith("canon-titan: config error: command line: ["), err


def test_a_data_path_on_the_builtin_dataset_suggests_the_dataset_that_reads_it(tmp_path):
    """dataset_path (or sources) without a dataset is one's own data on the default built-in corpus:
    the message names the dataset that reads it ("files" for documents, "tokens" for a token folder,
    "stream" for sources). At 432670c it said only "remove it"."""
    (tmp_path / "index.json").write_text("{}")
    for override, wanted in (
        (["--dataloader.dataset_path", "data/*.jsonl"], 'set dataset = "files"'),
        (["--dataloader.dataset_path", str(tmp_path)], 'set dataset = "tokens"'),
        (["--dataloader.sources", '["data/*.jsonl"]'], 'set dataset = "stream"'),
    ):
        with pytest.raises(ConfigError) as e:
            load(DEBUG_CONFIG, override)
        assert (
            e.value.key == f"[dataloader] {override[0].split('.')[1]}" and wanted in e.value.message
        ), e.value.message


@pytest.mark.parametrize(
    "config, override, key, message",
    [
        (
            "mamba2",
            ["--parallelism.tensor_parallel_degree", "2"],
            "[parallelism] tensor_parallel_degree",
            "Mamba2 has no tensor-parallel plan",
        ),
        ("gla5", ["--model.canon_set", "ABCD"], "[model] canon_set", "Canon-B is not available"),
        (
            "gla5",
            ["--model.kernel_backend", "mamba_ssm"],
            "[model] kernel_backend",
            "must be one of 'auto', 'torch', 'fla'",
        ),
    ],
)
def test_linear_model_config_errors(config, override, key, message):
    with pytest.raises(ConfigError) as e:
        load(REPO / "train_configs" / f"{config}_debug.toml", override)
    assert e.value.key == key and message in e.value.message


def test_document_masking_for_every_family_and_the_canon_reset_with_it():
    """``[dataloader] document_masking`` is one switch for every family; LlamaCanon's Canon layers
    follow it only with ``[model] canon_document_reset``, which alone (text data without positions)
    does nothing and is refused; the linear models have no such key (their Canon layers always
    follow)."""
    for family in ("llama", "llama_canon", "gla5", "gdn2", "mamba2"):
        run = load(
            REPO / "train_configs" / f"{family}_debug.toml",
            ["--dataloader.document_masking", "true"],
            environment=False,
        )
        assert run["dataloader"]["document_masking"]
    canon = REPO / "train_configs" / "llama_canon_debug.toml"
    assert load(canon, environment=False).model_args.canon_document_reset is False
    assert load(
        canon,
        ["--dataloader.document_masking", "true", "--model.canon_document_reset", "true"],
        environment=False,
    ).model_args.canon_document_reset
    with pytest.raises(ConfigError) as e:
        load(canon, ["--model.canon_document_reset", "true"], environment=False)
    assert (
        e.value.key == "[model] canon_document_reset"
        and "set [dataloader] document_masking = true" in e.value.message
    )
    with pytest.raises(ConfigError, match="canon_document_reset"):
        load(
            REPO / "train_configs" / "gla5_debug.toml",
            ["--model.canon_document_reset", "true"],
            environment=False,
        )


def test_world_size_checks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    load(DEBUG_CONFIG, ["--parallelism.tensor_parallel_degree", "2"])  # shard = -1 -> 2
    with pytest.raises(
        ConfigError, match="replicate x shard x tp x pp x cp = 6 but the world size is 4"
    ):
        load(
            DEBUG_CONFIG,
            [
                "--parallelism.data_parallel_shard_degree",
                "3",
                "--parallelism.tensor_parallel_degree",
                "2",
            ],
        )
    with pytest.raises(ConfigError, match=r"\[training\] global_batch_size: must be a multiple"):
        load(DEBUG_CONFIG, ["--training.global_batch_size", "6"])


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected an override of the form"):
        parse_overrides(["training.steps", "3"])
    assert parse_overrides(["--checkpoint.enable", "--model.flavor", "1B"]) == [
        ("checkpoint", "enable", True),
        ("model", "flavor", "1B"),
    ]


def test_show_output_is_a_config_that_resolves_identically(tmp_path):
    run = load(DEBUG_CONFIG, ["--training.steps", "3"])
    text = dumps(run.sections)
    again = load(write(tmp_path, text))
    assert again.sections == run.sections
    assert tomllib.loads(text)["training"]["steps"] == 3


def test_trainer_config_mapping():
    run = load(
        DEBUG_CONFIG,
        [
            "--activation_checkpoint.mode",
            "full",
            "--optimizer.lr",
            "0.002",
            "--lr_scheduler.decay_ratio",
            "0.2",
        ],
    )
    cfg = build_trainer_config(run)
    from torchtitan.distributed.activation_checkpoint import FullAC

    from canon_titan.components.loss import ZLossCrossEntropy

    assert isinstance(cfg.activation_checkpoint, FullAC.Config)
    assert isinstance(cfg.loss, ZLossCrossEntropy.Config)  # debug flavor has z_loss on
    group = cfg.optimizer.param_groups[0]
    assert group.optimizer_kwargs["lr"] == 0.002 and group.optimizer_kwargs["betas"] == (0.9, 0.95)
    assert cfg.lr_scheduler.decay_ratio == 0.2 and cfg.lr_scheduler.min_lr_factor == 0.01
    assert cfg.model_spec.model.layers[0].attention.q_norm is not None
    assert "[training]" in cfg.run_toml


def test_cli_validate_and_show_exit_codes(tmp_path, capsys):
    bad = write(tmp_path, MINIMAL + "stepz = 1\n", "bad.toml")
    assert cli.main(["config", "validate", str(DEBUG_CONFIG)]) == 0
    assert cli.main(["config", "validate", str(DEBUG_CONFIG), str(bad)]) == 2
    err = capsys.readouterr().err
    assert "INVALID" in err and "bad.toml" in err and "stepz" in err
    assert cli.main(["config", "show", str(DEBUG_CONFIG), "--training.steps", "4"]) == 0
    assert "steps = 4" in capsys.readouterr().out
    assert (
        cli.main(
            [
                "config",
                "validate",
                str(DEBUG_CONFIG),
                "--world-size",
                "3",
                "--parallelism.tensor_parallel_degree",
                "2",
            ]
        )
        == 2
    )
    assert cli.main(["train", "--config", str(bad)]) == 2


def test_every_shipped_config_validates(repo):
    # train_configs/sweeps/ holds sweeps' specs, not run configs (tests/test_sweep.py resolves them)
    files = sorted(p for p in (repo / "train_configs").rglob("*.toml") if "sweeps" not in p.parts)
    assert len(files) >= 23
    for path in files:
        load(path, environment=False)
    for path in files:
        if path.stem.endswith("_debug") or path.parent.name == "playground":
            load(path)  # the CPU configs also pass the data / tokenizer / hardware checks


def test_static_mode_skips_only_environment_checks(tmp_path):
    path = write(tmp_path, MINIMAL + '[tokenizer]\npath = "/nonexistent/tok"\n')
    with pytest.raises(
        ConfigError, match=r"\[tokenizer\] path = '/nonexistent/tok' does not exist"
    ):
        load(path)
    load(path, environment=False)
    with pytest.raises(ConfigError, match=r"\[training\] stepz"):
        load(path, ["--training.stepz", "1"], environment=False)


@pytest.mark.skipif(
    __import__("torch")._utils._get_available_device_type() is not None,
    reason="only a machine without an accelerator rejects CPU offload",
)
def test_cpu_offload_without_accelerator_is_a_config_error():
    with pytest.raises(ConfigError, match=r"\[training\] enable_cpu_offload: .*no accelerator"):
        load(DEBUG_CONFIG, ["--training.enable_cpu_offload", "true"])


def test_model_vocabulary_follows_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    from canon_titan.data.builtin import ASSET_DIR

    vocab = Tokenizer.from_file(str(ASSET_DIR / "tokenizer.json")).get_vocab_size()
    run = load(DEBUG_CONFIG)
    assert (
        run.model_args.vocab_size == run["model"]["vocab_size"] == vocab != 2048
    )  # flavor says 2048
    assert load(DEBUG_CONFIG, ["--model.vocab_size", str(vocab)]).model_args.vocab_size == vocab


def test_profiling_section_reaches_torchtitans_profiler(tmp_path):
    """``[profiling]`` is TorchTitan's profiler config (traces under the dump folder); a key it
    lacks is named with the section."""
    run = load(
        DEBUG_CONFIG,
        [
            "--profiling.enable_profiling",
            "true",
            "--profiling.profile_freq",
            "7",
            "--profiling.profiler_warmup",
            "2",
        ],
    )
    cfg = build_trainer_config(run)
    assert (
        cfg.profiler.enable_profiling
        and cfg.profiler.profile_freq == 7
        and cfg.profiler.profiler_warmup == 2
    )
    assert not build_trainer_config(load(DEBUG_CONFIG)).profiler.enable_profiling
    with pytest.raises(ConfigError, match=r"\[profiling\].*trace_post_processor"):
        load(write(tmp_path, MINIMAL + '[profiling]\ntrace_post_processor = "x"\n'))


def test_profiling_settings_that_cannot_run_are_config_errors(tmp_path):
    """A profile cycle shorter than its warm-up and recording, and a CUDA memory snapshot on a
    machine without CUDA (TorchTitan fails inside the first step there), are named before any
    process starts; a static check for another machine skips the hardware one."""
    with pytest.raises(
        ConfigError, match=r"\[profiling\] profile_freq: is 3; it must be at least .*\(4\)"
    ):
        load(
            DEBUG_CONFIG,
            [
                "--profiling.enable_profiling",
                "true",
                "--profiling.profile_freq",
                "3",
                "--profiling.profiler_warmup",
                "3",
            ],
        )
    snapshot = ["--profiling.enable_memory_snapshot", "true"]
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(
            ConfigError, match=r"\[profiling\] enable_memory_snapshot: .*no CUDA GPU"
        ):
            load(DEBUG_CONFIG, snapshot)
    assert load(DEBUG_CONFIG, snapshot, environment=False)["profiling"]["enable_memory_snapshot"]
