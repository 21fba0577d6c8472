"""Checkpoints that cannot be trusted and disks that cannot take the next one: a data file of random
bytes, NaN bytes in the optimizer state, a full disk whose advice must work when followed. Each case
is checked against an uninterrupted run or the files on disk."""

import io
import os
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from canon_titan.components.metrics import read_scalars
from conftest import COMMON, DEBUG_CONFIG, REPO, train_env


def train_cmd(dump, *extra):
    return [
        sys.executable,
        "-m",
        "canon_titan.cli",
        "train",
        "--config",
        str(DEBUG_CONFIG),
        "--nproc",
        "2",
        *COMMON,
        "--training.local_batch_size",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


def train(dump, *extra):
    proc = subprocess.run(
        train_cmd(dump, *extra),
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.returncode, proc.stdout + proc.stderr


def stop_lines(out):
    """The distinct lines a run stopped with (not its warnings; torchrun's copy of a worker's line
    is prefixed with its rank)."""
    lines = [re.sub(r"^\[rank\d+\]:", "", line) for line in out.splitlines()]
    return sorted(
        {
            line
            for line in lines
            if line.startswith("canon-titan: ") and not line.startswith("canon-titan: warning: ")
        }
    )


def nan_into_optimizer_state(step_dir):
    """NaN bytes over the first element of an optimizer state tensor, in place in its data file (the
    file keeps its size and its pickle; only values change, as a bad disk or copy would change
    them)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(step_dir)).read_metadata()
    index, info = next(
        (i, s)
        for i, s in metadata.storage_data.items()
        if i.fqn.startswith("optimizer") and i.fqn.endswith("exp_avg_sq")
    )
    path = step_dir / info.relative_path
    data = bytearray(path.read_bytes())
    piece = bytes(data[info.offset : info.offset + info.length])
    chunk = torch.load(io.BytesIO(piece), weights_only=True)
    assert chunk.dtype == torch.float32 and chunk.numel() > 0, (index.fqn, chunk.dtype)
    at = info.offset + piece.find(chunk.numpy().tobytes())
    assert at >= info.offset, "the tensor's bytes are not stored plainly in its slice"
    data[at : at + 4] = np.array([np.nan], dtype=np.float32).tobytes()
    path.write_bytes(bytes(data))
    return index.fqn


def random_tensor_bytes(step_dir):
    """Random bytes over one tensor's stored bytes (its whole slice of a data file, sizes
    unchanged); the data file it is in."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(step_dir)).read_metadata()
    index, info = next(
        (i, s)
        for i, s in metadata.storage_data.items()
        if isinstance(metadata.state_dict_metadata[i.fqn], TensorStorageMetadata)
    )
    path = step_dir / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset : info.offset + info.length] = os.urandom(info.length)
    path.write_bytes(bytes(data))
    return path


def all_finite(step_dir):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from canon_titan.convert.dcp_io import load_tensor, read_metadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return all(
            load_tensor(step_dir, name, meta).isfinite().all()
            for name, meta in read_metadata(step_dir).state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata) and meta.properties.dtype.is_floating_point
        )


