"""Dynamic sampling's further rounds asked for ahead (rollout.schedule.rounds_ahead, RolloutQueue) over a scripted
engine: the fixed schedule of what is asked (prompts, seeds, versions), which rounds a step takes from the buffer and
which on the spot, the rounds dropped as too old, the metrics, and a queue restored from a checkpoint's state going on
as the uninterrupted one."""
import torch
import torch.distributed as dist

from distributed_harness import run_distributed
from hand_built import scripted_queue
from megatron_gtpo.rollout.engine import Rollout
from megatron_gtpo.rollout.responses import Response, Responses
from megatron_gtpo.training.experience import GroupSelection
from megatron_gtpo.training.metrics import PhaseTimer
from megatron_gtpo.training.partial_rollouts import WholeResponses

# Draws whose prompt gets one correct and one wrong response (informative); every other prompt gets two wrong ones.
INFORMATIVE = {3, 4, 8, 9}
STATS = ("sampling_rounds", "rounds_served_ahead", "rounds_on_the_spot", "groups_asked_ahead", "groups_dropped_stale",
         "groups_generated", "tokens_generated")


def _seconds(seed: int) -> float:
    """The generation seconds of the engine answer asked with `seed` (sums of them are exact)."""
    return 0.5 + seed / 8


def _queue(dp_group, *, first_draw: int = 0, when_idle: bool = False):
    """Staleness 1, 2 rounds ahead, 4 steps of one group each, at most 2 further rounds a step, one prompt a draw; an
    answer took `_seconds(its seed)`."""
    def answer(rows, params):
        return Rollout(Responses.from_lists([
            [Response([1], [-0.1], "stop"), Response([0, 0], [-0.2, -0.3], "stop")] if row[0] - 1000 in INFORMATIVE
            else [Response([0], [-0.1], "stop"), Response([0, 0], [-0.2, -0.3], "stop")] for row in rows]),
            generation_s=_seconds(params.seed))

    def reward(prompts, responses):  # a one-token response starting with 1 is correct
        first = [ids[:1] == [1] for ids in responses.token_id_lists()]
        return torch.tensor(first, dtype=torch.float32).view(len(prompts), 2)

    return scripted_queue(answer, WholeResponses(), max_staleness=1, steps=4, group_size=2,
                          selection=GroupSelection(1, True, 2, None), reward=reward, dp_group=dp_group,
                          rounds_ahead=2, first_draw=first_draw, when_idle=when_idle)


def _step(queue, step, stats=STATS):
    exp = queue.experience(step, PhaseTimer())
    return ([p.id for p in exp.kept.groups.prompts], exp.kept.groups.start_versions_R.tolist(),
            {k: exp.stats[k] for k in stats})


def test_further_rounds_are_asked_ahead_on_a_fixed_schedule_and_served_oldest_first(world_of_one):
    """Draws (prompt p<i>): step 0 takes batch p0, asks batch 1 (p1), generates rounds p2, p3 on the spot and then
    asks p4, p5 ahead (version 0, seeds of its rounds 3, 4). Step 1 takes p1, asks batch 2 (p6), serves its round from
    p4 (version 0: one version old, within the bound), leaves p5, asks p7, p8 (version 1). Step 2 takes p6, asks batch
    3 (p9), drops p5 (two versions old), serves p7, p8, asks p10, p11. Step 3 takes p9; the run's last step asks
    nothing."""
    queue = _queue(world_of_one)
    steps = [_step(queue, step, (*STATS, "rollout_busy_s")) for step in range(4)]
    # A step's busy seconds are those of the answers it waited for (by seed): its batch, its rounds on the spot and
    # served from ahead, and the round it dropped as too old (step 2: p5, seed 4).
    busy = [sum(map(_seconds, seeds)) for seeds in [(0, 1, 2), (10, 3), (20, 4, 13, 14), (30,)]]
    assert [stats.pop("rollout_busy_s") for _, _, stats in steps] == busy
    assert [kept for kept, _, _ in steps] == [["p3"], ["p4"], ["p8"], ["p9"]]
    assert [versions for _, versions, _ in steps] == [[0, 0], [0, 0], [1, 1], [2, 2]]
    assert [stats for _, _, stats in steps] == [
        {"sampling_rounds": 3, "rounds_served_ahead": 0, "rounds_on_the_spot": 2, "groups_asked_ahead": 2,
         "groups_dropped_stale": 0, "groups_generated": 3, "tokens_generated": 9},
        {"sampling_rounds": 2, "rounds_served_ahead": 1, "rounds_on_the_spot": 0, "groups_asked_ahead": 3,
         "groups_dropped_stale": 0, "groups_generated": 2, "tokens_generated": 6},
        {"sampling_rounds": 3, "rounds_served_ahead": 2, "rounds_on_the_spot": 0, "groups_asked_ahead": 2,
         "groups_dropped_stale": 1, "groups_generated": 3, "tokens_generated": 12},
        {"sampling_rounds": 1, "rounds_served_ahead": 0, "rounds_on_the_spot": 0, "groups_asked_ahead": 2,
         "groups_dropped_stale": 0, "groups_generated": 1, "tokens_generated": 3}]
    # Seeds in the order asked: round r of step k is 10 k + r; rounds asked ahead after step k are its rounds 3, 4.
    assert [params.seed for params in queue.source.engine.asked] == [0, 10, 1, 2, 3, 4, 20, 13, 14, 30, 23, 24]


