"""What a cluster does to a long run: preemption, divergence, a full disk, changed data, changed
shapes, another number of processes, awkward lock files. Each case is checked against what an
uninterrupted run or the files on disk say."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from canon_titan.components.metrics import read_scalars
from conftest import COMMON, DEBUG_CONFIG, REPO, kill_tree, run_training, train_env

STEPS = ["--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "100"]


def cli_train_cmd(dump, *extra, nproc=2):
    return [sys.executable, "-m", "canon_titan.cli", "train", "--config", str(DEBUG_CONFIG), "--nproc", str(nproc),
            *COMMON, *STEPS, "--job.dump_folder", str(dump), *extra]


def interrupt(cmd, marker, send):
    """Run ``cmd`` until it prints ``marker``, then ``send(proc)``; its exit code and output."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
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
    return [int(line.split("step:")[1].split()[0]) for line in out.splitlines() if " step: " in line]


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
    for tb, marker, send in [("tb1", "step:  2", lambda p: os.kill(p.pid, signal.SIGTERM)),
                             ("tb2", "step:  ", double_ctrl_c)]:
        code, out = interrupt(cli_train_cmd(run, "--training.steps", "8", "--metrics.save_tb_folder", tb),
                              marker, send)
        step = logged_steps(out)[-1]
        assert code == 75, out[-4000:]
        assert f"preempted at step {step}, checkpoint saved, resume with the same command" in out
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
        assert (run / "checkpoint" / f"step-{step}" / ".metadata").is_file() and step < 8
        saved.append(step)
    assert saved[1] > saved[0]
    out = run_training(2, COMMON + STEPS + ["--training.steps", "8", "--job.dump_folder", str(run),
                                            "--metrics.save_tb_folder", "tb3"])
    assert f"Training starts at step {saved[1] + 1}" in out
    resumed = {**read_scalars(run, tb_folder="tb1"), **read_scalars(run, tb_folder="tb2"),
               **read_scalars(run, tb_folder="tb3")}
    assert resumed == reference


def test_a_second_signal_or_the_end_of_the_grace_period_exits_at_once():
    """After a stop signal a rank that has not saved within [job] stop_grace_seconds exits (75) with
    one line; so does one that gets a second signal after the duplicate window, at once."""
    script = ("import os, signal, sys, time\n"
              "from canon_titan.components.preemption import StopSignals\n"
              "StopSignals(int(sys.argv[1])).install()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "time.sleep(float(sys.argv[2]))\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "time.sleep(60)\n")
    for grace, gap, message, within in [(1, 60, "no checkpoint saved within [job] stop_grace_seconds = 1", 15),
                                        (600, 3, "second SIGTERM: exiting without saving", 15)]:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", script, str(grace), str(gap)], cwd=REPO, env=train_env(),
                              capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 75 and message in out and "Traceback" not in out, out
        assert time.monotonic() - started < within


def all_finite(step_dir):
    from canon_titan.convert.dcp_io import load_tensor, model_tensor_metadata

    return all(load_tensor(step_dir, name, meta).isfinite().all() for name, meta in
               model_tensor_metadata(step_dir).items())


