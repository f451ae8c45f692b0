#!/bin/bash
# megatron_gtpo on SLURM: srun starts node.sh once per node, node.sh starts one torchrun per node with the
# rendezvous at the first host of the node list. Automatic resume (the trainer restarts from
# <checkpoint dir>/latest), checkpoint-and-requeue on pre-emption or at the time limit, one log per job.
#
#   CONFIG=examples/qwen2.5-7b-gtpo.yaml sbatch --nodes=1 --gpus-per-node=8 examples/slurm/launch.sh
#   NPROC_PER_NODE=2 CONFIG=examples/cpu_demo.yaml EXTRA_ARGS="--set steps=2" sbatch examples/slurm/launch.sh
#
# A dry run without SLURM (a laptop): DRY_RUN=1 bash examples/slurm/qwen2.5-32b.sbatch loads and checks the config
# with every setting the job would pass, and plans it (tools/plan.py) for the job's nodes (NODES, default the
# script's #SBATCH --nodes) x NPROC_PER_NODE GPUs and the model PLAN_MODEL (the per-model scripts set it): the
# layout, memory per GPU, FITS or why not. Inside an allocation DRY_RUN=1 prints node.sh's torchrun commands.
#
# The per-model scripts (qwen2.5-7b.sbatch, qwen2.5-32b.sbatch) set the resources and exec this file. Every knob is
# an environment variable, read at run time; examples/slurm/README.md explains each one.
#SBATCH --job-name=megatron-gtpo
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

laptop_dry_run=0
if [[ "${DRY_RUN:-0}" == 1 && -z "${SLURM_JOB_ID:-}" ]]; then laptop_dry_run=1; fi
if [[ "$laptop_dry_run" == 0 ]]; then
    : "${SLURM_JOB_ID:?launch.sh runs inside a SLURM allocation: submit it with sbatch (or DRY_RUN=1 to check it)}"
fi
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$REPO_DIR"
: "${CONFIG:?set CONFIG to a trainer config, e.g. CONFIG=examples/qwen2.5-7b-gtpo.yaml}"
export PYTHON=${PYTHON:-python}
export PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
export NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
# One port per job, so that two jobs sharing a node do not collide.
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
export TORCHRUN_LOG_DIR=${TORCHRUN_LOG_DIR-logs/${SLURM_JOB_NAME:-megatron-gtpo}-${SLURM_JOB_ID:-0}}
# Network and NCCL: defaults that are safe everywhere; interfaces and HCAs are cluster-specific (README).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # megatron's TP communication ordering
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# NCCL_SOCKET_IFNAME, NCCL_IB_HCA, GLOO_SOCKET_IFNAME, ...: exported by the caller, srun passes them on.

train_args=(--config "$CONFIG")
if [[ -n "${RUN_DIR:-}" ]]; then train_args+=(--set "logging.output_dir=$RUN_DIR"); fi
if [[ -n "${CHECKPOINT_DIR:-}" ]]; then train_args+=(--set "checkpoint.dir=$CHECKPOINT_DIR"); fi
if [[ -n "${MODEL_DIR:-}" ]]; then train_args+=(--set "model.load=$MODEL_DIR" --set model.hf_dir=null); fi
if [[ -n "${HF_MODEL_DIR:-}" ]]; then train_args+=(--set "model.hf_dir=$HF_MODEL_DIR" --set model.load=null); fi
if [[ -n "${VLLM_HF_DIR:-}" ]]; then train_args+=(--set "rollout.vllm.hf_dir=$VLLM_HF_DIR"); fi
if [[ -n "${DATA_PATH:-}" ]]; then train_args+=(--set "data.path=$DATA_PATH"); fi
read -r -a extra_args <<< "${EXTRA_ARGS:-}"
train_args+=("${extra_args[@]}")

if [[ "$laptop_dry_run" == 1 ]]; then
    job_script=${JOB_SCRIPT:-$0}
    nodes=${NODES:-$(sed -n 's/^#SBATCH --nodes=\([0-9][0-9]*\).*/\1/p' "$job_script" | head -n 1)}
    : "${PLAN_MODEL:?a dry run plans for a model: set PLAN_MODEL to a preset (tools/plan.py --model) or a HF directory}"
    echo "dry run of $job_script without SLURM: ${nodes:-1} node(s) x $NPROC_PER_NODE GPUs, config $CONFIG"
    exec "$PYTHON" "$REPO_DIR/tools/plan.py" --model "$PLAN_MODEL" --nodes "${nodes:-1}" \
        --gpus-per-node "$NPROC_PER_NODE" "${train_args[@]}"
fi
nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $nodes node(s) x $NPROC_PER_NODE ranks, config $CONFIG"
echo "trainer arguments: ${train_args[*]}"

stop_requested=0
stop_training() {
    stop_requested=1
    echo "launch.sh: $1 at $(date +%T): the trainer checkpoints after the current step and exits"
    kill -USR1 "$srun_pid" 2>/dev/null || true  # srun forwards it to node.sh on every node
}
trap 'stop_training SIGUSR1' USR1
trap 'stop_training SIGTERM' TERM

srun --nodes="$nodes" ${TRAIN_NODELIST:+--nodelist="$TRAIN_NODELIST"} --ntasks-per-node=1 --kill-on-bad-exit=1 --label \
    bash "$REPO_DIR/examples/slurm/node.sh" "${train_args[@]}" &
srun_pid=$!
while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid" || true; done
status=0
wait "$srun_pid" || status=$?

# Checkpoints are written atomically, so whatever the exit status, <checkpoint dir>/latest is complete: requeue.
if [[ "$stop_requested" == 1 && "${REQUEUE:-1}" == 1 && "${DRY_RUN:-0}" != 1 ]]; then
    echo "launch.sh: trainer exited with status $status; requeueing job $SLURM_JOB_ID to resume from its checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
