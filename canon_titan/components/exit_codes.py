"""The exit codes of a training process that stopped on purpose, after one line saying why."""

REFUSED = 2  # a config error or a refusal before training (a live run, no loadable checkpoint, ...)
STOPPED = 3  # training stopped: divergence, a failed save
PREEMPTED = 75  # EX_TEMPFAIL, "try again": saved on SIGTERM/SIGINT; what a requeueing job script tests for
STOPPED_EXIT_CODES = {REFUSED, STOPPED, PREEMPTED}
