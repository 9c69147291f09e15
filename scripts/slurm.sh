#!/usr/bin/env bash
# A real Slurm on this one machine for the test suite: slurmctld plus one slurmd per emulated node, all on
# loopback, authenticated by munge. No systemd, no cgroups. Run as root (installs Debian's slurm-wlm and
# munge through apt when they are missing and writes /etc/slurm/slurm.conf, where every Slurm client looks).
#
#   scripts/slurm.sh start [NODES]   start (or keep) a Slurm with NODES emulated nodes n1..nN (default 2);
#                                    returns once every node is idle and a first job has run through
#   scripts/slurm.sh stop            cancel queued jobs and stop the daemons this script started
#   scripts/slurm.sh status          exit 0 when a controller answers with usable nodes
#
# Both start and stop are idempotent. Daemon state, logs and pid files live under /tmp/spartron-slurm.
set -euo pipefail

work=/tmp/spartron-slurm
conf=/etc/slurm/slurm.conf
packages=(slurmctld slurmd slurm-client munge)

die() { echo "slurm.sh: $*" >&2; exit 1; }

# True when the pid in file $1 is a live (not zombie) Slurm or munge daemon.
running() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] || return 1
  ps -o stat=,comm= -p "$pid" 2>/dev/null | grep -qE '^[^Z]\S* +(slurm|munge)'
}

# Stop the daemon named by pid file $1: SIGTERM, then SIGKILL after 10 s.
halt() {
  running "$1" || return 0
  local pid i
  pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for i in $(seq 40); do running "$1" || return 0; sleep 0.25; done
  kill -9 "$pid" 2>/dev/null || true
}

halt_slurm() {
  local f
  for f in "$work"/run/slurmd-*.pid "$work"/run/slurmctld.pid; do [ -e "$f" ] && halt "$f"; done
  return 0
}

nodes_ready() {  # every node of the cluster idle
  [ "$(sinfo -h -N -o %t 2>/dev/null | sort -u)" = idle ]
}

install_packages() {
  local tool missing=0
  for tool in slurmctld slurmd sbatch munged; do command -v "$tool" >/dev/null || missing=1; done
  [ "$missing" = 0 ] && return 0
  command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get to install it"
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine may have no package lists yet: try as is, then refresh them once.
  apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null; } \
    || die "apt-get could not install ${packages[*]}"
}

start_munge() {
  [ -s /etc/munge/munge.key ] || mungekey -c -k /etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  munge -n </dev/null >/dev/null 2>&1 && return 0  # a munged already answers
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  touch "$work/run/munged.ours"
  local i
  for i in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && return 0; sleep 0.1; done
  die "munged did not start"
}

write_conf() {  # $1 = node count; returns 0 when the file on disk changed
  local n=$1 host hw
  host=$(hostname -s)
  hw=$(slurmd -C | head -n 1 | cut -d' ' -f2-)  # this machine's CPUs, sockets, memory, as slurmd sees them
  for i in $(seq "$n"); do
    getent hosts "n$i" >/dev/null || echo "127.0.0.1 n$i" >>/etc/hosts
    mkdir -p "$work/spool/n$i"
  done
  cat >"$work/slurm.conf" <<EOF
# Written by spartron scripts/slurm.sh: a single-machine test cluster.
ClusterName=spartron
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool/%n
SlurmctldPidFile=$work/run/slurmctld.pid
SlurmdPidFile=$work/run/slurmd-%n.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
ReturnToService=2
EnforcePartLimits=ALL
# SIGKILL 10 s (not 30) after a cancel or requeue's SIGTERM: the ranks save within it; a batch shell still
# in its SIGTERM trap then no longer holds the requeued job back for 30 s.
KillWait=10
NodeName=n[1-$n] NodeHostname=$host NodeAddr=127.0.0.1 Port=[17001-$((17000 + n))] $hw
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  if cmp -s "$work/slurm.conf" "$conf"; then return 1; fi
  mkdir -p "$(dirname "$conf")"
  cp "$work/slurm.conf" "$conf"
  return 0
}

start() {
  local n=${1:-2} fresh=0 i job
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive integer, got '$n'"
  [ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts daemons)"
  install_packages
  mkdir -p "$work/state" "$work/log" "$work/run"
  start_munge
  if write_conf "$n"; then halt_slurm; fi  # a changed cluster shape needs fresh daemons
  if ! running "$work/run/slurmctld.pid"; then
    rm -rf "$work/state" && mkdir -p "$work/state"  # no jobs survive from an earlier cluster
    slurmctld
    fresh=1
  fi
  for i in $(seq "$n"); do running "$work/run/slurmd-n$i.pid" || slurmd -N "n$i"; done
  for i in $(seq 120); do nodes_ready && break; sleep 0.5; done
  nodes_ready || { sinfo -R >&2 || true; tail -n 20 "$work"/log/*.log >&2; die "nodes not idle; logs in $work/log"; }
  if [ "$fresh" = 1 ]; then
    # The first job after a controller start waits a few seconds to be scheduled; pay that here, once.
    job=$(sbatch --parsable -N "$n" -o /dev/null --wrap true)
    for i in $(seq 150); do
      scontrol show job "$job" 2>/dev/null | grep -q 'JobState=COMPLETED' && break
      sleep 0.2
    done
  fi
  sinfo
}

stop() {
  if running "$work/run/slurmctld.pid"; then
    squeue -h -o %i 2>/dev/null | xargs -r scancel || true
  fi
  halt_slurm
  if [ -e "$work/run/munged.ours" ]; then halt /run/munge/munged.pid; fi
  rm -f "$work"/run/*
}

status() {
  command -v sinfo >/dev/null || die "sinfo is not installed"
  sinfo -h -N -o '%N %t' || die "slurmctld does not answer"
}

case "${1:-}" in
  start) start "${2:-2}" ;;
  stop) stop ;;
  status) status ;;
  *) die "usage: scripts/slurm.sh start [NODES] | stop | status" ;;
esac
