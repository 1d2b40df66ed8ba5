#!/usr/bin/env bash
# NPROC trainer processes on this host, joined by jax.distributed on localhost.
#
#   launch/local.sh NPROC --config=configs/tiny.py --workdir=/tmp/run [train flags...]
#
# GPU host (nvidia-smi lists GPUs): process i sees GPU i (CUDA_VISIBLE_DEVICES=i).
# CPU-only host: JAX_PLATFORMS=cpu and DEVICES_PER_PROC fake CPU devices each (default 1).
# Logs: WORKDIR/logs/process_<i>.log. PYTHON picks the interpreter (default .venv/bin/python
# if present, else python3); PORT the coordinator port (default: a free one).
# Exit status: 0 when every process succeeded; otherwise the first failure's status (the rest
# are stopped: SIGTERM, then SIGKILL after KILL_AFTER seconds, default 30; the tail of the
# failed process's log is printed). SIGTERM / SIGINT are forwarded to every process (the
# trainer saves a checkpoint and exits 75).
set -euo pipefail

usage() { echo "usage: $0 NPROC --config=FILE --workdir=DIR [train flags...]" >&2; exit 2; }
[[ $# -ge 1 && $1 =~ ^[1-9][0-9]*$ ]] || usage
nproc=$1
shift

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x $root/.venv/bin/python ]]; then PYTHON=$root/.venv/bin/python; else PYTHON=python3; fi
fi

source "$root/launch/lib.sh"
workdir=$(workdir_flag "$@")
[[ -n $workdir ]] || { echo "$0: --workdir is required (the logs go to WORKDIR/logs)" >&2; exit 2; }
logs=$workdir/logs
mkdir -p "$logs"

port=${PORT:-$("$PYTHON" -c 'import socket
s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')}

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if ((gpus > 0 && nproc > gpus)); then
  echo "$0: $nproc processes but $gpus GPU(s): one process per GPU" >&2
  exit 2
fi

# The device count is ours to set: drop one inherited from the caller's XLA_FLAGS.
xla_flags=$(sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g' <<<"${XLA_FLAGS:-}")
pids=()
stopping=0
forward() {
  stopping=$2  # our status if no process was started yet
  echo "$0: forwarding SIG$1 to every process" >&2
  if ((${#pids[@]} > 0)); then kill -s "$1" "${pids[@]}" 2>/dev/null || true; fi
}
trap 'forward TERM 143' TERM
trap 'forward INT 130' INT

for ((i = 0; i < nproc && !stopping; i++)); do
  log=$logs/process_$i.log
  if ((gpus > 0)); then
    env=(CUDA_VISIBLE_DEVICES=$i)
  else
    env=(JAX_PLATFORMS=cpu
         "XLA_FLAGS=$xla_flags --xla_force_host_platform_device_count=${DEVICES_PER_PROC:-1}")
  fi
  # PYTHONPATH: the package from this checkout, run from any directory.
  env "${env[@]}" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" \
    "$PYTHON" -m deepseek41.train "$@" --coordinator_address="localhost:$port" \
    --num_processes="$nproc" --process_id="$i" >"$log" 2>&1 &
  pids+=($!)
done
if ((${#pids[@]} == 0)); then exit "$stopping"; fi
echo "launched $nproc process(es) (pids ${pids[*]}), coordinator localhost:$port, logs in $logs" >&2

# Wait for the processes in the order they end; the first failure stops the rest.
status=0
failed=
live=("${pids[@]}")
while ((${#live[@]} > 0)); do
  rc=0
  done_pid=
  wait -n -p done_pid "${live[@]}" || rc=$?
  if [[ -z ${done_pid:-} ]]; then continue; fi  # a trapped signal interrupted the wait
  rest=()
  for p in "${live[@]}"; do [[ $p == "$done_pid" ]] || rest+=("$p"); done
  live=("${rest[@]}")
  if ((rc != 0 && status == 0)); then
    status=$rc
    for ((i = 0; i < nproc; i++)); do [[ ${pids[i]} == "$done_pid" ]] && failed=$i; done
    # 75: stopped by a signal after saving; the others were signalled too and stop the same way.
    if ((rc != 75 && ${#live[@]} > 0)); then
      kill -s TERM "${live[@]}" 2>/dev/null || true
      # A process blocked in a collective with the failed one never sees the TERM: kill it.
      # (Its stdio is not ours: a caller reading our output would wait for the sleep.)
      (sleep "${KILL_AFTER:-30}" && kill -s KILL "${live[@]}") </dev/null >/dev/null 2>&1 &
      killer=$!
    fi
  fi
done
if [[ -n ${killer:-} ]]; then kill "$killer" 2>/dev/null || true; fi

if ((status == 75)); then
  echo "$0: stopped by a signal after saving a checkpoint (status 75); run the same command" \
    "again to resume" >&2
elif ((status != 0)); then
  echo "$0: process $failed failed with status $status; the end of $logs/process_$failed.log:" >&2
  tail -n 30 "$logs/process_$failed.log" >&2
fi
exit "$status"
