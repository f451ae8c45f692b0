"""The scratchpad-addition task (data/scratchpad_addition.py) and the synthetic task registry: the reference
scratchpad against Python's integer addition, the outcome-only verifier on hand cases, the held-out split, the
tokenizer round trip."""
import random

from megatron_gtpo.data import scratchpad_addition as task
from megatron_gtpo.data.synthetic import BOS_ID, EOS_ID
from megatron_gtpo.data.synthetic_tasks import SYNTHETIC_TASKS


def test_scratchpad_hand_case_and_column_sums_against_integer_addition():
    assert task.scratchpad(374, 658) == "4+8+0=12,7+5+1=13,3+6+1=10:1032"
    assert task.scratchpad(100, 200) == "0+0+0=00,0+0+0=00,1+2+0=03:300"
    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        steps, answer = task.scratchpad(a, b).split(":")
        assert int(answer) == a + b
        # The columns' sum digits, lowest first, and the last carry spell a + b.
        sums = [step.split("=")[1] for step in steps.split(",")]
        assert int(sums[-1][0] + "".join(s[1] for s in reversed(sums))) == a + b
        for i, step in enumerate(steps.split(",")):  # each column adds the operands' i-th digits
            x, y, _carry = step.split("=")[0].split("+")
            assert (int(x), int(y)) == (a // 10**i % 10, b // 10**i % 10)


def test_reward_is_outcome_only_on_hand_cases():
    right = "4+8+0=12,7+5+1=13,3+6+1=10:1032</s>"
    assert task.reward(right, "1032") == 1.0
    assert task.reward("4+8+0=99,7+5+1=13,3+6+1=10:1032</s>", "1032") == 1.0  # a wrong step, the right answer
    assert task.reward("4+8+0=12,7+5+1=13,3+6+1=10:1033</s>", "1032") == 0.0
    assert task.reward(right[:-4], "1032") == 0.0  # no EOS: cut off at the length limit
    assert task.reward("1032</s>", "1032") == 0.0  # no answer marker
    assert task.reward("12:34:1032</s>", "1032") == 1.0  # the last marker's answer counts
    assert task.reward(":01032</s>", "1032") == 0.0  # the answer is compared as written


def test_heldout_split_is_disjoint_from_training_as_unordered_pairs():
    def pairs(samples):
        return {tuple(sorted(map(int, task.tokenizer().decode(s.prompt_token_ids).rstrip("=").split("+"))))
                for s in samples}

    train, heldout = task.train_problems(), task.heldout_problems()
    assert len(train) == task.NUM_TRAIN and len(heldout) == task.NUM_HELDOUT
    assert len(pairs(train)) == len(train) and len(pairs(heldout)) == len(heldout)  # no duplicates either
    assert not pairs(train) & pairs(heldout)
    assert [s.index for s in train] == list(range(len(train)))
    assert task.heldout_problems() == heldout  # the split is fixed


def test_tokenizer_round_trip_and_demonstration():
    tok = task.tokenizer()
    text = "0123456789+=,:"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < tok.vocab_size == task.tiny_model_hf_config()["vocab_size"]
    assert tok.decode(ids + [EOS_ID]) == text + "</s>" and tok.decode(ids + [EOS_ID], skip_special_tokens=True) == text
    sample = task.train_problems()[0]
    assert sample.prompt_token_ids[0] == BOS_ID
    demo = task.demonstration(sample)
    assert demo[-1] == EOS_ID and 16 <= len(demo) <= 64
    assert task.reward(tok.decode(demo), sample.answer) == 1.0
    prompt_and_response = len(sample.prompt_token_ids) + len(demo)
    assert prompt_and_response <= task.tiny_model_hf_config()["max_position_embeddings"]


def test_the_registry_names_every_task_the_config_accepts():
    from megatron_gtpo.config import _CHOICES

    assert _CHOICES["data.task"] == tuple(SYNTHETIC_TASKS)
    addition = SYNTHETIC_TASKS["addition"]
    sample = addition.train_problems()[37]  # "3+7="
    assert addition.tokenizer().decode(addition.demonstration(sample)) == "10</s>"
    assert addition.heldout_problems is None
