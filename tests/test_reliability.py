"""Faults an operator meets: a killed launcher, two runs in one folder, bad bytes in data, damaged
token shards, interrupted and damaged conversions (a damaged checkpoint: test_failures.py)."""

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from canon_titan.convert.dcp_io import ConversionError
from canon_titan.data.builtin import ASSET_DIR
from canon_titan.data.documents import DataError, ReadStats, iter_documents
from canon_titan.data.pretokenize import open_shards, tokenize_files
from canon_titan.data.tokenizers import build_tokenizer
from conftest import (
    COMMON,
    CONFIGS,
    DEBUG_CONFIG,
    REPO,
    descendants,
    kill_tree,
    make_checkpoint,
    train_env,
)

LONG = COMMON + [
    "--training.steps",
    "500",
    "--training.local_batch_size",
    "2",
    "--checkpoint.enable",
    "false",
]


def cli_train(dump, *extra, nproc=2, **popen):
    cmd = [
        sys.executable,
        "-m",
        "canon_titan.cli",
        "train",
        "--config",
        str(DEBUG_CONFIG),
        "--nproc",
        str(nproc),
        *LONG,
        "--job.dump_folder",
        str(dump),
        *extra,
    ]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def wait_for(proc, marker, timeout=300):
    start, lines = time.time(), []
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            return "".join(lines)
        if time.time() - start > timeout:
            break
    raise AssertionError(f"never saw {marker!r}:\n{''.join(lines)[-4000:]}")


def all_gone(pids, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in _state(p)]
        if not alive:
            return []
        time.sleep(0.5)
    return alive


def _state(pid):
    try:
        return open(f"/proc/{pid}/status").read().split("State:")[1].split("\n")[0]
    except OSError:
        return "zombie"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["process_group", "launcher_only"])
def test_killing_the_launcher_stops_every_worker(tmp_path, how):
    """SIGKILL of the launcher's process group (torchrun's workers live in sessions of their own),
    or of the launcher alone: no process of the job keeps training."""
    proc = cli_train(tmp_path / "run", start_new_session=True)
    try:
        wait_for(proc, "step:  2")
        family = descendants(proc.pid)
        commands = {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in family}
        workers = [
            p
            for p, c in commands.items()
            if "canon_titan.train" in c and "canon_titan.launch.torchrun" not in c
        ]
        assert len(workers) == 2, commands
        if how == "process_group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGKILL)
        assert all_gone(family) == []
    finally:
        for p in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


@pytest.mark.slow
def test_a_live_run_locks_its_dump_folder(tmp_path, monkeypatch, capfd):
    """A training run (one process: its rank 0 holds the lock) refuses a second ``canon-titan
    train`` before launch and a training process started without the launcher (what torchrun
    starts) before it trains; once the run is killed, the kernel has dropped its lock. The second
    launch and the worker run in this process (the code their subprocesses would run, without
    importing torch again), and the freed lock is taken here rather than by a one-step run: 17 s
    instead of 80 s, with the same assertions."""
    from canon_titan import cli
    from canon_titan import train as train_module
    from canon_titan.cli import train as cli_train_module
    from canon_titan.launch.ownership import lock_dump_folder

    dump = tmp_path / "run"
    first = cli_train(dump, nproc=1, start_new_session=True)
    try:
        wait_for(first, "step:  1")
        launched = []
        monkeypatch.setattr(
            cli_train_module, "_run_torchrun", lambda cmd, env: launched.append(cmd) or 0
        )
        code = cli.main(
            ["train", "--config", str(DEBUG_CONFIG), *LONG, "--job.dump_folder", str(dump)]
        )
        err = capfd.readouterr().err
        assert code == 2 and not launched, err[-3000:]
        assert f"dump folder {dump} is in use by a live run (pid " in err
        # A training process started directly (torchrun's worker, global rank 0) refuses before
        # training.
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        code = train_module.main(
            ["--config", str(DEBUG_CONFIG), *LONG, "--job.dump_folder", str(dump)]
        )
        err = capfd.readouterr().err
        assert code == 2 and "is in use by a live run" in err, err[-3000:]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    deadline = time.time() + 30
    while True:  # the kernel dropped the dead run's lock (its processes may take a moment to go)
        try:
            lock_dump_folder(dump, hold=False)
            break
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def test_a_bad_byte_costs_one_record_with_its_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"document {i} " + "word " * 40}).encode() for i in range(1000)]
    lines[499] = lines[499].replace(b"document", b"docum\xffent")
    path.write_bytes(b"\n".join(lines) + b"\n")
    stats = ReadStats()
    kept = list(iter_documents(str(path), on_error="skip", stats=stats))
    assert (
        len(kept) == 999
        and stats.skipped == 1
        and stats.problems == [f"{path}:500: not UTF-8 (byte 16 of the line: b'\\xff')"]
    )
    with pytest.raises(DataError, match=r"docs.jsonl:500: not UTF-8.*--on-error skip"):
        list(iter_documents(str(path), skip_hint="--on-error skip"))
    index = tokenize_files(
        str(path),
        tmp_path / "tokens",
        kind="hf",
        tokenizer_path=str(ASSET_DIR),
        on_error="skip",
        log=lambda m: None,
    )
    assert index["shards"][0]["documents"] == 999 and index["shards"][0]["skipped"] == 1


