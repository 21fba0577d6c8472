#!/usr/bin/env bash
# One scripts/gpu_check.sh run across two device calls, so that it has the lease's whole time (a call may last
# 600 s, a lease 900 s with the machine's start in it). The first call starts the check in a process session of
# its own (the device machine ends a call's other processes, not those) writing to RUNDIR on that machine, and
# copies its report into OUTDIR, the folder whose files come back, every few seconds for WAIT seconds. The second
# call, made within the machine's idle window (30 s), writes the lease's end for the check to plan its last steps
# against, and copies again until the check ends or its WAIT is over:
#   scripts/gpu_lease.sh start RUNDIR OUTDIR WAIT [SECONDS] [gpu_check args]   # SECONDS: the check's own limit
#   scripts/gpu_lease.sh follow RUNDIR OUTDIR WAIT
# OUTDIR gets gpu_check.md, gpu_check.json, gpu_check.log, triton_autotune.json and console.log (the check's
# output), each a complete file (the check writes them by renaming), and the last one each time.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/gpu_lease.sh start RUNDIR OUTDIR WAIT [SECONDS] [gpu_check args] | follow RUNDIR OUTDIR WAIT"
[ $# -ge 4 ] || { echo "$usage" >&2; exit 2; }
mode=$1 run=$2 out=$3 wait=$4
shift 4
[[ $wait =~ ^[0-9]+$ ]] || { echo "gpu_lease: WAIT must be whole seconds, got '$wait'" >&2; exit 2; }
mkdir -p "$out" || exit 2
case $mode in
  start)
    # SECONDS, where given, becomes gpu_check.sh's GPU_CHECK_SECONDS (its own default otherwise).
    if [ $# -ge 1 ] && [[ $1 =~ ^[0-9]+$ ]]; then export GPU_CHECK_SECONDS=$1; shift; fi
    if [ -e "$run/pid" ]; then echo "gpu_lease: $run already holds a run (its pid file); follow it" >&2; exit 2; fi
    mkdir -p "$run" || exit 2
    # setsid: a session of its own, which outlives this call; the pid written is the check's (exec all the way).
    RUN=$run setsid bash -c 'echo $$ >"$RUN/pid.tmp" && mv "$RUN/pid.tmp" "$RUN/pid" &&
      exec bash scripts/gpu_check.sh "$RUN" --deadline-file "$RUN/deadline" "$@"' gpu_check "$@" \
      >"$run/console.log" 2>&1 </dev/null &
    for _ in $(seq 50); do [ -f "$run/pid" ] && break; sleep 0.1; done
    [ -f "$run/pid" ] || { echo "gpu_lease: the check did not start (see $run/console.log)" >&2; exit 1; }
    echo "[gpu_lease] started scripts/gpu_check.sh $run (pid $(cat "$run/pid")${GPU_CHECK_SECONDS:+, $GPU_CHECK_SECONDS s}); copying its report for $wait s" ;;
  follow)
    [ -f "$run/pid" ] || { echo "gpu_lease: $run holds no run (no pid file): start one first" >&2; exit 2; }
    # The check stops starting steps 25 s before this call's end, and so ends within it.
    echo $(($(date +%s) + wait - 25)) >"$run/deadline.tmp" && mv "$run/deadline.tmp" "$run/deadline"
    echo "[gpu_lease] following $run (pid $(cat "$run/pid")) for $wait s" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
pid=$(cat "$run/pid")
alive() {  # not a zombie either: in the first call the check is this script's child until the call ends
  [ -r "/proc/$pid/stat" ] && [ "$(sed 's/.*) //' "/proc/$pid/stat" | cut -d' ' -f1)" != Z ]
}
copy() {
  for f in gpu_check.md gpu_check.json gpu_check.log triton_autotune.json console.log; do
    [ -f "$run/$f" ] && cp "$run/$f" "$out/.$f.tmp" && mv "$out/.$f.tmp" "$out/$f"
  done
  return 0
}
end=$((SECONDS + wait))
while [ $SECONDS -lt $end ] && alive; do
  copy
  sleep 5
done
copy
if alive; then
  echo "[gpu_lease] the check is still running: follow it in the next call"
  tail -n 3 "$run/console.log"
  exit 3
fi
tail -n 20 "$run/console.log"
echo "[gpu_lease] the check has ended"
