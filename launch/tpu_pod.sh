#!/usr/bin/env bash
# deepseek41 on every worker of a Cloud TPU VM slice (v4-32, v5p-64, ...): one trainer process per
# worker host, each driving its local TPU chips, joined by jax.distributed, which reads the slice's
# layout from the TPU VM's metadata (`--distributed`).
#
#   launch/tpu_pod.sh TPU_NAME ZONE --config=configs/ablation_1b.py --workdir=/mnt/runs/a1 \
#       [train flags...]
#   SYNC=1 launch/tpu_pod.sh ...     # first copy this checkout to every worker and install it
#   ACTION=stop launch/tpu_pod.sh TPU_NAME ZONE --workdir=DIR   # SIGTERM: save, exit 75
#   DRY=1 launch/tpu_pod.sh ...      # print the commands instead of running them
#
# Settings (environment):
#   REMOTE_REPO  the checkout on the workers (default: deepseek41, under the ssh user's home)
#   PYTHON       interpreter on the workers, absolute or relative to REMOTE_REPO (default
#                .venv/bin/python)
#   SYNC=1       before the run: `git archive HEAD` of this checkout (committed files only) copied
#                to every worker, unpacked into REMOTE_REPO, and `pip install -e .[tpu]` into
#                REMOTE_REPO/.venv (created if missing)
#   LOG_DIR      per-worker logs on the workers, LOG_DIR/worker_<n>.log, appended to, and the
#                trainer's pid, LOG_DIR/worker_<n>.pid, which ACTION=stop signals (default
#                WORKDIR/logs; a worker-local directory such as /tmp/deepseek41-logs where
#                WORKDIR is a GCS FUSE mount, which handles appends poorly)
#   PROJECT      gcloud --project (default: gcloud's configured project)
#   SSH_FLAGS    extra `gcloud compute tpus tpu-vm ssh/scp` flags, split on spaces (e.g.
#                "--tunnel-through-iap" or "--internal-ip")
#   GCLOUD       the gcloud binary (default gcloud)
#   DRY=1        print each command (shell-quoted, one a line) instead of running it
#   TOPOLOGY     the slice's TPU topology (e.g. v5p:8x8x8, v5e:4x4, v6e:8x8): with it set, a
#                preflight first compiles the train step for that topology here, deviceless
#                (`python -m deepseek41.tools.plan --topology=...` with the run's --config and
#                --config.* flags, the config's mesh), and stops before touching the workers
#                when the step does not fit the chips' HBM or does not compile (needs the tpu
#                extra here: `pip install -e '.[tpu]'`)
#   PLAN_PYTHON  interpreter of the preflight (default: this checkout's .venv/bin/python)
#   PLAN_FLAGS   extra flags of the preflight plan, split on spaces (e.g. --per_layer for the
#                released model, whose whole step takes long to compile)
#
# WORKDIR must be one filesystem mounted at the same path on every worker (Filestore NFS or a GCS
# FUSE mount): every process writes its shards of each checkpoint there.
# The trainer runs under nohup: it outlives a dropped ssh session (this script then ends, the run
# goes on; follow it in the logs). The script's status is gcloud's, non-zero when a worker's
# trainer failed; 75 on a worker means it saved a checkpoint after SIGTERM (ACTION=stop, or a
# maintenance event's signal): run the same command again to resume.
set -euo pipefail

