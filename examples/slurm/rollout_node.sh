#!/bin/bash
# One rollout node of a disaggregated job (disaggregated.sbatch): SERVERS_PER_NODE rollout servers, server i on GPUs
# i x SERVER_TP .. (i + 1) x SERVER_TP - 1 of this node, listening on $(hostname):$((ROLLOUT_PORT + i)). The trainer
# connects to them (rollout.remote.addresses) and syncs its weights into them; they run until it shuts them down or
# the job ends. A server that dies (any exit but a trainer's shutdown, status 0) is relaunched at its address, at most
# SERVER_RESTARTS times: a trainer with rollout.remote.reconnect_timeout_s waits for it, sends it its weights and
# goes on (docs/remote_rollout.md).
#
# Environment: PYTHON, HF_MODEL_DIR (what the engines start from), ROLLOUT_ENGINE (vllm | builtin), SERVER_TP,
# SERVERS_PER_NODE, ROLLOUT_PORT, SERVER_ARGS (more remote_server flags), SERVER_RESTARTS (10), DRY_RUN (print the
# commands only).
set -euo pipefail

PYTHON=${PYTHON:-python}
: "${HF_MODEL_DIR:?rollout_node.sh: set HF_MODEL_DIR to the Hugging Face directory the rollout engines start from}"
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-vllm}
SERVER_TP=${SERVER_TP:-1}
SERVERS_PER_NODE=${SERVERS_PER_NODE:-$(( ${SLURM_GPUS_ON_NODE:-8} / SERVER_TP ))}
ROLLOUT_PORT=${ROLLOUT_PORT:-31000}
SERVER_RESTARTS=${SERVER_RESTARTS:-10}
read -r -a server_args <<< "${SERVER_ARGS:-}"
host=${SLURMD_NODENAME:-$(hostname)}  # the node name SLURM knows it by (what the trainer is told)

# supervise GPUS COMMAND...: run the server, and again each time it dies (above).
supervise() {
    local gpus=$1 restarts=0 status child
    shift
    while true; do
        CUDA_VISIBLE_DEVICES=$gpus "$@" &
        child=$!
        trap 'kill "$child" 2>/dev/null || true; exit 143' TERM INT
        status=0
        wait "$child" || status=$?
        if (( status == 0 )); then return 0; fi
        if (( restarts >= SERVER_RESTARTS )); then
            echo "rollout_node.sh: the server on GPUs $gpus exited with status $status after $restarts relaunch(es):" \
                 "giving up (SERVER_RESTARTS)" >&2
            return "$status"
        fi
        restarts=$((restarts + 1))
        echo "rollout_node.sh: the server on GPUs $gpus exited with status $status: relaunching it" \
             "($restarts of $SERVER_RESTARTS)" >&2
        sleep 1
    done
}

pids=()
for ((i = 0; i < SERVERS_PER_NODE; i++)); do
    gpus=$(seq -s, $((i * SERVER_TP)) $(((i + 1) * SERVER_TP - 1)))
    cmd=("$PYTHON" -m megatron_gtpo.rollout.remote_server --engine "$ROLLOUT_ENGINE" --hf-dir "$HF_MODEL_DIR"
         --listen "$host:$((ROLLOUT_PORT + i))" "${server_args[@]}")
    if [[ "$ROLLOUT_ENGINE" == vllm ]]; then cmd+=(--tensor-parallel-size "$SERVER_TP"); fi
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        echo "CUDA_VISIBLE_DEVICES=$gpus $(printf '%q ' "${cmd[@]}")"
        continue
    fi
    supervise "$gpus" "${cmd[@]}" &
    pids+=($!)
done
if [[ "${DRY_RUN:-0}" == 1 ]]; then exit 0; fi
trap 'kill "${pids[@]}" 2>/dev/null || true' TERM INT EXIT
wait "${pids[@]}"
