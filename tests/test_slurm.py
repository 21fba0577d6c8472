"""scripts/train.slurm under bash on one machine, with stand-ins for srun and scontrol that behave
as SLURM's do (tests/slurm_standin.py): the processes per node follow the GPUs SLURM gives, and a
preemption that saved a complete checkpoint is requeued whatever code srun reports."""

import os
import re
import signal
import subprocess

import pytest

import slurm_standin
from conftest import COMMON, DEBUG_CONFIG, REPO, free_port, train_env

TEMPLATE = REPO / "scripts" / "train.slurm"
FAKE_PYTHON = """#!/bin/bash
echo "OMP_NUM_THREADS=$OMP_NUM_THREADS $*" >> "$FAKE_LOG"
echo "$TRITON_CACHE_DIR $TRITON_CACHE_AUTOTUNING" >> "$FAKE_LOG.triton"
node_exit=FAKE_TORCHRUN_EXIT_NODE$SLURM_NODEID
case "$*" in *canon_titan.launch.torchrun*) exit "${!node_exit:-${FAKE_TORCHRUN_EXIT:-0}}";; esac
"""


def slurm_env(tmp_path, submit, **extra):
    bin_dir = slurm_standin.install(tmp_path / "bin")
    env = dict(
        train_env(),
        PATH=f"{bin_dir}:{train_env()['PATH']}",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_NNODES="2",
        SLURM_SUBMIT_DIR=str(submit),
        **extra,
    )
    for name in (
        "GPUS_PER_NODE",
        "OMP_NUM_THREADS",
        "SLURM_GPUS_ON_NODE",
        "SLURM_GPUS_PER_NODE",
        "SLURM_CPUS_PER_TASK",
    ):
        if name not in extra:
            env.pop(name, None)
    return env


def fake_submit_dir(tmp_path):
    """A submit folder whose .venv/bin/python logs its arguments (and the threads it was given)
    instead of
    running: the template's command lines, without a training run."""
    submit = tmp_path / "submit"
    (submit / ".venv" / "bin").mkdir(parents=True)
    (submit / ".venv" / "bin" / "python").write_text(FAKE_PYTHON)
    (submit / ".venv" / "bin" / "python").chmod(0o755)
    return submit


