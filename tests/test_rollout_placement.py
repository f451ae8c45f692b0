"""Where a replica's rollout engines run and which prompts each serves (rollout/placement.py): pure arithmetic on
ranks and lists, checked against hand-written layouts; no GPU needed. Then the engine group logic
(server_engine.ServerEngine) on 2-4 gloo ranks with stand-in servers: the prompt split across hosts, responses
reassembled in prompt order on every rank with the longest host's generation seconds, with routing replay each
rank's layers of the routing the hosts report, and the memory release before a colocated engine wakes."""
from types import SimpleNamespace

import pytest
import torch

from distributed_harness import run_distributed
from megatron_gtpo.rollout.placement import (colocated_cuda_devices, engine_hosts, engine_members, split_counts,
                                             split_prompts)


def engine_ranks(*, tp: int, pp: int, dp: int, engine_tp: int) -> list[list[int]]:
    """Global ranks whose GPUs each engine of the job uses, host first: replica-major, then engine order. The global
    rank of (tp_rank, dp_rank, pp_rank) is tp_rank + tp (dp_rank + dp pp_rank) (megatron's order tp-cp-ep-dp-pp)."""
    return [[t + tp * (replica + dp * s) for s, t in members]
            for replica in range(dp) for members in engine_members(tp=tp, pp=pp, engine_tp=engine_tp)]


def test_tp8_pp2_dp2_on_32_gpus_every_gpu_in_one_engine():
    # megatron's rank order tp-cp-ep-dp-pp: stage s of replica d holds ranks 8 (d + 2 s) .. + 7.
    assert engine_hosts(tp=8, pp=2, engine_tp=8) == [(0, 0), (1, 0)]
    engines = engine_ranks(tp=8, pp=2, dp=2, engine_tp=8)
    assert engines == [list(range(0, 8)), list(range(16, 24)),  # replica 0: stage 0, stage 1
                       list(range(8, 16)), list(range(24, 32))]  # replica 1
    # At vLLM TP=4: two engines per stage, eight in all, still covering every GPU once.
    engines4 = engine_ranks(tp=8, pp=2, dp=2, engine_tp=4)
    assert engines4[:4] == [[0, 1, 2, 3], [4, 5, 6, 7], [16, 17, 18, 19], [20, 21, 22, 23]]
    assert sorted(r for e in engines4 for r in e) == list(range(32))


@pytest.mark.parametrize("tp,pp,dp,engine_tp,expected", [
    (2, 2, 1, 2, [[0, 1], [2, 3]]),  # one engine per stage
    (2, 2, 1, 4, [[0, 1, 2, 3]]),  # one engine over both stages (the GPUs are consecutive at DP=1)
    (2, 2, 1, 1, [[0], [1], [2], [3]]),
    (1, 1, 4, 1, [[0], [1], [2], [3]]),  # pure data parallelism: an engine per GPU
    (1, 4, 1, 2, [[0, 1], [2, 3]]),  # two stages per engine
])
def test_small_layouts(tp, pp, dp, engine_tp, expected):
    assert engine_ranks(tp=tp, pp=pp, dp=dp, engine_tp=engine_tp) == expected


@pytest.mark.parametrize("tp,pp,engine_tp", [(4, 2, 3), (2, 3, 4), (2, 2, 8)])
def test_engines_that_fit_no_layout_are_refused(tp, pp, engine_tp):
    with pytest.raises(ValueError, match=f"tensor parallel size {engine_tp} must divide"):
        engine_hosts(tp=tp, pp=pp, engine_tp=engine_tp)


@pytest.mark.parametrize("num_prompts,engines,counts", [(10, 4, [3, 3, 2, 2]), (8, 2, [4, 4]), (1, 3, [1, 0, 0]),
                                                         (0, 2, [0, 0])])
def test_prompt_split_is_contiguous_and_even(num_prompts, engines, counts):
    prompts = [[i] for i in range(num_prompts)]
    assert split_counts(num_prompts, engines) == counts
    parts = split_prompts(prompts, engines)
    assert [len(p) for p in parts] == counts
    assert [p for part in parts for p in part] == prompts


def test_each_engine_gets_its_own_gpus():
    # 8 GPUs, training TP=4 x DP=2 (hosts on GPUs 0 and 4), vLLM TP=4.
    assert colocated_cuda_devices(device_index=0, device_count=8, engine_tp=4, tp=4, dp=2, visible=None) == "0,1,2,3"
    assert colocated_cuda_devices(device_index=4, device_count=8, engine_tp=4, tp=4, dp=2, visible=None) == "4,5,6,7"
    # A scheduler's own CUDA_VISIBLE_DEVICES: indices are positions in it, the result names the same devices.
    assert colocated_cuda_devices(device_index=2, device_count=4, engine_tp=2, tp=2, dp=1,
                                  visible="3, 5,6,7") == "6,7"


@pytest.mark.parametrize("kwargs,message", [
    (dict(device_index=0, device_count=8, engine_tp=8, tp=4, dp=2), "spans pipeline stages"),
    (dict(device_index=6, device_count=8, engine_tp=4, tp=4, dp=1), "from GPU 6 needs more than the 8 GPUs"),
])
def test_engines_that_do_not_fit_their_gpus_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        colocated_cuda_devices(visible=None, **kwargs)


