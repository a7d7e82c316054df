#!/usr/bin/env bash
# Fault-tolerant training on one machine: a torchft lighthouse and GROUPS replica groups, each its own
# torchrun job of NPROC ranks, restarted when it fails (it then recovers from a peer group, live).
#
#   bash scripts/ft_local.sh GROUPS NPROC train.py-overrides...
#   bash scripts/ft_local.sh 2 2 +recipe=llama_fsdp model=llama_debug +smoke=cpu training.steps=200
#
# Sets parallel.dp_replicate=GROUPS, fault_tolerance.enabled=true, the group and the lighthouse; each
# group writes to output_dir/replica_group_G/ and logs to ft-logs/groupG.log. Environment:
# LIGHTHOUSE_PORT (29510), HEARTBEAT_TIMEOUT_MS (5000: a group silent this long is out of the next
# quorum), JOIN_TIMEOUT_MS (10000: how long a quorum waits for a live group that is late),
# MAX_GROUP_RESTARTS (3). Stop everything with Ctrl-C.
set -uo pipefail
cd "$(dirname "$0")/.."
groups=$1 nproc=$2
shift 2
port=${LIGHTHOUSE_PORT:-29510}
mkdir -p ft-logs
# The lighthouse, and each group's transfer of its state to a recovering peer, listen on loopback only.
torchft_lighthouse --min_replicas 1 --bind "127.0.0.1:$port" --heartbeat_timeout_ms "${HEARTBEAT_TIMEOUT_MS:-5000}" \
    --join_timeout_ms "${JOIN_TIMEOUT_MS:-10000}" > ft-logs/lighthouse.log 2>&1 &
pids=($!)
trap 'kill "${pids[@]}" 2>/dev/null; wait; exit 130' INT TERM

run_group() {  # a group's torchrun, started again after a failure (up to MAX_GROUP_RESTARTS times)
    local group=$1 tries=0
    shift
    until OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} torchrun --standalone --nproc_per_node="$nproc" train.py "$@" \
        parallel.dp_replicate="$groups" fault_tolerance.enabled=true fault_tolerance.replica_group="$group" \
        fault_tolerance.lighthouse="http://127.0.0.1:$port" >> "ft-logs/group$group.log" 2>&1; do
        status=$?
        tries=$((tries + 1))
        [ "$status" = 2 ] && { echo "group $group: config error (ft-logs/group$group.log)"; return 2; }
        [ "$tries" -gt "${MAX_GROUP_RESTARTS:-3}" ] && { echo "group $group: failed $tries times, given up"; return 1; }
        echo "group $group: exited with $status; starting it again (it recovers from a peer group)"
        sleep 1
    done
}

for ((g = 0; g < groups; g++)); do
    run_group "$g" "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]:1}"; do
    wait "$pid" || status=$?
done
kill "${pids[0]}" 2>/dev/null
exit "$status"