def _shards(tmp_path, n=3):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n):
        (src / f"{i}.jsonl").write_text(
            "".join(
                json.dumps({"text": f"file {i} document {j}: " + "text " * 30}) + "\n"
                for j in range(40)
            )
        )
    out = tmp_path / "tokens"
    tokenize_files(
        str(src / "*.jsonl"), out, kind="hf", tokenizer_path=str(ASSET_DIR), log=lambda m: None
    )
    return src, out


def test_token_ids_outside_the_vocabulary_are_named_by_shard_and_offset(tmp_path, capsys):
    from canon_titan import cli

    src, out = _shards(tmp_path)
    tok = build_tokenizer("hf", str(ASSET_DIR))
    shard = out / "00001.bin"
    data = np.fromfile(shard, dtype=np.uint16)
    data[123] = tok.get_vocab_size() + 5  # damage that keeps the size
    data.tofile(shard)
    store = open_shards(out, tok)
    with pytest.raises(
        DataError, match=rf"00001.bin: token id {tok.get_vocab_size() + 5} at offset 123 is outside"
    ):
        store.slice(0, len(store))
    assert cli.main(["data", "inspect", str(out), "--verify"]) == 2
    assert "00001.bin holds 1 token ids outside the vocabulary" in capsys.readouterr().err
    index = json.loads((out / "index.json").read_text())
    index["shards"][2]["max_id"] = 10**6  # as if written by a bigger tokenizer
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(
        DataError, match="00002.bin holds token id 1000000, outside the training vocabulary"
    ):
        open_shards(out, tok)


def _big_shard(tmp_path) -> Path:
    """A token folder of one shard of many pages (a truncation inside the first page reads as zeros
    from a memory map; past it, SIGBUS)."""
    src = tmp_path / "big.jsonl"
    src.write_text(
        "".join(json.dumps({"text": f"document {j}: " + "text " * 60}) + "\n" for j in range(400))
    )
    out = tmp_path / "tokens"
    tokenize_files(str(src), out, kind="hf", tokenizer_path=str(ASSET_DIR), log=lambda m: None)
    assert (out / "00000.bin").stat().st_size > 16 * 4096
    return out


def test_a_shard_truncated_after_it_was_opened_is_named_not_a_sigbus(tmp_path):
    """Reads of a shard cut short after training opened it: one DataError naming the shard and both
    sizes. At 432670c the shard was memory-mapped, and the read past its new end killed the process
    with SIGBUS (run in a child process here, so that the old behaviour fails the test, not
    pytest)."""
    out = _big_shard(tmp_path)
    shard = out / "00000.bin"
    size = shard.stat().st_size
    script = (
        f"import os, sys\nfrom canon_titan.data.builtin import ASSET_DIR\n"
        f"from canon_titan.data.documents import DataError\n"
        f"from canon_titan.data.pretokenize import open_shards\n"
        f"from canon_titan.data.tokenizers import build_tokenizer\n"
        f"store = open_shards({str(out)!r}, build_tokenizer('hf', str(ASSET_DIR)))\n"
        f"store.slice(0, len(store))\n"
        f"os.truncate({str(shard)!r}, 100)\n"
        f"try:\n    store.slice(len(store) - 10, len(store))\n"
        f"except DataError as e:\n    print(e)\n    sys.exit(2)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.startswith(
        f"{shard} is 100 bytes now, {size:,} when the run opened it: the shard was "
        "truncated or replaced while training read it"
    ), proc.stdout


