"""What a cluster does to a long run: preemption, divergence, a full disk, changed data, changed
shapes, another number of processes, awkward lock files. Each case is checked against what an
uninterrupted run or the files on disk say."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from canon_titan.components.metrics import read_scalars
from conftest import COMMON, DEBUG_CONFIG, REPO, descendants, kill_tree, run_training, train_env

STEPS = ["--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "100"]


def cli_train_cmd(dump, *extra, nproc=2):
    return [
        sys.executable,
        "-m",
        "canon_titan.cli",
        "train",
        "--config",
        str(DEBUG_CONFIG),
        "--nproc",
        str(nproc),
        *COMMON,
        *STEPS,
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


def interrupt(cmd, marker, send):
    """Run ``cmd`` until it prints ``marker``, then ``send(proc)``; its exit code and output."""
    proc = subprocess.Popen(
        cmd,
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
            if marker in line:
                send(proc)
                break
        lines.append(proc.stdout.read())
        proc.wait(timeout=300)
    finally:
        kill_tree(proc.pid)
    out = "".join(lines)
    assert marker in out, out[-4000:]
    return proc.returncode, out


def logged_steps(out):
    return [
        int(line.split("step:")[1].split()[0]) for line in out.splitlines() if " step: " in line
    ]


def double_ctrl_c(proc):
    """Ctrl-C pressed twice in quick succession: SIGINT to the launcher's process group (the
    launcher and torchrun), twice, within the duplicate window (one request)."""
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)


@pytest.mark.slow
def test_preemption_saves_the_step_reached_and_resumes_exactly(tmp_path):
    """SIGTERM to the launcher (a scheduler's preemption), then SIGINT to the launcher's process
    group twice (a double Ctrl-C; torchrun gets each from the terminal and again from the
    launcher): each time every rank finishes its step, saves it and exits 75 with no traceback;
    resuming twice gives the losses of an uninterrupted run, bit for bit."""
    ref, run = tmp_path / "ref", tmp_path / "run"  # [job] seed: both start from the same weights
    run_training(2, COMMON + STEPS + ["--training.steps", "8", "--job.dump_folder", str(ref)])
    reference = read_scalars(ref)
    saved = []
    for tb, marker, send in [
        ("tb1", "step:  2", lambda p: os.kill(p.pid, signal.SIGTERM)),
        ("tb2", "step:  ", double_ctrl_c),
    ]:
        code, out = interrupt(
            cli_train_cmd(run, "--training.steps", "8", "--metrics.save_tb_folder", tb),
            marker,
            send,
        )
        step = logged_steps(out)[-1]
        assert code == 75, out[-4000:]
        assert f"preempted at step {step}, checkpoint saved, resume with the same command" in out
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
        assert (run / "checkpoint" / f"step-{step}" / ".metadata").is_file() and step < 8
        saved.append(step)
    assert saved[1] > saved[0]
    out = run_training(
        2,
        COMMON
        + STEPS
        + [
            "--training.steps",
            "8",
            "--job.dump_folder",
            str(run),
            "--metrics.save_tb_folder",
            "tb3",
        ],
    )
    assert f"Training starts at step {saved[1] + 1}" in out
    resumed = {
        **read_scalars(run, tb_folder="tb1"),
        **read_scalars(run, tb_folder="tb2"),
        **read_scalars(run, tb_folder="tb3"),
    }
    assert resumed == reference


def usr1_to_every_process(proc):
    """SLURM's ``--signal=USR1@T``: SIGUSR1 to every process of the job step at once (the launcher,
    torchrun and each worker)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.parametrize(
    "send",
    [usr1_to_every_process, lambda p: os.kill(p.pid, signal.SIGUSR1)],
    ids=["every-process", "launcher"],
)
def test_sigusr1_saves_and_exits_75_like_sigterm(tmp_path, send):
    """SIGUSR1 (SLURM's early-warning signal of choice) is a stop request like SIGTERM: every rank
    finishes its step, saves it and the job exits 75, whether every process gets it or only the
    launcher. At 4a7b0a2 every process died at once with no line and the steps since the last
    checkpoint were lost. The loss is logged every 4th step: the ranks agree on the request on a
    step that is not logged too (the host reads it a step late, and saves that step)."""
    run = tmp_path / "run"
    code, out = interrupt(
        cli_train_cmd(run, "--training.steps", "30", "--metrics.log_freq", "4"), "step:  1", send
    )
    step = int(re.search(r"preempted at step (\d+),", out).group(1))
    assert code == 75, out[-4000:]
    assert f"preempted at step {step}, checkpoint saved, resume with the same command" in out
    assert "SIGUSR1 received" in out or "SIGTERM received" in out
    assert "Traceback" not in out, out[-4000:]
    assert (run / "checkpoint" / f"step-{step}" / ".metadata").is_file() and step < 30


