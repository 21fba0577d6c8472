"""``config validate`` is a contract: a broken config (generated here from the shipped ones) is
refused with exit 2 and one message naming the file and the ``[section] key`` (no traceback, no
"ok"), and what it accepts is what training starts with (``train`` runs the same checks)."""

import itertools
import re
import tomllib

import pytest

from canon_titan import cli
from conftest import REPO

BASES = {
    "llama": REPO / "train_configs" / "llama_debug.toml",
    "llama_canon": REPO / "train_configs" / "llama_canon_debug.toml",
    "gla5": REPO / "train_configs" / "gla5_debug.toml",
    "mamba2": REPO / "train_configs" / "mamba2_debug.toml",
    "depo": REPO / "train_configs" / "playground" / "depo.toml",
}

# (section, key, bad TOML value): each is wrong for every base above.
MUTATIONS = [
    ("training", "steps", "0"),
    ("training", "steps", "-5"),
    ("training", "steps", "100000000000000000000"),
    ("training", "seq_len", "0"),
    ("training", "seq_len", "1000000000"),
    ("training", "local_batch_size", "0"),
    ("training", "max_norm", "nan"),
    ("training", "max_norm", "inf"),
    ("training", "max_norm", "-1.0"),
    ("training", "gc_freq", "0"),
    ("training", "global_batch_size", "-5"),
    ("training", "global_batch_size", "7"),
    ("training", "dtype", '"float64"'),
    ("optimizer", "lr", "nan"),
    ("optimizer", "lr", "inf"),
    ("optimizer", "lr", "-0.001"),
    ("optimizer", "weight_decay", "nan"),
    ("optimizer", "weight_decay", "-1.0"),
    ("optimizer", "eps", "0.0"),
    ("optimizer", "betas", "[0.9]"),
    ("optimizer", "betas", "[1.5, 0.9]"),
    ("optimizer", "name", '"SGD"'),
    ("lr_scheduler", "warmup_steps", "-1"),
    ("lr_scheduler", "min_lr_factor", "2.0"),
    ("lr_scheduler", "decay_ratio", "1.5"),
    ("lr_scheduler", "decay_type", '"exp"'),
    ("model", "rope_theta", "0.0"),
    ("model", "rope_theta", "nan"),
    ("model", "dim", "0"),
    ("model", "n_layers", "-1"),
    ("model", "n_heads", "7"),
    ("model", "ffn_hidden_dim", "-64"),
    ("model", "norm_eps", "0.0"),
    ("model", "norm_eps", "inf"),
    ("model", "vocab_size", "10"),
    ("model", "flavor", '"13B"'),
    ("model", "name", '"gpt"'),
    ("model", "canon_kernel", "9"),
    ("checkpoint", "interval", "0"),
    ("checkpoint", "keep_latest_k", "-1"),
    ("checkpoint", "keep_latest_k", "1"),
    ("checkpoint", "folder", '" "'),
    ("checkpoint", "initial_load_path", '"/nonexistent/canon-titan-ckpt"'),
    ("checkpoint", "load_step", "-5"),
    ("checkpoint", "async_mode", '"fast"'),
    ("checkpoint", "export_dtype", '"int8"'),
    ("metrics", "log_freq", "0"),
    ("metrics", "wandb_mode", '"cloud"'),
    ("comm", "init_timeout_seconds", "-1"),
    ("comm", "train_timeout_seconds", "0"),
    ("dataloader", "dataset", '"c4"'),
    ("dataloader", "on_error", '"ignore"'),
    ("dataloader", "seed", '"x"'),
    ("dataloader", "sources", '["*.jsonl"]'),
    ("dataloader", "shuffle_buffer", "8"),
    ("dataloader", "dataset_path", '"data/*.jsonl"'),
    ("parallelism", "tensor_parallel_degree", "0"),
    ("parallelism", "data_parallel_shard_degree", "0"),
    ("parallelism", "pipeline_parallel_degree", "-1"),
    ("parallelism", "pipeline_parallel_microbatch_size", "0"),
    ("activation_checkpoint", "mode", '"partial"'),
    ("compile", "components", '["optimizer"]'),
    ("float8", "recipe_name", '"fp4"'),
    ("eval", "every", "-1"),
    ("eval", "limit", "-1"),
    ("eval", "max_seconds", "nan"),
    ("eval", "max_seconds", "-1.0"),
    ("job", "seed", '"abc"'),
    ("job", "dump_folder", "123"),
    ("tokenizer", "kind", '"bpe"'),
    ("tokenizer", "path", '"/nonexistent/tokenizer.json"'),
]
# Right for some bases only: where a base already sets the value, the case would be void.
WHERE = {
    ("tokenizer", "path"): ("llama", "llama_canon", "gla5", "mamba2"),
    ("dataloader", "sources"): ("llama", "llama_canon", "gla5", "mamba2", "depo"),
    ("model", "canon_kernel"): ("llama_canon", "gla5", "mamba2"),
}


def cases():
    for (base, path), (section, key, value) in itertools.product(BASES.items(), MUTATIONS):
        if base in WHERE.get((section, key), (base,)):
            yield pytest.param(path, section, key, value, id=f"{base}-{section}.{key}={value}")