@pytest.mark.parametrize(
    "given, gpus, threads",
    [
        ({"SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "48"}, 4, 12),
        ({"SLURM_GPUS_PER_NODE": "h100:2", "SLURM_CPUS_PER_TASK": "16"}, 2, 8),
        ({"GPUS_PER_NODE": "3", "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "2"}, 3, 1),
        ({"SLURM_GPUS_ON_NODE": "2", "OMP_NUM_THREADS": "5"}, 2, 5),
    ],
    ids=["gpus_on_node", "typed_gpus_per_node", "override", "threads_given"],
)
def test_the_processes_per_node_follow_the_gpus_slurm_gives(tmp_path, given, gpus, threads):
    """One process per GPU that SLURM gave each node (its type stripped), its share of the task's
    CPUs as threads. At 432670c it was 8 whatever the allocation."""
    submit = fake_submit_dir(tmp_path)
    env = slurm_env(tmp_path, submit, SLURM_JOB_ID="11", FAKE_LOG=str(tmp_path / "calls"), **given)
    proc = subprocess.run(
        ["bash", str(TEMPLATE), "run.toml", "--training.steps", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    node0, node1 = (
        (tmp_path / "calls").read_text().splitlines()
    )  # the wrapper checks the config at 2 x gpus
    for node in (node0, node1):
        assert node.startswith(f"OMP_NUM_THREADS={threads} ")
        assert f"--nnodes 2 --nproc_per_node {gpus} " in node and node.endswith(
            "--training.steps 3"
        )


def test_without_a_gpu_count_the_template_says_what_to_set(tmp_path):
    submit = fake_submit_dir(tmp_path)
    env = slurm_env(tmp_path, submit, SLURM_JOB_ID="11", FAKE_LOG=str(tmp_path / "calls"))
    proc = subprocess.run(
        ["bash", str(TEMPLATE), "run.toml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and not (tmp_path / "calls").exists()
    assert proc.stderr.strip().splitlines() == [
        "canon-titan: cannot tell the GPUs per node (SLURM_GPUS_ON_NODE and "
        "SLURM_GPUS_PER_NODE are not set): "
        "keep '#SBATCH --gpus-per-node', or set GPUS_PER_NODE"
    ]


def run_fake_job(tmp_path, job: str, timeout: int = 60, **extra):
    """The template on two fake nodes of one GPU each (``fake_submit_dir``), as job ``job``."""
    submit = fake_submit_dir(tmp_path)
    env = slurm_env(
        tmp_path,
        submit,
        SLURM_JOB_ID=job,
        SLURM_GPUS_ON_NODE="1",
        FAKE_LOG=str(tmp_path / "calls"),
        **extra,
    )
    env.pop("TRITON_CACHE_DIR", None)
    return subprocess.run(
        ["bash", str(TEMPLATE), "run.toml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    ), submit


def test_a_failure_is_not_requeued(tmp_path):
    proc, _ = run_fake_job(tmp_path, "12", FAKE_TORCHRUN_EXIT="1")
    assert proc.returncode == 1, proc.stderr
    assert not (tmp_path / "bin" / "requeued").exists()


@pytest.mark.parametrize("node1", ["75", "3"], ids=["both-saved", "one-did-not-see-the-checkpoint"])
def test_a_stop_is_requeued_on_sruns_code_decided_on_the_first_node(tmp_path, node1):
    """Both nodes' wrappers stopped on a signal, the second ending 3 s after the first (a slower
    node's teardown): srun lets it end and reports the highest code, 75, and the job is requeued,
    with no file read that another node wrote. The same when the second node's wrapper did not see
    the checkpoint the first saved (NFS) and exited 3. At 381a133 srun (--kill-on-bad-exit) killed
    the slower node and reported 143, and the job requeued only on a marker file, which a node may
    not see seconds after another node made it."""
    proc, submit = run_fake_job(
        tmp_path,
        "13",
        timeout=120,
        FAKE_TORCHRUN_EXIT_NODE0="75",
        FAKE_TORCHRUN_EXIT_NODE1=node1,
        SRUN_SLOW_NODE_S="3",
    )
    assert proc.returncode == 75, proc.stderr
    assert "requeueing job 13 to resume from it" in proc.stderr
    assert (tmp_path / "bin" / "requeued").read_text() == "13\n"
    assert sorted(p.name for p in submit.iterdir()) == [".venv"]


def test_each_node_caches_triton_kernels_on_its_own_disk(tmp_path):
    """Triton's cache in the node's temporary folder (TMPDIR), not the shared home, and the
    autotuners' choices kept in it."""
    proc, _ = run_fake_job(tmp_path, "14", TMPDIR=str(tmp_path / "local"), USER="someone")
    assert proc.returncode == 0, proc.stderr
    seen = set((tmp_path / "calls.triton").read_text().splitlines())
    assert seen == {f"{tmp_path / 'local'}/canon-titan-triton-someone 1"}


@pytest.mark.slow
def test_a_preemption_whose_nodes_end_apart_is_requeued(tmp_path):
    """Two nodes, SIGTERM to every process of the job step (SLURM's --signal=TERM@120): both save
    the step reached and exit 75, the second node's task ending later; srun waits for it and reports
    75, and the job is requeued and exits 75. At 432670c it exited 143 and was not requeued."""
    submit = tmp_path / "submit"
    submit.mkdir()
    (submit / ".venv").symlink_to(REPO / ".venv")
    port = free_port()
    dump = tmp_path / "run"
    env = slurm_env(
        tmp_path,
        submit,
        SLURM_JOB_ID=str(port),
        SLURM_GPUS_ON_NODE="1",
        SLURM_CPUS_PER_TASK="1",
        RDZV_PORT=str(port),
        SRUN_SLOW_NODE_S="3",
    )
    proc = subprocess.Popen(
        [
            "bash",
            str(TEMPLATE),
            str(DEBUG_CONFIG),
            *COMMON,
            "--training.steps",
            "500",
            "--training.local_batch_size",
            "2",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "100",
            "--job.dump_folder",
            str(dump),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "step:  2" in line:
                for pid in slurm_standin.processes_under(proc.pid):
                    try:
                        command = open(f"/proc/{pid}/cmdline").read()
                        if "canon_titan" in command and "slurm_standin" not in command:
                            os.kill(pid, signal.SIGTERM)
                    except (OSError, ProcessLookupError):
                        pass
                break
        lines.append(proc.stdout.read())
        proc.wait(timeout=300)
    finally:
        for pid in slurm_standin.processes_under(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = "".join(lines)
    assert proc.returncode == 75, out[-5000:]
    assert f"requeueing job {port} to resume from it" in out, out[-5000:]
    assert (tmp_path / "bin" / "requeued").read_text() == f"{port}\n"
    step = re.search(r"preempted at step (\d+),", out).group(1)
    assert (dump / "checkpoint" / f"step-{step}" / ".metadata").is_file()
