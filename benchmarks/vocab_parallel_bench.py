"""Memory and time of vocab-parallel log-prob + entropy: ours against gathering the logits and against megatron-core.

    .venv/bin/python benchmarks/vocab_parallel_bench.py [--tokens 4096 --vocab 152064 --tp 1 2 --chunk-size 8]

For each TP size, TP ranks are spawned (gloo, megatron's model-parallel state initialised through
megatron_gtpo.distributed.initialize_parallel, which activates the CPU platform layer). Each rank holds its fp32
logits shard [T, V/TP] and runs, interleaved, `--repeats` times each:

  ours_chunked     vocab_parallel_logprobs_and_entropy(chunk_size=--chunk-size)
  ours_unchunked   vocab_parallel_logprobs_and_entropy(chunk_size=None)
  gather_full      (a) all_gather the shards on the vocab dim, then torch.log_softmax / exp for log-prob + entropy
  megatron_plus_entropy
                   (b) megatron.core.tensor_parallel.vocab_parallel_cross_entropy plus a separate vocab-parallel
                   entropy pass (torch ops + megatron's reduce_from_tensor_model_parallel_region). megatron's op
                   overwrites its fp32 input in place, so it gets a copy of the logits, made inside the measurement:
                   the entropy pass needs the logits too (with bf16 logits megatron's own .float() makes the same
                   fp32 copy).
  megatron_ce_only reference row, no entropy: megatron's op alone on a copy made before the measurement.
  ours_top_k_top_p ours_chunked with top-k 20 / top-p 0.9 sampling (distributed/truncation.py): log-probs of the
                   truncated distribution, the kept sets from the all-gathered top-20 candidates of every rank
  ours_top_p       ours_chunked with top-p 0.9 alone: on these logits (Gaussian, std 4: nuclei of ~700 ids of 152k)
                   every token's nucleus is longer than the 64 candidates, so every token takes the fallback (radix
                   select): the worst case
  gather_full_top_p
                   (a) with top-p 0.9: gather the vocabulary, sort every row, mask, log_softmax (what gathering, or
                   NeMo-RL's all-to-all to full rows, computes)

Two phases: "forward" (no autograd: the old-log-prob pass) at --tokens, and "forward+backward" (loss = sum of
w1 * logprob + w2 * entropy, gradient w.r.t. the shard) at --train-tokens, smaller by default because (a) keeps
several full-vocabulary [T, V] fp32 buffers alive for backward on every rank.

Memory method: torch's CPU allocator keeps no statistics and tracemalloc does not see it, so each rank resets the
kernel's resident-set high-water mark (writing 5 to /proc/self/clear_refs, Linux >= 4.0), records VmRSS, runs the
method and reads VmHWM. "Extra" = VmHWM - VmRSS before the call: the peak memory the call needed beyond what was
already resident (the input shard and everything else). Before each reset, glibc's malloc_trim(0) returns freed
heap pages to the kernel (large buffers are mmap'ed and returned on free anyway), so memory a call reuses from an
earlier call's freed heap still counts as its own. Reported: the largest extra over ranks and repeats. Time: wall
clock per call, the slowest rank, min and median over repeats (the machine is shared: the min is the least
disturbed).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_gtpo.distributed import Truncation, free_local_port
from megatron_gtpo.distributed.vocab_parallel import vocab_parallel_logprobs_and_entropy

METHODS = ("ours_chunked", "ours_unchunked", "gather_full", "megatron_plus_entropy", "megatron_ce_only",
           "ours_top_k_top_p", "ours_top_p", "gather_full_top_p")
TRUNCATIONS = {"ours_top_k_top_p": Truncation(20, 0.9), "ours_top_p": Truncation(0, 0.9)}


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_rss_peak() -> None:
    # Hand freed heap memory back to the kernel first, so allocations served from it count as new resident memory.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _gather_full(logits_TV, targets_T, tp_group, tp_rank, tp_size, top_p=1.0):
    """(a): every rank gathers the whole vocabulary, then plain torch (with `top_p`: a sort-based nucleus mask)."""
    parts = [torch.empty_like(logits_TV) for _ in range(tp_size)]
    dist.all_gather(parts, logits_TV.detach().contiguous(), group=tp_group)
    parts[tp_rank] = logits_TV  # autograd reaches this rank's shard, as megatron's gather_from_tp_region does
    full_TV = torch.cat(parts, dim=-1)
    del parts
    if top_p < 1:
        with torch.no_grad():
            descending_TV, order_TV = torch.sort(full_TV, dim=-1, descending=True)
            probs_TV = torch.softmax(descending_TV, dim=-1)
            after_nucleus_TV = probs_TV.cumsum(-1) - probs_TV >= top_p  # the mass before them reaches top_p
            dropped_TV = torch.zeros_like(full_TV, dtype=torch.bool).scatter_(-1, order_TV, after_nucleus_TV)
            dropped_TV.scatter_(-1, targets_T.unsqueeze(-1), False)  # the target is always renormalised over
            del descending_TV, order_TV, probs_TV
        entropy_T = -(torch.softmax(full_TV, -1) * torch.log_softmax(full_TV, -1)).sum(-1)
        logp_TV = torch.log_softmax(full_TV.masked_fill(dropped_TV, -torch.inf), dim=-1)
        return logp_TV.gather(-1, targets_T.unsqueeze(-1)).squeeze(-1), entropy_T
    logp_TV = torch.log_softmax(full_TV, dim=-1)
    del full_TV
    logprobs_T = logp_TV.gather(-1, targets_T.unsqueeze(-1)).squeeze(-1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    return logprobs_T, entropy_T


def _megatron_entropy(logits_TV, tp_group):
    """The separate entropy pass of (b): H = m + log S - sum(e * z) / S with e = exp(z - m), m the global max
    (held constant: H does not depend on it), partial sums all-reduced with megatron's reduce_from_tp_region
    (forward all-reduce, backward identity)."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    with torch.no_grad():
        max_T = logits_TV.amax(dim=-1)
        dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=tp_group)
    exp_TV = torch.exp(logits_TV - max_T.unsqueeze(-1))
    sum_exp_T = reduce_from_tensor_model_parallel_region(exp_TV.sum(-1))
    sum_exp_z_T = reduce_from_tensor_model_parallel_region((exp_TV * logits_TV).sum(-1))
    return max_T + torch.log(sum_exp_T) - sum_exp_z_T / sum_exp_T