@pytest.mark.slow
def test_damaged_checkpoints_are_named_and_the_run_falls_back_to_the_previous_one(tmp_path):
    """Checkpoints at steps 2 to 8; then step 8's second data file is overwritten with random bytes
    (same size: no size check sees it), one tensor's bytes in step 6 likewise, and step 4 gets NaN
    bytes in its optimizer state. The resume skips step 8 before it loads (its small values do not
    load), names step 6's file as the load meets it and falls back to step 4, finds step 4's
    optimizer state not finite and falls back to step 2, each in one line; it then trains steps 3 to
    8 with the losses of the uninterrupted run, and the checkpoints it writes over the damaged ones
    are complete and finite. At 432670c: a 130-line traceback naming no file, and a NaN optimizer
    state loaded unchecked."""
    run = tmp_path / "run"
    code, out = train(run, "--training.steps", "8", "--metrics.save_tb_folder", "tb_first")
    assert code == 0, out[-4000:]
    reference = read_scalars(run, tb_folder="tb_first")
    checkpoints = run / "checkpoint"
    random_file = checkpoints / "step-8" / "__1_0.distcp"
    random_file.write_bytes(os.urandom(random_file.stat().st_size))
    tensor_file = random_tensor_bytes(checkpoints / "step-6")
    nan_into_optimizer_state(checkpoints / "step-4")

    code, out = train(run, "--training.steps", "8", "--metrics.save_tb_folder", "tb_resumed")
    assert code == 0 and "Traceback" not in out, out[-6000:]
    assert (
        "canon-titan: warning: checkpoint step 8 cannot be loaded and is skipped: "
        f"{random_file}: its bytes do "
        "not load"
    ) in out, out[-6000:]
    warned = [
        line
        for line in out.splitlines()
        if "resuming from step" in line and line.startswith("[rank0]")
    ]
    assert len(warned) == 2, out[-6000:]
    assert (
        f"checkpoint {checkpoints / 'step-6'} cannot be loaded: {tensor_file}: its bytes "
        "do not load" in warned[0]
    ) and warned[0].endswith(
        "resuming from step 4 instead, the newest complete checkpoint before it"
    ), warned[0]
    assert (
        f"checkpoint {checkpoints / 'step-4'} holds values that are not finite (NaN or "
        "inf) in its optimizer "
        "state: resuming from step 2 instead" in warned[1]
    ), warned[1]
    assert "Training starts at step 3" in out
    resumed = read_scalars(run, tb_folder="tb_resumed")
    assert {s: resumed[s] for s in range(3, 9)} == {s: reference[s] for s in range(3, 9)}
    for step in (4, 6, 8):
        assert all_finite(checkpoints / f"step-{step}")


class _TrainState:
    """A trainer's train state as DCP sees it (a Stateful): its step, tokens seen and global
    batch."""

    def __init__(self, **state):
        self.state = state

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state_dict):
        self.state = dict(state_dict)


def test_a_checkpoint_saved_before_the_train_state_held_the_global_batch_still_loads(tmp_path):
    """``CanonTrainer.state_dict`` always holds the global batch; a checkpoint saved before it did
    loads with DCP's planner as the checkpointer sets it up, the saved values restored and the batch
    left as it was. An entry missing for any other reason still fails the load."""
    import torch.distributed.checkpoint as dcp

    from canon_titan.components.checkpointer import _EarlierTrainState

    earlier, later = tmp_path / "earlier", tmp_path / "later"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.full((3,), 2.0), "train_state": _TrainState(step=4, ntokens_seen=512)},
            checkpoint_id=str(earlier),
        )
        saved = _TrainState(step=6, global_batch_size=8)
        dcp.save({"w": torch.full((3,), 3.0), "train_state": saved}, checkpoint_id=str(later))
        state = _TrainState(step=0, ntokens_seen=0, global_batch_size=8)
        weights = torch.zeros(3)
        dcp.load(
            {"w": weights, "train_state": state},
            checkpoint_id=str(earlier),
            planner=_EarlierTrainState(),
        )
        assert state.state == {"step": 4, "ntokens_seen": 512, "global_batch_size": 8}
        assert torch.equal(weights, torch.full((3,), 2.0))
        state = _TrainState(step=0, ntokens_seen=0, global_batch_size=8)
        with pytest.raises(dcp.api.CheckpointException) as refused:
            dcp.load(
                {"w": weights, "train_state": state},
                checkpoint_id=str(later),
                planner=_EarlierTrainState(),
            )
    missing = "Missing key in checkpoint state_dict: train_state.ntokens_seen"
    assert missing in str(refused.value.failures)


