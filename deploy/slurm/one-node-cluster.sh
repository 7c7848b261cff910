#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, to try deploy/slurm/relayrl.sbatch (and what
# tests/integration/test_slurm.py starts): munge, slurmctld and slurmd as root, everything they
# write in one folder, free ports, no systemd. Debian's packages: apt-get install slurm-wlm munge
# (scripts/install.sh installs them when run as root).
#
#   deploy/slurm/one-node-cluster.sh start DIR    # prints: export SLURM_CONF=DIR/slurm.conf
#   deploy/slurm/one-node-cluster.sh stop DIR
#
# Job completions go to DIR/jobcomp.txt (jobcomp/filetxt: a job's final state without slurmdbd).
# KillWait is 60 s: scancel's SIGTERM, then 60 s before SIGKILL (relayrl's services linger 25 s).
# cred_expire is 20 s: a requeued job waits out its old credential's lifetime before it may start
# again (Slurm's default 120 s); on one node with nothing to page in, 20 s is ample for a step's start.
set -euo pipefail
cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ "$(id -u)" = 0 ] || { echo "one-node-cluster.sh: run as root (slurmd starts jobs as their users)" >&2; exit 1; }

stop() {
    for d in slurmd slurmctld munged; do
        pid_file="$dir/$d.pid"
        [ -f "$pid_file" ] || continue
        pid=$(cat "$pid_file")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$pid_file"
    done
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

case "$cmd" in
stop) stop; exit 0 ;;
start) ;;
*) echo "one-node-cluster.sh: start or stop" >&2; exit 2 ;;
esac

for tool in munged slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || { echo "one-node-cluster.sh: $tool not found (apt-get install slurm-wlm munge)" >&2; exit 1; }
done
dir=$(mkdir -p "$dir" && cd "$dir" && pwd)
mkdir -p "$dir/state" "$dir/spool" "$dir/munge" "$dir/munge-socket"
chmod 700 "$dir/munge"    # the key: root only
chmod 755 "$dir/munge-socket"  # the socket: every user that submits
node=$(hostname -s)
read -r cpus mem < <(slurmd -C | awk -F'[ =]' '{for (i = 1; i < NF; i++) { if ($i == "CPUs") c = $(i+1); if ($i == "RealMemory") m = $(i+1) }} END {print c, m}')
# A munge of its own: its key and socket in DIR, so two clusters (two test runs) never meet.
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge-socket/socket" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/seed"
trap 'stop' ERR  # a daemon that fails to start leaves none of the others behind
cat > "$dir/slurm.conf" <<EOF
ClusterName=relayrl$(basename "$dir" | tr -cd 'a-z0-9' | head -c 20)
SlurmctldHost=$node
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge-socket/socket,cred_expire=20
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=60
NodeName=$node CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -c -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 100); do
    if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.2
done
echo "one-node-cluster.sh: the node did not come up; see $dir/slurmctld.log and $dir/slurmd.log" >&2
stop
exit 1
