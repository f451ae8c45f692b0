#!/usr/bin/env bash
# The GPU checks, on a machine whose python3 already holds torch with CUDA (tests/gpu/README.md):
#
#     bash benchmarks/gpu_step.sh all OUT_DIR            # everything below in ONE command, in order of value, each
#                                                        # part under its own time limit (about 8 minutes in all)
#     bash benchmarks/gpu_step.sh tests OUT_DIR          # make test-gpu; JSON results and the log in OUT_DIR
#     bash benchmarks/gpu_step.sh throughput 0.5b OUT_DIR  # benchmarks/throughput.py, a random Qwen2.5-0.5B shape:
#                                                        # MFU, the entropy + shaping share of a step, and the CUDA
#                                                        # peak memory against the planner's
#     bash benchmarks/gpu_step.sh throughput 1.5b OUT_DIR
#
# throughput's run length: STEPS (default 6), SKIP (2), MAX_NEW_TOKENS (1024), ALGORITHMS ("grpo gtpo grpo_s").
#
# Wheels in .whl/ (megatron-core and anything else the machine lacks) are installed first into /tmp/site, without
# an index: machines that cannot reach PyPI get them carried along.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1

case "${1:-}" in
all)
    out=${2:?usage: gpu_step.sh all OUT_DIR}
    mkdir -p "$out"
    # A part that fails or runs out of its time is recorded in summary.txt and the next one still runs: a failure on
    # a real GPU is a result too. The limits add up to under 8 minutes, the one command a short lease allows.
    failed=0
    part() {
        local name=$1 limit=$2 start=$SECONDS rc=0
        shift 2
        echo "== $name (limit ${limit} s)" | tee -a "$out/summary.txt"
        timeout --kill-after=15 "$limit" "$@" || rc=$?
        echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/summary.txt"
        [ "$rc" -eq 0 ] || failed=1
    }
    part tests "${TESTS_LIMIT_S:-270}" bash "$0" tests "$out"
    # On an H200 (2026-11-26) 4 steps of 512 tokens finished GRPO but not GTPO within 210 s; the report is rewritten
    # after each algorithm's run, so a cut leaves the runs that finished.
    STEPS=${STEPS:-3} SKIP=${SKIP:-1} MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256} ALGORITHMS=${ALGORITHMS:-grpo gtpo} \
        part throughput "${THROUGHPUT_LIMIT_S:-200}" bash "$0" throughput 0.5b "$out"
    exit "$failed"
    ;;
tests)
    out=${2:?usage: gpu_step.sh tests OUT_DIR}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
    python3 -c "import torch; print('torch.cuda.get_device_name():', torch.cuda.get_device_name())" \
        | tee -a "$out/device.txt"
    python3 -m pip list 2>/dev/null | grep -iE '^(torch|transformers|megatron-core|transformer.engine|vllm) ' \
        | tee -a "$out/device.txt"
    MEGATRON_GTPO_GPU_RESULTS="$out/gpu_results.jsonl" make test-gpu GPU_PY=python3 2>&1 | tee "$out/test_gpu.log"
    ;;
throughput)
    size=${2:?usage: gpu_step.sh throughput 0.5b|1.5b OUT_DIR}
    out=${3:?usage: gpu_step.sh throughput 0.5b|1.5b OUT_DIR}
    mkdir -p "$out"
    # shellcheck disable=SC2086  # ALGORITHMS is a list
    python3 benchmarks/throughput.py --config examples/cpu_demo.yaml --nproc 1 --random-model "qwen2.5-$size" \
        --work-dir /tmp/bench --set parallel.tensor=1 --set model.dtype=bfloat16 --set warm_start.steps=0 \
        --set "rollout.max_new_tokens=${MAX_NEW_TOKENS:-1024}" --set data.micro_batch_size=8 \
        --steps "${STEPS:-6}" --skip "${SKIP:-2}" --algorithms ${ALGORITHMS:-grpo gtpo grpo_s} \
        --output "$out/throughput_gpu_$size.md" 2>&1 | tee "$out/throughput_$size.log"
    ;;
*)
    echo "usage: gpu_step.sh all OUT_DIR | tests OUT_DIR | throughput 0.5b|1.5b OUT_DIR" >&2
    exit 2
    ;;
esac