def _run_method(name, logits_TV, targets_T, tp_group, tp_rank, tp_size, chunk_size, megatron_input_TV):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if name == "ours_chunked":
        return vocab_parallel_logprobs_and_entropy(logits_TV, targets_T, tp_group=tp_group, chunk_size=chunk_size)
    if name == "ours_unchunked":
        return vocab_parallel_logprobs_and_entropy(logits_TV, targets_T, tp_group=tp_group)
    if name == "gather_full":
        return _gather_full(logits_TV, targets_T, tp_group, tp_rank, tp_size)
    if name == "megatron_plus_entropy":
        entropy_T = _megatron_entropy(logits_TV, tp_group)
        return -vocab_parallel_cross_entropy(logits_TV.clone(), targets_T), entropy_T
    if name == "megatron_ce_only":
        return -vocab_parallel_cross_entropy(megatron_input_TV, targets_T), None
    if name in TRUNCATIONS:
        return vocab_parallel_logprobs_and_entropy(logits_TV, targets_T, tp_group=tp_group, chunk_size=chunk_size,
                                                   truncation=TRUNCATIONS[name])
    if name == "gather_full_top_p":
        return _gather_full(logits_TV, targets_T, tp_group, tp_rank, tp_size, top_p=0.9)
    raise ValueError(f"unknown method {name!r}")


def _measure(name, logits_TV, targets_T, tp_group, tp_rank, tp_size, chunk_size, backward):
    weights_2T = torch.randn(2, logits_TV.shape[0], generator=torch.Generator().manual_seed(1)).to(logits_TV.device)
    # megatron_ce_only destroys its input: give it a copy made before the measurement starts.
    megatron_input_TV = logits_TV.detach().clone().requires_grad_(backward) if name == "megatron_ce_only" else None
    leaf_TV = logits_TV.detach().requires_grad_(backward)  # shares storage: no copy
    gc.collect()
    dist.barrier(group=tp_group)
    _reset_rss_peak()
    rss_before_kib = _proc_status_kib("VmRSS")
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        logprobs_T, entropy_T = _run_method(name, leaf_TV, targets_T, tp_group, tp_rank, tp_size, chunk_size,
                                            megatron_input_TV)
        if backward:
            loss = (weights_2T[0] * logprobs_T).sum()
            if entropy_T is not None:
                loss = loss + (weights_2T[1] * entropy_T).sum()
            wrt = megatron_input_TV if name == "megatron_ce_only" else leaf_TV
            grad_TV, = torch.autograd.grad(loss, wrt)
    seconds = time.perf_counter() - start
    extra_bytes = (_proc_status_kib("VmHWM") - rss_before_kib) * 1024
    outputs = (logprobs_T.detach(), None if entropy_T is None else entropy_T.detach(),
               grad_TV[:4, :64].clone() if backward and entropy_T is not None else None)
    return seconds, extra_bytes, outputs


