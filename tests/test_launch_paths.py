"""Every launch path gets the same guarantees: ``scripts/run_train.sh`` and the README's torchrun
line (the project's torchrun wrapper) as well as ``canon-titan train``. A stop signal is one line
and exit 75 with a complete checkpoint of the step reached; a refusal before training is one line
and exit 2, decided by rank 0 before any rank builds or loads, and no rank is left waiting."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import COMMON, DEBUG_CONFIG, REPO, descendants, free_port, kill_tree, train_env

STEPS = ["--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "100"]


def readme_torchrun(dump, *extra):
    """The launching guide's "with torchrun directly" line, as it is written there, for ``dump``."""
    guide = (REPO / "docs" / "launching.md").read_text()
    block = re.search(r"# the same, with torchrun directly\n(.*?)\n```", guide, re.S).group(1)
    words = block.replace("\\\n", " ").split()
    env = dict(word.split("=", 1) for word in words if re.fullmatch(r"[A-Z_]+=\S+", word))
    words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S+", w)]
    assert words[0] == ".venv/bin/python" and words[1:3] == ["-m", "canon_titan.launch.torchrun"], (
        words
    )
    words = [sys.executable, *words[1:]]
    at = words.index("--job.dump_folder")
    words[at + 1] = str(dump)
    return words + [*COMMON, *STEPS, *extra], env


def run_train_sh(dump, *extra):
    return [
        "bash",
        str(REPO / "scripts" / "run_train.sh"),
        *COMMON,
        *STEPS,
        "--job.dump_folder",
        str(dump),
        *extra,
    ], {"NGPU": "2"}


LAUNCHERS = {"run_train.sh": run_train_sh, "torchrun": readme_torchrun}


def start(cmd_env, merged=False, cwd=REPO):
    """Start a launch command in its own process group; ``merged``: its stderr in its stdout, in
    order."""
    cmd, env = cmd_env
    env = dict(train_env(), PYTHON=sys.executable, **env)
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
    )


def finish(proc, timeout=300):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc.pid)
    return proc.returncode, out, err


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_stop_signal_under_any_launcher_saves_and_exits_75_in_one_line(tmp_path, launcher):
    """Ctrl-C (SIGINT to the launch command's process group) under run_train.sh, and SIGTERM to the
    README's torchrun command: every rank saves the step it reached, the job exits 75, the last
    line says so, and there is no traceback. At 4a7b0a2 run_train.sh exited 1 with a 30-line
    SignalException traceback."""
    dump = tmp_path / "run"
    proc = start(LAUNCHERS[launcher](dump, "--training.steps", "40"), merged=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step:  2" in line:
            if launcher == "run_train.sh":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGTERM)
            break
    code, out, err = finish(proc)
    out = "".join(lines) + out
    steps = [int(m) for m in re.findall(r"step:\s+(\d+)", out)]
    assert code == 75, (code, out[-3000:])
    assert "Traceback" not in out and "SignalException" not in out, out[-4000:]
    assert (
        "Training completed" not in out
    )  # TorchTitan says so however its loop ends; it did not complete
    last = out.strip().splitlines()[-1]
    assert re.search(
        r"preempted at step (\d+), checkpoint saved, resume with the same command", last
    ), last
    step = int(re.search(r"preempted at step (\d+)", last).group(1))
    assert step >= max(steps) and (dump / "checkpoint" / f"step-{step}" / ".metadata").is_file()