def test_only_a_checkpoint_this_process_checked_is_called_good(tmp_path):
    """The advice after a divergence names the newest checkpoint before it; "the last good
    checkpoint" only if this process saved it or loaded it with finite values, and never one it
    found damaged. At 432670c any checkpoint whose files had the right sizes was called good (issue
    78: one with a NaN optimizer state, loaded unchecked, named as the one to go back to)."""
    import torch.distributed.checkpoint as dcp

    from canon_titan.components.checkpointer import newest_checkpoint_hint

    folder = tmp_path / "checkpoint"
    for step in (2, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(
                {"w": torch.ones(3), "train_state": {"step": torch.tensor(step)}},
                checkpoint_id=str(folder / f"step-{step}"),
            )
    assert newest_checkpoint_hint(folder, 5, checked={4}).startswith(
        f"the last good checkpoint is {folder / 'step-4'}; resume from it with "
        "--checkpoint.load_step 4"
    )
    unchecked = newest_checkpoint_hint(folder, 5, checked={2})
    assert "good" not in unchecked and unchecked.startswith(
        f"the newest checkpoint before it is {folder / 'step-4'}, which this run neither "
        "saved nor loaded"
    )
    assert newest_checkpoint_hint(folder, 5, checked={2}, damaged={4}).startswith(
        f"the last good checkpoint is {folder / 'step-2'}"
    )
    assert (
        newest_checkpoint_hint(folder, 2, checked={2})
        == "there is no earlier checkpoint: start again with a lower learning rate"
    )


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs whose size the test sets (``mount -o remount,size=...``), or a skip where this
    process cannot mount one (the fault needs a real filesystem that fills)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        not shutil.which("mount")
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=200m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_the_full_disk_advice_works_when_followed(tmp_path, tmpfs):
    """A disk with room for checkpoints 2 and 4 and half of a third: step 6's save fails. The line
    says how much to free and which settings keep the run inside the disk; run again with exactly
    those settings, the run resumes from step 4 and finishes at step 8 on the same disk, leaving the
    two newest checkpoints. At 432670c the line advised [checkpoint] keep_latest_k, which TorchTitan
    applies only after a save succeeds: the same save failed again."""
    run = tmpfs / "run"
    code, out = train(run, "--training.steps", "4")
    assert code == 0, out[-4000:]
    checkpoints = run / "checkpoint"
    size = max(sum(f.stat().st_size for f in (checkpoints / f"step-{s}").iterdir()) for s in (2, 4))
    used = shutil.disk_usage(tmpfs).used
    subprocess.run(["mount", "-o", f"remount,size={used + size // 2}", str(tmpfs)], check=True)

    code, out = train(run, "--training.steps", "8")
    lines = stop_lines(out)
    assert code == 3 and "Traceback" not in out, out[-4000:]
    assert (
        len(lines) == 1
        and "saving checkpoint step 6" in lines[0]
        and "the disk is full" in lines[0]
    ), out[-4000:]
    line = lines[0]
    assert f"A checkpoint of this run takes {size / 2**20:,.1f} MiB" in line, line
    advice = re.search(
        r"\(--checkpoint.keep_latest_k (\d+) --checkpoint.purge_before_save true;", line
    )
    assert advice and int(advice.group(1)) == 2, line  # two whole checkpoints fit, not three
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4"]

    code, out = train(
        run,
        "--training.steps",
        "8",
        "--checkpoint.keep_latest_k",
        advice.group(1),
        "--checkpoint.purge_before_save",
        "true",
    )
    assert code == 0 and "Traceback" not in out, out[-4000:]
    assert "Training starts at step 5" in out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-6", "step-8"]
    assert all_finite(checkpoints / "step-8")


def save_step(folder, step, **extra):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {
                "w": torch.ones(3),
                "train_state": {"step": torch.tensor(step), "note": f"step {step}"},
                **extra,
            },
            checkpoint_id=str(folder / f"step-{step}"),
        )
    return folder / f"step-{step}"


