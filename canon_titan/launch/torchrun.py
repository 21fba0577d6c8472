"""``python -m canon_titan.launch.torchrun ARGS``: torchrun (``torch.distributed.run``) as the
launcher runs it. A job that stops on purpose (preempted, diverged, refused: its ranks have said why
in one line) exits with its ranks' code instead of torchrun's failure report and traceback; any
other failure keeps torchrun's report.

Before torchrun starts anything, for a ``canon_titan.train`` job: its config is checked as ``config
validate`` checks it, at the job's world size (nodes x processes per node), and refused in one line
on every node; a host whose own name does not resolve (torchrun names the node by it, and its
workers would wait minutes for a store there) runs a one-node job on the loopback address and
refuses a multi-node one; a node rank out of range, a rendezvous port taken on the node that would
host it, and a node rank another node holds already are refused in one line
(``launch/rendezvous.py``). While a node waits for the others to join, it says every 30 s whom it
waits for and where. The node's Triton cache is seeded from ``CANON_TITAN_TRITON_SEED`` when given
(``launch/triton_cache.py``). A stop signal before torchrun has its own handlers is one line and 75
(nothing has started).

The lines the ranks say alike (``exit_codes.say_once``: a refusal, why they stopped) are printed
once, after torchrun ends, so the diagnosis is the last line on each node's console.

A stop signal often reaches torchrun twice at once: Ctrl-C or ``kill -- -PGID`` signals the
launcher's whole process group, and the launcher passes its own on. torchrun's handler raises on
each, so the copy lands inside its shutdown (a logging traceback, or a wait for the saving workers
cut short). Copies within the workers' duplicate window count as one, as they do in the workers;
a later signal still stops everything at once. SIGUSR1 (SLURM's ``--signal=USR1@T``), which torchrun
does not handle by default and which would kill it on the spot, is added to the signals it handles
(``--signals-to-handle``): it passes it to the workers, which save and exit as on SIGTERM.

Exit codes: 0, 2 (refused before training), 3 (stopped: divergence, a failed save, or a stop signal
that left no complete checkpoint of the step reached) and 75 only when the workers saved the step
they reached and that checkpoint is complete, or no worker had trained a step, so a requeue-on-75
job script resumes exactly.

What ``canon-titan train`` sets, the wrapper defaults to when it is not given: ``--log-dir``
(torchrun's per-rank copies of the output, on the local temporary disk, never the dump folder) and
``--shutdown-timeout`` (the run's ``[job] stop_grace_seconds`` plus 30 s, so the workers have the
time to save that the config gives them). The workers' exit reports go to ``OUTCOME_DIR_ENV``'s
folder when the environment names one (``canon-titan train`` does, to clean up after a killed
torchrun), else to a temporary folder of the wrapper's."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from canon_titan.components.exit_codes import (
    DUPLICATE_WINDOW_S,
    OUTCOME_DIR_ENV,
    PREEMPTED,
    REFUSED,
    STOPPED,
    STOPPED_EXIT_CODES,
    before_exit,
    exit_now,
    reported_exits,
    reported_lines,
    saved_checkpoints,
    take_stop_signals,
    trained,
    watching,
)

TRAINING_MODULE = "canon_titan.train"
SHUTDOWN_MARGIN_S = 30
"""Beyond the run's stop grace: the workers' exit, torchrun's own shutdown."""
_first_signal_at: list[float] = []


