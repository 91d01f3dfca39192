#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying mpifl's sbatch templates and sweeps
# without a cluster.  Needs root and Debian's packages slurmctld, slurmd and munge
# (`make slurm-deps` installs them).
#
#   slurm/local-cluster.sh up       # start munged, slurmctld, slurmd (idempotent)
#   eval "$(slurm/local-cluster.sh env)"   # export SLURM_CONF for srun/sbatch/squeue/submitit
#   slurm/local-cluster.sh status   # daemons, sinfo; exit 0 only when the node is usable
#   slurm/local-cluster.sh down     # cancel its jobs, stop only the daemons it started
#   slurm/local-cluster.sh up --nodes 3   # three nodes, each in its own namespaces (below)
#
# Everything (munge key and socket, slurm.conf, spool, logs, pid files) lives in one folder,
# $MPIFL_SLURM_DIR (default /tmp/mpifl-slurm); nothing under /etc is touched, so a system
# SLURM or munge keeps running undisturbed.  Ports: $MPIFL_SLURM_PORT (slurmctld, default 16817)
# and the next one (slurmd).  The node is `hostname` with CPUs=$(nproc) (override with
# $MPIFL_SLURM_CPUS) and one partition, $MPIFL_SLURM_PARTITION (default "debug").
#
# With --nodes N (N > 1) every node is a Linux network + UTS + mount + IPC namespace
# ("mpifl-n1" .. "mpifl-nN", addresses 10.77.0.11.. on the bridge mpiflbr0, whose 10.77.0.1 is
# the controller's) running its own slurmd, with its own hostname, boot id, /dev/shm and
# /etc/hosts, so MPI between nodes goes over TCP as between machines. munged and slurmctld run
# on the host. Each node gets CPUs=$MPIFL_SLURM_CPUS (default nproc): the nodes share this
# machine's cores, i.e. they over-subscribe it N times. `down` removes every namespace, link,
# mount and daemon it made.
set -euo pipefail

DIR=${MPIFL_SLURM_DIR:-/tmp/mpifl-slurm}
PORT=${MPIFL_SLURM_PORT:-16817}
PARTITION=${MPIFL_SLURM_PARTITION:-debug}
CPUS=${MPIFL_SLURM_CPUS:-$(nproc)}
# Job ids start somewhere new at each fresh cluster: MPICH names its shared-memory segments
# after the step (/dev/shm/mpich_shm_*), and a rank killed in a step leaves its segment; a
# later cluster that numbered its jobs from 1 again hung in MPI_Init in the steps whose
# numbers matched (slurm/README.md, "MPI_Init under srun")
FIRST_JOB_ID=$(( $(date +%s) % 50000000 + 1000 ))
HOST=$(hostname -s)
CONF=$DIR/etc/slurm.conf
SOCKET=$DIR/munge/munge.socket.2
export SLURM_CONF=$CONF

die() { echo "local-cluster: $*" >&2; exit 1; }
say() { echo "local-cluster: $*" >&2; }