def test_a_damaged_checkpoint_with_nothing_to_fall_back_to_is_refused(tmp_path, monkeypatch):
    """Where the load meets a damaged checkpoint, the run falls back to the newest complete one
    before it (checking it as the resume did the first), and with none left it is refused in one
    line naming the folder to move away. A damaged checkpoint given as --checkpoint.load_step is
    refused naming the load_step that loads; one whose small values do not load is skipped before
    the load, naming its file."""
    from torchtitan.components.checkpointer import CheckpointManager

    from canon_titan.components.checkpointer import CanonCheckpointer
    from canon_titan.convert.dcp_io import CheckpointDamaged, NoLoadableCheckpoint, resume_step

    folder = tmp_path / "checkpoint"
    for step in (2, 4, 6):
        save_step(folder, step)
    damaged, loads, prepared = set(), [], []

    def load(self, step=-1):
        loads.append(step)
        if step in damaged:
            raise CheckpointDamaged(
                f"checkpoint {folder / f'step-{step}'} cannot be loaded: it is damaged"
            )
        return True

    monkeypatch.setattr(CheckpointManager, "_load", load)
    checkpointer = CanonCheckpointer.__new__(CanonCheckpointer)
    checkpointer.folder, checkpointer.checked, checkpointer.damaged = str(folder), set(), set()
    checkpointer.before_fallback, checkpointer.pinned_step = prepared.append, None

    damaged.update({6, 4})
    assert checkpointer._load(6) and loads == [6, 4, 2] and checkpointer.checked == {2}
    assert prepared == [folder / "step-4", folder / "step-2"] and checkpointer.damaged == {6, 4}
    # --checkpoint.load_step 6: the step asked for is refused, naming the one to ask for instead
    checkpointer.pinned_step, loads[:] = 6, []
    with pytest.raises(
        NoLoadableCheckpoint,
        match=r"^\[checkpoint\] load_step = 6: checkpoint .*step-6 cannot be "
        r"loaded: it is damaged; the newest complete checkpoint before it "
        r"is step 4: --checkpoint.load_step 4$",
    ):
        checkpointer._load(6)
    assert loads == [6]
    checkpointer.pinned_step = None
    damaged.add(2)
    with pytest.raises(
        NoLoadableCheckpoint,
        match=rf"cannot be loaded: it is damaged, and there is no complete "
        rf"checkpoint before step 2 to fall back to \(move "
        rf"{re.escape(str(folder / 'step-2'))} away to start afresh\)",
    ):
        checkpointer._load(6)

    values = folder / "step-6" / "__0_0.distcp"
    values.write_bytes(
        os.urandom(values.stat().st_size)
    )  # the only data file: the small values too
    step, skipped = resume_step(folder)
    assert (
        step == 4
        and len(skipped) == 1
        and skipped[0].startswith(
            f"checkpoint step 6 cannot be loaded and is skipped: {values}: its bytes do not load ("
        )
    ), skipped
    with pytest.raises(
        NoLoadableCheckpoint,
        match=r"\[checkpoint\] load_step = 6: checkpoint step 6 cannot be loaded: "
        r".*; the newest checkpoint before it that loads is step 4: "
        r"--checkpoint.load_step 4",
    ):
        resume_step(folder, load_step=6)


def test_a_read_error_is_the_file_systems_not_a_damaged_checkpoint(tmp_path, monkeypatch):
    """An OSError while reading a data file (EIO, ESTALE from a network file system) is raised as it
    is: a checkpoint is called damaged, skipped and later overwritten only for bytes that do not
    load."""
    import errno

    from torch.distributed.checkpoint import FileSystemReader

    from canon_titan.convert.dcp_io import CheckpointDamaged, inner_failure, values_problem

    step_dir = save_step(tmp_path, 2)
    data = step_dir / "__0_0.distcp"
    data.write_bytes(os.urandom(data.stat().st_size))
    assert values_problem(step_dir).startswith(f"{data}: its bytes do not load")

    save_step(tmp_path, 4)

    def eio(self, file, sinfo):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(file))

    monkeypatch.setattr(FileSystemReader, "_slice_file", eio)
    with pytest.raises(BaseException) as raised:
        values_problem(tmp_path / "step-4")
    assert (
        inner_failure(raised.value, OSError) is not None
        and inner_failure(raised.value, CheckpointDamaged) is None
    )
