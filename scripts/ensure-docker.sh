#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine; install and start Debian's if not.
# Idempotent. Used by .ci/run; safe for a developer to run as root.
set -euo pipefail

log() { echo "[ensure-docker] $*" >&2; }

# The machine's own dockerd processes: not the extra engines the test suite starts, which each
# have a --data-root of their own (tests/engine/_extra_engines.py).
main_dockerd_pids() {
  local pid
  for pid in $(pgrep -x dockerd); do
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "--data-root" || echo "$pid"
  done
}

# A main dockerd process that is not a zombie (a SIGKILLed one nobody reaped yet is no engine).
live_dockerd() {
  local pid state
  for pid in $(main_dockerd_pids); do
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)
    if [ -n "$state" ] && [ "$state" != "Z" ]; then return 0; fi
  done
  return 1
}

# gVisor as the "runsc" runtime: --network=none (without it runsc does not start here),
# --oci-seccomp (without it runsc ignores the container's seccomp profile) and --host-uds=open
# (without it a sandbox cannot connect to the egress proxy's unix socket, see docs/egress.md). An
# existing runsc entry only gets the flags it lacks; merged into an existing daemon.json; a
# running engine reloads it on SIGHUP.
register_runsc() {
  command -v runsc >/dev/null 2>&1 || return 0
  mkdir -p /etc/docker
  if grep -q -- "--host-uds=open" /etc/docker/daemon.json 2>/dev/null; then return 0; fi
  log "registering the runsc runtime (or adding the flags it lacks)"
  RUNSC="$(command -v runsc)" python3 - <<'PY'
import json, os
path = "/etc/docker/daemon.json"
try:
    config = json.load(open(path))
except (OSError, ValueError):
    config = {}
runtimes = config.setdefault("runtimes", {})
entry = runtimes.setdefault("runsc", {"path": os.environ["RUNSC"]})
args = entry.setdefault("runtimeArgs", [])
for flag in ("--network=none", "--oci-seccomp", "--host-uds=open"):
    if flag not in args:
        args.append(flag)
json.dump(config, open(path, "w"))
PY
  if docker info >/dev/null 2>&1 && live_dockerd; then
    kill -HUP "$(main_dockerd_pids | head -n1)"
    for _ in $(seq 1 20); do
      docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q -- "--host-uds=open" && return 0
      sleep 0.5
    done
    log "dockerd did not reload its runtimes; restart it to use gVisor"
  fi
}

if ! command -v dockerd >/dev/null 2>&1; then
  log "installing docker.io from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq docker.io >/dev/null
fi

if [ "${WITH_RUNSC:-0}" = "1" ] && ! command -v runsc >/dev/null 2>&1; then
  log "installing runsc (gVisor)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq runsc >/dev/null || log "runsc not installable; gVisor tests will be skipped"
fi
register_runsc

if docker info >/dev/null 2>&1; then
  log "engine already answers"
  exit 0
fi

# A dockerd that is still shutting down (it stops the containers first, up to 10 s each) has
# already closed its socket but holds its pid file: a new one started now would exit at once
# with "pid file found". Wait for it to come back or to be gone, whichever comes first.
if live_dockerd; then
  log "a dockerd is running but does not answer; waiting for it to answer or exit"
  for _ in $(seq 1 240); do
    if docker info >/dev/null 2>&1; then
      log "engine answers"
      exit 0
    fi
    live_dockerd || break
    sleep 0.5
  done
  if live_dockerd; then
    log "dockerd neither answered nor exited within 120 s; see /var/log/dockerd.log"
    exit 1
  fi
fi

# A pid file naming no live dockerd (a SIGKILLed one that is still a zombie, or a reused pid)
# makes a new dockerd refuse to start ("pid file found"): no dockerd is alive here, so it is stale.
if [ -f /var/run/docker.pid ] && ! live_dockerd; then
  log "removing a stale /var/run/docker.pid"
  rm -f /var/run/docker.pid
fi

log "starting dockerd"
# Appending, so the log of a previous dockerd is kept and never overwritten under its feet.
nohup dockerd >>/var/log/dockerd.log 2>&1 &
started=$!

# After a SIGKILL, dockerd first reconnects to containerd and recovers its containers: with many of
# them that has taken minutes on a loaded machine.
for _ in $(seq 1 360); do
  if docker info >/dev/null 2>&1; then
    log "engine up"
    exit 0
  fi
  if ! kill -0 "$started" 2>/dev/null; then
    log "dockerd exited during start-up; the end of /var/log/dockerd.log:"
    tail -n 30 /var/log/dockerd.log >&2 || true
    exit 1
  fi
  sleep 0.5
done
log "dockerd did not answer within 180 s; the end of /var/log/dockerd.log:"
tail -n 30 /var/log/dockerd.log >&2 || true
exit 1