def _rank_main(rank, tp_size, port, args, result_queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // tp_size))
    from megatron_gtpo.distributed import destroy_parallel, initialize_parallel

    groups = initialize_parallel(tensor_parallel=tp_size, backend="gloo")
    tp_group, tp_rank = groups.tp_group, groups.tp_rank
    vocab_local = args.vocab // tp_size
    results = {}
    for phase, num_tokens, backward in (("forward", args.tokens, False),
                                        ("forward+backward", args.train_tokens, True)):
        # The same global logits on every TP layout: each rank draws the whole matrix's rows for its shard only.
        gen = torch.Generator().manual_seed(1234 + tp_rank)
        # On the training device (the CPU platform's audit refuses host tensors in collectives on a non-gloo group,
        # as NCCL would).
        logits_TV = torch.randn(num_tokens, vocab_local, generator=gen).mul_(4.0).to(groups.device)
        targets_T = torch.randint(0, args.vocab, (num_tokens,), generator=torch.Generator().manual_seed(99)).to(
            groups.device)
        methods = [name for name in args.methods if name not in args.skip.get(phase, ())]
        for name in methods:  # warm-up on a few rows: lazy imports, thread pools, allocator
            _measure(name, logits_TV[:16], targets_T[:16], tp_group, tp_rank, tp_size, args.chunk_size, backward)
        times = {name: [] for name in methods}
        extras = {name: [] for name in methods}
        references = {}  # per distribution (full, top-k / top-p, top-p): the first method's outputs
        max_abs_diff = {}
        for _ in range(args.repeats):
            for name in methods:
                seconds, extra, outputs = _measure(name, logits_TV, targets_T, tp_group, tp_rank, tp_size,
                                                   args.chunk_size, backward)
                times[name].append(seconds)
                extras[name].append(extra)
                reference = references.setdefault(_DISTRIBUTION.get(name, "full"), outputs)
                diffs = [(a - b).abs().max().item() for a, b in zip(outputs, reference)
                         if a is not None and b is not None]
                max_abs_diff[name] = max([max_abs_diff.get(name, 0.0)] + diffs)
                del outputs
        results[phase] = dict(tokens=num_tokens, times=times, extras=extras, max_abs_diff=max_abs_diff,
                              shard_bytes=logits_TV.numel() * logits_TV.element_size())
        del logits_TV
    destroy_parallel()
    result_queue.put((rank, results))


# The log-probs each method gives: its row's "max abs diff" is against the first method of the same distribution.
_DISTRIBUTION = {"ours_top_k_top_p": "top-k 20, top-p 0.9", "ours_top_p": "top-p 0.9", "gather_full_top_p": "top-p 0.9"}
# Full-vocabulary fp32 [T, V] buffers that gather_full holds at its peak on every rank (gathered logits, log-probs,
# probabilities, their product; more for backward), to avoid pushing a shared machine into the OOM killer;
# gather_full_top_p's sort adds values, int64 indices, probabilities and masks.
_GATHER_FULL_BUFFERS = {"forward": 3, "forward+backward": 5}
_GATHER_FULL_TOP_P_BUFFERS = {"forward": 7, "forward+backward": 9}


def _memory_skips(args, tp_size):
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    skips = {}
    for phase, tokens in (("forward", args.tokens), ("forward+backward", args.train_tokens)):
        skips[phase] = {}
        for name, buffers in (("gather_full", _GATHER_FULL_BUFFERS), ("gather_full_top_p", _GATHER_FULL_TOP_P_BUFFERS)):
            need = tp_size * (buffers[phase] * tokens * args.vocab * 4 + tokens * args.vocab * 4 // tp_size)
            if name in args.methods and need * 1.2 > available:
                skips[phase][name] = (f"needs about {need / 2**30:.1f} GiB on this machine, "
                                      f"{available / 2**30:.1f} GiB available")
    return skips


def _run_tp(tp_size, args):
    ctx = mp.get_context("spawn")
    result_queue = ctx.SimpleQueue()
    port = free_local_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, tp_size, port, args, result_queue))
             for rank in range(tp_size)]
    for p in procs:
        p.start()
    per_rank = dict(result_queue.get() for _ in range(tp_size))
    for p in procs:
        p.join()
    return [per_rank[r] for r in range(tp_size)]