# pid_of NAME: the pid recorded for one of our daemons, if that process is alive and is it.
pid_of() {
    local f=$DIR/run/$1.pid pid
    [[ -s $f ]] || return 1
    pid=$(<"$f")
    [[ -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "${1%%-*}" || return 1  # slurmd-NODE: slurmd
    echo "$pid"
}

need_tools() {
    [[ $(id -u) == 0 ]] || die "must run as root (the daemons run as SlurmUser=root)"
    local t missing=()
    for t in munged slurmctld slurmd scontrol sinfo; do
        command -v "$t" >/dev/null || missing+=("$t")
    done
    ((${#missing[@]} == 0)) || die "missing ${missing[*]}: apt-get install slurmctld slurmd munge (or: make slurm-deps)"
}

gpu_count() {
    if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else echo 0; fi
}

write_config() {
    mkdir -p "$DIR"/{etc,munge,run,log,spool/ctld,spool/d}
    chmod 700 "$DIR/munge"
    local mem gpus gres_line="" gres_types=""
    mem=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
    gpus=$(gpu_count)
    if ((gpus > 0)); then
        gres_types="GresTypes=gpu"
        gres_line="Gres=gpu:$gpus"
        : >"$DIR/etc/gres.conf"
        for ((i = 0; i < gpus; i++)); do echo "NodeName=$HOST Name=gpu File=/dev/nvidia$i" >>"$DIR/etc/gres.conf"; done
    fi
    cat >"$CONF" <<EOF
# Written by mpifl slurm/local-cluster.sh: a one-node cluster for trying sweeps.
ClusterName=mpifl-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=30
MinJobAge=300
JobRequeue=1
FirstJobId=$FIRST_JOB_ID
$gres_types
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem $gres_line State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    pid_of munged >/dev/null && return 0
    if [[ ! -s $DIR/munge/munge.key ]]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$DIR/munge/munge.key"
    fi
    munged --force --key-file="$DIR/munge/munge.key" --socket="$SOCKET" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed" || die "munged failed; see $DIR/log/munged.log"
}

start_daemon() {  # start_daemon NAME ARGS...: start one slurm daemon unless ours is running
    local name=$1
    shift
    pid_of "$name" >/dev/null && return 0
    "$name" "$@" || die "$name failed to start; see $DIR/log/$name.log"
}

wait_idle() {  # the node is usable (idle/mixed/allocated), or fail after 60 s
    local i state
    for ((i = 0; i < 120; i++)); do
        state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)
        case $state in
            idle* | mix* | alloc*) return 0 ;;
            down* | drain* | fail*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 0.5
    done
    die "node $HOST is not ready (state '${state:-unknown}'); see $DIR/log/"
}

# ---------------------------------------------------------------- several nodes (--nodes N)

BRIDGE=mpiflbr0
NET=10.77.0

node_names() { local i; for ((i = 1; i <= $1; i++)); do echo "mpifl-n$i"; done; }
nodes_up() { if [[ -s $DIR/nodes ]]; then cat "$DIR/nodes"; else echo 1; fi; }

write_multi_config() {  # write_multi_config N
    local n=$1 i mem
    mkdir -p "$DIR"/{etc,munge,run,log,spool/ctld,node}
    chmod 700 "$DIR/munge"
    mem=$(awk -v n="$n" '/MemTotal/ {printf "%d", $2 / 1024 * 0.9 / n}' /proc/meminfo)
    { echo "127.0.0.1 localhost"; echo "$NET.1 $HOST"
      for ((i = 1; i <= n; i++)); do echo "$NET.$((10 + i)) mpifl-n$i"; done; } >"$DIR/etc/hosts"
    cat >"$CONF" <<EOF
# Written by mpifl slurm/local-cluster.sh: $n namespace nodes on one machine.
ClusterName=mpifl-local
SlurmctldHost=$HOST($NET.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d-%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=20
MessageTimeout=10
InactiveLimit=0
KillWait=30
MinJobAge=300
JobRequeue=1
FirstJobId=$FIRST_JOB_ID
EOF
    for ((i = 1; i <= n; i++)); do
        echo "NodeName=mpifl-n$i NodeAddr=$NET.$((10 + i)) CPUs=$CPUS RealMemory=$mem State=UNKNOWN" >>"$CONF"
    done
    echo "PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
}

make_network() {  # make_network N: the bridge (controller side) and one veth + netns per node
    local n=$1 i
    ip link add "$BRIDGE" type bridge
    ip addr add "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for ((i = 1; i <= n; i++)); do
        ip netns add "mpifl-n$i"
        ip link add "mpv$i" type veth peer name eth0 netns "mpifl-n$i"
        ip link set "mpv$i" master "$BRIDGE" up
        ip -n "mpifl-n$i" addr add "$NET.$((10 + i))/24" dev eth0
        ip -n "mpifl-n$i" link set eth0 up
        ip -n "mpifl-n$i" link set lo up
    done
}

start_node() {  # start_node I: slurmd in node I's namespaces (hostname, cgroup fs, boot id, shm, hosts)
    local name="mpifl-n$1"
    mkdir -p "$DIR/node/$name"
    cat /proc/sys/kernel/random/uuid >"$DIR/node/$name/boot_id"
    # `ip netns exec` mounts a fresh sysfs without cgroups: slurmd wants /sys/fs/cgroup with a
    # (here empty, private) named v1 hierarchy. UCX tells machines apart by boot_id and shares
    # memory through /dev/shm, so each node gets its own of both: MPI between nodes uses TCP.
    ip netns exec "$name" unshare --uts --ipc --mount --propagation private bash -c "
        set -e
        hostname $name
        mount -t tmpfs none /sys/fs/cgroup
        mkdir -p /sys/fs/cgroup/systemd
        mount -t cgroup -o none,name=$name cgroup /sys/fs/cgroup/systemd
        mount --bind $DIR/node/$name/boot_id /proc/sys/kernel/random/boot_id
        mount -t tmpfs none /dev/shm
        mount --bind $DIR/etc/hosts /etc/hosts
        exec slurmd -f $CONF -N $name" || die "slurmd of $name failed; see $DIR/log/slurmd-$name.log"
}

wait_nodes() {  # every node usable, or fail after 60 s
    local i ready=0
    for ((i = 0; i < 120; i++)); do
        ready=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)/' | wc -l)
        ((ready == $1)) && return 0
        sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(down|drain|fail)/ {print $1}' |
            while read -r node; do scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true; done
        sleep 0.5
    done
    die "only $ready of $1 nodes are ready; see $DIR/log/"
}

cmd_up_multi() {
    local n=$1 i
    need_tools
    command -v ip >/dev/null || die "missing ip: apt-get install iproute2"
    if [[ $(nodes_up) == "$n" ]] && pid_of slurmctld >/dev/null; then
        wait_nodes "$n"
        say "already up ($n nodes, $CONF)"
        return 0
    fi
    stop_ours
    write_multi_config "$n"
    echo "$n" >"$DIR/nodes"
    make_network "$n"
    start_munge
    start_daemon slurmctld -f "$CONF"
    for ((i = 1; i <= n; i++)); do start_node "$i"; done
    wait_nodes "$n"
    say "up: $n nodes mpifl-n1..mpifl-n$n ($NET.11..), $CPUS CPUs each (over-subscribing $(nproc) cores), partition $PARTITION; export SLURM_CONF=$CONF"
}

stop_nodes() {  # every process in our node namespaces (slurmd, steps, ranks), the namespaces, the bridge
    local name
    for name in $(ip netns list 2>/dev/null | awk '$1 ~ /^mpifl-n[0-9]+$/ {print $1}'); do
        ip netns pids "$name" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$name" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -f "$DIR/nodes"
}

cmd_up() {
    need_tools
    if pid_of slurmctld >/dev/null && pid_of slurmd >/dev/null && pid_of munged >/dev/null; then
        wait_idle
        say "already up ($CONF)"
        return 0
    fi
    stop_ours  # a partial start (one daemon died): begin again from a fresh config
    write_config
    start_munge
    start_daemon slurmctld -f "$CONF"
    start_daemon slurmd -f "$CONF" -N "$HOST"
    wait_idle
    say "up: node $HOST, $CPUS CPUs, partition $PARTITION; export SLURM_CONF=$CONF"
}

stop_pid() {  # stop_pid NAME: TERM our daemon, wait up to 10 s, then KILL
    local pid i
    pid=$(pid_of "$1") || return 0
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        [[ -d /proc/$pid ]] || return 0
        sleep 0.2
    done
    kill -9 "$pid" 2>/dev/null || true
}

stop_ours() {  # in parallel: a daemon may take seconds to exit
    [[ -s $DIR/nodes ]] && stop_nodes &  # only namespaces this folder's cluster made
    stop_pid slurmd &
    stop_pid slurmctld &
    wait
    stop_pid munged
}

cmd_down() {
    if pid_of slurmctld >/dev/null; then
        scancel --full --quiet --partition="$PARTITION" 2>/dev/null || true
        local i
        for ((i = 0; i < 50; i++)); do
            [[ -z $(squeue -h -t R,CG -o %i 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
    stop_ours
    rm -rf "$DIR/spool" "$DIR/run"
    say "down (config and logs kept in $DIR)"
}

cmd_status() {
    local name pid ok=0
    local daemons="munged slurmctld slurmd"
    [[ $(nodes_up) != 1 ]] && daemons="munged slurmctld $(node_names "$(nodes_up)" | sed 's/^/slurmd-/')"
    for name in $daemons; do
        if pid=$(pid_of "$name"); then echo "$name: running (pid $pid)"
        else echo "$name: stopped"; ok=1; fi
    done
    echo "SLURM_CONF=$CONF"
    if ((ok == 0)); then sinfo -N -o '%N %P %c %t' || ok=1; fi
    return $ok
}

case ${1:-} in
    up)
        if [[ ${2:-} == --nodes ]]; then
            [[ ${3:-} =~ ^[1-9][0-9]?$ ]] || die "--nodes wants a number of nodes (1-99), got '${3:-}'"
            if (($3 > 1)); then cmd_up_multi "$3"; else cmd_up; fi
        elif [[ -n ${2:-} ]]; then die "unknown option '$2' (up [--nodes N])"
        else cmd_up; fi ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up [--nodes N]|down|status|env" >&2; exit 2 ;;
esac