# Records, at exit, the allocator configuration a training process ran with (its os.environ, which
# /proc does not show once the process has changed it).
RECORD_ALLOC_CONF = """
import atexit, os, sys
def _record():
    if sys.argv and sys.argv[0].endswith(os.path.join("canon_titan", "train.py")):
        with open(os.path.join(os.environ["ALLOC_CONF_RECORDS"], str(os.getpid())), "w") as f:
            f.write(os.environ.get("PYTORCH_ALLOC_CONF", "unset"))
atexit.register(_record)
"""


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step run trained to its end through run_train.sh, started from another directory than the
    checkout's with a relative CONFIG whose TOML names a relative dump folder; refusals leave it as
    it is. Returns (that directory, the dump folder); the allocator configuration of each training
    process is recorded in its ``records`` folder."""
    here = tmp_path_factory.mktemp("finished")
    (here / "mydata").mkdir()
    toml = DEBUG_CONFIG.read_text().replace(
        'dump_folder = "./outputs/llama_debug"', 'dump_folder = "outputs/run"'
    )
    (here / "mydata" / "x.toml").write_text(toml)
    (here / "site").mkdir()
    (here / "site" / "sitecustomize.py").write_text(RECORD_ALLOC_CONF)
    (here / "records").mkdir()
    cmd, env = run_train_sh(here / "unused", "--training.steps", "2")
    cmd = cmd[: cmd.index("--job.dump_folder")] + cmd[cmd.index("--job.dump_folder") + 2 :]
    env.update(
        CONFIG="mydata/x.toml",
        PYTHONPATH=str(here / "site"),
        ALLOC_CONF_RECORDS=str(here / "records"),
    )
    code, out, err = finish(start((cmd, env), cwd=here))
    assert code == 0, (out[-2000:], err[-3000:])
    return here, here / "outputs" / "run"


@pytest.mark.slow
def test_run_train_sh_reads_relative_paths_from_the_current_directory_with_expandable_segments(
    finished_run,
):
    """CONFIG and the TOML's relative dump folder are read from the current directory, as
    ``canon-titan train`` reads them (at 432670c run_train.sh changed to the checkout and found no
    config), and every training process ran with expandable segments, as TorchTitan's run_train.sh
    sets (at 432670c no launch path did)."""
    here, dump = finished_run
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()
    records = [path.read_text() for path in (here / "records").iterdir()]
    assert records == ["expandable_segments:True"] * 2, records


def test_run_train_sh_names_the_directory_a_missing_relative_config_is_read_from(tmp_path):
    """One line naming the current directory, exit 2, before torchrun starts."""
    cmd, env = run_train_sh(tmp_path / "run")
    code, out, err = finish(
        start((cmd, dict(env, CONFIG="mydata/x.toml")), cwd=tmp_path), timeout=120
    )
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [
        f"canon-titan: config error: mydata/x.toml: config file not found in "
        f"{tmp_path} (a relative path is read from the current directory)"
    ], err


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_refusal_under_any_launcher_is_one_line_and_2_before_any_rank_builds(
    finished_run, launcher
):
    """A finished run launched again, and an edited model over its dump folder: rank 0 refuses
    before any rank builds the model or loads, in one line, with exit 2, and no other rank is
    left waiting (the job ends in seconds). At 4a7b0a2 the right line came inside a 60-line
    ChildFailedError traceback with exit 1, after every rank had built the model."""
    _, dump = finished_run
    for extra, expected in [
        (["--training.steps", "2"], "already holds a finished run"),
        (["--training.steps", "4", "--model.dim", "96"], "written by another model"),
    ]:
        started = time.monotonic()
        code, out, err = finish(start(LAUNCHERS[launcher](dump, *extra)))
        lines = [
            line for line in err.splitlines() if re.match(r"(\[rank\d+\]:)?canon-titan:", line)
        ]
        assert code == 2, (code, out[-2000:], err[-3000:])
        assert len(lines) == 1 and expected in lines[0], err[-3000:]
        assert err.strip().splitlines()[-1] == lines[0], err[
            -3000:
        ]  # the diagnosis is the last line
        assert "Traceback" not in out + err and "ChildFailedError" not in out + err, err[-3000:]
        assert "Building" not in out + err and "Model " not in out, out[
            -3000:
        ]  # no rank built the model
        assert time.monotonic() - started < 90


def test_the_readme_launch_commands_run_in_order_each_in_its_own_dump_folder():
    """Run one after the other as written, the README's three single-node launch commands train
    (the second and third did not: they met the first one's finished run)."""
    guide = (REPO / "docs" / "launching.md").read_text()
    section = guide[: guide.index("## Multi-node")]
    folders = re.findall(r"--job\.dump_folder (\S+)", section)
    commands = [c for c in re.findall(r"```bash\n(.*?)```", section, re.S)]
    assert (
        sum(
            block.count("canon_titan.train")
            + block.count("canon-titan train")
            + block.count("run_train.sh")
            for block in commands
        )
        == 3
    )
    assert len(folders) == 3 and len(set(folders)) == 3, folders
    assert all(f.startswith("outputs/") for f in folders)  # ignored by git: a clean tree afterwards


@pytest.mark.slow
def test_a_divergence_stop_under_run_train_sh_ends_on_its_diagnosis(tmp_path):
    """A diverging run (lr 1e3) under run_train.sh: exit 3, and the one line naming the step and the
    last good checkpoint is the last thing on screen. At 4a7b0a2 torchelastic's ``failed (exitcode:
    3)`` and ``no error file defined`` lines followed it (and the exit code was 1)."""
    proc = start(
        run_train_sh(
            tmp_path / "run",
            "--training.steps",
            "10",
            "--optimizer.lr",
            "1e3",
            "--checkpoint.interval",
            "2",
        )
    )
    code, out, err = finish(proc)
    assert code == 3, err[-3000:]
    # torchrun tails each worker's stdout and stderr apart, so "last" is within the error stream,
    # where torchelastic's own lines go too.
    last = err.strip().splitlines()[-1]
    assert re.match(r"(\[rank0\]:)?canon-titan: .*not finite", last), err[-3000:]
    assert "exitcode" not in out + err and "no error file" not in err and "Traceback" not in err, (
        err[-3000:]
    )


# Rank 1 fails first by torchrun's clock: it writes its error file (as torch's ``record`` does on an
# exception, e.g. a collective whose peer has gone) and is still exiting when torchrun stops it with
# SIGTERM. Rank 0 stops on purpose a second later, as a diverged run does: one line, code 3.
RACE = """
import os, sys, time
from pathlib import Path
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from canon_titan.components.exit_codes import report_exit
mine = Path(os.environ["TORCHELASTIC_ERROR_FILE"])
if os.environ["RANK"] == "1":
    try:
        raise RuntimeError("Connection closed by peer")
    except RuntimeError as e:
        ErrorHandler().record_exception(e)
    time.sleep(600)
peer = mine.parent.parent / "1" / "error.json"
while not peer.is_file():
    time.sleep(0.05)
time.sleep(1.5)  # torchrun's timestamps are whole seconds
print("canon-titan: the gradients at step 4 are not finite: the run stops", file=sys.stderr,
      flush=True)
os._exit(report_exit(3))
"""


@pytest.mark.slow
def test_a_purposeful_stop_stays_last_when_a_stopped_worker_failed_first(tmp_path):
    """torchrun names the failure with the earliest timestamp; when that is a worker it stopped
    itself (exit -15, its error file written a second before rank 0 stopped on purpose), the wrapper
    still exits 3 with rank 0's line last. Before the fix, torchrun's ``failed (exitcode: -15)`` and
    ``no error file defined`` lines followed it (seen once in 1,234 tests, with two test workers on
    two cores)."""
    script = tmp_path / "race.py"
    script.write_text(RACE)
    cmd = [
        sys.executable,
        "-m",
        "canon_titan.launch.torchrun",
        "--standalone",
        "--nproc_per_node=2",
        "--log-dir",
        str(tmp_path / "logs"),
        str(script),
    ]
    code, out, err = finish(start((cmd, {})), timeout=120)
    assert code == 3, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.match(r"(\[rank0\]:)?canon-titan: .*not finite", last), err[-3000:]
    assert "exitcode" not in out + err and "no error file" not in err and "Traceback" not in err, (
        err[-3000:]
    )


# Both ranks refuse alike; rank 1 is still shutting down (its atexit work, the interpreter's
# teardown) when rank 0 has exited, and torchrun stops it with SIGTERM.
SLOW_REFUSER = """
import atexit, os, time
from canon_titan.components.exit_codes import report_exit, say_once, stop_before_training
stop_before_training()
say_once("dump folder x already holds a finished run")
if os.environ["RANK"] == "0":
    os._exit(report_exit(2))
atexit.register(time.sleep, 600)
raise SystemExit(report_exit(2))
"""


@pytest.mark.slow
def test_a_refusing_rank_stopped_while_it_shuts_down_keeps_its_line_and_code(tmp_path):
    """A rank that has said its refusal and reported exit 2 keeps both when torchrun's SIGTERM comes
    during its shutdown: the job exits 2 with the refusal as its one line. At 223c57f the stop
    handler wrote "SIGTERM before training started" over the rank's line and the wrapper printed
    both (the README torchrun refusal test failed on it, reproducibly, from 4fa9bc2 on)."""
    script = tmp_path / "refuse.py"
    script.write_text(SLOW_REFUSER)
    cmd = [sys.executable, "-m", "canon_titan.launch.torchrun", "--standalone"]
    cmd += ["--nproc_per_node=2", "--log-dir", str(tmp_path / "logs"), str(script)]
    code, out, err = finish(start((cmd, {})), timeout=120)
    lines = [line for line in err.splitlines() if re.match(r"(\[rank\d+\]:)?canon-titan:", line)]
    assert code == 2, err[-3000:]
    assert lines == ["canon-titan: dump folder x already holds a finished run"], err[-3000:]
    assert err.strip().splitlines()[-1] == lines[0] and "Traceback" not in err, err[-3000:]


@pytest.mark.slow
def test_sigint_reaches_a_run_started_in_the_background_of_a_script(tmp_path):
    """``canon-titan train ... &`` in a non-interactive script starts with SIGINT ignored (bash does
    that for background jobs); a SIGINT the user sends it still saves and exits 75."""
    script = 'canon-titan train "$@" & echo launcher=$!; wait $!'
    cmd = [
        "bash",
        "-c",
        script,
        "bash",
        "--config",
        str(DEBUG_CONFIG),
        "--nproc",
        "2",
        *COMMON,
        *STEPS,
        "--training.steps",
        "40",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    env = dict(PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    proc = start((cmd, env), merged=True)
    launcher, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        launcher = launcher or (int(line.split("=")[1]) if line.startswith("launcher=") else None)
        if "step:  2" in line:
            os.kill(launcher, signal.SIGINT)
            break
    code, out, _ = finish(proc)
    out = "".join(lines) + out
    assert code == 75 and "preempted at step" in out, out[-3000:]


def training_processes(pid):
    """The training processes (``-m canon_titan.train``) under ``pid``."""
    found = []
    for child in descendants(pid):
        try:
            command = open(f"/proc/{child}/cmdline").read().split("\0")
        except OSError:
            continue
        if "canon_titan.train" in command and "canon_titan.launch.torchrun" not in command:
            found.append(child)
    return found


def signal_every_process(proc, sig=signal.SIGTERM):
    """``sig`` to every process of a job at once, as a scheduler sends it."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


BEFORE_TRAINING = (
    "canon-titan: SIGTERM before training started: stopped, nothing to save; run the same "
    "command again"
)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["importing torch", "building the trainer"])
def test_a_stop_signal_to_every_process_during_start_up_is_one_line_and_75_on_every_rank(
    tmp_path, phase
):
    """SIGTERM to every process of a run_train.sh job while its training processes import torch, or
    just before they build the trainer: every rank stops at once with 75 (nothing had trained), the
    job exits 75 (a requeue runs it again) with one line saying so, long before the 90 s grace. At
    432670c the first exited 3 with a line about "the step they reached", and in the second one rank
    died at once while rank 0 waited out the grace and exited 3, saying checkpointing was off."""
    exits = tmp_path / "exits"
    exits.mkdir()
    cmd, env = run_train_sh(tmp_path / "run", "--training.steps", "20")
    proc = start((cmd, dict(env, CANON_TITAN_OUTCOME_DIR=str(exits))))
    try:
        if phase == "importing torch":
            while len(training_processes(proc.pid)) < 2 and proc.poll() is None:
                time.sleep(0.05)
            time.sleep(
                1.0
            )  # each has taken the signals (its first lines), and imports torch for seconds more
        else:
            for line in proc.stdout:
                if "Run config" in line:  # the line just before the trainer is built
                    break
        signal_every_process(proc)
        sent = time.monotonic()
        code, out, err = finish(proc, timeout=120)
    finally:
        kill_tree(proc.pid)
    assert code == 75, (code, out[-2000:], err[-3000:])
    assert time.monotonic() - sent < 30, time.monotonic() - sent
    lines = [line for line in err.splitlines() if "canon-titan:" in line]
    assert lines == [BEFORE_TRAINING] and err.strip().splitlines()[-1] == BEFORE_TRAINING, err[
        -3000:
    ]
    assert "Traceback" not in out + err
    assert {path.name: path.read_text() for path in exits.glob("rank-*")} == {
        "rank-0": "75",
        "rank-1": "75",
    }
    assert not (tmp_path / "run" / "checkpoint").exists()


@pytest.mark.slow
def test_a_killed_torchrun_is_one_line_3_and_leaves_no_temporary_folders(tmp_path):
    """torchrun SIGKILLed under ``canon-titan train`` (its workers die with it): one line naming
    what happened and what there is to resume from, exit 3 (stopped without saving the step
    reached), and torchrun's log and exit-report folders gone from the temporary disk. At 432670c it
    exited 247 with no line and left both behind."""
    dump = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "canon_titan.cli",
        "train",
        "--config",
        str(DEBUG_CONFIG),
        "--nproc",
        "2",
        *COMMON,
        *STEPS,
        "--training.steps",
        "40",
        "--checkpoint.interval",
        "2",
        "--job.dump_folder",
        str(dump),
    ]
    proc = start((cmd, {}), merged=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step:  3" in line:
            torchrun = [
                pid
                for pid in descendants(proc.pid)
                if "canon_titan.launch.torchrun" in open(f"/proc/{pid}/cmdline").read().split("\0")
            ]
            workers = training_processes(proc.pid)
            os.kill(torchrun[0], signal.SIGKILL)
            break
    code, out, _ = finish(proc, timeout=120)
    out = "".join(lines) + out
    scratch = Path(re.search(r"--log-dir (\S+)/logs", out).group(1))
    assert code == 3, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(
        "canon-titan: torchrun was killed by SIGKILL, and its training processes with it"
    ), last
    assert f"the newest complete checkpoint is step 2 ({dump / 'checkpoint' / 'step-2'})" in last, (
        last
    )
    assert not scratch.exists()
    time.sleep(1)
    assert not [pid for pid in workers if alive(pid)]


def alive(pid: int) -> bool:
    """Whether a process runs: not gone, and not a zombie (dead, waiting for the process that
    adopted it, init or a subreaper, to collect it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def hostname_not_resolving(command: list[str]) -> list[str]:
    """``command`` in a UTS namespace of its own whose host name resolves nowhere."""
    return [
        "unshare",
        "--uts",
        "sh",
        "-c",
        'hostname canon-titan-unresolvable && exec "$@"',
        "sh",
        *command,
    ]


def can_rename_host() -> bool:
    try:
        return (
            subprocess.run(
                hostname_not_resolving(["true"]), capture_output=True, timeout=30
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not can_rename_host(), reason="needs unshare --uts (root or user namespaces)")
def test_a_host_whose_name_does_not_resolve_trains_alone_and_refuses_several_nodes(tmp_path):
    """On a host whose own name resolves nowhere, ``canon-titan train`` runs on the loopback address
    and trains (at 432670c it waited over 400 s in c10d's connection retries), and a multi-node
    run_train.sh is refused in one line naming the host, within seconds."""
    cmd = [
        sys.executable,
        "-m",
        "canon_titan.cli",
        "train",
        "--config",
        str(DEBUG_CONFIG),
        "--nproc",
        "1",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "1",
        "--training.steps",
        "1",
        "--checkpoint.enable",
        "false",
        "--job.dump_folder",
        str(tmp_path / "alone"),
    ]
    started = time.monotonic()
    code, out, err = finish(start((hostname_not_resolving(cmd), {})), timeout=400)
    assert code == 0, err[-3000:]
    assert "step:  1" in out and time.monotonic() - started < 240
    cmd, env = run_train_sh(tmp_path / "nodes")
    env.update(NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    started = time.monotonic()
    code, out, err = finish(start((hostname_not_resolving(cmd), env)), timeout=120)
    assert code == 2 and time.monotonic() - started < 60, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith(
        "canon-titan: this host's name 'canon-titan-unresolvable' does not resolve"
    ), line


def global_rank_of(launcher) -> int | None:
    """The global rank of the (single) training process under ``launcher``, while it runs."""
    for pid in training_processes(launcher.pid):
        try:
            env = dict(
                item.split("=", 1)
                for item in open(f"/proc/{pid}/environ").read().split("\0")
                if "=" in item
            )
        except OSError:
            continue
        if "RANK" in env:
            return int(env["RANK"])
    return None


@pytest.mark.slow
def test_node_rank_decides_where_rank_0_runs_and_a_waiting_node_says_for_whom(tmp_path):
    """Two run_train.sh nodes on loopback, one process each, node 1 started first: it says every 30
    s that it waits for node 0 at MASTER_ADDR:MASTER_PORT; once node 0 joins, global rank 0 runs on
    node 0 (NODE_RANK=0), not on the node that joined first (at 432670c, with c10d's rendezvous, it
    did, and a node waited in silence). Node 1's console prefixes its rank's lines with its global
    rank, 1 (torchrun's own prefix is the local rank: ``[rank0]:`` on every node). Launched again on
    the finished run, both nodes refuse in one line each."""
    port = free_port()
    launched = []

    def node(rank):
        cmd, env = run_train_sh(tmp_path / "run", "--training.steps", "1")
        env.update(
            NGPU="1",
            NNODES="2",
            NODE_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        launched.append(start((cmd, env)))
        return launched[-1]

    try:
        first = node(1)
        said = next(line for line in first.stderr if "canon-titan:" in line)
        assert said.startswith(
            f"canon-titan: node 1 of 2: waiting for node 0 at 127.0.0.1:{port}, which does not "
            "answer yet"
        ), said
        second = node(0)
        ranks = {}
        while len(ranks) < 2 and first.poll() is None and second.poll() is None:
            for rank, launcher in ((1, first), (0, second)):
                found = global_rank_of(launcher)
                if found is not None:
                    ranks[rank] = found
            time.sleep(0.1)
        assert ranks == {0: 0, 1: 1}, ranks
        results = [finish(launcher) for launcher in (first, second)]
        assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
        node1 = results[0][1]
        assert re.search(r"^\[rank1\]:", node1, re.M), node1[-2000:]
        assert not re.search(r"^\[rank0\]:", node1, re.M), node1[-2000:]
        for code, _out, err in [finish(launcher) for launcher in (node(1), node(0))]:
            lines = [line for line in err.splitlines() if "canon-titan:" in line]
            assert code == 2 and len(lines) == 1 and "already holds a finished run" in lines[0], (
                err[-3000:]
            )
    finally:
        for launcher in launched:
            kill_tree(launcher.pid)


def test_a_second_node_left_at_node_rank_0_is_refused_in_one_line(tmp_path):
    """run_train.sh on several nodes needs each node's NODE_RANK and node 0's address; and a node
    that has node rank 0 while the master address is another host's (a second node started without
    its own rank) is refused, where it would host a store of its own and wait for nodes that never
    come."""
    cmd, env = run_train_sh(tmp_path / "run")
    code, out, err = finish(
        start((cmd, dict(env, NNODES="2", MASTER_ADDR="127.0.0.1"))), timeout=60
    )
    assert code == 2 and err.strip().splitlines() == [
        "canon-titan: NNODES=2: set NODE_RANK (another on each node, 0 to 1; node 0 holds "
        "global rank 0) and "
        "MASTER_ADDR (node 0's address) on every node"
    ], err
    elsewhere = "192.0.2.1"  # TEST-NET-1: no host's own address
    code, out, err = finish(
        start((cmd, dict(env, NNODES="2", NODE_RANK="0", MASTER_ADDR=elsewhere))), timeout=120
    )
    assert code == 2, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith(
        f"canon-titan: this node has node rank 0, so it hosts the rendezvous at '{elsewhere}'"
    ), line


def _node(tmp_path, rank, nodes=2, **extra):
    cmd, env = run_train_sh(tmp_path / "run")
    return start(
        (
            cmd,
            dict(
                env,
                NGPU="1",
                NNODES=str(nodes),
                NODE_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                **extra,
            ),
        )
    )


def test_a_node_rank_out_of_range_is_refused_in_one_line(tmp_path):
    """NODE_RANK=2 of NNODES=2: one line naming the range, at once. At 381a133 every node waited
    until torchrun's 600 s rendezvous timeout."""
    code, out, err = finish(_node(tmp_path, 2, MASTER_PORT=str(free_port())), timeout=120)
    assert code == 2, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line == (
        "canon-titan: node rank 2 (--node_rank, NODE_RANK) is outside 0 to 1 for 2 nodes "
        "(--nnodes, NNODES): give each node its own rank, node 0 the one at MASTER_ADDR"
    ), line


def test_a_master_port_taken_on_node_0_is_refused_in_one_line(tmp_path):
    """Another process listens on MASTER_PORT on node 0: one line naming the port. At 381a133 a
    45-line DistNetworkError traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = finish(_node(tmp_path, 0, MASTER_PORT=str(port)), timeout=120)
    assert code == 2, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith(
        f"canon-titan: port {port} on 127.0.0.1 (--master_port, MASTER_PORT) is taken by another "
        "process"
    ), line


CLAIMED_ELSEWHERE = """
import socket, sys
socket.gethostname = lambda: "other-node"
from canon_titan.launch import rendezvous
print(rendezvous._claim("127.0.0.1", int(sys.argv[1]), 1))
"""


def test_a_node_rank_another_node_holds_is_refused_in_one_line(tmp_path):
    """Node rank 1 given to two nodes of three: the second to join is refused in one line naming
    the first (node 0's store, which torchrun's agent on node 0 serves, stood in for by a TCPStore
    here). At 381a133 both counted as nodes of the job and every node waited in silence."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = free_port()
    node0 = TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    first = subprocess.run(
        [sys.executable, "-c", CLAIMED_ELSEWHERE, str(port)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.stdout.strip() == "None", first.stderr  # the first node of rank 1 holds it
    code, out, err = finish(_node(tmp_path, 1, nodes=3, MASTER_PORT=str(port)), timeout=180)
    del node0
    assert code == 2, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line == (
        "canon-titan: node rank 1 (--node_rank, NODE_RANK) is taken by other-node, which joined "
        "first: give each node its own rank from 0 to NNODES - 1"
    ), line


def test_a_pretuned_triton_cache_seeds_a_nodes_cache_without_overwriting_it(tmp_path, monkeypatch):
    """``CANON_TITAN_TRITON_SEED``: the files the node's cache lacks are copied (whole, nothing half
    written left), those it has are kept; a seed that is not a folder is one line."""
    from canon_titan.launch import triton_cache

    seed, cache = tmp_path / "seed", tmp_path / "cache"
    (seed / "k1").mkdir(parents=True)
    (seed / "k1" / "kernel.cubin").write_bytes(b"seeded")
    (seed / "k2.autotune.json").write_text("{}")
    (cache / "k1").mkdir(parents=True)
    (cache / "k1" / "kernel.cubin").write_bytes(b"compiled here")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setenv(triton_cache.SEED_ENV, str(seed))
    said, problem = triton_cache.seeded_from_environment()
    assert (
        problem is None
        and said == f"Triton cache {cache}: 1 files copied from {seed} (CANON_TITAN_TRITON_SEED)"
    )
    assert (cache / "k1" / "kernel.cubin").read_bytes() == b"compiled here"
    assert (cache / "k2.autotune.json").read_text() == "{}"
    assert sorted(p.name for p in cache.rglob("*")) == ["k1", "k2.autotune.json", "kernel.cubin"]
    monkeypatch.setenv(triton_cache.SEED_ENV, str(tmp_path / "missing"))
    assert triton_cache.seeded_from_environment()[1].startswith(
        f"CANON_TITAN_TRITON_SEED={tmp_path / 'missing'} is not a folder"
    )