@pytest.mark.slow
def test_a_full_disk_is_named_and_divergence_stops_before_saving(tmp_path):
    """First a save meets a full disk (its data files point at /dev/full, where writes fail with
    ENOSPC): one line, no partial step folder. Then the same folder diverges (lr 1e3, a checkpoint
    every 2 steps, keep_latest_k = 2, the loss logged every 10 steps, where 0eeee93 wrote NaN
    steps 6 and 8 and purged the good ones): the run stops with one line naming the step and the
    last good checkpoint, and every checkpoint left is finite."""
    run = tmp_path / "run"
    base = cli_train_cmd(run, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2",
                         "--metrics.log_freq", "10")
    full = run / "checkpoint" / "step-2"
    full.mkdir(parents=True)
    for rank in range(2):
        (full / f"__{rank}_0.distcp").symlink_to("/dev/full")
    proc = subprocess.run(base + ["--training.steps", "3"], cwd=REPO, env=train_env(), capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3 and "Traceback" not in out, out[-4000:]
    assert f"canon-titan: saving checkpoint step 2 to {full} failed: the disk is full" in out, out[-4000:]
    assert "earlier checkpoints are intact" in out and not full.exists()

    diverged = subprocess.run(base + ["--training.steps", "10", "--optimizer.lr", "1e3"], cwd=REPO, env=train_env(),
                              capture_output=True, text=True, timeout=600)
    out = diverged.stdout + diverged.stderr
    assert diverged.returncode == 3, out[-4000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
    kept = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoint").iterdir())
    assert kept and all(all_finite(run / "checkpoint" / f"step-{s}") for s in kept)
    message = [line for line in out.splitlines() if line.startswith("[rank0]:canon-titan: ")][-1]
    stopped = int(re.search(r"at step (\d+)", message).group(1))
    assert "not finite" in message and kept[-1] < stopped <= kept[-1] + 2, message
    assert f"the last good checkpoint is {run / 'checkpoint' / f'step-{kept[-1]}'}" in message
    assert f"--checkpoint.load_step {kept[-1]}" in message


def test_the_loss_guard_skips_spikes_and_stops_on_repeated_non_finite_losses():
    from canon_titan.components.divergence import DivergenceSection, LossGuard

    guard = LossGuard(DivergenceSection(spike_factor=2.0, spike_window=3, max_nonfinite_steps=2))
    # Running mean of the last three kept losses: (4 + 3 + 2) / 3 = 3; 6.5 > 2 x 3 is a spike.
    assert [guard.judge(s, x) for s, x in enumerate([4.0, 3.0, 2.0, 6.5, 5.9], 1)] == ["ok"] * 3 + ["skip", "ok"]
    assert "step 4 (6.5) is a spike, above 2.0 x its running mean 3" in guard.problem
    assert guard.judge(6, float("nan")) == "skip" and guard.judge(7, float("inf")) == "stop"
    assert guard.problem == "the loss at step 7 is not finite (inf)"
    stop = LossGuard(DivergenceSection(spike_factor=1.5, spike_window=1, on_spike="stop"))
    assert [stop.judge(1, 2.0), stop.judge(2, 3.1)] == ["ok", "stop"]


def launch_checks(monkeypatch, capsys, args):
    """``canon-titan train ARGS`` up to the point it would start torchrun: exit code, stderr, and
    whether it launched."""
    from canon_titan import cli
    from canon_titan.cli import train as cli_train_module

    launched = []
    monkeypatch.setattr(cli_train_module, "_run_torchrun", lambda cmd, env: launched.append(cmd) or 0)
    code = cli.main(["train", *map(str, args)])
    return code, capsys.readouterr().err, bool(launched)


@pytest.mark.slow
def test_resume_checks_catch_damage_changed_data_shapes_batch_and_model_only_steps(tmp_path, monkeypatch, capsys):
    """One run (2 processes, checkpoints at steps 1 to 3, the last model-only), then what a resume
    meets: a model-only last step, another model shape or family, fewer processes, appended data,
    a damaged newest checkpoint, no loadable one. Each refusal happens before launch, in one line;
    the allowed resumes train."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}: " + "word " * 40}) + "\n" for i in range(60)))
    run = tmp_path / "run"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    data = ["--dataloader.dataset", "files", "--dataloader.dataset_path", str(docs)]
    cmd = cli_train_cmd(run, *data, "--checkpoint.interval", "1", "--checkpoint.last_save_model_only", "true")
    first = subprocess.run(cmd + ["--training.steps", "3"], cwd=REPO, env=dict(train_env(), TMPDIR=str(tmp)),
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    assert not list(tmp.glob("torchelastic_*")) and not (run / "torchelastic").exists()  # row 13
    args = cmd[cmd.index("--config"):] + ["--training.steps", "4"]

    code, err, launched = launch_checks(monkeypatch, capsys, args)
    assert code == 0 and launched
    assert "step-3 holds the model only ([checkpoint] last_save_model_only = true)" in err  # row 9
    for extra, message in [(["--model.dim", "256"], "has shape"),  # row 7
                           (["--config", REPO / "train_configs" / "llama_canon_debug.toml"], "is missing"),
                           (["--nproc", "1"], "the global batch changes from 4 to 2 sequences")]:  # row 8
        code, err, launched = launch_checks(monkeypatch, capsys, args + extra)
        assert code == 2 and not launched and message in err and len(err.strip().splitlines()) <= 2, err
    assert "--training.global_batch_size 4 to keep the recipe" in err
    code, err, launched = launch_checks(monkeypatch, capsys, args + [  # row 7: another family as the initial load
        "--config", REPO / "train_configs" / "llama_canon_debug.toml", "--job.dump_folder", tmp_path / "fresh",
        "--checkpoint.initial_load_path", run / "checkpoint" / "step-1"])
    assert code == 2 and not launched and "is missing" in err and len(err.strip().splitlines()) <= 2, err
    code, err, launched = launch_checks(monkeypatch, capsys, args + ["--nproc", "1", "--training.global_batch_size", "2"])
    assert code == 0 and "the global batch changes from 4 to 2 sequences" in err
    # A step-0 (seed) checkpoint holds a train state too, but a run starting from it loads the model
    # alone: another process count is no change of batch for it.
    seeded = tmp_path / "seeded"
    shutil.copytree(run / "checkpoint" / "step-1", seeded / "checkpoint" / "step-0")
    code, err, launched = launch_checks(monkeypatch, capsys, args + ["--nproc", "1", "--job.dump_folder", seeded])
    assert code == 0 and launched and "global batch" not in err, err

    with docs.open("a") as f:  # row 6
        f.write(json.dumps({"text": "one more document " * 10}) + "\n")
    code, err, launched = launch_checks(monkeypatch, capsys, args)
    assert code == 2 and not launched and f"{docs} changed (" in err and "--dataloader.allow_changed_data" in err
    damaged = sorted((run / "checkpoint" / "step-2").glob("*.distcp"))[0]
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    resumed = subprocess.run(cmd + ["--training.steps", "4", "--dataloader.allow_changed_data", "true"], cwd=REPO,
                             env=train_env(), capture_output=True, text=True, timeout=600)
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


def test_an_hf_start_with_changed_bytes_or_shapes_is_refused_by_the_config_check(tmp_path):
    from canon_titan.config import ConfigError, load
    from canon_titan.convert.hf import CHECKSUMS, to_hf
    from conftest import CONFIGS, make_checkpoint

    run, step, _ = make_checkpoint(tmp_path, [], config=CONFIGS["llama"])
    hf = to_hf(step, tmp_path / "hf", run)
    start = ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf", "true"]
    load(CONFIGS["llama"], start)
    # Tensors of a wider model under the right config.json.
    wide, wide_step, _ = make_checkpoint(tmp_path / "wide", ["--model.dim", "512"], config=CONFIGS["llama"])
    wrong = to_hf(wide_step, tmp_path / "wrong", wide)
    (wrong / "config.json").write_text((hf / "config.json").read_text())
    with pytest.raises(ConfigError, match=f"{wrong}: tensor .* has shape"):
        load(CONFIGS["llama"], ["--checkpoint.initial_load_path", str(wrong), "--checkpoint.initial_load_in_hf", "true"])
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
    assert code == 2 and f"cannot open the lock file {dump / LOCK_FILE}" in err and "Traceback" not in err


def test_without_flock_a_lease_file_stands_in(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    from canon_titan.launch import ownership as launch

    def no_flock(handle, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(launch, "_held", [])
    dump = tmp_path / "run"
    launch.lock_dump_folder(dump, hold=False)  # the launcher's check: nothing held, nothing written
    assert not (dump / launch.LEASE_FILE).exists()
    assert "without flock" in caplog.text and "weaker" in caplog.text
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        lease = dump / launch.LEASE_FILE
        lease.write_text(json.dumps({"pid": sleeper.pid, "host": os.uname().nodename, "started": "now"}))
        with pytest.raises(launch.DumpFolderInUse, match=f"pid {sleeper.pid} on .*delete {lease}"):
            launch.lock_dump_folder(dump)
    finally:
        sleeper.kill()
        sleeper.wait()
    launch.lock_dump_folder(dump)  # the holder is gone: its lease is stale and taken over
    assert json.loads(lease.read_text())["pid"] == os.getpid()