def _terminate_once(signum, frame) -> None:
    """torchrun's death-signal handler, raising once per stop request."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    now = time.monotonic()
    if _first_signal_at and now - _first_signal_at[0] <= DUPLICATE_WINDOW_S:
        return
    _first_signal_at[:] = [now]
    raise SignalException(
        f"Process {os.getpid()} got signal: {signal.Signals(signum)}", sigval=signal.Signals(signum)
    )


def _stop_before_start(signum) -> None:
    """A stop signal before torchrun has its own handlers: no worker has started."""
    os.write(
        2,
        f"canon-titan: {signal.Signals(signum).name} before the training processes "
        "started: stopped, "
        "nothing to save; run the same command again\n".encode(),
    )
    exit_now(PREEMPTED)


def after_stop_signal(reported: dict[int, int], saved: list[Path], training: bool) -> int:
    """The job's code when torchrun got a stop signal: what its workers reported, and whether any
    had trained a step (``training``). A run that finished (every worker 0: the signal came during
    the last step, which was saved) is 0; one that stopped for another reason keeps its code (3
    where the step reached is not on disk: the grace period ran out, a second signal, checkpointing
    off); 75 when no worker had trained (nothing is lost, whatever became of the workers), or when
    the workers saved the step reached and every checkpoint they said they saved is complete;
    trained workers that could not say (killed) are 3."""
    codes = set(reported.values())
    if codes == {0}:
        return 0
    stopped = codes & (STOPPED_EXIT_CODES - {PREEMPTED})
    if stopped:
        return max(stopped)
    if not training:
        return PREEMPTED
    if not codes:
        return STOPPED
    return PREEMPTED if _complete(saved) else STOPPED


def _complete(saved: list[Path]) -> bool:
    return all((step_dir / ".metadata").is_file() for step_dir in saved)


class _PurposefulStops(logging.Filter):
    """torchrun's lines about a worker that stopped on purpose (its rank has said why in one line,
    which must stay the last thing on screen): ``failed (exitcode: 3)`` and the error-file line that
    follows it; any other failure keeps them, and torchrun's report. Its ``Sending process N closing
    signal SIGTERM``, logged as it stops the other workers and before it logs why, goes too: it
    names pids, not a cause; and so does its ``Received 15 death signal, shutting down workers``:
    the workers say what became of the run.

    torchrun names the failure with the earliest timestamp, and a worker it stopped with SIGTERM or
    SIGKILL can hold an earlier one than the rank that stopped on purpose (an error file written
    while it was still exiting, on a loaded machine). Such a line goes too when a worker has
    reported a purposeful stop to ``outcomes`` (the folder the workers report their exit codes to),
    as ``main`` then exits with that worker's code."""

    def __init__(self, outcomes: str | None = None):
        super().__init__()
        self.seen = False
        self.outcomes = outcomes

    def _stopped_on_purpose(self, exitcode) -> bool:
        if exitcode in STOPPED_EXIT_CODES:
            return True
        if exitcode not in (-signal.SIGTERM, -signal.SIGKILL) or not self.outcomes:
            return False
        return any(code in STOPPED_EXIT_CODES for code in reported_exits(self.outcomes).values())

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        if message.startswith(("Sending process %s closing signal", "Received %s death signal")):
            return False
        if (
            message.startswith("failed (exitcode: %s)")
            and record.args
            and self._stopped_on_purpose(record.args[0])
        ):
            self.seen = True
            return False
        return not (self.seen and message.startswith("no error file defined"))


def with_defaults(argv: list[str], grace: int | None) -> tuple[list[str], str | None]:
    """torchrun's arguments, with ``--log-dir``, ``--shutdown-timeout`` (from the run's stop
    ``grace``, when known) and ``--signals-to-handle`` added where they are not given and the job
    runs
    ``canon_titan.train``; and the log folder made here (None if none)."""
    try:
        module = next(
            i
            for i in range(1, len(argv))
            if argv[i] == TRAINING_MODULE and argv[i - 1] in ("-m", "--module")
        )
    except StopIteration:
        return argv, None
    launcher, training = argv[: module - 1], argv[module - 1 :]
    given = {arg.split("=")[0].replace("_", "-") for arg in launcher if arg.startswith("--")}
    added, own_log_dir = [], None
    if "--log-dir" not in given:
        own_log_dir = tempfile.mkdtemp(prefix="torchelastic_")
        added += ["--log-dir", own_log_dir]
    if "--shutdown-timeout" not in given and grace is not None:
        added += ["--shutdown-timeout", str(grace + SHUTDOWN_MARGIN_S)]
    if "--signals-to-handle" not in given:
        added += ["--signals-to-handle", SIGNALS_TO_HANDLE]
    return [*launcher, *added, *training], own_log_dir


SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""torchrun's default, and SIGUSR1."""
LINE_PREFIX_ENV, LINE_PREFIX = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${role_name}${rank}]:"
"""torchrun prefixes a worker's lines with its local rank (``[rank0]:`` on every node); the default
here is its global rank, so node 1's console says whose lines they are."""