def _summarise(per_rank):
    """Slowest rank per repeat, then min/median over repeats; largest extra memory over ranks and repeats."""
    out = {}
    for phase in per_rank[0]:
        rows = {}
        for name in per_rank[0][phase]["times"]:
            slowest = [max(r[phase]["times"][name][i] for r in per_rank)
                       for i in range(len(per_rank[0][phase]["times"][name]))]
            rows[name] = dict(time_min_s=min(slowest), time_median_s=statistics.median(slowest),
                              extra_mib=max(max(r[phase]["extras"][name]) for r in per_rank) / 2**20,
                              max_abs_diff_vs_first=max(r[phase]["max_abs_diff"][name] for r in per_rank))
        out[phase] = dict(tokens=per_rank[0][phase]["tokens"],
                          shard_mib=per_rank[0][phase]["shard_bytes"] / 2**20, rows=rows)
    return out


def _markdown(summary_by_tp, args, command, started, finished):
    lines = [f"Command: `{command}`", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}, {args.threads or 'cores / TP'} thread(s) per rank, gloo. "
             f"Load average before / after: {started} / {finished}.", ""]
    for tp_size, summary in summary_by_tp.items():
        for phase, s in summary.items():
            lines += [f"### TP={tp_size}, {phase}, T={s['tokens']}, V={args.vocab} "
                      f"(fp32 shard {s['shard_mib']:.0f} MiB per rank)", "",
                      "| method | extra memory (MiB) | time min (s) | time median (s) | max abs diff vs first of its "
                      "distribution |",
                      "|---|---|---|---|---|"]
            for name, row in s["rows"].items():
                lines.append(f"| {name} | {row['extra_mib']:.1f} | {row['time_min_s']:.3f} | "
                             f"{row['time_median_s']:.3f} | {row['max_abs_diff_vs_first']:.2e} |")
            for name, reason in s["skipped"].items():
                lines.append(f"| {name} | skipped: {reason} | | | |")
            rows = s["rows"]
            if "ours_chunked" in rows:
                lines.append("")
                for other in ("gather_full", "megatron_plus_entropy", "megatron_ce_only", "ours_unchunked",
                              "ours_top_k_top_p", "ours_top_p", "gather_full_top_p"):
                    if other in rows:
                        lines.append(_ratio_line(rows, other, "ours_chunked"))
            if "ours_top_p" in rows and "gather_full_top_p" in rows:
                lines.append(_ratio_line(rows, "gather_full_top_p", "ours_top_p"))
            lines.append("")
    return "\n".join(lines)


def _ratio_line(rows, name, base):
    return (f"- {name} / {base}: extra memory {rows[name]['extra_mib'] / max(rows[base]['extra_mib'], 1e-9):.1f}x, "
            f"time {rows[name]['time_min_s'] / rows[base]['time_min_s']:.2f}x "
            f"(medians {rows[name]['time_median_s'] / rows[base]['time_median_s']:.2f}x)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--train-tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunk-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="per rank; 0 means cores // TP")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args(argv)
    command = "python benchmarks/vocab_parallel_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = os.getloadavg()
    summary_by_tp = {}
    for tp_size in args.tp:
        if args.vocab % tp_size:
            raise ValueError(f"--vocab {args.vocab} is not divisible by TP={tp_size}")
        args.skip = _memory_skips(args, tp_size)
        summary = _summarise(_run_tp(tp_size, args))
        for phase, skipped in args.skip.items():
            summary[phase]["skipped"] = skipped
        summary_by_tp[tp_size] = summary
        print(json.dumps({tp_size: summary_by_tp[tp_size]}, indent=1), flush=True)
    finished = os.getloadavg()
    fmt = lambda load: ", ".join(f"{x:.1f}" for x in load)  # noqa: E731
    print(_markdown(summary_by_tp, args, command, fmt(started), fmt(finished)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary_by_tp, f, indent=1)


if __name__ == "__main__":
    main()
