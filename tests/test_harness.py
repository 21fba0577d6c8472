"""The suite's own helpers: a folder made once for all of a session's pytest-xdist workers."""

import multiprocessing
import time

import pytest

from conftest import make_once


def _fill(folder, log):
    with open(log, "a") as f:
        f.write("made\n")
    time.sleep(1.0)  # long enough for the other process to ask meanwhile
    (folder / "weights").write_text("w")


def _ask(folder, log, out):
    made = make_once(folder, lambda f: _fill(f, log))
    out.put((made / "weights").read_text())


def test_a_folder_two_processes_ask_for_at_once_is_made_once(tmp_path):
    folder, log = tmp_path / "seed", tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(folder, log, out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(out.get(timeout=5) for _ in procs) == ["w", "w"]
    assert log.read_text() == "made\n"


def test_a_make_that_fails_leaves_nothing_and_the_next_ask_makes_it(tmp_path):
    folder = tmp_path / "seed"

    def broken(f):
        (f / "half").write_text("x")
        raise RuntimeError("training failed")

    with pytest.raises(RuntimeError, match="training failed"):
        make_once(folder, broken)
    assert not folder.exists()
    assert (
        make_once(folder, lambda f: (f / "weights").write_text("w")) / "weights"
    ).read_text() == "w"
    assert not (folder / "half").exists()