def _checked_run(launch) -> tuple[int | None, str | None]:
    """For a job of ``canon_titan.train``: its run's ``[job] stop_grace_seconds`` (None when
    unknown), and what ``config validate`` finds wrong with its config at the job's world size
    (None: nothing, or
    ``canon-titan train`` has checked it already)."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    from canon_titan.config import ConfigError, load
    from canon_titan.config.titan_sections import load_or_report
    from canon_titan.launch.prelaunch import CHECKED_ENV

    args = launch.training_script_args
    if "--config" not in args[:-1]:
        return None, None  # the workers say what is missing
    at = args.index("--config")
    path, overrides = args[at + 1], args[:at] + args[at + 2 :]
    if os.environ.get(CHECKED_ENV) == "1":
        try:
            return load(path, overrides, environment=False)["job"]["stop_grace_seconds"], None
        except ConfigError:
            return None, None
    world = os.environ.get("WORLD_SIZE")
    min_nodes, max_nodes = parse_min_max_nnodes(launch.nnodes)
    try:
        if min_nodes == max_nodes:
            os.environ["WORLD_SIZE"] = str(
                max_nodes * determine_local_world_size(launch.nproc_per_node)
            )
    except ValueError:
        pass  # "gpu" on a machine without one: torchrun says so
    try:
        run, error = load_or_report(path, overrides)
    finally:
        if world is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = world
    if error:
        return None, f"config error: {error}"
    return run["job"]["stop_grace_seconds"], None


def _single_node(launch) -> bool:
    from torch.distributed.run import parse_min_max_nnodes

    return launch.standalone or parse_min_max_nnodes(launch.nnodes)[1] == 1


def _local_address(launch) -> tuple[list[str], str | None]:
    """torchrun names this node by its fully qualified host name unless ``--local-addr`` gives an
    address, and its workers connect to rank 0's store at that name: where it does not resolve, they
    wait minutes and give up. Then a one-node job uses the loopback address (arguments to add), and
    a multi-node job is refused (a line), since the other nodes could not reach this one by its
    name."""
    if launch.local_addr:
        return [], None
    name = socket.getfqdn()
    try:
        socket.getaddrinfo(name, None)
        return [], None
    except OSError as e:
        reason = e.strerror or str(e)
    if _single_node(launch):
        return ["--local-addr", "127.0.0.1"], None
    return [], (
        f"this host's name {name!r} does not resolve ({reason}), and the other nodes (and "
        "gloo) find a "
        "node by its name: add it to /etc/hosts or DNS, or give torchrun --local-addr "
        "with an address the "
        "other nodes reach (scripts/run_train.sh: PET_LOCAL_ADDR=ADDR)"
    )


def _endpoint(launch) -> str:
    """Where the rendezvous is: ``--rdzv_endpoint``, or the static one's master address and port."""
    return (
        launch.rdzv_endpoint or f"{launch.master_addr}:{launch.master_port or 29500}"
    )  # torchrun's default port


def _store_host(launch) -> str | None:
    """Under torchrun's static rendezvous node 0 hosts the store at its master address: where that
    is not one of this node's addresses (a second node left at the default node rank 0), each node
    would wait for the others at a store of its own. A line then, else None."""
    if _single_node(launch) or launch.rdzv_backend != "static" or launch.node_rank != 0:
        return None
    host = _endpoint(launch).rpartition(":")[0].strip("[]")
    try:
        addresses = {info[4][:2] for info in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)}
    except OSError as e:
        return (
            f"node 0's address {host!r} (--master_addr, MASTER_ADDR) does not resolve "
            f"({e.strerror or e})"
        )
    for address in addresses:
        try:
            with socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET) as probe:
                probe.bind((address[0], 0))  # only an address of this host binds
            return None
        except OSError:
            continue
    return (
        f"this node has node rank 0, so it hosts the rendezvous at {host!r} "
        "(--master_addr, MASTER_ADDR), "
        "which is not one of its addresses: give every other node its own node rank (--node_rank, "
        "NODE_RANK: 1 to nodes - 1) and node 0's address"
    )


WAIT_REPORT_S = 30
"""How often a node waiting for the others says so."""


def _waiting_for(launch) -> str:
    """Whom this node waits for, and where (a multi-node job, before its workers start)."""
    from torch.distributed.run import parse_min_max_nnodes

    nodes = parse_min_max_nnodes(launch.nnodes)[1]
    endpoint = _endpoint(launch)
    others = "node 1" if nodes == 2 else f"nodes 1-{nodes - 1}"
    if launch.rdzv_backend != "static":
        answers = "answers" if _answers(endpoint) else "does not answer yet"
        return (
            f"waiting for {nodes} nodes to join the {launch.rdzv_backend} rendezvous "
            f"{launch.rdzv_id!r} at "
            f"{endpoint} (which {answers})"
        )
    if launch.node_rank == 0:
        return (
            f"node 0 of {nodes}: waiting for {others} to join at {endpoint} (the store on this "
            "node)"
        )
    if not _answers(endpoint):
        return (
            f"node {launch.node_rank} of {nodes}: waiting for node 0 at {endpoint}, which "
            "does not answer yet "
            "(node 0 starts the store there)"
        )
    return (
        f"node {launch.node_rank} of {nodes}: node 0 answers at {endpoint}; waiting for the "
        "other nodes to join"
    )