usage() {
  echo "usage: $0 TPU_NAME ZONE --config=FILE --workdir=DIR [train flags...]" >&2
  exit 2
}
[[ $# -ge 2 && -n $1 && -n $2 && $1 != -* && $2 != -* ]] || usage
tpu=$1 zone=$2
shift 2

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
gcloud=${GCLOUD:-gcloud}
remote_repo=${REMOTE_REPO:-deepseek41}
python=${PYTHON:-.venv/bin/python}
action=${ACTION:-run}

source "$root/launch/lib.sh"
workdir=$(workdir_flag "$@")
log_dir=${LOG_DIR:-${workdir:+$workdir/logs}}
if [[ -z $log_dir ]]; then
  echo "$0: --workdir is required (the logs and pid files go to WORKDIR/logs unless LOG_DIR is" \
    "set)" >&2
  exit 2
fi
if [[ $action != run && $action != stop ]]; then
  echo "$0: ACTION is run or stop, not $action" >&2
  exit 2
fi

if [[ -z ${DRY:-} ]] && ! command -v "$gcloud" >/dev/null 2>&1; then
  echo "$0: '$gcloud' not found: install the Google Cloud CLI" \
    "(https://cloud.google.com/sdk/docs/install), run \`gcloud auth login\`, or set GCLOUD;" \
    "DRY=1 prints the commands without running them" >&2
  exit 127
fi

# shellcheck disable=SC2206  # SSH_FLAGS is split on spaces on purpose
gflags=(--zone="$zone" ${PROJECT:+--project="$PROJECT"} ${SSH_FLAGS:-})

# One word for a POSIX shell: as it is when plain, else in single quotes. (The remote scripts
# hold no newline, so this never needs bash's $'...' form, which sh does not read.)
q() {
  if [[ $1 =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then printf '%s' "$1"; else printf '%s' "${1@Q}"; fi
}

# Run one local command, or with DRY=1 print it, one line, quoted for a shell.
run() {
  if [[ -n ${DRY:-} ]]; then
    local words=() a
    for a in "$@"; do words+=("$(q "$a")"); done
    echo "${words[*]}"
  else
    "$@"
  fi
}

# A command for every worker, run by bash whatever the ssh user's login shell is.
on_workers() {
  local script="set -euo pipefail; ${1//$'\n'/ }"
  run "$gcloud" compute tpus tpu-vm ssh "$tpu" "${gflags[@]}" --worker=all \
    --command="bash -c $(q "$script")"
}

# The worker's index: TPU_WORKER_ID where set (GKE), else the TPU VM's metadata (as jax reads it),
# else the host name; it names the log and the pid file.
worker_files="worker=\${TPU_WORKER_ID:-\$(curl -sf --max-time 5 -H Metadata-Flavor:Google
http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number ||
hostname)}; log=$(q "$log_dir")/worker_\$worker.log; pidfile=$(q "$log_dir")/worker_\$worker.pid"

if [[ $action == stop ]]; then
  on_workers "cd $(q "$remote_repo"); $worker_files;
if [ -s \"\$pidfile\" ] && kill -0 \$(cat \"\$pidfile\") 2>/dev/null; then
kill -s TERM \$(cat \"\$pidfile\"); echo \"worker \$worker: sent SIGTERM to the trainer\";
else echo \"worker \$worker: no trainer running\"; fi"
  exit
fi

# Preflight: the TPU compiler's plan of this config on this slice (tools/topology_plan.py); a step
# that cannot fit fails here, in minutes, instead of on every worker after the sync.
if [[ -n ${TOPOLOGY:-} ]]; then
  plan=("${PLAN_PYTHON:-$root/.venv/bin/python}" -m deepseek41.tools.plan --topology="$TOPOLOGY")
  for a in "$@"; do
    if [[ $a == --config=* || $a == --config.* ]]; then plan+=("$a"); fi
  done
  # shellcheck disable=SC2206  # PLAN_FLAGS is split on spaces on purpose
  plan+=(${PLAN_FLAGS:-})
  if ! (cd "$root" && PYTHONPATH="$root" run "${plan[@]}"); then
    echo "$0: preflight: the train step does not fit or does not compile for $TOPOLOGY (the" \
      "plan above); nothing was started" >&2
    exit 1
  fi
fi

if [[ -n ${SYNC:-} ]]; then
  if [[ -n $(git -C "$root" status --porcelain --untracked-files=no) ]]; then
    echo "$0: SYNC copies the committed HEAD; uncommitted changes are not copied" >&2
  fi
  tarball=${TMPDIR:-/tmp}/deepseek41-$$.tar.gz
  run git -C "$root" archive --format=tar.gz -o "$tarball" HEAD
  run "$gcloud" compute tpus tpu-vm scp "$tarball" "$tpu:/tmp/deepseek41.tar.gz" "${gflags[@]}" \
    --worker=all
  on_workers "mkdir -p $(q "$remote_repo"); tar -xzf /tmp/deepseek41.tar.gz -C $(q "$remote_repo");
cd $(q "$remote_repo"); [ -x .venv/bin/python ] || python3 -m venv .venv;
.venv/bin/pip install --quiet --upgrade pip; .venv/bin/pip install --quiet -e '.[tpu]'"
  if [[ -z ${DRY:-} ]]; then rm -f "$tarball"; fi
fi

train=("$python" -m deepseek41.train --distributed "$@")
quoted_train=
for a in "${train[@]}"; do quoted_train+="$(q "$a") "; done
on_workers "cd $(q "$remote_repo"); mkdir -p $(q "$log_dir"); $worker_files;
echo \"== \$(date -u +%FT%TZ) worker \$worker on \$(hostname)\" >>\"\$log\";
PYTHONPATH=\$PWD nohup $quoted_train>>\"\$log\" 2>&1 </dev/null & pid=\$!;
echo \$pid >\"\$pidfile\"; echo \"worker \$worker: trainer pid \$pid, log \$log\";
status=0; wait \$pid || status=\$?; echo \"worker \$worker: trainer exited with status \$status\";
exit \$status"
