#!/usr/bin/env bash
# The GPU checks, on a machine whose python3 already holds torch with CUDA (tests/gpu/README.md):
#
#     bash benchmarks/gpu_step.sh all OUT_DIR            # everything below in ONE command, each part under its own
#                                                        # time limit, the limits summing to 500 s (540 s at most
#                                                        # with the 10 s each part may take to die)
#     bash benchmarks/gpu_step.sh probe OUT_DIR          # benchmarks/gpu_probe.py (OUT_DIR/probe.jsonl)
#     bash benchmarks/gpu_step.sh tests OUT_DIR          # make test-gpu (TESTS="-k expression" narrows it); JSON
#                                                        # results and the log in OUT_DIR
#     bash benchmarks/gpu_step.sh throughput 0.5b OUT_DIR  # benchmarks/throughput.py, a random Qwen2.5-0.5B shape:
#                                                        # MFU, the entropy + shaping share of a step, and the CUDA
#                                                        # peak memory against the planner's
#     bash benchmarks/gpu_step.sh throughput 1.5b OUT_DIR
#
# throughput's run length: STEPS (default 6), SKIP (2), MAX_NEW_TOKENS (1024), ALGORITHMS ("grpo gtpo grpo_s").
#
# Wheels in .whl/ (megatron-core and anything else the machine lacks) are installed once, first, into /tmp/site,
# without an index: machines that cannot reach PyPI get them carried along. Every result is written under OUT_DIR
# as it is produced (probe.jsonl line by line, the throughput runs' logs and metrics as they run).
#
# DRY_RUN=1, on any machine (no GPU): every part of the same command runs what it can without CUDA, under the same
# limits, into OUT_DIR: the preflight without its CUDA check; the probe's --dry-run (what its items build at the GPU's
# sizes, nothing run); throughput's --dry-run (each algorithm's trainer command, its config loaded and checked as the
# trainer checks it); the GPU tests' command, printed (tests/test_gpu_trainer_configs.py checks their trainer runs'
# configs on the CPU). tests/test_scripts.py runs it (with PREFLIGHT_S, the preflight's limit, raised for a busy CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
dry_run=${DRY_RUN:-}

install_wheels() {  # once per command: the parts of `all` inherit GPU_STEP_WHEELS_INSTALLED
    if [ -z "${GPU_STEP_WHEELS_INSTALLED:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
        timeout 30 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl
    fi
    export GPU_STEP_WHEELS_INSTALLED=1
}

case "${1:-}" in
all)
    out=${2:?usage: gpu_step.sh all OUT_DIR}
    mkdir -p "$out"
    install_wheels
    # Nothing else is worth its minutes if megatron-core, a package the trainer imports, or CUDA is missing: stop at
    # once, saying which.
    if ! timeout "${PREFLIGHT_S:-20}" python3 -c "import sys, torch, megatron.core, megatron_gtpo.training.trainer
assert torch.cuda.is_available() or sys.argv[1], 'no CUDA device'" "$dry_run" >"$out/preflight.txt" 2>&1; then
        echo "ABORT: the preflight failed (an import, or CUDA):" | tee -a "$out/summary.txt"
        tail -5 "$out/preflight.txt" | tee -a "$out/summary.txt"
        exit 3
    fi
    # A part that fails or runs out of its time is recorded in summary.txt and the next one still runs: a failure on
    # a real GPU is a result too. Limits: 30 (wheels, above) + 20 (preflight) + 170 + 150 + 130 = 500 s; each part
    # gets 10 s more to die after its limit's SIGTERM: 530 s at worst.
    failed=0
    part() {
        local name=$1 limit=$2 start=$SECONDS rc=0
        shift 2
        echo "== $name (limit ${limit} s)${dry_run:+ dry run}" | tee -a "$out/summary.txt"
        timeout --kill-after=10 "$limit" "$@" || rc=$?
        echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/summary.txt"
        [ "$rc" -eq 0 ] || failed=1
    }
    # The probe starts no item after 140 s; its last item (the 7B log-prob pass) takes well under 30 s.
    PROBE_DEADLINE_S=140 part probe 170 bash "$0" probe "$out"
    # GRPO against GTPO, 3 steps of 256 tokens (the first left out): the entropy + shaping share of the step. The
    # report is rewritten after each algorithm's run, so a cut leaves the runs that finished.
    STEPS=${STEPS:-3} SKIP=${SKIP:-1} MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256} ALGORITHMS=${ALGORITHMS:-grpo gtpo} \
        part throughput 150 bash "$0" throughput 0.5b "$out"
    # Only the GPU tests that have not passed on a GPU yet (tests/gpu/README.md says which passed where).
    not_yet_passed="-k 'test_resume_matches_uninterrupted_run or test_rl_step_peak_memory_is_within_the_plan'"
    TESTS=${TESTS:-$not_yet_passed} part tests 130 bash "$0" tests "$out"
    exit "$failed"
    ;;
probe)
    out=${2:?usage: gpu_step.sh probe OUT_DIR}
    install_wheels
    python3 benchmarks/gpu_probe.py --output-dir "$out" --deadline-s "${PROBE_DEADLINE_S:-300}" ${dry_run:+--dry-run}
    ;;
tests)
    out=${2:?usage: gpu_step.sh tests OUT_DIR}
    mkdir -p "$out"
    install_wheels
    command=(make test-gpu GPU_PY=python3 "PYTEST_ARGS=${TESTS:-} --junitxml=$out/test_gpu.xml")
    if [ -n "$dry_run" ]; then
        echo "dry run: MEGATRON_GTPO_GPU_RESULTS=$out/gpu_results.jsonl ${command[*]@Q}" | tee "$out/test_gpu.log"
        exit 0
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
    python3 -c "import torch; print('torch.cuda.get_device_name():', torch.cuda.get_device_name())" \
        | tee -a "$out/device.txt"
    python3 -m pip list 2>/dev/null | grep -iE '^(torch|transformers|megatron-core|transformer.engine|vllm) ' \
        | tee -a "$out/device.txt"
    MEGATRON_GTPO_GPU_RESULTS="$out/gpu_results.jsonl" "${command[@]}" 2>&1 | tee "$out/test_gpu.log"
    ;;
throughput)
    size=${2:?usage: gpu_step.sh throughput 0.5b|1.5b OUT_DIR}
    out=${3:?usage: gpu_step.sh throughput 0.5b|1.5b OUT_DIR}
    mkdir -p "$out"
    install_wheels
    # shellcheck disable=SC2086  # ALGORITHMS is a list
    python3 benchmarks/throughput.py --config examples/cpu_demo.yaml --nproc 1 --random-model "qwen2.5-$size" \
        --work-dir /tmp/bench --log-dir "$out/throughput_$size" --set parallel.tensor=1 \
        --set model.dtype=bfloat16 --set warm_start.steps=0 \
        --set "rollout.max_new_tokens=${MAX_NEW_TOKENS:-1024}" --set data.micro_batch_size=8 \
        --steps "${STEPS:-6}" --skip "${SKIP:-2}" --algorithms ${ALGORITHMS:-grpo gtpo grpo_s} \
        --output "$out/throughput_gpu_$size.md" ${dry_run:+--dry-run} 2>&1 | tee "$out/throughput_$size.log"
    ;;
*)
    echo "usage: [DRY_RUN=1] gpu_step.sh all OUT_DIR | probe OUT_DIR | tests OUT_DIR | throughput 0.5b|1.5b OUT_DIR" >&2
    exit 2
    ;;
esac
