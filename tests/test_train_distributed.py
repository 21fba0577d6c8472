"""Real TorchTitan training with torchrun + gloo, checked against single-process runs."""

import math

import pytest

from canon_titan.components.metrics import read_scalars
from conftest import COMMON, CONFIGS, run_training, run_training_until, seed_checkpoint, start_from

pytestmark = pytest.mark.slow


@pytest.fixture
def llama_seed(tmp_path_factory):
    return seed_checkpoint("llama", tmp_path_factory)


@pytest.mark.parametrize("model", ["llama"])  # llama_canon: every FSDP run of test_parallelism.py
def test_fsdp_two_processes_match_one_process(model, tmp_path, tmp_path_factory):
    seed = seed_checkpoint(model, tmp_path_factory)
    steps = ["--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "100"]
    one, two = tmp_path / "one", tmp_path / "two"
    start_from(seed, one)
    start_from(seed, two)
    run_training(
        1,
        COMMON + steps + ["--job.dump_folder", str(one), "--training.local_batch_size", "4"],
        config=CONFIGS[model],
    )
    out = run_training(
        2,
        COMMON + steps + ["--job.dump_folder", str(two), "--training.local_batch_size", "2"],
        config=CONFIGS[model],
    )
    assert "dp_shard=2" in out and "Loading the checkpoint from" in out
    loss1, loss2 = read_scalars(one), read_scalars(two)
    gn1, gn2 = read_scalars(one, "grad_norm"), read_scalars(two, "grad_norm")
    assert list(loss1) == list(loss2) == list(range(1, 9))
    # Same global batch and weights; only the fp32 summation order of the gradient
    # reduce-scatter differs (measured ~3e-7 relative after 8 steps). 1e-5 leaves margin while a
    # wrong batch split or loss scaling shows up at >= 1e-2.
    for step in loss1:
        assert loss2[step] == pytest.approx(loss1[step], rel=1e-5), step
        assert gn2[step] == pytest.approx(gn1[step], rel=1e-4), step
    assert loss1[8] < loss1[1] - 1.0


def test_kill_and_resume_equals_uninterrupted(llama_seed, tmp_path):
    args = COMMON + [
        "--training.steps",
        "12",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "4",
        "--training.local_batch_size",
        "2",
    ]
    ref, interrupted = tmp_path / "ref", tmp_path / "interrupted"
    start_from(llama_seed, ref)
    start_from(llama_seed, interrupted)
    run_training(2, args + ["--job.dump_folder", str(ref)])
    reference = read_scalars(ref)
    # SIGKILL the job while it trains step 10: step-8 is the newest complete checkpoint.
    run_training_until(2, args + ["--job.dump_folder", str(interrupted)], stop_marker="step: 10")
    saved = sorted(p.name for p in (interrupted / "checkpoint").iterdir())
    assert "step-8" in saved and "step-12" not in saved
    out = run_training(
        2, args + ["--job.dump_folder", str(interrupted), "--metrics.save_tb_folder", "tb_resumed"]
    )
    assert "Training starts at step 9" in out
    resumed = read_scalars(interrupted, tb_folder="tb_resumed")
    assert list(resumed) == [9, 10, 11, 12]
    for step, value in resumed.items():
        # Same processes, same fp32 kernels, state restored exactly: bitwise equal.
        assert value == reference[step], (step, value, reference[step])
    lr = read_scalars(ref, "lr/AdamW")
    warmup, peak, floor, steps = 10, 3e-3, 0.01, 12
    # The lr logged at step s is the one that step uses. TorchTitan: linear warmup s / warmup,
    # one stable step, then cosine from the peak to min_lr_factor * peak over steps - warmup.
    assert lr[5] == pytest.approx(peak * 5 / warmup, rel=1e-6)
    assert lr[11] == pytest.approx(peak, rel=1e-6)
    progress = (12 - warmup - 1) / (steps - warmup)
    assert lr[12] == pytest.approx(
        peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))), rel=1e-6
    )
    # The last save kept the full state (last_save_model_only = false): training can go on.
    out = run_training(
        2,
        args
        + [
            "--job.dump_folder",
            str(interrupted),
            "--training.steps",
            "13",
            "--metrics.save_tb_folder",
            "tb_more",
        ],
    )
    assert "Training starts at step 13" in out


def test_cli_train_launches_torchrun(tmp_path, repo):
    import subprocess
    import sys

    from conftest import train_env

    out = tmp_path / "cli"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "canon_titan.cli",
            "train",
            "--config",
            str(repo / "train_configs" / "llama_debug.toml"),
            "--nproc",
            "2",
            "--training.steps",
            "3",
            "--job.dump_folder",
            str(out),
            *COMMON,
        ],
        cwd=repo,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(read_scalars(out)) == [1, 2, 3]
    assert (out / "run_config.toml").read_text().count("steps = 3") == 1
    assert (out / "checkpoint" / "step-3" / ".metadata").is_file()