@pytest.mark.slow
def test_a_stop_signal_during_the_last_step_is_a_normal_finish(tmp_path):
    """SIGTERM while the last step trains: that step is trained and saved, the run is complete, so
    the job exits 0 (at 4a7b0a2 it exited 75, SLURM requeued it, and the rerun exited 2 "already
    holds a finished run")."""
    run = tmp_path / "run"
    code, out = interrupt(
        cli_train_cmd(run, "--training.steps", "6", "--metrics.log_freq", "1"),
        "step:  5",
        lambda p: os.kill(p.pid, signal.SIGTERM),
    )
    assert code == 0, out[-4000:]
    assert "SIGTERM received" in out and "preempted" not in out and "Traceback" not in out, out[
        -4000:
    ]
    assert (run / "checkpoint" / "step-6" / ".metadata").is_file()


@pytest.mark.parametrize(
    "who, sig",
    [
        ("launcher", signal.SIGINT),
        ("torchrun", signal.SIGTERM),
        ("run_train.sh", signal.SIGINT),
        ("run_train.sh", signal.SIGTERM),
    ],
)
def test_a_stop_signal_before_training_starts_is_one_line_and_75(tmp_path, who, sig):
    """Ctrl-C while ``canon-titan train`` checks the run, SIGTERM while torchrun imports torch, and
    Ctrl-C (SIGINT to its process group) or SIGTERM while ``scripts/run_train.sh`` checks the
    config: one line and 75 (a requeue-on-75 job script runs it again; nothing had trained). At
    4a7b0a2 the first was a 65-line KeyboardInterrupt traceback (130), the second a silent death
    (241); at 432670c run_train.sh's check printed a KeyboardInterrupt traceback, or exited 143
    without a line."""
    dump = tmp_path / "run"
    if who == "launcher":
        cmd = cli_train_cmd(dump, "--training.steps", "4")
    elif who == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "canon_titan.launch.torchrun",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "canon_titan.train",
            "--config",
            str(DEBUG_CONFIG),
            *COMMON,
            *STEPS,
            "--job.dump_folder",
            str(dump),
        ]
    else:
        cmd = [
            "bash",
            str(REPO / "scripts" / "run_train.sh"),
            *COMMON,
            *STEPS,
            "--job.dump_folder",
            str(dump),
        ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=dict(train_env(), NGPU="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        time.sleep(0.6)  # the process is up, and still importing torch or checking the config
        if who == "run_train.sh" and sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C
        else:
            os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 75, (proc.returncode, out[-2000:], err[-4000:])
    assert err.strip().splitlines() == [
        f"canon-titan: {sig.name} before "
        + (
            "training started (canon-titan train was checking the run)"
            if who == "launcher"
            else "the training processes started"
        )
        + ": stopped, nothing to save; run the same command again"
    ], err[-4000:]
    assert not (dump / "checkpoint").exists()


def test_the_exit_code_after_a_stop_signal_is_what_the_workers_reported(tmp_path):
    """75 ("saved, requeue") only when the workers saved the step they reached and that checkpoint
    is complete; at 4a7b0a2 a job whose workers were killed, or ran out of grace, also said 75."""
    from canon_titan.launch.torchrun import after_stop_signal

    complete, partial = tmp_path / "step-7", tmp_path / "step-9"
    complete.mkdir(), partial.mkdir()
    (complete / ".metadata").write_bytes(b"")
    assert after_stop_signal({0: 0, 1: 0}, [], True) == 0  # finished during the last step
    assert after_stop_signal({0: 75, 1: 75}, [complete], True) == 75  # saved the step reached
    assert (
        after_stop_signal({0: 3, 1: 75}, [complete], True) == 3
    )  # a failed save or divergence is not "requeue"
    assert after_stop_signal({}, [], True) == 3  # no worker could say: killed before saving
    assert (
        after_stop_signal({0: 3, 1: 3}, [], True) == 3
    )  # out of grace, a second signal, or checkpointing off
    assert after_stop_signal({0: 75, 1: 75}, [partial], True) == 3  # the save did not finish
    # No worker had trained a step: nothing is lost, a rerun is exact, whatever became of the
    # workers (at 432670c workers killed while importing torch made it 3).
    assert after_stop_signal({0: 75, 1: 75}, [], False) == 75
    assert after_stop_signal({}, [], False) == 75
    assert after_stop_signal({0: 75}, [], False) == 75
    assert after_stop_signal({0: 2, 1: 75}, [], False) == 2  # a refusal stays one


def test_a_second_signal_or_the_end_of_the_grace_period_exits_at_once():
    """After a stop signal a rank that has not saved within [job] stop_grace_seconds exits (3: the
    step reached is not on disk, so not 75, "saved, requeue") with
    one line; so does one that gets a second signal after the duplicate window, at once."""
    script = (
        "import os, signal, sys, time\n"
        "from canon_titan.components.checkpointer import newest_checkpoint_line\n"
        "from canon_titan.components.preemption import StopSignals\n"
        "StopSignals(int(sys.argv[1]), on_disk=lambda: "
        "newest_checkpoint_line('no-such-folder')).install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(float(sys.argv[2]))\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(60)\n"
    )
    for grace, gap, message, within in [
        (1, 60, "no checkpoint saved within [job] stop_grace_seconds = 1", 15),
        (600, 3, "second SIGTERM: exiting without saving", 15),
    ]:
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", script, str(grace), str(gap)],
            cwd=REPO,
            env=train_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 3 and message in out and "Traceback" not in out, out
        # What is true: no checkpoint exists (at 4a7b0a2: "the previous checkpoint is intact").
        assert (
            "there is no checkpoint yet: running the command again starts from the beginning" in out
        ), out
        assert time.monotonic() - started < within


# Two gloo ranks; rank 1 never joins the all-reduce, so rank 0's main thread stays inside it (in
# C++, where Python runs no signal handler) until the collective's timeout, far past the grace
# period.
HUNG_RANK = """
import datetime, sys, time
import torch, torch.distributed as dist
from canon_titan.components.checkpointer import newest_checkpoint_line
from canon_titan.components.preemption import StopSignals
rank, store, grace = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=240))
if rank == 1:
    time.sleep(600)
StopSignals(grace, on_disk=lambda: newest_checkpoint_line("no-such-folder")).install()
print("entering the all-reduce", flush=True)
dist.all_reduce(torch.ones(1))
print("the all-reduce returned", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "grace, second_after, message",
    [
        (2, None, "no checkpoint saved within [job] stop_grace_seconds = 2: exiting"),
        (600, 3.0, "second SIGTERM: exiting without saving this step"),
    ],
    ids=["grace-period", "second-signal"],
)
def test_stop_signals_act_while_the_main_thread_is_blocked_in_a_collective(
    tmp_path, grace, second_after, message
):
    """A rank whose main thread is blocked in a gloo all-reduce that its peer never joins: after
    SIGTERM it exits (3: nothing of the step reached saved; one line, no traceback) when the grace
    period runs out, or at once on a second signal, not when the collective times out. At 4a7b0a2
    the grace timer and the second signal lived in a Python signal handler, which ran only when the
    all-reduce gave up (240 s here)."""
    store = tmp_path / "store"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", HUNG_RANK, str(rank), str(store), str(grace)],
            cwd=REPO,
            env=train_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in (1, 0)
    ]
    peer, hung = ranks
    try:
        assert hung.stdout.readline() == "entering the all-reduce\n", hung.communicate(timeout=60)
        time.sleep(1.0)  # inside the all-reduce
        os.kill(hung.pid, signal.SIGTERM)
        sent = time.monotonic()
        if second_after is not None:
            time.sleep(second_after)
            os.kill(hung.pid, signal.SIGTERM)
            sent = time.monotonic()
        try:
            out, err = hung.communicate(timeout=(grace if second_after is None else 0) + 30)
        except subprocess.TimeoutExpired:
            kill_tree(hung.pid)
            out, err = hung.communicate()
        waited = time.monotonic() - sent
    finally:
        for proc in ranks:
            kill_tree(proc.pid)
            proc.wait()
    assert hung.returncode == 3, (hung.returncode, out, err[-3000:])
    assert "Traceback" not in err and "the all-reduce returned" not in out, err[-3000:]
    lines = [line for line in err.splitlines() if message in line]
    assert len(lines) == 1 and "there is no checkpoint yet" in lines[0], err[-3000:]
    # The grace period, or at once, with a margin for a loaded machine (the collective: 240 s).
    assert waited < (grace if second_after is None else 0) + 5, waited


def all_finite(step_dir):
    from canon_titan.convert.dcp_io import load_tensor, model_tensor_metadata

    return all(
        load_tensor(step_dir, name, meta).isfinite().all()
        for name, meta in model_tensor_metadata(step_dir).items()
    )


@pytest.mark.slow
def test_a_full_disk_is_named_and_divergence_stops_before_saving(tmp_path):
    """First a save meets a full disk (its data files point at /dev/full, where writes fail with
    ENOSPC): one line, no partial step folder. Then the same folder diverges (lr 1e3, a checkpoint
    every 2 steps, keep_latest_k = 2, the loss logged every 10 steps, where 0eeee93 wrote NaN
    steps 6 and 8 and purged the good ones): the run stops with one line naming the step and the
    last good checkpoint, and every checkpoint left is finite."""
    run = tmp_path / "run"
    base = cli_train_cmd(
        run,
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "2",
        "--metrics.log_freq",
        "10",
    )
    full = run / "checkpoint" / "step-2"
    full.mkdir(parents=True)
    for rank in range(2):
        (full / f"__{rank}_0.distcp").symlink_to("/dev/full")
    proc = subprocess.run(
        base + ["--training.steps", "3"],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3 and "Traceback" not in out, out[-4000:]
    assert f"canon-titan: saving checkpoint step 2 to {full} failed: the disk is full" in out, out[
        -4000:
    ]
    assert "earlier checkpoints are intact" in out and not full.exists()

    diverged = subprocess.run(
        base + ["--training.steps", "10", "--optimizer.lr", "1e3"],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = diverged.stdout + diverged.stderr
    assert diverged.returncode == 3, out[-4000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
    kept = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoint").iterdir())
    assert kept and all(all_finite(run / "checkpoint" / f"step-{s}") for s in kept)
    message = [
        line
        for line in out.splitlines()
        if line.removeprefix("[rank0]:").startswith("canon-titan: ")
    ][-1]
    stopped = int(re.search(r"at step (\d+)", message).group(1))
    assert "not finite" in message and kept[-1] < stopped <= kept[-1] + 2, message
    assert f"the last good checkpoint is {run / 'checkpoint' / f'step-{kept[-1]}'}" in message
    assert f"--checkpoint.load_step {kept[-1]}" in message


def guard_verdicts(section, losses, bad_gradients=()):
    """The guard's verdict on each step of ``losses`` (gradients not finite at ``bad_gradients``),
    as the host reads it, and the skip flag the optimizer got."""
    from canon_titan.components.divergence import LossGuard

    guard, out = LossGuard(section, torch.device("cpu")), []
    for step, loss in enumerate(losses, 1):
        skip, record = guard.judge(torch.tensor(loss), torch.tensor(float(step in bad_gradients)))
        verdict = guard.verdict(step, record.tolist())
        out.append(
            (
                "stop" if verdict.stop else "skip" if verdict.skipped else "ok",
                verdict.problem,
                skip.item(),
            )
        )
    return out


def test_the_loss_guard_skips_spikes_and_stops_on_repeated_non_finite_losses():
    from canon_titan.components.divergence import DivergenceSection

    section = DivergenceSection(spike_factor=2.0, spike_window=3, max_nonfinite_steps=2)
    # Running mean of the last three kept losses: (4 + 3 + 2) / 3 = 3; 6.5 > 2 x 3 is a spike.
    got = guard_verdicts(section, [4.0, 3.0, 2.0, 6.5, 5.9, float("nan"), float("inf")])
    assert [v for v, _, _ in got] == ["ok"] * 3 + ["skip", "ok", "skip", "stop"]
    assert [skip for _, _, skip in got] == [0.0] * 3 + [
        1.0,
        0.0,
        1.0,
        1.0,
    ]  # no bad update reaches the weights
    assert "step 4 (6.5) is a spike, above 2.0 x its running mean 3 " in got[3][1]
    assert got[6][1] == "the loss at step 7 is not finite (inf)"
    # What the host counts from the same records: skipped in a row, applied since the start.
    from canon_titan.components.divergence import LossGuard

    guard, counts = LossGuard(section, torch.device("cpu")), []
    for step, loss in enumerate([4.0, 3.0, 2.0, 6.5, 5.9, float("nan")], 1):
        verdict = guard.verdict(
            step, guard.judge(torch.tensor(loss), torch.tensor(0.0))[1].tolist()
        )
        counts.append((verdict.in_a_row, verdict.applied))
    assert counts == [(0, 1), (0, 2), (0, 3), (1, 3), (0, 4), (1, 4)]
    # A stop holds back every later update too (the host reads it a step late).
    got = guard_verdicts(
        DivergenceSection(spike_factor=1.5, spike_window=1, on_spike="stop"), [2.0, 3.1, 1.0]
    )
    assert [v for v, _, _ in got[:2]] == ["ok", "stop"] and [skip for _, _, skip in got] == [
        0.0,
        1.0,
        1.0,
    ]
    # A finite loss over gradients that are not: skipped, and the spike window does not keep its
    # loss (kept, 2.9 would make the mean 2.45 and 3.5 no spike).
    got = guard_verdicts(
        DivergenceSection(spike_factor=1.5, spike_window=2, max_nonfinite_steps=2),
        [2.0, 2.0, 2.9, 2.0, 3.5],
        bad_gradients={3},
    )
    assert [v for v, _, _ in got] == ["ok", "ok", "skip", "ok", "skip"], got
    assert got[2][1] == "the gradients at step 3 are not finite (its loss was finite)"


def with_fault(tmp_path, code: str) -> dict:
    """The environment of a job whose training processes run ``code`` at start-up (a
    ``sitecustomize`` on their path): a fault injected into the real trainer, in every worker."""
    folder = tmp_path / "fault"
    folder.mkdir(parents=True)
    (folder / "sitecustomize.py").write_text(
        "import os\nif 'TORCHELASTIC_RUN_ID' in os.environ:\n"
        + "".join(f"    {line}\n" for line in code.strip().splitlines())
    )
    env = train_env()
    env["PYTHONPATH"] = os.pathsep.join([str(folder), *filter(None, [env.get("PYTHONPATH")])])
    return env


# The loss every rank's step returns jumps to ten times its level from step 4 on (its gradients do
# not).
LOSS_JUMPS = """
from torchtitan import trainer
step = trainer.Trainer.forward_backward_step
def forward_backward_step(self, **kwargs):
    loss = step(self, **kwargs)
    return loss * 10 if self.step >= 4 else loss
trainer.Trainer.forward_backward_step = forward_backward_step
"""

# Rank 1's first gradient shard becomes NaN in step 3's backward (TorchTitan's forward-backward,
# inside canon-titan's step); every loss stays finite.
NAN_GRADIENT = """
import math, torch
from torchtitan import trainer
step = trainer.Trainer.forward_backward_step
def forward_backward_step(self, **kwargs):
    loss = step(self, **kwargs)
    if self.step == 3 and torch.distributed.get_rank() == 1:
        grad = next(p.grad for m in self.model_parts for p in m.parameters() if p.grad is not None)
        (grad.to_local() if hasattr(grad, 'to_local') else grad).fill_(math.nan)
    return loss
trainer.Trainer.forward_backward_step = forward_backward_step
"""


@pytest.mark.slow
def test_a_loss_at_a_new_level_stops_after_the_bounded_skips(tmp_path):
    """``on_spike = "skip"`` with a loss that jumps to a new level and stays there: every step is a
    spike, so after ``max_consecutive_skips`` skipped steps in a row the run stops with one line and
    exit 3. At 4a7b0a2 the running mean froze, every later step was skipped, the weights never
    changed and the run exited 0."""
    run = tmp_path / "run"
    cmd = cli_train_cmd(
        run,
        "--training.steps",
        "12",
        "--divergence.spike_factor",
        "3",
        "--divergence.spike_window",
        "2",
        "--divergence.max_consecutive_skips",
        "4",
        "--metrics.log_freq",
        "1",
    )
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=with_fault(tmp_path, LOSS_JUMPS),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert "4 steps in a row were skipped (steps 4-7, [divergence] max_consecutive_skips)" in out, (
        out[-4000:]
    )
    assert [s for s in (4, 5, 6) if f"the loss at step {s} (" in out] == [4, 5, 6]

    # A run too short to reach the bound, whose every step is skipped (its loss never finite, with a
    # large max_nonfinite_steps), has trained nothing and says so (exit 3) rather than finishing.
    never_finite = LOSS_JUMPS.replace(
        "loss * 10 if self.step >= 4 else loss", "loss * float('nan')"
    )
    short = subprocess.run(
        cli_train_cmd(
            tmp_path / "short",
            "--training.steps",
            "3",
            "--divergence.max_nonfinite_steps",
            "100",
            "--divergence.max_consecutive_skips",
            "100",
        ),
        cwd=REPO,
        env=with_fault(tmp_path / "again", never_finite),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = short.stdout + short.stderr
    assert short.returncode == 3 and "Traceback" not in out, out[-4000:]
    assert (
        "canon-titan: every step this run trained (3) was skipped ([divergence]), so it "
        "trained nothing" in out
    )


@pytest.mark.slow
def test_a_nan_gradient_with_a_finite_loss_is_skipped_at_its_step(tmp_path):
    """A NaN gradient on one rank while every loss is finite: the gradients are judged before the
    optimizer step, so that step's update is skipped (with ``max_nonfinite_steps = 2``) and the run
    goes on with finite losses to its end; with the default (1) it stops there, naming step 3. At
    4a7b0a2 only the loss was judged: the NaN update was applied and the next steps' losses were
    NaN."""
    run = tmp_path / "run"
    env = with_fault(tmp_path, NAN_GRADIENT)
    proc = subprocess.run(
        cli_train_cmd(
            run,
            "--training.steps",
            "6",
            "--divergence.max_nonfinite_steps",
            "2",
            "--metrics.log_freq",
            "1",
        ),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert (
        "the gradients at step 3 are not finite (its loss was finite): its update is skipped" in out
    ), out[-4000:]
    losses = read_scalars(run)
    assert sorted(losses) == list(range(1, 7)) and all(map(math.isfinite, losses.values())), losses
    assert all_finite(run / "checkpoint" / "step-6")

    stopped = subprocess.run(
        cli_train_cmd(tmp_path / "stopped", "--training.steps", "6"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = stopped.stdout + stopped.stderr
    assert stopped.returncode == 3 and "Traceback" not in out, out[-4000:]
    assert (
        "canon-titan: the gradients at step 3 are not finite (its loss was finite): the "
        "run stops before saving it" in out
    )


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_a_skipped_step_leaves_the_weights_as_they_were_with_each_optimizer(
    tmp_path, implementation
):
    """The skipped update is not applied at all, whichever optimizer: the fused one skips it in its
    kernel (the device's skip flag as its ``found_inf``), the foreach one is not called (the host
    reads the verdict). The checkpoint after the skipped step 3 holds step 2's weights, to the bit;
    step 4 trains."""
    from canon_titan.convert.dcp_io import load_tensor, model_tensor_metadata

    run = tmp_path / "run"
    proc = subprocess.run(
        cli_train_cmd(
            run,
            "--training.steps",
            "4",
            "--divergence.max_nonfinite_steps",
            "2",
            "--checkpoint.interval",
            "1",
            "--checkpoint.keep_latest_k",
            "10",
            "--optimizer.implementation",
            implementation,
        ),
        cwd=REPO,
        env=with_fault(tmp_path, NAN_GRADIENT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert (
        "the gradients at step 3 are not finite (its loss was finite): its update is skipped" in out
    ), out[-4000:]

    def weights(step):
        folder = run / "checkpoint" / f"step-{step}"
        return {
            name: load_tensor(folder, name, meta)
            for name, meta in model_tensor_metadata(folder).items()
        }

    second, third, fourth = weights(2), weights(3), weights(4)
    assert all(torch.equal(second[name], third[name]) for name in second)
    assert not all(torch.equal(third[name], fourth[name]) for name in third)
    assert all(t.isfinite().all() for t in fourth.values())


# Where no small filesystem can be mounted: the error torch's writer raises when the disk fills
# (the bytes of a tensor do not all reach the file; no OSError anywhere in the chain).
WRITER_FAILS_AT_STEP_4 = """
from torch.distributed.checkpoint import filesystem
write_item = filesystem._write_item
def _write_item(transforms, stream, data, item, storage_key, *args, **kwargs):
    if '/step-4/' in getattr(stream, 'name', ''):
        raise RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598')
    return write_item(transforms, stream, data, item, storage_key, *args, **kwargs)
filesystem._write_item = _write_item
"""


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MiB tmpfs (a debug checkpoint is about 12 MiB: the second one does not fit), or, where
    this process cannot mount one, None (the test then injects the error a full disk gives)."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = (
        shutil.which("mount")
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        == 0
    )
    yield mount if mounted and not os.environ.get("CANON_TITAN_TEST_NO_MOUNT") else None
    if mounted:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_disk_that_fills_during_a_save_is_one_line_and_the_partial_step_goes(
    tmp_path, small_disk
):
    """The usual full disk: the tensor bytes fill it and torch's writer raises a RuntimeError with
    no OSError under it. The run stops (exit 3) with one line naming the step folder and the free
    space left, the partial folder is removed, the earlier checkpoint loads, and the line reaches
    the console although the disk is full (torchrun's copies of the output are on the local disk).
    At 4a7b0a2 this was a traceback inside torchrun's ChildFailedError block, with the partial
    folder left behind."""
    run = (small_disk or tmp_path) / "run"
    env = train_env() if small_disk else with_fault(tmp_path, WRITER_FAILS_AT_STEP_4)
    proc = subprocess.run(
        cli_train_cmd(
            run,
            "--training.steps",
            "8",
            "--checkpoint.interval",
            "2",
            "--checkpoint.keep_latest_k",
            "10",
        ),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    line = f"canon-titan: saving checkpoint step 4 to {run / 'checkpoint' / 'step-4'} failed: "
    assert line in out and "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
    message = next(text for text in out.splitlines() if line in text)
    if small_disk:
        assert "the disk is full (0.0 MiB free on its filesystem)" in message, message
    else:
        assert (
            "RuntimeError: [enforce fail at inline_container.cc:672]" in message
            and "MiB free" in message
        )
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-2"]
    assert all_finite(run / "checkpoint" / "step-2")


def test_a_step_folder_whose_save_did_not_finish_is_named_when_skipped(tmp_path):
    """A ``step-N`` folder without ``.metadata`` (a save cut short) is skipped with a line saying
    which and why (at 4a7b0a2, silently); alone, it does not stop a fresh start."""
    import torch.distributed.checkpoint as dcp

    from canon_titan.convert.dcp_io import resume_step

    folder = tmp_path / "checkpoint"
    dcp.save(
        {"model": {"w": torch.ones(3)}, "train_state": {"step": torch.tensor(2)}},
        checkpoint_id=str(folder / "step-2"),
    )
    (folder / "step-4").mkdir()
    (folder / "step-4" / "__0_0.distcp").write_bytes(b"partial")
    assert resume_step(folder) == (
        2,
        ["step-4 has no .metadata (its save did not finish) and is skipped"],
    )
    shutil.rmtree(folder / "step-2")
    assert resume_step(folder) == (
        -1,
        ["step-4 has no .metadata (its save did not finish) and is skipped"],
    )


@pytest.mark.slow
def test_a_damaged_token_shard_is_one_line(tmp_path):
    """A token folder whose shard holds an id outside the vocabulary: one line naming the shard and
    exit 2 (at 4a7b0a2 the same message, buried in 149 lines of traceback)."""
    from canon_titan.data.builtin import ASSET_DIR
    from canon_titan.data.pretokenize import tokenize_files

    source = tmp_path / "docs.jsonl"
    source.write_text(
        "".join(json.dumps({"text": f"document {i}: " + "word " * 60}) + "\n" for i in range(80))
    )
    tokens = tmp_path / "tokens"
    tokenize_files(
        str(source), tokens, kind="hf", tokenizer_path=str(ASSET_DIR), log=lambda m: None
    )
    index = json.loads((tokens / "index.json").read_text())
    index["shards"][0]["max_id"] = 99_999  # as a shard tokenized with another tokenizer records it
    (tokens / "index.json").write_text(json.dumps(index))
    proc = subprocess.run(
        cli_train_cmd(
            tmp_path / "run",
            "--training.steps",
            "2",
            "--dataloader.dataset",
            "tokens",
            "--dataloader.dataset_path",
            str(tokens),
        ),
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    lines = [line for line in out.splitlines() if "outside the training vocabulary" in line]
    assert len(lines) == 1 and "holds token id 99999" in lines[0], out[-4000:]


def launch_checks(monkeypatch, capsys, args):
    """``canon-titan train ARGS`` up to the point it would start torchrun: exit code, stderr, and
    whether it launched."""
    from canon_titan import cli
    from canon_titan.cli import train as cli_train_module

    launched = []
    monkeypatch.setattr(
        cli_train_module, "_run_torchrun", lambda cmd, env: launched.append(cmd) or 0
    )
    code = cli.main(["train", *map(str, args)])
    return code, capsys.readouterr().err, bool(launched)


@pytest.mark.slow
def test_resume_checks_catch_damage_changed_data_shapes_batch_and_model_only_steps(
    tmp_path, monkeypatch, capsys
):
    """One run (2 processes, checkpoints at steps 1 to 3, the last model-only), then what a resume
    meets: a model-only last step, another model shape or family, fewer processes, appended data,
    a damaged newest checkpoint, no loadable one. Each refusal happens before launch, in one line;
    the allowed resumes train."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(json.dumps({"text": f"document {i}: " + "word " * 40}) + "\n" for i in range(60))
    )
    run = tmp_path / "run"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    data = ["--dataloader.dataset", "files", "--dataloader.dataset_path", str(docs)]
    cmd = cli_train_cmd(
        run, *data, "--checkpoint.interval", "1", "--checkpoint.last_save_model_only", "true"
    )
    first = subprocess.run(
        cmd + ["--training.steps", "3"],
        cwd=REPO,
        env=dict(train_env(), TMPDIR=str(tmp)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    assert not list(tmp.glob("torchelastic_*")) and not (run / "torchelastic").exists()  # row 13
    args = cmd[cmd.index("--config") :] + ["--training.steps", "4"]

    code, err, launched = launch_checks(monkeypatch, capsys, args)
    assert code == 0 and launched
    assert "step-3 holds the model only ([checkpoint] last_save_model_only = true)" in err  # row 9
    for extra, message in [
        (["--model.dim", "256"], "has shape"),  # row 7
        (["--config", REPO / "train_configs" / "llama_canon_debug.toml"], "is missing"),
        (["--nproc", "1"], "the global batch changes from 4 to 2 sequences"),
    ]:  # row 8
        code, err, launched = launch_checks(monkeypatch, capsys, args + extra)
        assert (
            code == 2 and not launched and message in err and len(err.strip().splitlines()) <= 2
        ), err
    assert "--training.global_batch_size 4 to keep the recipe" in err
    code, err, launched = launch_checks(
        monkeypatch,
        capsys,
        args
        + [  # row 7: another family as the initial load
            "--config",
            REPO / "train_configs" / "llama_canon_debug.toml",
            "--job.dump_folder",
            tmp_path / "fresh",
            "--checkpoint.initial_load_path",
            run / "checkpoint" / "step-1",
        ],
    )
    assert (
        code == 2 and not launched and "is missing" in err and len(err.strip().splitlines()) <= 2
    ), err
    code, err, launched = launch_checks(
        monkeypatch, capsys, args + ["--nproc", "1", "--training.global_batch_size", "2"]
    )
    assert code == 0 and "the global batch changes from 4 to 2 sequences" in err
    # A step-0 (seed) checkpoint holds a train state too, but a run starting from it loads the model
    # alone: another process count is no change of batch for it.
    seeded = tmp_path / "seeded"
    shutil.copytree(run / "checkpoint" / "step-1", seeded / "checkpoint" / "step-0")
    code, err, launched = launch_checks(
        monkeypatch, capsys, args + ["--nproc", "1", "--job.dump_folder", seeded]
    )
    assert code == 0 and launched and "global batch" not in err, err

    with docs.open("a") as f:  # row 6
        f.write(json.dumps({"text": "one more document " * 10}) + "\n")
    code, err, launched = launch_checks(monkeypatch, capsys, args)
    assert (
        code == 2
        and not launched
        and f"{docs} changed (" in err
        and "--dataloader.allow_changed_data" in err
    )
    damaged = sorted((run / "checkpoint" / "step-2").glob("*.distcp"))[0]
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    resumed = subprocess.run(
        cmd + ["--training.steps", "4", "--dataloader.allow_changed_data", "true"],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]
    assert f"checkpoint step 2 cannot be loaded and is skipped: {damaged} is truncated" in out
    assert "Training starts at step 2" in out and "starts a new pass over the new data" in out
    assert "Dataloader resumes at global sample" not in out

    for step_dir in (run / "checkpoint").iterdir():
        for shard in step_dir.glob("*.distcp"):
            shard.write_bytes(b"")
    code, err, launched = launch_checks(monkeypatch, capsys, args + ["--training.steps", "5"])
    assert code == 2 and not launched and "Traceback" not in err
    assert f"no checkpoint in {run / 'checkpoint'} can be loaded" in err


def test_nothing_below_the_launcher_imports_from_it():
    """``launch/`` is the job around the training processes (``cli/`` and the ``train`` entry point
    run it): what a training process is made of (the trainer, its components, models, data) imports
    nothing from it. At d1a0ebf the trainer imported the resume checks from ``launch/``."""
    import ast

    package = REPO / "canon_titan"
    above = [package / "launch", package / "sweep", package / "cli", package / "train.py"]
    offending = []
    for path in sorted(package.rglob("*.py")):
        if any(path == a or a in path.parents for a in above):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            offending += [
                f"{path.relative_to(REPO)}: {n}"
                for n in names
                if n.startswith("canon_titan.launch")
            ]
    assert not offending, offending


def test_an_hf_start_with_changed_bytes_or_shapes_is_refused_by_the_config_check(tmp_path):
    from canon_titan.config import ConfigError, load
    from canon_titan.convert.hf import CHECKSUMS, to_hf
    from conftest import CONFIGS, make_checkpoint

    run, step, _ = make_checkpoint(tmp_path, [], config=CONFIGS["llama"])
    hf = to_hf(step, tmp_path / "hf", run)
    start = ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf", "true"]
    load(CONFIGS["llama"], start)
    # Tensors of a wider model under the right config.json.
    wide, wide_step, _ = make_checkpoint(
        tmp_path / "wide", ["--model.dim", "512"], config=CONFIGS["llama"]
    )
    wrong = to_hf(wide_step, tmp_path / "wrong", wide)
    (wrong / "config.json").write_text((hf / "config.json").read_text())
    with pytest.raises(ConfigError, match=f"{wrong}: tensor .* has shape"):
        load(
            CONFIGS["llama"],
            [
                "--checkpoint.initial_load_path",
                str(wrong),
                "--checkpoint.initial_load_in_hf",
                "true",
            ],
        )
    shard = hf / sorted(json.loads((hf / CHECKSUMS).read_text()))[0]
    payload = bytearray(shard.read_bytes())
    payload[-10] ^= 0x40
    shard.write_bytes(bytes(payload))
    with pytest.raises(ConfigError, match=f"{shard}: its contents changed since the export"):
        load(CONFIGS["llama"], start)


def test_a_lock_file_that_cannot_be_opened_is_one_line(tmp_path, capsys):
    from canon_titan import cli
    from canon_titan.launch.ownership import LOCK_FILE

    dump = tmp_path / "run"
    (dump / LOCK_FILE).mkdir(parents=True)  # what open() meets with another user's file: an OSError
    code = cli.main(["train", "--config", str(DEBUG_CONFIG), "--job.dump_folder", str(dump)])
    err = capsys.readouterr().err
    assert (
        code == 2
        and f"cannot open the lock file {dump / LOCK_FILE}" in err
        and "Traceback" not in err
    )


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP", "ENOSYS", "EINVAL"])
def test_without_flock_a_lease_file_stands_in(tmp_path, monkeypatch, code):
    """Whatever a filesystem without locks answers (Lustre ``noflock`` gives ENOSYS, which refused
    every run as "in use by a live run"), a lease file stands in; only EWOULDBLOCK means a
    holder."""
    import errno
    import fcntl

    from canon_titan.launch import ownership as launch

    def no_flock(handle, how):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(launch, "_held", [])
    dump = tmp_path / "run"
    launch.lock_dump_folder(dump, hold=False)  # the launcher's check: nothing held, nothing written
    assert not (dump / launch.LEASE_FILE).exists()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        lease = dump / launch.LEASE_FILE
        lease.write_text(
            json.dumps(
                {
                    "pid": sleeper.pid,
                    "pid_start": launch._process_start(sleeper.pid),
                    "host": os.uname().nodename,
                    "started": "now",
                }
            )
        )
        with pytest.raises(
            launch.DumpFolderInUse, match=f"pid {sleeper.pid} on .*{lease}: its process .* is alive"
        ):
            launch.lock_dump_folder(dump)
    finally:
        sleeper.kill()
        sleeper.wait()
    launch.lock_dump_folder(dump)  # the holder is gone: its lease is stale and taken over
    assert json.loads(lease.read_text())["pid"] == os.getpid()
