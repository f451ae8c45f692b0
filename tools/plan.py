"""Memory and FLOPs plan of a Qwen2.5 / Qwen3 / Qwen3-MoE model under a TP/PP/DP/EP layout, for one RL step
(megatron_gtpo.planning).

    python tools/plan.py --model qwen2.5-32b --tp 8 --pp 2 --dp 4 [--json]
    python tools/plan.py --model qwen2.5-7b --config examples/qwen2.5-7b-gtpo.yaml --nodes 1
    python tools/plan.py --model qwen3-30b-a3b --config examples/qwen3-30b-a3b-gtpo.yaml --nodes 2 --suggest
    python tools/plan.py --model qwen2.5-32b --config examples/qwen2.5-32b-gtpo-20k.yaml --nodes 4

--model is a name (qwen2.5-0.5b ... qwen2.5-72b, qwen3-0.6b ... qwen3-32b, qwen3-30b-a3b, qwen3-235b-a22b), a
config.json, or a Hugging Face model directory. --config takes the layout, workload, dtype, recompute and rollout
settings from a trainer config; explicit flags win. A mixture-of-experts model generates on the built-in engine (no
vLLM). --cp splits every sequence over that many GPUs (context parallelism: a GPU holds 1 / CP of each sequence's
activations and logits, and the keys and values the attention exchanges). --suggest plans every layout of the
--nodes' GPUs the rules allow, CP included, and prints the best that fits.
--disaggregated splits the --nodes between rollout servers (rollout.engine vllm_remote, one per data-parallel
replica) and training by a phase-time model, and prints the split, the phase times against colocated engines on all
the GPUs, the staleness it needs and the model's assumptions (docs/planning.md):

    python tools/plan.py --model qwen2.5-7b --config examples/qwen2.5-7b-gtpo.yaml --nodes 4 --disaggregated

Exit status: 0 the layout fits (--disaggregated: a split runs), 1 it does not (the reasons are printed), 2 it is
invalid (TP must divide the heads and query groups, PP the layers, ...; --disaggregated: no split runs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from dataclasses import replace

from megatron_gtpo.cli import run_cli
from megatron_gtpo.layout import ParallelLayout
from megatron_gtpo.planning import (KERNEL_PROFILES, Settings, Workload, plan, plan_disaggregated,
                                    settings_from_config, suggest_layouts, workload_from_config)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="qwen2.5-<size>, qwen3-<size>, a config.json, or a HF model directory")
    p.add_argument("--config", help="a megatron_gtpo trainer config (YAML): layout, workload and settings from it")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a value of --config, as the trainer's --set (repeatable)")
    layout = p.add_argument_group("layout")
    layout.add_argument("--tp", type=int, help="tensor parallel size (default 1, or the config's)")
    layout.add_argument("--pp", type=int, help="pipeline parallel size (default 1, or the config's)")
    layout.add_argument("--dp", type=int, help="data parallel size (default: from --nodes, else 1)")
    layout.add_argument("--nodes", type=int,
                        help="nodes of --gpus-per-node GPUs: DP = nodes x GPUs / (TP x PP x CP)")
    layout.add_argument("--vpp", type=int, help="virtual pipeline size (interleaved schedule)")
    layout.add_argument("--sp", action="store_true", default=None, help="sequence parallelism")
    layout.add_argument("--ep", type=int, help="expert parallel size (mixture-of-experts models; default 1)")
    layout.add_argument("--etp", type=int, help="expert tensor parallel size (default: TP)")
    layout.add_argument("--cp", type=int, help="context parallel size (default 1, or the config's)")
    layout.add_argument("--suggest", action="store_true",
                        help="plan every allowed layout of the GPUs of --nodes and print the best that fits")
    work = p.add_argument_group("workload (defaults: the paper's 128 prompts x 16, 2048 + 4096 tokens)")
    work.add_argument("--prompts-per-step", type=int)
    work.add_argument("--responses-per-prompt", type=int, help="G, the group size")
    work.add_argument("--max-prompt-tokens", type=int)
    work.add_argument("--max-response-tokens", type=int)
    work.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch (default 1)")
    work.add_argument("--mini-batches", type=int, help="optimizer steps per RL step")
    work.add_argument("--epochs", type=int, help="passes over each step's data")
    work.add_argument("--mean-response-tokens", type=int,
                      help="expected response length for the phase times (default: half of the maximum)")
    work.add_argument("--old-logprob-passes", type=int, choices=(0, 1, 2),
                      help="forward-only passes before the update: the old-policy pass (none where the update's own "
                           "forward gives the old log-probs: docs/step_batch.md) and a KL reference's (default 1, or "
                           "what --config runs)")
    mem = p.add_argument_group("memory")
    mem.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per GPU (default 80, H100)")
    mem.add_argument("--gpus-per-node", type=int, default=8)
    mem.add_argument("--dtype", choices=("bfloat16", "float32"), help="model dtype (default bfloat16)")
    mem.add_argument("--no-distributed-optimizer", action="store_true",
                     help="optimizer state replicated on every DP rank (the trainer always shards it)")
    mem.add_argument("--recompute", action="store_true", default=None, help="full activation recompute")
    mem.add_argument("--kernels", choices=KERNEL_PROFILES, default="te",
                     help="activation profile: te (Transformer Engine, flash attention) or local (megatron-core's "
                          "local spec with the SDPA attention: a GPU without Transformer Engine)")
    mem.add_argument("--vllm-memory-fraction", type=float, help="vLLM's share of each GPU (default 0.5)")
    mem.add_argument("--no-vllm", action="store_true", help="no colocated vLLM engine")
    mem.add_argument("--vllm-tp", type=int, help="vLLM tensor parallel size of each colocated engine (default: the "
                                                 "config's rollout.vllm.tensor_parallel, else the largest divisor of "
                                                 "TP that divides the attention heads, within a node: TP / it "
                                                 "engines per pipeline stage)")
    mem.add_argument("--vllm-overhead-gib", type=float, default=Settings.vllm_overhead_gib)
    mem.add_argument("--framework-overhead-gib", type=float, default=Settings.framework_overhead_gib)
    mem.add_argument("--allocator-slack", type=float, default=Settings.allocator_slack_fraction,
                     help="caching-allocator slack as a fraction of the transient allocations (default %(default)s)")
    mem.add_argument("--builtin-batch-tokens", type=int,
                     help="the built-in engine's KV-cache token slots per batch (default: the config's "
                          "rollout.builtin.max_batch_tokens, else every row of a replica at once)")
    mem.add_argument("--logprob-workspace-mib", type=float,
                     help="the vocab-parallel op's workspace budget (default: the config's, else 256)")
    split = p.add_argument_group("generating while training (--disaggregated; the rates are assumptions)")
    split.add_argument("--disaggregated", action="store_true",
                       help="split the GPUs of --nodes between rollout servers and training (whole nodes each)")
    split.add_argument("--max-staleness", type=int, default=1,
                       help="rollout.schedule.max_staleness of the step (default 1)")
    split.add_argument("--server-tp", type=int,
                       help="vLLM TP of each rollout server (SERVER_TP; default: the best of those the model allows)")
    defaults = Settings()
    for flag, name, what in (
            ("--peak-flops-per-s", "peak_flops_per_s", "one GPU's bf16 dense peak"),
            ("--hbm-bytes-per-s", "hbm_bytes_per_s", "one GPU's HBM bandwidth"),
            ("--training-mfu", "training_mfu", "old_logprob and update model FLOPs / peak"),
            ("--generation-mfu", "generation_mfu", "prefill and compute-bound decode FLOPs / peak"),
            ("--decode-bandwidth-efficiency", "decode_bandwidth_efficiency", "decode reads / HBM bandwidth"),
            ("--weight-sync-bytes-per-s", "weight_sync_bytes_per_s", "one replica's weight sync to its server"),
            ("--server-memory-fraction", "server_memory_fraction", "a rollout server's share of its GPUs")):
        split.add_argument(flag, type=float, default=getattr(defaults, name),
                           help=f"{what} (default {getattr(defaults, name):g})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def load_model(model: str) -> tuple[str, dict]:
    from megatron_gtpo.models.presets import PRESET_NAMES, hf_config

    if model.lower() in PRESET_NAMES:
        return model.lower(), hf_config(model)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"--model {model!r} is neither a known name ({', '.join(PRESET_NAMES)}) nor a "
                         f"config.json / model directory")
    with open(path, encoding="utf-8") as f:
        return model, json.load(f)


def build_inputs(args, moe: bool = False) -> tuple[ParallelLayout, Workload, Settings]:
    """The layout, workload and settings of the flags and --config; `moe`: the model has experts, so it plans the
    built-in engine unless asked otherwise."""
    workload, settings, layout = Workload(), Settings(), ParallelLayout()
    if args.overrides and not args.config:
        raise ValueError("--set overrides a value of --config: give the config")
    if args.config:
        from megatron_gtpo.config import load_config

        cfg = load_config(args.config, args.overrides)
        workload = workload_from_config(cfg)
        settings = settings_from_config(cfg, kernels=args.kernels)
        layout = ParallelLayout(tensor=cfg.parallel.tensor, pipeline=cfg.parallel.pipeline,
                                virtual_pipeline=cfg.parallel.virtual_pipeline,
                                sequence_parallel=cfg.parallel.sequence_parallel, expert=cfg.parallel.expert,
                                expert_tensor=cfg.parallel.expert_tensor, context=cfg.parallel.context)
    pick = lambda value, default: default if value is None else value  # noqa: E731
    tp, pp, cp = pick(args.tp, layout.tensor), pick(args.pp, layout.pipeline), pick(args.cp, layout.context)
    if args.nodes is not None:
        gpus = args.nodes * args.gpus_per_node
        if gpus % (tp * pp * cp):
            raise ValueError(f"{args.nodes} nodes x {args.gpus_per_node} GPUs are not divisible by TP x PP x CP = "
                             f"{tp} x {pp} x {cp}")
        if args.dp is not None and args.dp != gpus // (tp * pp * cp):
            raise ValueError(f"--dp {args.dp} contradicts --nodes {args.nodes} (DP = {gpus // (tp * pp * cp)})")
        dp = gpus // (tp * pp * cp)
    else:
        dp = pick(args.dp, 1)
    layout = ParallelLayout(tensor=tp, pipeline=pp, data=dp, context=cp,
                            virtual_pipeline=pick(args.vpp, layout.virtual_pipeline),
                            sequence_parallel=pick(args.sp, layout.sequence_parallel),
                            expert=pick(args.ep, layout.expert), expert_tensor=pick(args.etp, layout.expert_tensor))
    workload = Workload(
        prompts_per_step=pick(args.prompts_per_step, workload.prompts_per_step),
        num_responses_per_prompt=pick(args.responses_per_prompt, workload.num_responses_per_prompt),
        max_prompt_tokens=pick(args.max_prompt_tokens, workload.max_prompt_tokens),
        max_response_tokens=pick(args.max_response_tokens, workload.max_response_tokens),
        micro_batch_size=pick(args.micro_batch_size, workload.micro_batch_size),
        mini_batches_per_step=pick(args.mini_batches, workload.mini_batches_per_step),
        epochs_per_step=pick(args.epochs, workload.epochs_per_step),
        mean_response_tokens=pick(args.mean_response_tokens, workload.mean_response_tokens),
        old_logprob_passes=pick(args.old_logprob_passes, workload.old_logprob_passes))
    default_fraction = settings.vllm_memory_fraction if args.config else \
        (None if moe else Settings.vllm_memory_fraction)
    fraction = None if args.no_vllm else pick(args.vllm_memory_fraction, default_fraction)
    settings = replace(settings, gpu_memory_gib=args.gpu_memory_gib, gpus_per_node=args.gpus_per_node,
                       params_dtype=pick(args.dtype, settings.params_dtype),
                       distributed_optimizer=not args.no_distributed_optimizer,
                       recompute_activations=pick(args.recompute, settings.recompute_activations),
                       kernels=args.kernels, vllm_memory_fraction=fraction,
                       vllm_tensor_parallel=pick(args.vllm_tp, settings.vllm_tensor_parallel),
                       vllm_overhead_gib=args.vllm_overhead_gib, framework_overhead_gib=args.framework_overhead_gib,
                       allocator_slack_fraction=args.allocator_slack,
                       logprob_workspace_mib=pick(args.logprob_workspace_mib, settings.logprob_workspace_mib),
                       builtin_max_batch_tokens=pick(args.builtin_batch_tokens, settings.builtin_max_batch_tokens),
                       peak_flops_per_s=args.peak_flops_per_s, hbm_bytes_per_s=args.hbm_bytes_per_s,
                       training_mfu=args.training_mfu, generation_mfu=args.generation_mfu,
                       decode_bandwidth_efficiency=args.decode_bandwidth_efficiency,
                       weight_sync_bytes_per_s=args.weight_sync_bytes_per_s,
                       server_memory_fraction=args.server_memory_fraction)
    return layout, workload, settings


def format_table(result: dict) -> str:
    lay, mem, kv, fl = result["layout"], result["memory_gib"], result["kv_cache"], result["flops_per_step"]
    experts = f", EP={lay['expert']} ETP={lay['expert_tensor'] or lay['tensor']}" if lay["expert"] > 1 \
        or result["params_active"] != result["params_total"] else ""
    context = f" CP={lay['context']}" if lay["context"] > 1 else ""
    lines = [
        f"{result['model']}: TP={lay['tensor']} PP={lay['pipeline']}{context} DP={lay['data']}{experts} "
        f"(VPP={lay['virtual_pipeline']}, SP={lay['sequence_parallel']}), {lay['world_size']} GPUs of "
        f"{mem['gpu']:g} GiB",
        f"parameters: {result['params_total']:,} total, {result['params_active']:,} active per token, "
        f"{result['params_per_gpu']:,} on the largest rank (per stage: "
        f"{', '.join(f'{n:,}' for n in result['params_per_stage'])})",
        "",
        f"memory per GPU, GiB (worst pipeline stage: {result['worst_stage']})",
    ]
    for key in ("parameters", "gradients", "optimizer", "routing_record", "activations", "context_kv", "logits",
                "logprob_workspaces",
                "dispatcher_buffers", "allocator_slack", "framework_overhead", "vllm_asleep", "training_peak",
                "vllm_budget", "vllm_weights", "vllm_kv_cache", "builtin_kv_cache", "generation_peak"):
        lines.append(f"  {key:<20} {mem[key]:9.2f}")
    lines += ["", "training peak, GiB        no recompute   recompute"]
    for name, label in (("distopt", "distributed optimizer"), ("no_distopt", "replicated optimizer")):
        v = result["variants_gib"]
        lines.append(f"  {label:<24} {v[name + '_no_recompute']:9.2f}   {v[name + '_recompute']:9.2f}")
    if kv["vllm_tensor_parallel"] is not None:
        lines += ["", f"rollout: {kv['engines']} colocated vLLM engines of TP={kv['vllm_tensor_parallel']} "
                      f"({kv['engines_per_replica']} per model replica), {kv['gpus_generating']} of "
                      f"{lay['world_size']} GPUs generating, each engine with the whole model",
                  f"vLLM KV cache: {kv['kv_cache_gib_per_gpu']:.2f} GiB per GPU = {kv['tokens']:,} tokens per engine "
                  f"({kv['bytes_per_token']:,} B/token per GPU) = {kv['full_length_sequences']} full-length "
                  f"sequences at once; {kv['sequences_per_engine']} sequences per engine per step "
                  f"({kv['waves_at_full_length']} waves at full length)"]
    elif lay["context"] > 1:
        lines += ["", "rollout: rollout servers (the built-in engine does not generate under context parallelism)"]
    else:
        lines += ["", f"rollout: the built-in engine on the training model, a KV cache of "
                      f"{kv['builtin_batch_tokens']:,} token slots per batch"]
    lines += ["", "FLOPs per step (" + fl["note"] + ")"]
    for key in ("generate", "old_logprob", "update", "total"):
        lines.append(f"  {key:<12} {fl[key]:.3e}")
    lines += ["", "FITS" if result["fits"] else "DOES NOT FIT:"] + [f"  - {r}" for r in result["reasons"]]
    return "\n".join(lines)


def format_suggestions(plans: list) -> str:
    lines = ["", "layouts that fit, best first (TP PP CP DP EP ETP SP recompute: training / generation peak GiB)"]
    for p in plans[:8]:
        lay, mem = p.layout, p.memory_gib
        lines.append(f"  TP={lay.tensor} PP={lay.pipeline} CP={lay.context} DP={lay.data} EP={lay.expert} "
                     f"ETP={lay.expert_tensor_size} SP={lay.sequence_parallel} "
                     f"recompute={p.settings.recompute_activations}: {mem['training_peak']:.1f} / "
                     f"{mem['generation_peak']:.1f}")
    return "\n".join(lines)


PHASES = (("prefill_s", "prefill"), ("decode_s", "decode"), ("generate_s", "generate"),
          ("old_logprob_s", "old_logprob"), ("update_s", "update"), ("train_s", "train"),
          ("weight_sync_s", "weight sync"), ("step_s", "step"))


def format_disaggregated(result: dict) -> str:
    train, roll, phases, co = result["training"], result["rollout"], result["phases_s"], result["colocated"]
    lay, a, n = train["layout"], result["assumptions"], result["max_staleness"]
    context = f" CP={lay['context']}" if lay["context"] > 1 else ""
    unused = result["nodes"] - train["nodes"] - roll["nodes"]
    lines = [
        f"{result['model']} on {result['nodes']} nodes x {result['gpus_per_node']} GPUs: rollout servers "
        f"(rollout.engine vllm_remote) and training on nodes of their own, rollout.schedule.max_staleness {n}",
        "",
        f"split (the shortest step of the {1 + len(result['alternatives'])} that run):",
        f"  training: {train['nodes']} node(s), TP={lay['tensor']} PP={lay['pipeline']}{context} DP={lay['data']} "
        f"({train['gpus']} GPUs), training peak {train['training_peak_gib']:.1f} GiB per GPU",
        f"  rollout:  {roll['nodes']} node(s), {roll['servers']} vLLM servers of TP={roll['server_tp']} "
        f"({roll['gpus']} GPUs), KV cache {roll['kv_cache_gib_per_gpu']:.2f} GiB per GPU = "
        f"{roll['kv_tokens_per_engine']:,} tokens per server;",
        f"            {roll['sequences_per_engine']} sequences per server, {roll['running_per_engine']} at once "
        f"({roll['waves']} wave(s))",
        f"  unused:   {unused} node(s)",
        f"  launch:   ROLLOUT_NODES={roll['nodes']} SERVER_TP={roll['server_tp']} "
        f"SERVERS_PER_NODE={roll['servers_per_node']} MAX_STALENESS={n} "
        f"sbatch --nodes={train['nodes'] + roll['nodes']} examples/slurm/disaggregated.sbatch",
        "",
    ]
    co_phases, co_lay = co["phases_s"] or {}, co["layout"]
    engines = f", {co['engines']} vLLM engines of TP={co['vllm_tp']}" if co.get("engines") else ""
    lines.append(f"phase times per step, s   disaggregated   colocated (TP={co_lay['tensor']} PP={co_lay['pipeline']} "
                 f"DP={co_lay['data']} on all {co['gpus']} GPUs{engines})")
    for key, label in PHASES:
        colocated = f"{co_phases[key]:10.2f}" if key in co_phases else f"{'-':>10}"
        lines.append(f"  {label:<22} {phases[key]:10.2f}   {colocated}")
    idle = result["idle_s"]
    lines.append(f"  idle per step: training {idle['training']:.2f} s, rollout {idle['rollout']:.2f} s")
    if co_phases:
        ratio = phases["step_s"] / co_phases["step_s"]
        lines.append(f"  step, disaggregated / colocated: {ratio:.2f} "
                     f"({'disaggregated' if ratio < 1 else 'colocated'} is faster)")
    else:
        lines.append("  colocated: no phase times: " + ("; ".join(co["reasons"]) or "no vLLM engine planned"))
    lines += [""] + textwrap.wrap(
        f"staleness needed: {result['staleness_needed']}. At every N >= 1 the step is max(generate, train) + weight "
        f"sync: each step's weight sync waits for the generation before it (a server answers in order), so one "
        f"generation overlaps one training step, and a larger N only makes the batches staler. At N = 0 the step is "
        f"generate + train + weight sync.", 118, subsequent_indent="  ")
    lines += ["", "assumptions (estimates, not measurements):",
              f"  GPU: {a['peak_flops_per_s'] / 1e12:g} TFLOP/s bf16 dense peak, {a['hbm_bytes_per_s'] / 1e12:g} TB/s "
              f"HBM (H100 SXM datasheet by default)",
              f"  training MFU {a['training_mfu']:g}; generation MFU {a['generation_mfu']:g} (prefill, "
              f"compute-bound decode steps); decode reads weights and KV cache at {a['decode_bandwidth_efficiency']:g} "
              f"of HBM bandwidth",
              f"  weight sync {a['weight_sync_bytes_per_s'] / 1e9:g} GB/s per replica; rollout servers use "
              f"{a['server_memory_fraction']:g} of their GPUs, colocated vLLM {a['vllm_memory_fraction']}, vLLM "
              f"overhead {a['vllm_overhead_gib']:g} GiB per GPU",
              f"  lengths: prompts {a['prompt_tokens']} tokens (the maximum), responses {a['mean_response_tokens']} "
              f"on average ({a['mean_response_source']}), one straggler per server to {a['max_response_tokens']}",
              *textwrap.wrap("not modelled: " + "; ".join(a["not_modelled"]), 118, initial_indent="  ",
                             subsequent_indent="    ")]
    if result["alternatives"]:
        lines += ["", "other splits that run, s (training + rollout nodes: step; generate, train)"]
        for other in result["alternatives"][:6]:
            t, r, ph = other["training"], other["rollout"], other["phases_s"]
            lines.append(f"  DP={t['layout']['data']}, servers of TP={r['server_tp']}, {t['nodes']} + {r['nodes']} "
                         f"nodes: {ph['step_s']:.2f} (generate {ph['generate_s']:.2f}, train {ph['train_s']:.2f})")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_gtpo.models.qwen import ModelShape

    name, hf_config = load_model(args.model)
    shape = ModelShape.from_hf(hf_config)
    layout, workload, settings = build_inputs(args, moe=shape.moe is not None)
    if args.disaggregated:
        if args.nodes is None or args.suggest:
            raise ValueError("--disaggregated splits the GPUs of --nodes (give it), and does not take --suggest")
        result = plan_disaggregated(shape, layout, workload, settings, nodes=args.nodes,
                                    max_staleness=args.max_staleness, server_tp=args.server_tp, model_name=name)
        print(json.dumps(result) if args.json else format_disaggregated(result))
        return 0
    if args.suggest:
        fitting = suggest_layouts(shape, layout.world_size, workload, settings)
        if not fitting:
            raise ValueError(f"no layout of {layout.world_size} GPUs fits {name}: use more nodes")
        best = fitting[0]
        result = plan(shape, best.layout, workload, best.settings, model_name=name).to_json()
        print(json.dumps(result) if args.json else format_table(result) + format_suggestions(fitting))
        return 0
    result = plan(shape, layout, workload, settings, model_name=name).to_json()
    print(json.dumps(result) if args.json else format_table(result))
    if not result["fits"] and args.json:
        print("plan: does not fit: " + "; ".join(result["reasons"]), file=sys.stderr)
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    run_cli("plan", main)
