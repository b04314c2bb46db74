#!/usr/bin/env bash
# A one-node Slurm (Debian 12: slurm-wlm 22.05 + munge) on this machine, for the Slurm pool tests.
# Idempotent: run it again and it only starts what is not running. Needs root.
#
# Partition `debug`: this host as itself (its real CPU count). Partition `two`: two more NodeNames on the same host,
# <host>-n1 and <host>-n2 (one CPU each, each with a slurmd of its own on its own port; Debian's build supports
# several slurmd per host, `slurmd -N`), so a job can span two "nodes" here; /etc/hosts names them 127.0.0.1 so
# torchrun's rendezvous finds the head by name.
#
# No accounting database: AccountingStorageType=accounting_storage/none and JobCompType=jobcomp/filetxt. With that,
# `sacct` answers an error (it reads only slurmdbd), so the tracker reads `squeue` (core.slurm.parse); finished jobs
# stay in `squeue` for MinJobAge seconds, which is set long enough here for the tracker to see every end.
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
    echo "slurm-setup: must run as root" >&2
    exit 1
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

# munge: a key readable by the munge user only, and the daemon.
if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --force
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
if ! munge -n </dev/null >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
fi

host=$(hostname -s)
node_line=$(slurmd -C | head -1)  # NodeName=<host> CPUs=... RealMemory=...: what slurmd will find
install -d -o slurm -g slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
conf=/etc/slurm/slurm.conf
wanted=$(cat <<EOF
# written by scripts/slurm-setup.sh
ClusterName=llmjobs
SlurmctldHost=${host}
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerType=sched/backfill
# a requeued job (its begin time pushed back) waited for the main scheduler's periodic pass (every 60 s by default):
# 11-13 s after its begin time in test_usr2_saves_requeues_and_resumes; every 2 s here
SchedulerParameters=sched_interval=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
JobAcctGatherType=jobacct_gather/none
MinJobAge=600
KillWait=10
InactiveLimit=0
${node_line} Port=6818 State=UNKNOWN
NodeName=${host}-n1 NodeHostname=${host} NodeAddr=127.0.0.1 Port=6821 CPUs=1 RealMemory=2048 State=UNKNOWN
NodeName=${host}-n2 NodeHostname=${host} NodeAddr=127.0.0.1 Port=6822 CPUs=1 RealMemory=2048 State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP
PartitionName=two Nodes=${host}-n1,${host}-n2 MaxTime=INFINITE State=UP
EOF
)
if [[ ! -f $conf ]] || [[ "$(cat "$conf")" != "$wanted" ]]; then
    printf '%s\n' "$wanted" >"$conf"
    restart=1
fi
# cgroup.conf is read by slurmd even with proctrack/linuxproc in 22.05; an empty one avoids its warnings.
[[ -f /etc/slurm/cgroup.conf ]] || echo "CgroupPlugin=cgroup/v1" >/etc/slurm/cgroup.conf

for name in "${host}-n1" "${host}-n2"; do
    grep -qE "^127\.0\.0\.1[[:space:]].*\b${name}\b" /etc/hosts || echo "127.0.0.1 ${name}" >>/etc/hosts
done
nodes=("$host" "${host}-n1" "${host}-n2")
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [[ ${restart:-0} == 1 ]]; then
    for pidfile in /run/slurmctld.pid /run/slurmd.pid /run/slurmd-*.pid; do
        alive "$pidfile" && kill "$(cat "$pidfile")"
    done
    sleep 2
fi
alive /run/slurmctld.pid || slurmctld
for name in "${nodes[@]}"; do
    install -d -o slurm -g slurm "/var/spool/slurmd/${name}"
    alive "/run/slurmd-${name}.pid" || slurmd -N "$name"
done

for _ in $(seq 60); do
    up=$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated|completing)' || true)
    if scontrol ping 2>/dev/null | grep -q UP && [[ $up -ge 3 ]]; then
        break
    fi
    sleep 1
done
for name in "${nodes[@]}"; do  # a node left down by an earlier run
    scontrol update NodeName="$name" State=RESUME >/dev/null 2>&1 || true
done
if ! timeout 60 srun -p debug -N1 -n2 hostname || ! timeout 60 srun -p two -N2 -n2 hostname; then
    echo "slurm-setup: srun did not run on both partitions" >&2
    sinfo -N >&2 || true
    tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd-*.log >&2 || true
    exit 1
fi
echo "slurm-setup: Slurm is up on ${host}: partition debug (${host}), partition two (${host}-n1, ${host}-n2)"
