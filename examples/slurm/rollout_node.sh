#!/bin/bash
# One rollout node of a disaggregated job (disaggregated.sbatch): SERVERS_PER_NODE rollout servers, server i on GPUs
# i x SERVER_TP .. (i + 1) x SERVER_TP - 1 of this node, listening on $(hostname):$((ROLLOUT_PORT + i)). The trainer
# connects to them (rollout.remote_addresses) and syncs its weights into them; they run until it shuts them down or
# the job ends.
#
# Environment: PYTHON, HF_MODEL_DIR (what the engines start from), ROLLOUT_ENGINE (vllm | builtin), SERVER_TP,
# SERVERS_PER_NODE, ROLLOUT_PORT, SERVER_ARGS (more remote_server flags), DRY_RUN (print the commands only).
set -euo pipefail

PYTHON=${PYTHON:-python}
: "${HF_MODEL_DIR:?rollout_node.sh: set HF_MODEL_DIR to the Hugging Face directory the rollout engines start from}"
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-vllm}
SERVER_TP=${SERVER_TP:-1}
SERVERS_PER_NODE=${SERVERS_PER_NODE:-$(( ${SLURM_GPUS_ON_NODE:-8} / SERVER_TP ))}
ROLLOUT_PORT=${ROLLOUT_PORT:-31000}
read -r -a server_args <<< "${SERVER_ARGS:-}"
host=${SLURMD_NODENAME:-$(hostname)}  # the node name SLURM knows it by (what the trainer is told)

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
    CUDA_VISIBLE_DEVICES=$gpus "${cmd[@]}" &
    pids+=($!)
done
if [[ "${DRY_RUN:-0}" == 1 ]]; then exit 0; fi
trap 'kill "${pids[@]}" 2>/dev/null || true' TERM INT EXIT
wait "${pids[@]}"
