"""What a new user trips over, command by command: relative paths, re-runs, result files, help,
start-up cost, log noise, wrong devices and hints."""

import json
import os
import subprocess
import sys

import pytest

from canon_titan import cli
from canon_titan.config import ConfigError, load
from conftest import COMMON, CONFIGS, DEBUG_CONFIG, REPO, make_checkpoint, run_training, train_env

LLAMA = CONFIGS["llama"]


def test_relative_initial_load_path_is_resolved_and_checked(tmp_path, monkeypatch):
    run, step, _ = make_checkpoint(tmp_path, [])
    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(step, tmp_path)
    resolved = load(CONFIGS["llama_canon"], ["--checkpoint.initial_load_path", relative])
    assert resolved["checkpoint"]["initial_load_path"] == str(step)
    with pytest.raises(ConfigError) as e:
        load(CONFIGS["llama_canon"], ["--checkpoint.initial_load_path", "dcp/missing"])
    assert e.value.source == "command line" and e.value.key == "[checkpoint] initial_load_path"
    assert f"{tmp_path / 'dcp' / 'missing'} does not exist" in e.value.message


@pytest.mark.slow
def test_a_finished_run_is_not_trained_again_silently(tmp_path):
    dump = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "canon_titan.cli",
        "train",
        "--config",
        str(DEBUG_CONFIG),
        *COMMON,
        "--training.steps",
        "2",
        "--training.local_batch_size",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--job.dump_folder",
        str(dump),
    ]
    first = subprocess.run(
        args, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600
    )
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run(
        args, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 2 and "canon_titan.launch.torchrun" not in again.stdout
    assert (
        f"dump folder {dump} already holds a finished run: its checkpoint step-2 reaches "
        "[training] steps = 2" in again.stderr
    )
    longer = subprocess.run(
        args + ["--training.steps", "3", "--optimizer.lr", "0.001"],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "the config differs from the one of the run already in" in longer.stderr
    assert (
        "[training] steps: 2 -> 3" in longer.stderr
        and "[optimizer] lr: 0.003 -> 0.001" in longer.stderr
    )
    assert "Training starts at step 3" in longer.stdout


def test_run_config_paths_are_absolute_so_it_works_from_anywhere(tmp_path, monkeypatch):
    from canon_titan.config.build import build_trainer_config

    monkeypatch.chdir(tmp_path)
    run = load(
        CONFIGS["llama_canon"],
        [
            "--job.dump_folder",
            "outputs/here",
            "--tokenizer.path",
            str(os.path.relpath(REPO / "canon_titan" / "assets" / "builtin", tmp_path)),
        ],
    )
    written = json.dumps(build_trainer_config(run).run_toml)
    assert f'dump_folder = \\"{tmp_path / "outputs" / "here"}\\"' in written
    assert f'path = \\"{REPO / "canon_titan" / "assets" / "builtin"}\\"' in written


@pytest.mark.slow
def test_eval_synthetic_reads_a_run_config_from_another_directory(tmp_path):
    dump = tmp_path / "depo"
    run_training(
        1,
        COMMON
        + [
            "--training.steps",
            "2",
            "--training.local_batch_size",
            "2",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "2",
            "--job.dump_folder",
            os.path.relpath(dump, REPO),
        ],
        config=REPO / "train_configs" / "playground" / "depo.toml",
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "canon_titan.cli",
            "eval",
            "synthetic",
            "--config",
            str(dump / "run_config.toml"),
            "--count",
            "2",
        ],
        cwd=elsewhere,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("[eval] wrote") == 1 and (dump / "eval_synthetic.json").is_file()


def test_validate_catches_unknown_eval_tasks(capsys):
    code = cli.main(
        ["config", "validate", str(LLAMA), "--eval.every", "5", "--eval.tasks", '["no_such_task"]']
    )
    err = capsys.readouterr().err
    assert (
        code == 2
        and "[eval] tasks" in err
        and "unknown lm-eval task or group 'no_such_task'" in err
    )


def test_every_command_with_overrides_says_so_in_its_help(capsys):
    for command in (
        ["train"],
        ["config", "show"],
        ["config", "validate"],
        ["convert", "to-hf"],
        ["convert", "from-hf"],
        ["data", "synthetic"],
        ["data", "capo-people"],
        ["eval", "synthetic"],
    ):
        with pytest.raises(SystemExit):
            cli.main([*command, "--help"])
        assert "--section.key value argument overrides that key" in capsys.readouterr().out.replace(
            "\n", " "
        ), command
    with pytest.raises(SystemExit):
        cli.main(["data", "tokenize", "--help"])
    assert str(REPO / "canon_titan" / "assets" / "builtin") in capsys.readouterr().out.replace(
        "\n", ""
    )


def test_the_cli_starts_without_transformers_or_torchtitan():
    """--help imports neither (they take seconds); import canon_titan does not import
    transformers."""
    script = (
        "import sys, runpy\n"
        "sys.argv = ['canon-titan', '--help']\n"
        "try:\n    runpy.run_module('canon_titan.cli', run_name='__main__')\nexcept "
        "SystemExit:\n    pass\n"
        "heavy = [m for m in ('transformers', 'torchtitan', 'torch', 'lm_eval') if m in "
        "sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "HEAVY []" in proc.stdout, proc.stdout + proc.stderr


def test_config_validate_loads_no_trainer_model_or_data_libraries():
    """`config validate` (and every [model] args class) answers without the trainer, the model stack
    (torchtitan.models.common compiles FlexAttention on import, loading dynamo/inductor), the data
    libraries, transformers or lm-eval: together they took 9 s of its start-up."""
    configs = [
        str(REPO / "train_configs" / name)
        for name in (
            "llama_canon_debug.toml",
            "gla5_debug.toml",
            "mamba2_debug.toml",
            "playground/depo.toml",
        )
    ]
    script = (
        "import sys, runpy\n"
        f"sys.argv = ['canon-titan', 'config', 'validate', *{configs!r}]\n"
        "try:\n    runpy.run_module('canon_titan.cli', run_name='__main__')\nexcept "
        "SystemExit:\n    pass\n"
        "import model_registry\n"
        "[model_registry.model_args(name, 'debug').validate() for name in "
        "model_registry.FAMILIES]\n"
        "heavy = [m for m in ('torchtitan.trainer', 'torchtitan.models.common', "
        "'torch._dynamo', 'datasets',\n"
        "                     'transformers', 'lm_eval', "
        "'canon_titan.models.llama.model') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.stdout.count("ok ") == len(configs), proc.stdout + proc.stderr
    assert "HEAVY []" in proc.stdout, proc.stdout + proc.stderr


def test_eval_lm_on_a_missing_device_is_one_clear_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code = cli.main(["eval", "lm", "--model", str(REPO), "--suite", "tiny", "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2 and "--device cuda: this machine has no CUDA device; use --device cpu" in err


@pytest.mark.slow
def test_a_cpu_training_log_is_quiet_and_plain(tmp_path):
    dump = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "canon_titan.cli",
            "train",
            "--config",
            str(DEBUG_CONFIG),
            "--nproc",
            "2",
            *COMMON,
            "--training.steps",
            "3",
            "--training.local_batch_size",
            "2",
            "--checkpoint.enable",
            "false",
            "--job.dump_folder",
            str(dump),
        ],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    for noise in (
        "Failed to load",
        "is an Enum subclass",
        "Peak flops undefined",
        "lspci",
        "TORCH_NCCL",
        "DTensor random",
        "manual_seed() may not",
        "\x1b[",
        "initial_load_model_only",
        "-0.00GiB",
        "Setting OMP_NUM_THREADS",
    ):
        assert noise not in log, noise
    steps = [line for line in log.splitlines() if "step:  " in line and "loss:" in line]
    assert len(steps) == 3 and all(
        "mfu: N/A" in line and "memory:  0.00GiB" not in line for line in steps
    )
    assert not (dump / "comm_traces").exists()


def test_local_eval_files_missing_are_named_as_such(tmp_path):
    pytest.importorskip("lm_eval")
    from canon_titan.evaluation import lm

    manager = lm.task_manager(["babilong_qa1_0k"], str(tmp_path))
    with pytest.raises(lm.LMEvalError) as e:
        lm.check_datasets(manager, ["babilong_qa1_0k"])
    message = str(e.value)
    assert (
        message.startswith("local test files are missing") and "Hugging Face cache" not in message
    )
    assert f"{tmp_path / 'babilong' / 'qa1_0k.jsonl'} does not exist" in message
    assert "docs/evaluation.md, section Babilong" in message


@pytest.mark.slow
def test_the_startup_benchmark_times_each_command_with_the_cpu_of_all_its_processes():
    """``scripts/benchmarks/bench_startup.py``, whose figures the README quotes: a row per command
    with its wall and CPU seconds, the CPU of every process a command started included. The training
    job's launcher alone imports about what ``config validate`` does; its two ranks each import
    TorchTitan too, so counting them makes its CPU several times the validation's."""
    proc = subprocess.run(
        [sys.executable, "scripts/benchmarks/bench_startup.py", "--runs", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {line[:45].strip(): line[45:].split() for line in proc.stdout.splitlines()[1:]}
    train = "train, 2 ranks, 2 steps (llama_canon debug)"
    assert list(rows) == ["--help", "config validate (5 debug configs)", train], proc.stdout
    validate_cpu = float(rows["config validate (5 debug configs)"][2])
    assert float(rows[train][2]) > 3 * validate_cpu, proc.stdout
