import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from proc_tree import descendants

# Triton decides when a kernel module is imported whether its kernels run in the interpreter; on a
# machine without a GPU the tests run them there, on CPU tensors (the training subprocesses
# inherit it). TRITON_INTERPRET only makes 'triton' backends usable; 'auto' still picks torch.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
DEBUG_CONFIG = REPO / "train_configs" / "llama_debug.toml"
CONFIGS = {name: REPO / "train_configs" / f"{name}_debug.toml" for name in ("llama", "llama_canon")}
# Short sequences and a loss/grad-norm value at every step, in TensorBoard, for comparisons.
COMMON = [
    "--training.seq_len",
    "128",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "true",
]


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The folder ``name``, filled by ``make(folder)`` once per test session however many
    pytest-xdist workers ask for it: the first makes it, the others wait for it and read it. (A
    module- or session-scoped fixture is made once per worker that runs one of its tests, and a
    training run costs each of its processes about 10 s of CPU in imports before it trains.)"""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this session's folder, which its workers share
    (base / "made_once").mkdir(exist_ok=True)
    return make_once(base / "made_once" / name, make)


def make_once(folder: Path, make) -> Path:
    """``folder``, filled by ``make(folder)`` unless a process did so before, under a file lock:
    processes that ask while one makes it wait for it. A ``make`` that raises leaves no folder: the
    next one to ask tries again (and fails with its own error)."""
    from filelock import FileLock

    with FileLock(f"{folder}.lock"):
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            (folder / ".made").touch()
    return folder


def seed_checkpoint(model: str, tmp_path_factory) -> Path:
    """Initial weights written once per session by one process, so runs on any layout start from
    identical weights."""
    made = made_once(
        tmp_path_factory,
        f"seed_{model}",
        lambda out: run_training(
            1,
            COMMON
            + [
                "--job.dump_folder",
                str(out),
                "--checkpoint.enable",
                "--checkpoint.create_seed_checkpoint",
            ],
            config=CONFIGS[model],
        ),
    )
    return made / "checkpoint" / "step-0"


def make_checkpoint(tmp_path, overrides, config=CONFIGS["llama_canon"], seed=0):
    """A randomly initialised model saved as a DCP checkpoint (model tensors only), with the
    run's resolved TOML beside it as a training run writes it: returns (run, step dir, model)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from canon_titan.config import load
    from canon_titan.config.toml_writer import dumps

    run = load(config, overrides, environment=False)
    torch.manual_seed(seed)
    model = run.model_spec().model.build()
    model.init_states()
    step = tmp_path / "ckpt" / "step-0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(model.state_dict(), checkpoint_id=str(step))
    (tmp_path / "run_config.toml").write_text(dumps(run.sections))
    return run, step, model.eval()


MC = [
    {
        "q": f"Item {i}: the sky on a clear day is",
        "choices": [" blue", " a green cat", " red"],
        "label": i % 3,
    }
    for i in range(6)
]
PPL = [
    {"text": f"Once upon a time there were {i} cats in a small house by the sea."} for i in range(3)
]
TINY_TASKS = {
    "tiny_mc": "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: choices\n"
    "doc_to_target: label\n"
    "target_delimiter: ''\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_text: q\ndoc_to_target: a\n"
    "target_delimiter: ''\n"
    "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
    "metric_list:\n  - metric: exact_match\n",
    "tiny_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: text\n"
    "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
}


def write_tiny_tasks(folder: Path, gen_rows: list[dict]) -> None:
    """Three local lm-eval tasks (multiple choice, generation, rolling perplexity) on JSON lines."""
    import json

    for name, rows in (("tiny_mc", MC), ("tiny_gen", gen_rows), ("tiny_ppl", PPL)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n" + TINY_TASKS[name]
        )


def start_from(seed_dir: Path, dump: Path) -> Path:
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(seed_dir, dump / "checkpoint" / "step-0")
    return dump


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, config: Path, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "canon_titan.train",
        "--config",
        str(config),
        *overrides,
    ]


def train_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
    env.pop("WORLD_SIZE", None)
    return env


def run_training(
    nproc: int, overrides: list[str], config: Path = DEBUG_CONFIG, timeout: int = 600
) -> str:
    """Run a real torchrun training job; returns its output, fails the test on a non-zero exit."""
    proc = subprocess.run(
        torchrun_cmd(nproc, config, overrides),
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"training failed (exit {proc.returncode}):\n{out[-6000:]}"
    return out


def kill_tree(pid: int) -> None:
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_training_until(
    nproc: int,
    overrides: list[str],
    stop_marker: str,
    config: Path = DEBUG_CONFIG,
    timeout: int = 600,
) -> str:
    """Start training and SIGKILL torchrun and every worker once ``stop_marker`` is printed."""
    proc = subprocess.Popen(
        torchrun_cmd(nproc, config, overrides),
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if stop_marker in line:
                kill_tree(proc.pid)
                break
        proc.wait(timeout=timeout)
    finally:
        kill_tree(proc.pid)
    out = "".join(lines)
    assert stop_marker in out, f"never saw {stop_marker!r}:\n{out[-6000:]}"
    assert proc.returncode == -signal.SIGKILL
    return out


@pytest.fixture(autouse=True)
def logging_as_it_was():
    """Every test leaves the root logger (TorchTitan's ``logger``) with the handlers, level and
    filters it found. A command's ``main`` run in-process sets up logging; a handler bound to the
    test's captured stream, which pytest closes after the test, would make every later test's log
    line in the same worker a logging error."""
    root = logging.getLogger()
    handlers, level, filters = root.handlers[:], root.level, root.filters[:]
    yield
    root.handlers[:], root.filters[:] = handlers, filters
    root.setLevel(level)


@pytest.fixture
def repo() -> Path:
    return REPO