def _answers(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        return True
    except (OSError, ValueError):
        return False


def _say_while_waiting(launch) -> None:
    """Every ``WAIT_REPORT_S`` until torchrun starts its workers (it installs its signal handlers as
    it does, once every node has joined): whom this node waits for."""
    began = time.monotonic()
    while True:
        time.sleep(WAIT_REPORT_S)
        if not watching(signal.SIGTERM):
            return
        print(
            f"canon-titan: {_waiting_for(launch)}, {time.monotonic() - began:.0f} s so far",
            file=sys.stderr,
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    from canon_titan.tools.startup import importing

    # Imported here, after the stop signals are taken (importing torch takes seconds).
    with importing():
        from torch.distributed.elastic.multiprocessing import api as elastic_api
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun_main
        from torch.distributed.run import parse_args, parse_min_max_nnodes

        from canon_titan.launch import rendezvous
        from canon_titan.launch.triton_cache import seeded_from_environment

    argv = sys.argv[1:] if argv is None else argv
    launch = parse_args(argv)  # torchrun's own reading of its arguments
    grace, problem = (
        _checked_run(launch)
        if launch.module and launch.training_script == TRAINING_MODULE
        else (None, None)
    )
    local, problem = ([], problem) if problem else _local_address(launch)
    problem = problem or _store_host(launch)
    if not problem and not _single_node(launch):
        threading.Thread(
            target=_say_while_waiting, args=(launch,), name="waiting", daemon=True
        ).start()
        problem = rendezvous.problem(launch, parse_min_max_nnodes(launch.nnodes)[1])
    seeded, seed_problem = seeded_from_environment() if not problem else (None, None)
    problem = problem or seed_problem
    if problem:
        print(f"canon-titan: {problem}", file=sys.stderr)
        return REFUSED
    if seeded:
        print(f"canon-titan: {seeded}", file=sys.stderr)
    argv, own_log_dir = with_defaults(argv, grace)
    argv = local + argv
    # torchrun installs the module's handler by name when it starts its workers, and raises on every
    # signal; it has no public hook for the handler (--signals-to-handle picks the signals only).
    # The name is pinned in tests/test_upstream.py; where a torch lacks it, torchrun's own handler
    # stays.
    if callable(getattr(elastic_api, "_terminate_process_handler", None)):
        elastic_api._terminate_process_handler = _terminate_once
    made = [own_log_dir] if own_log_dir else []
    os.environ.setdefault(LINE_PREFIX_ENV, LINE_PREFIX)
    outcomes = os.environ.get(OUTCOME_DIR_ENV)
    if outcomes is None:
        outcomes = os.environ[OUTCOME_DIR_ENV] = tempfile.mkdtemp(
            prefix="canon-titan-exits-"
        )  # the workers inherit it
        made.append(outcomes)
    before_exit(lambda: [shutil.rmtree(folder, ignore_errors=True) for folder in made])
    quiet = _PurposefulStops(outcomes)
    for name in (
        "torch.distributed.elastic.multiprocessing.api",
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.errors.error_handler",
    ):
        logging.getLogger(name).addFilter(quiet)
    code = None
    try:
        torchrun_main(argv)
        code = 0
    except (
        SignalException
    ) as e:  # its workers got the signal too, and saved, finished or ran out of time
        reported, training = reported_exits(outcomes), trained(outcomes)
        code = after_stop_signal(reported, saved_checkpoints(outcomes), training)
        if not training and not reported_lines(outcomes):  # workers ended before they could say so
            print(
                f"canon-titan: {signal.Signals(e.sigval).name} before training started: "
                "stopped, nothing to save; "
                "run the same command again",
                file=sys.stderr,
            )
        elif not reported:
            print(
                "canon-titan: the training processes were stopped before they could save "
                "the step they reached; "
                "the same command resumes from the newest complete checkpoint",
                file=sys.stderr,
            )
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        # Once one worker exits, torchrun stops the others with SIGTERM (or SIGKILL, late ones).
        stopped = codes & STOPPED_EXIT_CODES
        if not stopped or not codes <= STOPPED_EXIT_CODES | {-signal.SIGTERM, -signal.SIGKILL}:
            raise
        code = max(stopped)
        if code == PREEMPTED and not _complete(saved_checkpoints(outcomes)):
            code = STOPPED
    finally:
        for line in reported_lines(outcomes):
            print(f"canon-titan: {line}", file=sys.stderr, flush=True)
        if code is None and own_log_dir:  # torchrun's report names the files there
            made.remove(own_log_dir)
    return code


if __name__ == "__main__":
    from canon_titan.tools.startup import process_setup

    process_setup()
    take_stop_signals(_stop_before_start)
    sys.exit(main())
