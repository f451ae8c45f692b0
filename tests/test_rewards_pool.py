"""RewardPool: pluggable reward functions in worker processes, per-item time limits, errors, thread safety."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from megatron_gtpo.rewards import RewardPool, math_reward, verify_math_answer

TIMEOUT_S = 1.0
KILL_GRACE_S = 0.5
# Start-up, pipes and process replacement on a loaded 2-core machine; a missing time limit would take minutes.
SLACK_S = 3.0


def exact_match_reward(response: str, reference: str) -> float:
    return 1.0 if response.strip() == reference.strip() else 0.0


def reward_ignoring_alarms(response: str, reference: str) -> float:
    """Blocks SIGALRM, so only the parent's hard deadline (kill) can stop it, when the response says 'hang'."""
    if response == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(600)
    return exact_match_reward(response, reference)


def reward_raising_on_boom(response: str, reference: str) -> float:
    if response == "boom":
        raise KeyError("boom in the reward")
    return exact_match_reward(response, reference)


def test_pluggable_reward_function_scores_in_order():
    responses = [f"r{i % 7}" for i in range(50)]
    references = [f"r{i % 5}" for i in range(50)]
    expected = [1.0 if i % 7 == i % 5 else 0.0 for i in range(50)]
    with RewardPool(exact_match_reward, num_workers=2, chunk_size=3) as reward_pool:
        assert reward_pool.rewards(responses, references) == expected
        assert reward_pool.rewards([], []) == []
        assert reward_pool.stats.num_rewarded == 50


def test_pathological_expression_times_out_to_zero_within_the_limit():
    responses = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{4}", "\\boxed{10^{10^{8}}}", "\\boxed{\\frac{1}{2}}"]
    references = ["5", "4", "1", "0.5"]
    with RewardPool(verify_math_answer, num_workers=2, timeout_s=TIMEOUT_S, kill_grace_s=KILL_GRACE_S) as reward_pool:
        started = time.monotonic()
        rewards = reward_pool.rewards(responses, references)
        elapsed_s = time.monotonic() - started
        assert rewards == [0.0, 1.0, 0.0, 1.0]
        assert reward_pool.stats.num_soft_timeouts + reward_pool.stats.num_killed == 2
    # The two slow items run on different workers at the same time: one limit, not two, plus slack.
    assert elapsed_s < TIMEOUT_S + KILL_GRACE_S + SLACK_S, elapsed_s


@pytest.mark.slow
def test_worker_that_ignores_its_timer_is_killed_and_the_rest_of_its_chunk_still_scored():
    with RewardPool(reward_ignoring_alarms, num_workers=1, chunk_size=5, timeout_s=TIMEOUT_S,
                      kill_grace_s=KILL_GRACE_S) as reward_pool:
        started = time.monotonic()
        assert reward_pool.rewards(["a", "b", "hang"], ["a", "x", "hang"]) == [1.0, 0.0, 0.0]
        elapsed_s = time.monotonic() - started
        assert reward_pool.stats.num_killed == 1 and reward_pool.stats.num_soft_timeouts == 0
        # items after the hung one go back to the queue and are scored by the replacement worker
        rewards = reward_pool.rewards(["a", "hang", "b", "c", "d"], ["a", "hang", "x", "c", "d"])
        assert rewards == [1.0, 0.0, 0.0, 1.0, 1.0]
        assert reward_pool.stats.num_killed == 2
    assert elapsed_s < TIMEOUT_S + KILL_GRACE_S + SLACK_S, elapsed_s


def test_reward_function_error_raises_with_traceback_and_pool_stays_usable():
    with RewardPool(reward_raising_on_boom, num_workers=2, chunk_size=2) as reward_pool:
        with pytest.raises(RuntimeError, match="KeyError: 'boom in the reward'"):
            reward_pool.rewards(["a", "b", "boom", "c", "d", "e"], ["a"] * 6)
        assert reward_pool.rewards(["a", "b", "c"], ["a", "b", "x"]) == [1.0, 1.0, 0.0]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="reward_fn must be picklable"):
        RewardPool(lambda response, reference: 0.0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(exact_match_reward, num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(exact_match_reward, timeout_s=0)
    with RewardPool(exact_match_reward) as reward_pool:
        with pytest.raises(ValueError, match="same length"):
            reward_pool.rewards(["a"], [])
        with pytest.raises(ValueError, match=r"responses\[1\] must be a str"):
            reward_pool.rewards(["a", 3], ["a", "b"])
    with pytest.raises(RuntimeError, match="closed"):
        reward_pool.rewards(["a"], ["a"])


def test_math_reward_is_safe_from_threads():
    cases = [("\\boxed{%d}" % (i % 4), str(i % 3)) for i in range(12)]
    expected = [1.0 if i % 4 == i % 3 else 0.0 for i in range(12)]
    results = [None] * len(cases)

    def score(index: int) -> None:
        results[index] = math_reward(*cases[index])

    threads = [threading.Thread(target=score, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected
    assert math_reward("Answer: 1,000", "1000") == 1.0