class _EchoServer:
    """A stand-in engine: each prompt's response repeats its ids, tagged with the serving host (the last token is
    the host's index). Each call takes 0.5 s and records when it ran, so that the test can see the engines generate
    at the same time rather than one after the other; it says it generated for `_seconds(index)` s."""

    def __init__(self, index):
        self.index = index
        self.calls = []
        self.intervals = []

    def submit(self, prompts, params, *, first_prompt=0, between_steps=None):
        """Each prompt's response, and for its P + R - 1 fed positions at every layer the experts `_experts` names
        (a routing server's rollout, vllm_engine.VLLMServer.submit)."""
        import time

        from megatron_gtpo.rollout.engine import Rollout
        from megatron_gtpo.rollout.responses import Response, Responses

        self.calls.append((len(prompts), first_prompt))
        start = time.time()
        time.sleep(0.5)
        self.intervals.append((start, time.time()))
        rollout = Rollout(Responses.from_lists([[Response(list(p) + [self.index], [-0.5] * (len(p) + 1), "length")]
                                                for p in prompts]),
                          [_experts(first_prompt + i, 2 * len(p), range(1, 4))  # P + R - 1, R = P + 1
                           for i, p in enumerate(prompts)], _seconds(self.index))
        return lambda: rollout


def _seconds(host_index: int) -> float:
    """The generation seconds host `host_index`'s stand-in reports: a later host's longer."""
    return 0.25 * (host_index + 1)


def _experts(prompt_index, rows, layers):
    """Hand-made routing of a response of prompt `prompt_index`: int16 [rows, layers, 2], a different expert per
    prompt, position, layer (1-based) and slot."""
    import torch

    r, m, j = torch.meshgrid(torch.arange(rows), torch.tensor(list(layers)), torch.arange(2), indexing="ij")
    return ((prompt_index + 2 * r + 3 * m + j) % 8).to(torch.int16)


LAYOUTS = [(2, 2, 1, 7), (2, 2, 2, 5), (2, 2, 4, 3), (4, 1, 2, 1)]  # (tp, pp, engine_tp, prompts) on 4 ranks


def _split_across_hosts(rank, world_size):
    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.rollout import server_engine
    from megatron_gtpo.rollout.engine import SamplingParams
    from megatron_gtpo.rollout.server_engine import ServerEngine

    server_engine._ROUTING_SLICE_BYTES = 5 * 3 * 2 * 2  # the routing crosses in slices of 5 positions
    out = []
    for tp, pp, engine_tp, num_prompts in LAYOUTS:
        groups = initialize_parallel(tp, pp)
        hosts = engine_hosts(tp=tp, pp=pp, engine_tp=engine_tp)
        me = (groups.pp_rank, groups.tp_rank)
        server = _EchoServer(hosts.index(me)) if me in hosts else None
        layers = (1,) if groups.pp_rank == 0 else (2, 3)  # this stage's MoE layers
        engine = ServerEngine(server, groups, SimpleNamespace(vocab_size=100, max_position_embeddings=64,
                                                              num_layers=3, moe=SimpleNamespace(topk=2)),
                              hosts=hosts, routed_layers=layers)
        responses = engine.generate([[i, i + 1] for i in range(num_prompts)], SamplingParams(max_new_tokens=1))
        out.append((responses.token_id_lists(), None if server is None else server.calls[:],
                    None if server is None else server.intervals[:]))
        # Routing replay: prompts of 1 to 3 tokens; each rank keeps its own layers of each response, on the host.
        prompts = [[i] * (1 + i % 3) for i in range(num_prompts)]
        rollout = engine.submit(prompts, SamplingParams(max_new_tokens=1))()
        routed_record, routes = rollout.responses, rollout.routed_experts
        assert routed_record.token_id_lists()[0][:-1] == prompts[0]
        for i, (prompt, experts) in enumerate(zip(prompts, routes)):
            assert experts.device.type == "cpu"
            assert torch.equal(experts, _experts(i, 2 * len(prompt), layers)), (tp, pp, engine_tp, i)
        assert len(routes) == num_prompts
        out[-1] += (rollout.generation_s,)
    return out


