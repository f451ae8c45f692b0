"""The arithmetic-target task (data/arithmetic_target.py): the verifier on hand cases, the solution count against an
independent search over expression trees, the generated problems (several solutions, none one step away, held-out
digits never trained on), the warm start's demonstrations, the tokenizer round trip and the task registry."""
import itertools

import pytest

from megatron_gtpo.data import arithmetic_target as task
from megatron_gtpo.data.synthetic import BOS_ID, EOS_ID
from megatron_gtpo.data.synthetic_tasks import SYNTHETIC_TASKS

PROBLEM = "3 1 9 8:70="


@pytest.mark.parametrize("response,expected", [
    ("3-1=2,9*8=72,72-2=70</s>", 1.0),
    ("8*9=72,72-3=69,69+1=70</s>", 1.0),
    ("8*9=72,72-3=69;9*8=72,3-1=2,72-2=70</s>", 1.0),  # a failed attempt, then a correct one
    ("3-1=2,9*8=72,72-2=70;8*9=72</s>", 0.0),  # only the last attempt counts
    ("3-1=2,9*8=72,72-2=70", 0.0),  # no EOS: cut off at the length limit
    ("3-1=2,9*8=72,72-2=71</s>", 0.0),  # a wrong result
    ("1-3=2,9*8=72,72-2=70</s>", 0.0),  # subtraction below zero
    ("9+1=10,8-1=7,10*7=70</s>", 0.0),  # the 1 used twice
    ("9*8=72,72-2=70</s>", 0.0),  # 2 is not available
    ("3-1=02,9*8=72,72-02=70</s>", 0.0),  # leading zeros
    ("3-1=2, 9*8=72,72-2=70</s>", 0.0),  # not a step
    ("</s>", 0.0),
])
def test_reward_reads_the_last_attempt_on_hand_cases(response, expected):
    assert task.reward(response, PROBLEM) == expected


def _brute_force_values(digits):
    """value -> set of canonical step texts, by an independent search: every sequence of steps over the multiset,
    commutative steps written with x >= y, counted as distinct texts."""
    out = {}

    def search(pool, steps):
        for i, j in itertools.permutations(range(len(pool)), 2):
            x, y = pool[i], pool[j]
            rest = [n for k, n in enumerate(pool) if k not in (i, j)]
            for op, z in (("+", x + y), ("-", x - y), ("*", x * y)):
                if x < y or (op == "-" and z < 0):
                    continue
                text = steps + [f"{x}{op}{y}={z}"]
                out.setdefault(z, set()).add(",".join(text))
                search(rest + [z], text)

    search(list(digits), [])
    return out


@pytest.mark.parametrize("digits", [(3, 1, 9, 8), (4, 4, 3, 4), (1, 1, 1, 1), (9, 9, 2, 5)])
def test_solution_count_matches_an_independent_search(digits):
    values = _brute_force_values(digits)
    for target in range(0, 200):
        assert task.count_solutions(digits, target) == len(values.get(target, ())), target
        for text in values.get(target, ()):  # every found sequence passes the verifier
            prompt = " ".join(map(str, digits)) + f":{target}="
            assert task.reward(text + "</s>", prompt) == 1.0


@pytest.mark.slow  # over 1.5 s of CPU: the whole task enumerated (make test runs it)
def test_problems_have_several_solutions_none_one_step_away_and_disjoint_held_out_digits():
    train, heldout = task.train_problems(), task.heldout_problems()
    assert len(heldout) == task.NUM_HELDOUT and len(train) > 5000
    parsed = {split: [task.parse_prompt(s.answer) for s in samples]
              for split, samples in (("train", train), ("heldout", heldout))}
    assert {tuple(sorted(d)) for d, _ in parsed["train"]}.isdisjoint({tuple(sorted(d)) for d, _ in parsed["heldout"]})
    assert len({tuple(sorted(d)) for d, _ in parsed["heldout"]}) == task.NUM_HELDOUT // task.HELDOUT_PER_DIGITS
    for digits, target in parsed["heldout"] + parsed["train"][:200]:
        values = _brute_force_values(digits)
        assert 10 <= target <= 99 and len(values[target]) >= task.MIN_SOLUTIONS
        one_step = {z for z, texts in values.items() if any("," not in t for t in texts)}
        assert target not in one_step
    assert train[0].prompt_token_ids == (BOS_ID, *task.tokenizer().encode(train[0].answer))
    assert task.train_problems() == train  # seeded: the same problems every time


@pytest.mark.slow  # over 1.5 s of CPU: the whole task enumerated (make test runs it)
def test_demonstrations_are_correct_and_some_try_again():
    tok = task.tokenizer()
    samples = task.train_problems()[:300]
    texts = [tok.decode(task.demonstration(s)) for s in samples]
    assert all(task.demonstration(s)[-1] == EOS_ID for s in samples)
    assert all(task.reward(text, s.answer) == 1.0 for text, s in zip(texts, samples))
    for text, sample in zip(texts, samples):  # index % 4 failed attempts, each a valid sequence missing the target
        digits, target = task.parse_prompt(sample.answer)
        *failed, _ = text[:-len("</s>")].split(";")
        assert len(failed) == sample.index % (task.MAX_FAILED_ATTEMPTS + 1)
        for attempt in failed:
            reached = int(attempt.rsplit("=", 1)[1])
            assert reached != target and "," in attempt and task.score_attempt(digits, attempt, reached)
    assert max(len(task.demonstration(s)) + len(s.prompt_token_ids)
               for s in task.train_problems()) <= task.tiny_model_hf_config()["max_position_embeddings"]


def test_the_task_is_registered_with_its_tiny_model():
    entry = SYNTHETIC_TASKS["arithmetic_target"]
    assert entry.reward is task.reward and entry.heldout_problems is task.heldout_problems
    config = entry.tiny_model_hf_config()
    assert config["vocab_size"] == task.VOCAB_SIZE >= 3 + len(task.SYMBOLS)
    assert config["max_position_embeddings"] == 128
    assert task.tokenizer().decode(task.tokenizer().encode("9*8=72;1+2=3")) == "9*8=72;1+2=3"