@pytest.mark.slow
def test_a_shard_truncated_mid_run_stops_the_run_in_one_line(tmp_path):
    """`canon-titan train` on a token folder; once step 1 is logged the shard is cut to a tenth: the
    run stops with exit 2 and one line naming the shard, no traceback. At 432670c both ranks died of
    SIGBUS (120 lines, exit 1) without naming it."""
    out = _big_shard(tmp_path)
    shard = out / "00000.bin"
    proc = cli_train(
        tmp_path / "run",
        "--dataloader.dataset",
        "tokens",
        "--dataloader.dataset_path",
        str(out),
        start_new_session=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if " step:  1 " in line:
                os.truncate(shard, shard.stat().st_size // 10)
                break
        lines.append(proc.stdout.read())
        proc.wait(timeout=300)
    finally:
        kill_tree(proc.pid)
    out_text = "".join(lines)
    assert proc.returncode == 2, out_text[-4000:]
    assert "Traceback" not in out_text and "SIGBUS" not in out_text, out_text[-4000:]
    named = {
        re.sub(r"^\[rank\d+\]:", "", line)
        for line in out_text.splitlines()
        if "the shard was truncated or replaced" in line
    }
    assert len(named) == 1 and next(iter(named)).startswith(
        f"canon-titan: data error: {shard} is "
    ), named


def test_tokenize_resume_redoes_shards_that_no_longer_match(tmp_path):
    src, out = _shards(tmp_path)
    expected = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    (out / "00000.bin").unlink()
    (out / "00001.bin").write_bytes(expected["00001.bin"][:-4])
    changed = bytearray(expected["00002.bin"])
    changed[10] ^= 1
    (out / "00002.bin").write_bytes(bytes(changed))
    messages = []
    tokenize_files(
        str(src / "*.jsonl"), out, kind="hf", tokenizer_path=str(ASSET_DIR), log=messages.append
    )
    assert any("00000.bin is missing" in m for m in messages)
    assert any("00001.bin has" in m and "its record says" in m for m in messages)
    assert any("00002.bin does not match its recorded checksum" in m for m in messages)
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == expected


def convert_cli(*args):
    """``canon-titan convert ARGS`` in this process (a subprocess per call would cost seconds of
    imports each): exit code, stdout and stderr."""
    from canon_titan import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["convert", *map(str, args)])
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_conversion_faults_are_one_line_naming_the_file(tmp_path):
    run, step, _ = make_checkpoint(tmp_path, [])
    config = tmp_path / "run_config.toml"
    out = tmp_path / "hf"
    assert convert_cli("to-hf", step, out, "--config", config).returncode == 0
    # Damaged DCP: truncated data, missing data, unreadable metadata.
    data = sorted(step.glob("*.distcp"))[0]
    original = data.read_bytes()
    for damage, message in [
        (lambda: data.write_bytes(original[:100]), "is truncated"),
        (lambda: data.unlink(), "is missing"),
        (lambda: (step / ".metadata").write_bytes(b"garbage"), "not a readable DCP metadata file"),
    ]:
        damage()
        proc = convert_cli("to-hf", step, tmp_path / "x", "--config", config)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (
            proc.stderr
        )
        assert len(proc.stderr.strip().splitlines()) == 1 and str(step) in proc.stderr
    # An output parent that cannot hold a folder.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = convert_cli("from-hf", out, blocker / "dcp", "--config", config)
    assert (
        proc.returncode == 2
        and f"cannot write into {blocker}" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    # Non-JSON config and index.
    for name in ("config.json", "model.safetensors.index.json"):
        broken = tmp_path / f"broken-{name}"
        subprocess.run(["cp", "-r", str(out), str(broken)], check=True)
        (broken / name).write_text("{not json")
        proc = convert_cli("from-hf", broken, tmp_path / f"dcp-{name}", "--config", config)
        assert proc.returncode == 2 and f"{broken / name}: not readable JSON" in proc.stderr, (
            proc.stderr
        )


@pytest.fixture
def tiny_disk(tmp_path, monkeypatch):
    """(folder, fill): a 1 MiB tmpfs (a debug model's weights do not fit), or where this process
    cannot mount one, a folder whose safetensors and DCP writes fail as a full disk makes them fail
    once
    ``fill()`` is called (after the test wrote its inputs)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if (
        not os.environ.get("CANON_TITAN_TEST_NO_MOUNT")
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        == 0
    ):
        yield mount, lambda: None
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        return

    def fill():
        import safetensors.torch
        from torch.distributed.checkpoint import filesystem

        disk_usage = shutil.disk_usage

        def no_room_left(path):  # as a full disk reports itself
            usage = disk_usage(path)
            return usage._replace(free=0) if Path(path).is_relative_to(mount) else usage

        def full(*args, **kwargs):
            raise safetensors.SafetensorError(
                "Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                'message: "No space left on device" })'
            )

        def enospc(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(safetensors.torch, "save_file", full)
        monkeypatch.setattr(filesystem, "_write_item", enospc)
        monkeypatch.setattr(shutil, "disk_usage", no_room_left)

    yield mount, fill


def test_a_conversion_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, tiny_disk):
    """to-hf and from-hf into a disk that fills: one line naming the output and the free space, exit
    2, no output folder and no partial one. At 432670c to-hf gave an 18-line traceback (safetensors'
    error is not an OSError)."""
    disk, fill = tiny_disk
    run, step, _ = make_checkpoint(tmp_path, [])
    config = tmp_path / "run_config.toml"
    exported = tmp_path / "hf"
    assert convert_cli("to-hf", step, exported, "--config", config).returncode == 0
    fill()
    for direction, source, out in (
        ("to-hf", step, disk / "hf"),
        ("from-hf", exported, disk / "dcp"),
    ):
        proc = convert_cli(direction, source, out, "--config", config)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith(
            f"canon-titan: conversion error: writing {out} failed: the disk is full ("
        ), lines
        assert lines[0].endswith(
            "MiB free on its filesystem); nothing of it is left behind: free space and run the "
            "same command"
        ), lines
        assert list(disk.iterdir()) == []


def test_flipped_bytes_in_an_export_are_caught_by_its_checksums(tmp_path):
    from canon_titan.convert.hf import CHECKSUMS, from_hf, to_hf

    run, step, _ = make_checkpoint(tmp_path, [])
    out = to_hf(step, tmp_path / "hf", run)
    manifest = json.loads((out / CHECKSUMS).read_text())
    shard = out / sorted(manifest)[0]
    payload = bytearray(shard.read_bytes())
    payload[-10] ^= 0x40  # inside a tensor: safetensors reads it without complaint
    shard.write_bytes(bytes(payload))
    with pytest.raises(ConversionError, match=f"{shard}: its contents changed since the export"):
        from_hf(out, tmp_path / "dcp", run)


def test_interrupted_conversions_leave_no_stale_folders(tmp_path):
    from canon_titan.convert.hf import to_hf

    run, step, _ = make_checkpoint(tmp_path, [])
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / ".hf.partial-abc123"
    stale.mkdir()
    (stale / ".owner").write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"0" * 1000)
    out = to_hf(step, tmp_path / "hf", run)
    assert not stale.exists() and not list(tmp_path.glob(".hf.partial-*"))
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())
    assert all(oct(p.stat().st_mode & 0o777) == oct(0o666 & ~_umask()) for p in out.iterdir())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_pipeline_runs_log_the_last_stage_by_default(tmp_path, monkeypatch):
    from canon_titan import cli
    from canon_titan.cli import train as cli_train_module

    launched = []
    monkeypatch.setattr(
        cli_train_module, "_run_torchrun", lambda cmd, env: launched.append(cmd) or 0
    )
    args = [
        "train",
        "--config",
        str(CONFIGS["llama_canon"]),
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    assert cli.main(args + ["--nproc", "2", "--parallelism.pipeline_parallel_degree", "2"]) == 0
    assert cli.main(args + ["--nproc", "4", "--parallelism.pipeline_parallel_degree", "2"]) == 0
    assert cli.main(args + ["--nproc", "2"]) == 0
    filters = [cmd[cmd.index("--local-ranks-filter") + 1] for cmd in launched]
    assert filters == ["1", "2", "0"]