def test_prompts_are_split_across_hosts_and_come_back_in_order():
    per_rank = run_distributed(_split_across_hosts, 4, timeout_s=180)
    for (tp, pp, engine_tp, num_prompts), results in zip(LAYOUTS, zip(*per_rank)):
        counts = split_counts(num_prompts, len(engine_hosts(tp=tp, pp=pp, engine_tp=engine_tp)))
        serving = [i for i, c in enumerate(counts) for _ in range(c)]
        expected = [[i, i + 1, engine] for i, engine in enumerate(serving)]
        for tokens, _, _, _ in results:  # every rank holds every response, in prompt order, from the engine that served
            assert tokens == expected, (tp, pp, engine_tp)
        # Every rank's rollout took the longest generation seconds of the hosts that served (hosts without prompts
        # generate nothing).
        busiest = max(_seconds(i) for i, c in enumerate(counts) if c)
        assert [seconds for *_, seconds in results] == [busiest] * len(results), (tp, pp, engine_tp)
        # Each host served its contiguous part once, told where it starts (seeds); empty parts call nothing.
        starts = [sum(counts[:i]) for i in range(len(counts))]
        calls = [c for _, c, _, _ in results if c is not None]
        assert sorted(calls) == sorted([[(c, s)] if c else [] for c, s in zip(counts, starts)]), (tp, pp, engine_tp)
        # The engines generated at the same time: every call began before any ended.
        intervals = [i for _, _, ivs, _ in results if ivs for i in ivs]
        assert max(start for start, _ in intervals) < min(end for _, end in intervals), (tp, pp, engine_tp)


def _release_before_wake(rank, world_size):
    import time

    import torch

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.rollout.engine import Rollout, SamplingParams
    from megatron_gtpo.rollout.responses import Response, Responses
    from megatron_gtpo.rollout.server_engine import ServerEngine

    groups = initialize_parallel(2, 1)
    events = []
    torch.cuda.empty_cache = lambda: events.append(("empty_cache", time.monotonic()))

    class Server:  # the colocated vLLM server as ServerEngine sees it: waking happens inside submit
        def submit(self, prompts, params, *, first_prompt=0, between_steps=None):
            events.append(("wake", time.monotonic()))
            rollout = Rollout(Responses.from_lists([[Response([1], [-0.5], "length")] for _ in prompts]))
            return lambda: rollout

    engine = ServerEngine(Server() if groups.tp_rank == 0 else None, groups,
                          SimpleNamespace(vocab_size=100, max_position_embeddings=64))
    if rank == 1:
        time.sleep(1.0)  # the rank that is late to release must still release before the engine wakes
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    return events


@pytest.mark.slow
def test_every_rank_releases_cached_memory_before_the_engine_wakes():
    """A colocated engine's KV cache and weights wake on every GPU of the model replica: each rank's caching
    allocator must have given its cached blocks back first (torch.cuda.empty_cache on all ranks, then the wake)."""
    destination, other = run_distributed(_release_before_wake, 2, timeout_s=120)
    wake = [t for name, t in destination if name == "wake"]
    releases = [t for events in (destination, other) for name, t in events if name == "empty_cache"]
    assert len(wake) == 1 and len(releases) == 2
    assert max(releases) < wake[0]


def _start_engines(rank, world_size, fail_on_rank):
    import time

    import torch
    import torch.distributed as dist

    from megatron_gtpo.distributed import initialize_parallel
    from megatron_gtpo.rollout.server_engine import start_colocated_servers

    parallel = initialize_parallel(2, 1)  # 2 replicas of TP=2; an engine at vLLM TP=2 on each TP rank 0
    events = []
    torch.cuda.empty_cache = lambda: events.append(("empty_cache", time.monotonic()))
    all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        events.append(("collective", time.monotonic(), tuple(dist.get_process_group_ranks(group or dist.group.WORLD))))
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = recording_all_reduce

    def start_server():
        events.append(("start", time.monotonic()))
        if rank == fail_on_rank:
            raise RuntimeError("out of memory while profiling")
        time.sleep(1.0)  # vLLM profiles the free memory meanwhile
        events.append(("up", time.monotonic()))
        return "server"

    try:
        server = start_colocated_servers(parallel, [(0, 0)], start_server)
    except RuntimeError as e:
        return str(e)
    torch.cuda.empty_cache()  # what the first weight sync does next
    groups = [tuple(dist.get_process_group_ranks(g)) for g in (parallel.tp_group, parallel.dp_group,
                                                                   parallel.pp_group, parallel.mp_group)]
    return server, events, groups


def test_colocated_engines_start_on_released_memory_with_warm_groups_and_all_ranks_wait_for_them():
    """Before any engine starts, every rank has emptied its cache and run a collective on each of its process groups
    (NCCL makes a communicator at a group's first collective); no rank frees memory again until every engine is up."""
    per_rank = run_distributed(_start_engines, 4, args=(None,), timeout_s=120)
    assert [server for server, _, _ in per_rank] == ["server", None, "server", None]
    starts = [t for _, events, _ in per_rank for name, t, *_ in events if name == "start"]
    ups = [t for _, events, _ in per_rank for name, t, *_ in events if name == "up"]
    assert len(starts) == len(ups) == 2
    for _, events, groups in per_rank:
        releases = [t for name, t, *_ in events if name == "empty_cache"]
        warmed = {event[2] for event in events if event[0] == "collective" and event[1] < min(starts)}
        assert len(releases) == 2 and releases[0] < min(starts) and releases[1] > max(ups)
        assert set(groups) <= warmed and (0, 1, 2, 3) in warmed


def test_an_engine_that_fails_to_start_fails_every_rank():
    errors = run_distributed(_start_engines, 4, args=(2,), timeout_s=120)
    assert all(e == "1 rollout engine(s) failed to start: rank 2: RuntimeError: out of memory while profiling"
               for e in errors), errors