def _with(path, section, key, value) -> str:
    """The base file's text with ``[section] key = value`` (replacing the key if set)."""
    text = path.read_text()
    data = tomllib.loads(text)
    lines = text.splitlines()
    if section in data and key in data[section]:
        start = lines.index(f"[{section}]")
        for i in range(start + 1, len(lines)):
            if re.match(rf"{re.escape(key)}\s*=", lines[i]):
                lines[i] = f"{key} = {value}"
                break
        return "\n".join(lines) + "\n"
    if section in data:
        lines.insert(lines.index(f"[{section}]") + 1, f"{key} = {value}")
        return "\n".join(lines) + "\n"
    return text + f"\n[{section}]\n{key} = {value}\n"


def validate(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["config", "validate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("path, section, key, value", list(cases()))
def test_broken_config_is_refused_naming_file_and_key(tmp_path, capsys, path, section, key, value):
    bad = tmp_path / path.name
    bad.write_text(_with(path, section, key, value))
    code, out, err = validate(capsys, bad)
    assert code == 2, f"accepted:\n{out}{err}"
    assert "Traceback" not in out + err and not out.startswith("ok")
    assert str(bad) in err and f"[{section}] {key}" in err, err


def test_the_table_is_the_audit_size():
    assert len(list(cases())) >= 128


def test_shipped_configs_are_accepted(capsys):
    code, out, err = validate(capsys, *BASES.values())
    assert code == 0, err


@pytest.mark.parametrize(
    "content, message",
    [
        (b'[model]\nname = "llama"\nflavor = "debug"\n# caf\xe9\n', "not UTF-8"),
        (
            b'[model]\nname = "llama"\nflavor = "debug"\n[training]\nsteps = 1\nsteps = 2\n',
            "not valid TOML",
        ),
        (b"model = 3\n", "must be a table [model]"),
        (b"[trainer]\nsteps = 3\n", "unknown section"),
    ],
)
def test_unreadable_files_are_refused_and_the_others_still_checked(
    tmp_path, capsys, content, message
):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(content)
    code, out, err = validate(capsys, bad, BASES["llama"])
    assert code == 2 and str(bad) in err and message in err and "Traceback" not in err
    assert f"ok      {BASES['llama']}" in out  # the next file was still validated


@pytest.mark.parametrize(
    "index, message",
    [("{not json", "not a readable token index"), ('{"format": "other"}', "unknown format")],
)
def test_a_broken_token_folder_is_a_config_error(tmp_path, capsys, index, message):
    folder = tmp_path / "tokens"
    folder.mkdir()
    (folder / "index.json").write_text(index)
    code, out, err = validate(
        capsys,
        BASES["llama"],
        "--dataloader.dataset",
        "tokens",
        "--dataloader.dataset_path",
        str(folder),
    )
    assert (
        code == 2
        and "[dataloader] dataset_path" in err
        and message in err
        and "Traceback" not in err
    )


@pytest.mark.parametrize("size", ["0", "-2"])
def test_world_size_below_one_is_refused(capsys, size):
    code, out, err = validate(capsys, BASES["llama"], "--world-size", size)
    assert code == 2 and "--world-size" in err and "ok" not in out


# Valid-looking variants of the bases (world size, overrides). Each base x variant is judged twice:
# by `config validate` (our checks and TorchTitan's section configs, without the trainer or the
# model code) and by `train`'s pre-launch build (the whole Trainer.Config, with the model spec, its
# float8 conversion and update_from_config). The two verdicts must agree.
VARIANTS = {
    "one-process": (1, []),
    "fsdp2-compile": (2, ["--compile.enable"]),
    "tp2-sp": (
        2,
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.enable_sequence_parallel",
            "true",
        ],
    ),
    "tp3": (3, ["--parallelism.tensor_parallel_degree", "3"]),
    "pp2": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
        ],
    ),
    "pp2-odd-microbatch": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "3",
        ],
    ),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "hsdp2x2-full-ac": (
        4,
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--activation_checkpoint.mode",
            "full",
        ],
    ),
    "float8-emulated-tp2": (
        2,
        ["--float8.enable", "--float8.emulate", "--parallelism.tensor_parallel_degree", "2"],
    ),
    "selective-ac-last-hf": (
        1,
        [
            "--activation_checkpoint.mode",
            "selective",
            "--checkpoint.enable",
            "--checkpoint.last_save_in_hf",
        ],
    ),
}


def _verdict(check) -> str | None:
    from canon_titan.config import ConfigError

    try:
        check()
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("base", BASES)
def test_validate_and_the_pre_launch_build_agree(monkeypatch, tmp_path, base, variant):
    from canon_titan.config import load
    from canon_titan.config.build import build_trainer_config
    from canon_titan.config.titan_sections import titan_sections

    world, overrides = VARIANTS[variant]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    overrides = [*overrides, "--job.dump_folder", str(tmp_path / "out")]
    fast = _verdict(lambda: titan_sections(load(BASES[base], overrides)))
    full = _verdict(lambda: build_trainer_config(load(BASES[base], overrides)))
    assert fast == full


def test_the_agreement_table_accepts_and_refuses():
    """Not void: the variants hold configs both accept and configs both refuse (checked above)."""
    from canon_titan.config import ConfigError, load

    verdicts = []
    for base, (world, overrides) in itertools.product(BASES, VARIANTS.values()):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("WORLD_SIZE", str(world))
            try:
                load(BASES[base], overrides)
                verdicts.append(True)
            except ConfigError:
                verdicts.append(False)
    assert 10 <= sum(verdicts) <= len(verdicts) - 10, verdicts