def test_a_queue_restored_after_a_step_goes_on_as_the_uninterrupted_one(world_of_one):
    """The checkpoint state after step 1 holds the round p5 left from step 0 and p7, p8 asked after step 1: a queue
    restored from it (its loader at draw 9, as the checkpointed loader) gives steps 2 and 3 the same experience and
    asks the engine the same rounds."""
    whole = _queue(world_of_one)
    for step in range(2):
        _step(whole, step)
    restored = _queue(world_of_one, first_draw=9)
    restored.load_state_dict(whole.state_dict())
    assert [[p.id for p in asked.prompts] for asked in restored.ahead] == [["p5"], ["p7"], ["p8"]]
    with_busy = (*STATS, "rollout_busy_s")  # the seconds of a round held in the checkpoint count when served
    assert [_step(restored, step, with_busy) for step in (2, 3)] == [_step(whole, step, with_busy) for step in (2, 3)]
    assert [p.seed for p in restored.source.engine.asked] == [p.seed for p in whole.source.engine.asked[9:]]


def _idle_step(queue, step, idle_answers):
    """Step `step` as the trainer runs it under rollout.schedule.ahead_schedule when_idle: its experience (which polls
    the servers after its rounds), then its phases on a timer that polls the queue after each (`poll`: after the
    old-policy pass and after the update, not after the advantages or the sync); `idle_answers`: what the scripted
    servers say at the polls that ask them."""
    queue.source.engine.idle_answers = list(idle_answers)
    timer = PhaseTimer(after_phase=queue.poll(step))
    kept = _step(queue, step)
    for phase in ("old_logprob", "advantages", "update", "sync"):
        with timer(phase):
            pass
    assert not queue.source.engine.idle_answers, "a poll that should have asked the servers did not"
    return kept


def test_when_idle_rounds_are_asked_one_at_a_time_when_the_servers_are_idle(world_of_one):
    """rollout.schedule.ahead_schedule when_idle, 2 rounds ahead: step 0's servers are busy after its rounds, idle after
    its old-policy pass and its update: p4, p5 are asked there (seeds of its rounds 3, 4). Step 1 serves p4; p5 (version
    0) is too old for step 2, so it polls: busy, then idle (p7, seed 13), idle again (p8, seed 14). Step 2 drops p5,
    serves p7, p8; its first two polls find the servers idle (p10, p11), the third asks no server (two rounds held). The
    last step asks nothing and polls nothing."""
    queue = _queue(world_of_one, when_idle=True)
    answers = [[False, True, True], [False, True, True], [True, True], []]
    steps = [_idle_step(queue, step, idle) for step, idle in enumerate(answers)]
    assert [kept for kept, _, _ in steps] == [["p3"], ["p4"], ["p8"], ["p9"]]
    assert [stats["rounds_served_ahead"] for _, _, stats in steps] == [0, 1, 2, 0]
    assert [params.seed for params in queue.source.engine.asked] == [0, 10, 1, 2, 3, 4, 20, 13, 14, 30, 23, 24]


def test_the_fixed_schedule_never_polls_the_servers(world_of_one):
    """Without when_idle, a poll (`poll`) neither asks the servers (an empty script would raise) nor asks a round, also
    where fewer rounds than rollout.schedule.rounds_ahead are held (before the first step's)."""
    queue = _queue(world_of_one)
    timer = PhaseTimer(after_phase=queue.poll(0))
    for phase in ("old_logprob", "update"):
        with timer(phase):
            pass
    assert not queue.source.engine.asked and not queue.ahead


def test_the_servers_are_polled_after_the_old_policy_pass_and_the_update_only(world_of_one):
    """A step's phase timer polls the queue after every phase; the queue asks the servers after its rounds, its
    old-policy pass and its update, never after the advantages or the weight sync (whose weights are the next step's:
    a round asked there would be stamped with the wrong version)."""
    queue = _queue(world_of_one, when_idle=True)
    queue.source.engine.idle_answers = [False, False, False, True]  # the fourth would ask a round
    timer = PhaseTimer(after_phase=queue.poll(0))
    _step(queue, 0)
    for phase in ("old_logprob", "advantages", "update", "sync"):
        with timer(phase):
            pass
    assert queue.source.engine.idle_answers == [True] and not queue.ahead


def _two_replicas(rank, world_size):
    """Step 0 under when_idle on two data-parallel ranks: after the rounds both servers are busy; after the old-policy
    pass only rank 0's is idle; after the update both are. What each rank asked for ahead."""
    queue = _queue(dist.group.WORLD, when_idle=True)
    _idle_step(queue, 0, [False, rank == 0, True])
    return [p.id for asked in queue.ahead for p in asked.prompts]


def test_when_idle_asks_only_when_every_replicas_servers_are_idle():
    """The loaders of the data-parallel ranks draw together: a round is asked for ahead on every rank or on none,
    only once every rank's servers are idle (here after the update: one round each, p4)."""
    assert run_distributed(_two_replicas, world_size=2, timeout_s=120) == [["p4"], ["p4"]]
