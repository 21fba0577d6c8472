"""Real 2-process training on the synthetic tasks (Depo, Brevo, Capo): it starts, the loss falls,
and the eval command scores the resulting checkpoint."""

import json
import subprocess
import sys

import pytest

from canon_titan.components.metrics import LOSS_TAG, read_scalars
from conftest import REPO, run_training, train_env

# Depo, Brevo and Capo in real 2-process training (every task's windows: test_synthetic_loader.py)
TASKS = {
    "depo1": ["--depo.N", "8", "--depo.K", "4", "--depo.mini_vocab", "8"],
    "brevo1": ["--brevo.N", "10"],
    "capo_bios": [
        "--capo.individuals",
        "30",
        "--training.seq_len",
        "256",
    ],  # bios: ~190 built-in tokens
}


@pytest.mark.slow
@pytest.mark.parametrize("dataset", list(TASKS))
def test_two_process_training_loss_falls(dataset, tmp_path):
    answer_only = "false" if dataset == "capo_bios" else "true"
    run_training(
        2,
        [
            "--dataloader.dataset",
            dataset,
            "--dataloader.answer_only_loss",
            answer_only,
            "--training.seq_len",
            "128",
            *TASKS[dataset],
            "--training.steps",
            "16",
            "--training.local_batch_size",
            "4",
            "--lr_scheduler.warmup_steps",
            "2",
            "--metrics.log_freq",
            "1",
            "--checkpoint.interval",
            "16",
            "--job.dump_folder",
            str(tmp_path),
        ],
    )
    losses = read_scalars(tmp_path)
    assert sorted(losses) == list(range(1, 17))
    first, last = losses[1], sum(losses[k] for k in (14, 15, 16)) / 3
    assert last < 0.7 * first, losses
    if dataset in ("depo1", "capo_bios"):  # the eval command on the checkpoint just written
        out = tmp_path / "eval.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "canon_titan.cli",
                "eval",
                "synthetic",
                "--config",
                str(tmp_path / "run_config.toml"),
                "--count",
                "3",
                "--out",
                str(out),
            ],
            cwd=REPO,
            env=train_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = json.loads(out.read_text())
        assert result["dataset"] == dataset and result["checkpoint"].endswith("step-16")
        assert result["overall"]["total"] == sum(g["total"] for g in result["groups"].values()) > 0
        assert "greedy accuracy" in proc.stdout


@pytest.mark.slow
def test_resume_on_four_processes_from_two(tmp_path):
    """A depo1 run on 2 processes, resumed from its step-2 checkpoint on 4 (FSDP resharded through
    DCP, 1 window per rank instead of 2, the same global batch): steps 3 and 4 train on the windows
    of the uninterrupted run, carried samples included, so losses and grad norms match it."""
    import shutil

    args = [
        "--dataloader.dataset",
        "depo1",
        "--dataloader.answer_only_loss",
        "true",
        "--training.seq_len",
        "128",
        *TASKS["depo1"],
        "--training.steps",
        "4",
        "--training.global_batch_size",
        "4",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    ref = tmp_path / "ref"
    run_training(2, args + ["--training.local_batch_size", "2", "--job.dump_folder", str(ref)])
    resumed = tmp_path / "resumed"
    shutil.copytree(ref, resumed, ignore=shutil.ignore_patterns("step-4", "tb"))
    out = run_training(
        4, args + ["--training.local_batch_size", "1", "--job.dump_folder", str(resumed)]
    )
    assert "Training starts at step 3" in out
    assert "resumes at global window 8 (resharded from 2 data-parallel rank(s) to 4)" in out
    for tag, rtol in ((LOSS_TAG, 1e-5), ("grad_norm", 1e-4)):
        expected, got = read_scalars(ref, tag), read_scalars(resumed, tag)
        assert sorted(got) == [3, 4]
        for step in (3, 4):
            assert got[step] == pytest.approx(expected[step], rel=rtol), (tag, step)
