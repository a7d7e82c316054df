#!/usr/bin/env bash
# A two-node Slurm cluster on this machine, for testing scripts/slurm/train.sbatch for real.
#
#   scripts/slurm/local_cluster.sh start    # installs slurm-wlm if missing (Debian, as root), starts it
#   scripts/slurm/local_cluster.sh status
#   scripts/slurm/local_cluster.sh stop     # stops the daemons by their recorded PIDs
#   export SLURM_CONF=$(scripts/slurm/local_cluster.sh conf)    # then sbatch, squeue, ... use it
#
# Both nodes (n1, n2) are slurmd processes on 127.0.0.1 with their own ports; no munge, no
# accounting, no systemd. State lives in $SLURM_LOCAL_DIR (default /tmp/trainer-slurm).
set -euo pipefail

# The daemons install to /usr/sbin, which a non-login shell's PATH may lack.
export PATH=$PATH:/usr/sbin:/sbin
dir=${SLURM_LOCAL_DIR:-/tmp/trainer-slurm}
conf=$dir/slurm.conf
nodes=(n1 n2)

install() {
    command -v slurmctld >/dev/null && return
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "slurm-wlm is not installed and cannot be installed here (needs root and apt-get)" >&2
        exit 3
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null 2>&1
}

write_conf() {
    mkdir -p "$dir/state"
    local cpus port=${SLURM_LOCAL_PORT:-16817}
    cpus=$(nproc)
    cat > "$conf" <<CONF
ClusterName=trainer-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$port
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
# Look at pending jobs every second (a released requeued job starts at once, not at the next minute).
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=5
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
NodeName=n1 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$((port + 1)) CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$((port + 2)) CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
}

running() {  # the PID in file $1 is alive
    [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start() {
    install
    if running "$dir/slurmctld.pid"; then
        echo "already running ($conf)"
        return
    fi
    write_conf
    export SLURM_CONF=$conf
    slurmctld -f "$conf" -c -i
    for node in "${nodes[@]}"; do
        slurmd -f "$conf" -N "$node"
    done
    for _ in $(seq 100); do  # both nodes idle: ready for jobs
        if [ "$(sinfo -h -o '%t' -N 2>/dev/null | sort -u | tr -d '\n')" = idle ]; then
            echo "started: SLURM_CONF=$conf"
            return
        fi
        sleep 0.2
    done
    sinfo -N >&2 || true
    echo "the nodes did not come up; see $dir/*.log" >&2
    exit 1
}

stop() {
    for pidfile in "$dir"/slurmd-*.pid "$dir/slurmctld.pid"; do
        if running "$pidfile"; then
            kill "$(cat "$pidfile")"
        fi
        rm -f "$pidfile"
    done
    echo stopped
}

status() {
    if running "$dir/slurmctld.pid"; then
        SLURM_CONF=$conf sinfo -N
    else
        echo "not running"
        return 1
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    conf) echo "$conf" ;;
    *) echo "usage: $0 start|status|stop|conf" >&2; exit 2 ;;
esac
