#!/usr/bin/env bash
# The GPU checks in one call each, on a machine whose python3 already holds torch with CUDA (tests/gpu/README.md):
#
#     bash benchmarks/gpu_step.sh tests OUT_DIR          # make test-gpu; JSON results and the log in OUT_DIR
#     bash benchmarks/gpu_step.sh throughput 0.5b OUT_DIR  # benchmarks/throughput.py, a random Qwen2.5-0.5B shape
#     bash benchmarks/gpu_step.sh throughput 1.5b OUT_DIR
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
# The native CPU kernels are optional (torch ops otherwise); build them in place when a compiler is there.
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "native CPU kernels not built: torch ops are used"

case "${1:-}" in
tests)
    out=${2:?usage: gpu_step.sh tests OUT_DIR}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
    python3 -m pip list 2>/dev/null | grep -iE '^(torch|transformers|megatron-core|transformer.engine|vllm) ' \
        | tee -a "$out/device.txt"
    MEGATRON_GTPO_GPU_RESULTS="$out/gpu_results.jsonl" make test-gpu GPU_PY=python3 2>&1 | tee "$out/test_gpu.log"
    ;;
throughput)
    size=${2:?usage: gpu_step.sh throughput 0.5b|1.5b OUT_DIR}
    out=${3:?usage: gpu_step.sh throughput 0.5b|1.5b OUT_DIR}
    mkdir -p "$out"
    python3 benchmarks/throughput.py --config examples/cpu_demo.yaml --nproc 1 --random-model "qwen2.5-$size" \
        --work-dir /tmp/bench --set parallel.tensor=1 --set model.dtype=bfloat16 --set warm_start.steps=0 \
        --set rollout.max_new_tokens=1024 --set data.micro_batch_size=8 --steps 6 --skip 2 \
        --output "$out/throughput_h100_$size.md" 2>&1 | tee "$out/throughput_$size.log"
    ;;
*)
    echo "usage: gpu_step.sh tests OUT_DIR | throughput 0.5b|1.5b OUT_DIR" >&2
    exit 2
    ;;
esac
