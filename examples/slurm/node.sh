#!/bin/bash
# One node of a megatron_gtpo job. launch.sh starts it with srun, one task per node; it runs torchrun as
#   python -m megatron_gtpo.launch --nnodes=$SLURM_NNODES --node_rank=$SLURM_NODEID --nproc_per_node=$NPROC_PER_NODE \
#            --master_addr=<first host of the node list> --master_port=$MASTER_PORT -m megatron_gtpo.train "$@"
# (megatron_gtpo.launch: torchrun's options and agent, ending with the ranks' one-line error and its status)
# (torchrun's static rendezvous: node 0 hosts the TCP store every rank joins). It can also run without SLURM, one
# copy per machine, given SLURM_NNODES, SLURM_NODEID and SLURM_JOB_NODELIST or MASTER_ADDR (tests/test_multinode.py
# does that in network namespaces).
#
# Pre-emption: SIGUSR1 or SIGTERM to this script is forwarded as SIGUSR1 to the trainer ranks (torchrun's children),
# which finish the step in progress, write a checkpoint and exit 0; torchrun then exits 0. (Under srun the ranks also
# get the step's SIGUSR1 directly; twice is harmless.) torchrun itself ignores SIGUSR1.
#
# Environment (examples/slurm/README.md explains each): PYTHON, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT,
# TORCHRUN_LOG_DIR, DRY_RUN, and SLURM_NNODES / SLURM_NODEID / SLURM_STEP_NODELIST / SLURM_JOB_NODELIST.
set -euo pipefail

PYTHON=${PYTHON:-python}
NNODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:?node.sh: SLURM_NNODES is not set (run it through srun or set it)}}
NODE_RANK=${SLURM_NODEID:?node.sh: SLURM_NODEID is not set (run it through srun or set it)}
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MASTER_PORT=${MASTER_PORT:-29500}
if [[ -z "${MASTER_ADDR:-}" ]]; then
    nodelist=${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:?node.sh: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set}}
    # The same parser the trainer uses for srun-native launches (megatron_gtpo.distributed.parallel).
    MASTER_ADDR=$("$PYTHON" -c 'import sys
from megatron_gtpo.distributed.parallel import first_host_in_nodelist
print(first_host_in_nodelist(sys.argv[1]))' "$nodelist")
fi

# megatron_gtpo.launch is torchrun (its options, its agent) ending with the ranks' own one-line error and status.
cmd=("$PYTHON" -m megatron_gtpo.launch --nnodes="$NNODES" --node_rank="$NODE_RANK"
     --nproc_per_node="$NPROC_PER_NODE" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
if [[ -n "${TORCHRUN_LOG_DIR:-}" ]]; then  # per-rank stdout/stderr files, also echoed to the job log
    cmd+=(--log-dir="$TORCHRUN_LOG_DIR/node$NODE_RANK" --tee=3)
fi
cmd+=(-m megatron_gtpo.train "$@")

echo "node $NODE_RANK/$NNODES on $(hostname): rendezvous at $MASTER_ADDR:$MASTER_PORT, $NPROC_PER_NODE ranks"
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi

# SLURM delivers a step's signals to every process of the step, torchrun included, and SIGUSR1 would kill it: it
# runs with SIGUSR1 ignored. Its ranks inherit that until the trainer installs its handler (after start-up).
( trap '' USR1; exec "${cmd[@]}" ) &
torchrun_pid=$!
stop_ranks() {
    echo "node $NODE_RANK: $1: asking the trainer ranks to checkpoint after this step and exit"
    pkill -USR1 -P "$torchrun_pid" || true
}
trap 'stop_ranks SIGUSR1' USR1
trap 'stop_ranks SIGTERM' TERM
# A trapped signal interrupts `wait` while torchrun keeps running: wait again; bash keeps the exit status.
while kill -0 "$torchrun_pid" 2>/dev/null; do wait "$torchrun_pid" || true; done
status=0
wait "$torchrun_pid" || status=$?
exit "$status"
